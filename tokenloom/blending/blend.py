"""Weighted blends of GPT datasets, per split (Megatron's BlendedMegatronDatasetBuilder).

Policy: weights are per-*sample* probabilities, not per-token and not per-source-size.
Each source d is planned ``target = ceil(size * w[d])`` samples and built with a
small surplus, ``ceil(target * (1 + surplus))`` (0.5% by default), because the
greedy interleave below can ask a source for one sample more than its target.
Samples are interleaved greedily: step i takes the source that lags its target
``w[d] * max(i, 1)`` most (lowest index on ties), which keeps every prefix of the
blend within about one sample per source of the weights. Without weights, a sized
blend weights sources by their sample counts, and an unsized one serves every
sample of every source exactly once ("exhaustive"). Megatron's arrays and rules are
reproduced exactly, including the double normalisation of the weights; where
Megatron asserts or raises IndexError, tokenloom raises a TokenloomError that says
what to change.

``BlendBuilder`` is the one place that decides which datasets exist; the arrays
come from the pure functions ``gpt.build_gpt_indices`` and :func:`build_blend_indices`,
called through :meth:`BlendBuilder.gpt_indices` / :meth:`BlendBuilder.blend_indices`
so a caching layer can override just those two.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import numpy as np

from tokenloom.blending import helpers
from tokenloom.blending.gpt import GPTDataset, GPTDatasetConfig, GPTIndices, TokenSource, build_gpt_indices
from tokenloom.blending.mock import MockSource
from tokenloom.blending.sources import LazySource
from tokenloom.blending.split import Bookend, Split, normalize, split_documents, split_matrix
from tokenloom.errors import FormatError, TokenloomError

MAX_BLEND_MEMBERS = 32766
"""Megatron's limit (fewer than 32767): the dataset index is int16."""

Sizes = Sequence[int | None]


@dataclass(frozen=True)
class Blend:
    """Token sources (path prefixes) and optional weights."""

    prefixes: tuple[str, ...]
    """Path prefixes of the indexed datasets (``<prefix>.bin`` / ``<prefix>.idx``)."""

    weights: tuple[float, ...] | None = None
    """One positive weight per prefix, normalised to sum 1; None to weight by size."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefixes", tuple(self.prefixes))
        if not self.prefixes:
            raise TokenloomError("a blend needs at least one prefix")
        if self.weights is None:
            return
        object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        if len(self.weights) != len(self.prefixes):
            raise TokenloomError(f"{len(self.prefixes)} prefixes but {len(self.weights)} weights")
        bad = [w for w in self.weights if not (math.isfinite(w) and w > 0)]
        if bad:
            raise TokenloomError(f"blend weights must be finite and > 0 (drop the source instead), got {bad}")


@dataclass(frozen=True, kw_only=True)
class BlendConfig:
    """Which sources feed which split, and how GPT samples are cut from them."""

    gpt: GPTDatasetConfig
    """Sample shape, seed and split string shared by every dataset."""

    blend: Blend | None = None
    """One blend for all splits; each source is split by ``gpt.split``."""

    blend_per_split: tuple[Blend | None, ...] | None = None
    """A blend per split (train, valid, test), each using its sources whole; ``gpt.split`` must be None."""

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built per source so the greedy blend never runs short."""

    multiple_validation_sets: bool = False
    """With blend_per_split: the valid split is a list of GPT datasets, one per source, not a blend."""

    def __post_init__(self) -> None:
        if self.blend is not None and self.blend_per_split is not None:
            raise TokenloomError("give either blend or blend_per_split, not both")
        if self.blend_per_split is not None:
            if len(self.blend_per_split) != len(Split):
                raise TokenloomError(
                    f"blend_per_split needs 3 entries (train, valid, test), got {len(self.blend_per_split)}"
                )
            if self.gpt.split is not None:
                raise TokenloomError("blend_per_split uses every source whole: set split to None")
        elif self.blend is not None and self.gpt.split is None:
            raise TokenloomError("a blend needs a split string, e.g. '969,30,1'")
        if self.multiple_validation_sets and self.blend_per_split is None:
            raise TokenloomError("multiple_validation_sets needs blend_per_split (a valid blend of its own)")
        if self.mid_level_dataset_surplus < 0:
            raise TokenloomError(
                f"mid_level_dataset_surplus must be >= 0, got {self.mid_level_dataset_surplus}"
            )


