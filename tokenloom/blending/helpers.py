"""Index builders: the C++ functions from ``tokenloom._native``, or their numpy references.

``native.pick`` chooses once, at import; both implementations take the same
arguments, give the same arrays and raise the same errors (TypeError for a wrong
dtype, never a silent cast; ValueError for out-of-range input).
"""

from __future__ import annotations

from typing import cast

import numpy as np

from tokenloom import native
from tokenloom.blending import reference

build_sample_idx_int32 = native.pick("build_sample_idx_int32", reference.build_sample_idx_int32)
build_sample_idx_int64 = native.pick("build_sample_idx_int64", reference.build_sample_idx_int64)
build_blending_indices = native.pick("build_blending_indices", reference.build_blending_indices)
build_exhaustive_blending_indices = native.pick(
    "build_exhaustive_blending_indices", reference.build_exhaustive_blending_indices
)

INT32_MAX = int(np.iinfo(np.int32).max)

_LegacyState = tuple[str, np.ndarray, int, int, float]


def _legacy_state(rng: np.random.RandomState) -> _LegacyState:
    """``rng.get_state()``: the legacy MT19937 tuple (numpy's stub types the default call as a dict)."""
    return cast(_LegacyState, rng.get_state())

_SHUFFLES = {np.dtype(t): native.pick(f"legacy_shuffle_{np.dtype(t).name}", None)
             for t in (np.int32, np.uint32, np.int64)}


class SeededStream:
    """The shuffles of a fresh ``numpy.random.RandomState(seed)``, without constructing one.

    Seeding a RandomState costs more than building an index of a small source, and a blend of
    10,000 sources builds 20,000 of them from the same seed. The seeded state (2.5 KB) is
    computed once per seed and copied, and the native legacy shuffle advances it; the draws, and so the arrays, are numpy's.
    """

    _seeded: dict[int, _LegacyState] = {}

    def __init__(self, seed: int):
        state = self._seeded.get(seed)
        if state is None:
            state = self._seeded.setdefault(seed, _legacy_state(np.random.RandomState(seed)))
        self.key = np.array(state[1], dtype=np.uint32)
        self.pos = int(state[2])

    def shuffle(self, array: np.ndarray) -> None:
        fn = _SHUFFLES.get(array.dtype)
        if fn is not None and array.ndim == 1 and array.flags.c_contiguous and len(array) <= 2**32:
            self.pos = fn(array, self.key, self.pos)
            return
        rng = np.random.RandomState()
        rng.set_state(("MT19937", self.key, self.pos, 0, 0.0))
        rng.shuffle(array)
        _, key, self.pos, _, _ = _legacy_state(rng)
        self.key = np.ascontiguousarray(key, dtype=np.uint32)


Shuffler = np.random.RandomState | SeededStream


def shuffle(rng: Shuffler, array: np.ndarray) -> None:
    """``rng.shuffle(array)`` with the same result and the same generator state afterwards.

    The native version draws numpy's legacy MT19937 stream itself (several times faster on
    large arrays: it prefetches the swap targets; see bench/RESULTS.md, notes) and releases the GIL, so several indices can
    be shuffled on different cores. It takes numpy's state and hands it back, so the next
    draw from ``rng`` is what it would have been. Other dtypes, non-contiguous arrays and
    arrays past 2^32 elements go to numpy, and so do short ones (under 2^14 elements),
    where handing the generator state over and back costs more than numpy's
    shuffle: a blend of thousands of small sources shuffles tens of thousands of them.
    """
    if isinstance(rng, SeededStream):
        rng.shuffle(array)
        return
    fn = _SHUFFLES.get(array.dtype)
    if fn is None or array.ndim != 1 or not array.flags.c_contiguous or not 1 << 14 <= len(array) <= 2**32:
        rng.shuffle(array)
        return
    name, key, pos, has_gauss, gauss = _legacy_state(rng)
    key = np.ascontiguousarray(key, dtype=np.uint32)
    pos = fn(array, key, pos)
    rng.set_state((name, key, pos, has_gauss, gauss))


def sample_idx_dtype(sizes: np.ndarray, doc_idx: np.ndarray) -> type:
    """int32 when every stored value fits (Megatron's rule), else int64."""
    largest = max(len(doc_idx), int(sizes.max()) if len(sizes) else 0)
    return np.int32 if largest <= INT32_MAX else np.int64


def build_sample_idx(
    sizes: np.ndarray,
    doc_idx: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last: bool = True,
    add_extra_token: bool = True,
    exact_ceil: bool = False,
) -> np.ndarray:
    """The ``[n + 1, 2]`` sample index in the narrowest dtype Megatron would use."""
    build = build_sample_idx_int32 if sample_idx_dtype(sizes, doc_idx) is np.int32 else build_sample_idx_int64
    return build(
        sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, int(add_extra_token), exact_ceil
    )


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index int16, dataset_sample_index int64)`` of length ``size`` for these weights."""
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)
    build_blending_indices(dataset_index, dataset_sample_index, w, len(w), size, False)
    return dataset_index, dataset_sample_index


def exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every sample of every dataset once: arrays of length ``sum(sizes)``."""
    s = np.asarray(sizes, dtype=np.int64)
    total = int(s.sum())
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    build_exhaustive_blending_indices(dataset_index, dataset_sample_index, s, len(s))
    return dataset_index, dataset_sample_index


pack_best_fit = native.pick("pack_best_fit", reference.pack_best_fit)
