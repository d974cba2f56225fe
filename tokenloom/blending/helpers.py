"""Index builders: the C++ functions from ``tokenloom._native``, or their numpy references.

``native.pick`` chooses once, at import; both implementations take the same
arguments, give the same arrays and raise the same errors (TypeError for a wrong
dtype, never a silent cast; ValueError for out-of-range input).
"""

from __future__ import annotations

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

_SHUFFLES = {np.dtype(t): native.pick(f"legacy_shuffle_{np.dtype(t).name}", None)
             for t in (np.int32, np.uint32, np.int64)}


def shuffle(rng: np.random.RandomState, array: np.ndarray) -> None:
    """``rng.shuffle(array)`` with the same result and the same generator state afterwards.

    The native version draws numpy's legacy MT19937 stream itself (3-5x faster on large
    arrays: it prefetches the swap targets) and releases the GIL, so several indices can
    be shuffled on different cores. It takes numpy's state and hands it back, so the next
    draw from ``rng`` is what it would have been. Other dtypes, non-contiguous arrays and
    arrays past 2^32 elements go to numpy, and so do short ones (under 2^14 elements),
    where handing the generator state over and back (~0.1 ms) costs more than numpy's
    shuffle: a blend of thousands of small sources shuffles tens of thousands of them.
    """
    fn = _SHUFFLES.get(array.dtype)
    if fn is None or array.ndim != 1 or not array.flags.c_contiguous or not 1 << 14 <= len(array) <= 2**32:
        rng.shuffle(array)
        return
    name, key, pos, has_gauss, gauss = rng.get_state()
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