def sample_budgets(weights: Sequence[float], sizes: Sequence[int], surplus: float = 0.0) -> list[list[int]]:
    """Samples per source (rows) per split (columns): ``ceil(ceil(size * w) * (1 + surplus))``."""
    assert np.isclose(sum(weights), 1.0), weights
    return [[int(math.ceil(math.ceil(size * w) * (1 + surplus))) for size in sizes] for w in weights]


def build_blend_indices(
    weights: Sequence[float],
    size: int | None,
    lengths: Sequence[int],
    names: Sequence[str] | None = None,
    split: Split = Split.train,
    surplus: float = 0.005,
) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index int16, dataset_sample_index int64)`` for members of these lengths.

    ``size`` None: exhaustive, ``weights`` are the integral member lengths. Otherwise
    ``weights`` must already be as Megatron stores them (normalised, see
    :class:`BlendedDataset`). Raises TokenloomError if a member would be over-drawn.
    """
    if size is None:
        dataset_index, dataset_sample_index = helpers.exhaustive_blending_indices([int(w) for w in weights])
    else:
        dataset_index, dataset_sample_index = helpers.blending_indices(list(weights), size)
    drawn = np.bincount(dataset_index, minlength=len(lengths))
    for d in map(int, np.flatnonzero(drawn > np.asarray(lengths))):
        name = names[d] if names else f"member {d}"
        raise TokenloomError(
            f"the {split.name} blend draws {drawn[d]} samples from {name}, which has only {lengths[d]}; "
            f"raise mid_level_dataset_surplus (now {surplus}), e.g. to {max(10 * surplus, 0.05):g}"
        )
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Samples interleaved from several GPT datasets of one split."""

    def __init__(
        self,
        datasets: Sequence[GPTDataset],
        weights: list[float] | list[int],
        size: int | None,
        indices: tuple[np.ndarray, np.ndarray] | None = None,
        surplus: float = 0.005,
    ) -> None:
        _check_members(datasets, weights)
        self.datasets = datasets
        self.split = datasets[0].split
        self.weights = normalize(weights) if size is not None else list(weights)
        """As Megatron stores them: normalised again when sized, integer lengths when exhaustive."""
        self.size = size
        if indices is None:
            indices = build_blend_indices(
                self.weights,
                size,
                [len(ds) for ds in datasets],
                [_name(ds) for ds in datasets],
                self.split,
                surplus,
            )
        self.dataset_index, self.dataset_sample_index = indices

    def __len__(self) -> int:
        return len(self.dataset_index)

    def locate(self, i: int) -> tuple[int, int]:
        """(member, sample within that member) of blended sample i."""
        return int(self.dataset_index[i]), int(self.dataset_sample_index[i])

    def source_of(self, i: int) -> int:
        """The member (position in ``datasets``) blended sample i comes from."""
        return int(self.dataset_index[i])

    def __getitem__(self, i: int) -> np.ndarray:
        d, k = self.locate(i)
        return self.datasets[d][k]

    def documents_of(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample i and its document piece lengths (:meth:`GPTDataset.documents_of`)."""
        d, k = self.locate(i)
        return self.datasets[d].documents_of(k)

    def __repr__(self) -> str:
        drawn = np.bincount(self.dataset_index, minlength=len(self.datasets))
        lines = [f"BlendedDataset({self.split.name}, {len(self)} samples, {len(self.datasets)} sources)"]
        for ds, w, n in zip(self.datasets, self.weights, drawn, strict=True):
            lines.append(
                f"  - {_name(ds)}: weight {w:.4g}, draws {n} of {len(ds)} samples "
                f"({ds.indices.num_epochs} epoch(s) built)"
            )
        return "\n".join(lines)


def _check_members(datasets: Sequence[GPTDataset], weights: Sequence[float]) -> None:
    if len(datasets) > MAX_BLEND_MEMBERS:
        raise TokenloomError(f"at most {MAX_BLEND_MEMBERS} sources per blend, got {len(datasets)}")
    if len(weights) != len(datasets):
        raise TokenloomError(f"{len(datasets)} blend members but {len(weights)} weights")
    empty = [_name(datasets[d]) for d, w in enumerate(weights) if not w > 0]  # members may be made lazily
    if empty:
        raise TokenloomError(
            f"the {datasets[0].split.name} blend has sources with no samples: {empty}; "
            "drop them or change the split"
        )


def _name(ds: GPTDataset) -> str:
    return str(ds.source.path_prefix) if ds.source.path_prefix is not None else repr(ds.source)


def _open_indexed(prefix: str | None) -> TokenSource:
    if prefix is None:  # only the mock source has none, and it comes with its own opener
        raise TokenloomError("a blend source needs a path prefix")

    return LazySource(prefix)


TopLevel = GPTDataset | BlendedDataset | list[GPTDataset]  # a list: multiple_validation_sets


class BlendBuilder:
    """Builds the train/valid/test datasets of a :class:`BlendConfig`, as Megatron would.

    ``sizes`` are the samples wanted per split (None: one epoch / every sample).
    Sources are opened once each through ``open_source(prefix)``.
    """

    def __init__(
        self, config: BlendConfig, open_source: Callable[[str | None], TokenSource] = _open_indexed
    ) -> None:
        self.config = config
        self._open_source = open_source
        self._sources: dict[str | None, TokenSource] = {}

    # -- the two computations a cache may override --------------------------------

    def gpt_indices(
        self,
        prefix: str | None,
        source: TokenSource,
        documents: np.ndarray,
        bookend: Bookend,
        num_samples: int | None,
        split: Split,
    ) -> GPTIndices:
        return build_gpt_indices(source.sequence_lengths, documents, num_samples, split, self.config.gpt)

    def blend_indices(
        self, datasets: list[GPTDataset], weights: list[float] | list[int], size: int | None, split: Split
    ) -> tuple[np.ndarray, np.ndarray]:
        return build_blend_indices(
            weights,
            size,
            [len(ds) for ds in datasets],
            [_name(ds) for ds in datasets],
            split,
            self.config.mid_level_dataset_surplus,
        )

    # -- assembly ------------------------------------------------------------------

    def source(self, prefix: str | None) -> TokenSource:
        if prefix not in self._sources:
            self._sources[prefix] = self._open_source(prefix)
        return self._sources[prefix]

    def gpt_dataset(
        self, prefix: str | None, bookend: Bookend, num_samples: int | None, split: Split
    ) -> GPTDataset:
        source = self.source(prefix)
        documents = split_documents(bookend, len(source))
        try:
            indices = self.gpt_indices(prefix, source, documents, bookend, num_samples, split)
        except FormatError:  # the files, not the split: the message names them and the fix
            raise
        except TokenloomError as exc:
            raise TokenloomError(
                f"{prefix if prefix is not None else source!r}, {split.name} split "
                f"({len(documents)} of {len(source)} sequences): {exc}; change the split or drop the source"
            ) from None
        return GPTDataset(source, documents, num_samples, split, self.config.gpt, indices=indices)

    def blended_dataset(
        self, datasets: list[GPTDataset], weights: list[float] | list[int], size: int | None, split: Split
    ) -> BlendedDataset:
        _check_members(datasets, weights)
        stored = normalize(weights) if size is not None else list(weights)
        return BlendedDataset(
            datasets, weights, size, indices=self.blend_indices(datasets, stored, size, split)
        )

    def build(self, sizes: Sizes) -> list[TopLevel | None]:
        """One dataset (or None) per split, following Megatron's case table (spec C.3)."""
        if len(sizes) != len(Split):
            raise TokenloomError(f"sizes needs 3 entries (train, valid, test), got {len(sizes)}")
        cfg = self.config
        if cfg.blend is not None:
            if cfg.blend.weights is not None:
                _require_sizes(sizes, range(len(Split)))
            if cfg.gpt.split is None:  # refused by BlendConfig already
                raise TokenloomError("a blend needs a split string, e.g. '969,30,1'")
            return self.build_blend(cfg.blend, split_matrix(cfg.gpt.split), list(sizes))
        if cfg.blend_per_split is None:
            raise TokenloomError("no blend given; use build_mock_datasets for synthetic data")
        out: list[TopLevel | None] = [None] * len(Split)
        for split, blend in zip(Split, cfg.blend_per_split, strict=True):
            if blend is None:
                continue
            if blend.weights is not None:
                _require_sizes(sizes, [split])
            matrix: list[Bookend | None] = [None] * len(Split)
            matrix[split] = (0.0, 1.0)
            only: list[int | None] = [0] * len(Split)
            only[split] = sizes[split]
            if len(blend.prefixes) == 1:  # weights of a lone per-split source are ignored, as in Megatron
                out[split] = self.gpt_dataset(blend.prefixes[0], (0.0, 1.0), sizes[split], split)
            elif cfg.multiple_validation_sets and split == Split.valid:  # each asked for all valid samples
                out[split] = [self.gpt_dataset(p, (0.0, 1.0), sizes[split], split) for p in blend.prefixes]
            else:
                out[split] = self.build_blend(blend, matrix, only)[split]
        return out

    def build_blend(
        self, blend: Blend, matrix: list[Bookend | None], sizes: list[int | None]
    ) -> list[TopLevel | None]:
        """The splits of one blend: ``matrix`` gives each split's book-ends (None: not built)."""
        prefixes = blend.prefixes
        weights = normalize(blend.weights) if blend.weights is not None else None
        if len(prefixes) == 1 and weights is None:
            return [
                self.gpt_dataset(prefixes[0], bookend, sizes[s], Split(s)) if bookend else None
                for s, bookend in enumerate(matrix)
            ]
        buffers: Sequence[Sequence[int | None]]
        if weights is None:
            buffers = [[None] * len(Split) for _ in prefixes]
        else:
            counts = cast(list[int], sizes)  # a weighted blend's callers check every count (_require_sizes)
            targets = sample_budgets(weights, counts)
            buffers = sample_budgets(weights, counts, self.config.mid_level_dataset_surplus)
        active = [s for s, bookend in enumerate(matrix) if bookend is not None]
        for prefix in prefixes:  # opened here, once, not raced for by the threads below
            self.source(prefix)
        requests = [(p, bookend, buffers[d][s], Split(s)) for s, bookend in enumerate(matrix) if bookend is not None
                    for d, p in enumerate(prefixes)]
        out: list[TopLevel | None] = [None] * len(Split)
        # Every member of every split is queued on one thread pool, train first, and this
        # thread blends each split as soon as its members are done, while the pool goes on
        # with the later splits' members. Each dataset draws from its own RandomState(seed),
        # so no array depends on the scheduling; the native shuffles, sample index and hashing
        # release the GIL. Errors surface in split order, as a serial build would raise them.
        with ThreadPoolExecutor(max(1, min(len(requests), os.cpu_count() or 1))) as pool:
            built = [pool.submit(self.gpt_dataset, *r) for r in requests]
            for k, s in enumerate(active):
                members = [f.result() for f in built[k * len(prefixes) : (k + 1) * len(prefixes)]]
                size: int | None
                if weights is not None:
                    split_weights: list[float] | list[int] = weights
                    size = sum(targets[d][s] for d in range(len(prefixes)))
                else:
                    split_weights = [len(ds) for ds in members]
                    wanted = sizes[s]
                    size = None if wanted is None else min(wanted, sum(split_weights))
                out[s] = self.blended_dataset(members, split_weights, size, Split(s))
        return out


def _require_sizes(sizes: Sizes, splits: Sequence[int]) -> None:
    missing = [Split(s).name for s in splits if sizes[s] is None]
    if missing:
        raise TokenloomError(f"weighted blends need a sample count for every split; none given for {missing}")


def build_mock_datasets(
    gpt: GPTDatasetConfig, sizes: Sizes, source: MockSource, builder: BlendBuilder | None = None
) -> list[GPTDataset]:
    """Megatron's mock mode: one GPT dataset per split over ``source``, split forced to "1,1,1".

    ``builder`` (opening ``source`` for the prefix None) replaces the default one, e.g. to cache.
    """
    builder = builder or BlendBuilder(BlendConfig(gpt=gpt), open_source=lambda _: source)
    matrix = [bookend for bookend in split_matrix("1,1,1") if bookend is not None]  # all three
    return [builder.gpt_dataset(None, bookend, sizes[s], Split(s)) for s, bookend in enumerate(matrix)]
