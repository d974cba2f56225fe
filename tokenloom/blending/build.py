"""``tokenloom build``: the datasets of a blend, with cached indices and a plan that explains them.

Two modes:

* ``megatron`` (default): weights are per-sample probabilities and every array equals
  megatron-core 0.16.1's for the same prefixes, weights, split, sequence length, seed
  and sample counts. Sources are repeated (epochs) as often as the counts require.
* ``tokens``: weights are shares of *tokens*, the size is given in tokens
  (``train_tokens``), every source may be repeated at most ``max_repeat`` times, and an
  impossible mix is refused before anything is built, with the numbers and the largest
  weight that would fit. Samples all hold ``seq_length`` tokens, so a token share is a
  sample share: the arrays are built by the same algorithm (exact arithmetic for the
  last partial sample instead of Megatron's float32 rounding).

Unspecified valid/test sample counts are derived from the train count in proportion
to the split weights (the same number of passes over each split).

Index arrays are cached under ``cache_dir`` keyed by content (see ``cache.py``): the
config, and a digest of each source's ``.idx`` and manifest. The plan printed per
split and source shows documents, tokens, requested and realised share, epochs
(repetition) and cache key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from tokenloom.blending.args import phase_sources, resolve_schedule
from tokenloom.blending.blend import Blend, BlendBuilder, BlendConfig, BlendedDataset, sample_budgets
from tokenloom.blending.cache import ArrayCache, content_key
from tokenloom.blending.gpt import GPTDataset, GPTDatasetConfig, GPTIndices, key_fields, packing_cost
from tokenloom.blending.sources import LazySource, SourceMeta, source_metadata
from tokenloom.blending.split import (
    Split,
    normalize,
    parse_split,
    split_bounds,
    split_documents,
    split_matrix,
)
from tokenloom.errors import TokenloomError
from tokenloom.indexed import manifest

INDEX_FORMAT = 2  # bump when the arrays for a given key would change


@dataclass(kw_only=True)
class BuildConfig:
    data: list[tuple[float, str]] | None = None
    """Sources as (weight, prefix) pairs; weights are normalised (Megatron's --data-path W1 P1 W2 P2)."""
    data_per_split: dict[str, list[tuple[float, str]]] | None = None
    """A separate blend per split: {"train": [(w, prefix), ...], "valid": [...], "test": [...]}."""
    split: str | None = "969,30,1"
    """Train/valid/test weights over each source's documents (ignored with data_per_split)."""
    seq_length: int = 2048
    """Tokens per sample (each sample reads seq_length + 1 tokens)."""
    num_samples: tuple[int | None, ...] = (None, None, None)
    """Samples per split (train, valid, test); valid/test default to the train count scaled by the split."""
    train_tokens: int | None = None
    """Train size in tokens instead of samples (tokens mode); valid/test scale with the split."""
    seed: int = 1234
    """Seed of the document and sample shuffles."""
    cache_dir: str | None = None
    """Directory for the index arrays (.npy, content-addressed); None builds in memory only."""
    mode: str = "megatron"
    """megatron (weights = sample probabilities, Megatron's arrays) or tokens (token shares, max_repeat)."""
    max_repeat: float = 4.0
    """tokens mode: the most times any source's split may be repeated."""
    exhaustive: bool = False
    """Use every sample of every source once, ignoring weights (Megatron's unweighted blend)."""
    dry_run: bool = False
    """Compute and print the plan without writing anything to the cache."""
    packing: str = "concat"
    """How documents become samples. concat (default, Megatron-exact): the documents run
    end to end and every sample is a full window, so no token is wasted but documents are
    cut at sample boundaries. best-fit: each document (a longer one cut into sample-sized
    pieces) lies whole in one sample, packed by best-fit decreasing, and the last pieces of cut
    documents may be cut again to fill the room left; the rest of it is padding the loss
    skips. Pick best-fit for document-level attention masking, short documents and
    evaluation on whole documents; concat for Megatron-identical arrays and caches."""


@dataclass
class SourceRow:
    split: str
    prefix: str
    documents: int
    tokens: int
    requested: float
    realised: float
    samples: int
    epochs: int
    cache_key: str
    packed_samples: int | None = None
    """best-fit: samples in one epoch of this source's split."""
    padding: int | None = None
    """best-fit: padding tokens in one epoch."""
    padding_share: float | None = None
    """best-fit: padding / all token slots of one epoch's samples."""
    cut: int | None = None
    """best-fit: documents cut into pieces (only those longer than a sample)."""
    concat_cut: int | None = None
    """best-fit: documents concatenation would cut at sample boundaries (in the split's order)."""


@dataclass
class BuildResult:
    datasets: list  # per split: GPTDataset | BlendedDataset | None
    plan: list[SourceRow] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)  # split -> key of its top-level arrays
    fingerprint: str = ""
    builds: int = 0  # index entries computed by this process
    hits: int = 0  # index entries loaded from the cache
    sources: dict[str, SourceMeta] = field(default_factory=dict)  # prefix -> what the build read of it

    @property
    def train(self):
        return self.datasets[Split.train]

    @property
    def valid(self):
        return self.datasets[Split.valid]

    @property
    def test(self):
        return self.datasets[Split.test]


# --------------------------------------------------------------------------- caching builder


class CachedBlendBuilder(BlendBuilder):
    """``BlendBuilder`` whose arrays go through an :class:`ArrayCache`.

    A lone source's split is one entry (its document, sample and shuffle index). A
    blend's split is one *bundle* entry: every member's three indices end to end, a
    table of where each member's part starts, and the blend's two arrays. One entry per
    split, not one per member, is what makes thousands of sources cheap: 10,000 sources
    cost three entries (three renames, a few dozen fsyncs) instead of 30,000, a warm
    start reads three, and the members' arrays are views into the bundle's, mapped when
    large, so a rank touches only the pages of the sources it reads. The price: a changed
    source rebuilds its whole split (members are built in parallel, about a millisecond
    each for small sources).
    """

    def __init__(
        self,
        config: BlendConfig,
        cache: ArrayCache | None,
        may_build: bool = True,
        metas: dict[str, SourceMeta] | None = None,
        progress=None,
        **kw,
    ):
        """``may_build=False``: every entry must already be in the cache (a non-builder rank).
        ``metas``: each prefix's :class:`SourceMeta` (sources then open lazily, see ``sources.py``).
        ``progress(done, total)`` is called as blend members are built."""
        if metas is not None and "open_source" not in kw:
            kw["open_source"] = lambda prefix: LazySource(prefix, metas[prefix])
        super().__init__(config, **kw)
        self.cache = cache
        self.may_build = may_build
        self.metas = metas or {}
        self.progress = progress
        self.keys: dict = {}  # id(indices) or ("blend", split) -> cache key
        self.hits = self.builds = 0
        self._counting = threading.Lock()  # members are built on a thread pool

    def build(self, sizes):
        """As ``BlendBuilder.build``, but a split asked for 0 samples is skipped (None), not built."""
        cfg = self.config
        if cfg.blend is None or 0 not in sizes:
            return super().build(sizes)
        matrix = [None if sizes[s] == 0 else b for s, b in enumerate(split_matrix(cfg.gpt.split))]
        missing = [Split(s).name for s, b in enumerate(matrix) if b is not None and sizes[s] is None]
        if cfg.blend.weights is not None and missing:
            raise TokenloomError(
                f"weighted blends need a sample count for every split; none given for {missing}"
            )
        return self.build_blend(cfg.blend, matrix, list(sizes))

    def _source_key(self, prefix, source) -> dict:
        if prefix is None:  # mock source: defined by its lengths and generator settings
            return {
                "mock": _array_digest(source.sequence_lengths),
                "seed": getattr(source, "seed", None),
                "vocab": getattr(source, "vocab_size", None),
                "content": getattr(source, "content", None),
            }
        meta = self.metas.get(prefix)
        if meta is None:
            memo = self.cache.dir if self.cache is not None else None
            meta = source_metadata([prefix], memo)[prefix]
        return {"prefix": os.path.basename(prefix), "digest": meta.digest}

    def build_blend(self, blend, matrix, sizes):
        """Each split of the blend from its bundle entry (built first if missing)."""
        if self.cache is None or (len(blend.prefixes) == 1 and blend.weights is None):
            return super().build_blend(blend, matrix, sizes)
        out = [None] * len(Split)
        sources = [[self._source_key(p, self.source(p)), len(self.source(p))] for p in blend.prefixes]
        for s, bookend in enumerate(matrix):
            if bookend is None:
                continue
            split = Split(s)
            only: list = [None] * len(Split)
            only[s] = bookend
            counts = [0] * len(Split)
            counts[s] = sizes[s]
            description = {
                "kind": "blend-split",
                "format": INDEX_FORMAT,
                "split": split.name,
                "bookend": list(bookend),
                "size": sizes[s],
                "weights": None if blend.weights is None else list(blend.weights),
                "sources": sources,
                "gpt": key_fields(self.config.gpt),
                "surplus": self.config.mid_level_dataset_surplus,
            }
            key = content_key(description)

            def compute(only=only, counts=counts, s=s):
                plain = _ProgressBuilder(self.config, self.source, self.progress, len(blend.prefixes))
                return _bundle(plain.build_blend(blend, only, counts)[s])

            out[s] = self._unbundle(self._cached(key, description, compute), blend, bookend, counts, split, key)
        return out

    def _unbundle(self, arrays, blend, bookend, counts, split: Split, key: str) -> BlendedDataset:
        """The split's BlendedDataset over a bundle entry's arrays; members are made on first use."""
        if blend.weights is not None:
            weights: list = normalize(blend.weights)
            buffers: list[int | None] = [b[split] for b in sample_budgets(weights, counts, self.config.mid_level_dataset_surplus)]
        else:
            buffers = [None] * len(blend.prefixes)
        members = BundleMembers([self.source(p) for p in blend.prefixes], bookend, buffers, split,
                                self.config.gpt, arrays, key)
        if blend.weights is None:
            weights = members.lengths()
        size = int(arrays["size"][0])
        self.keys[("blend", split)] = key
        return BlendedDataset(
            members, weights, None if size < 0 else size,
            indices=(arrays["dataset_index"], arrays["dataset_sample_index"]),
        )

    def _cached(self, key: str, description: dict, build):
        if self.cache is None:
            arrays, built = build(), True
        else:
            arrays, built = self.cache.get_or_build(key, build, description, may_build=self.may_build)
        with self._counting:
            self.builds += built
            self.hits += not built
        return arrays

    def gpt_indices(self, prefix, source, documents, bookend, num_samples, split) -> GPTIndices:
        description = {
            "kind": "gpt-indices",
            "format": INDEX_FORMAT,
            "source": self._source_key(prefix, source),
            "sequences": len(source),
            "bookend": list(bookend),
            "num_samples": num_samples,
            "split": split.name,
            "gpt": key_fields(self.config.gpt),
        }
        key = content_key(description)

        def build():
            idx = super(CachedBlendBuilder, self).gpt_indices(
                prefix, source, documents, bookend, num_samples, split
            )
            return {
                "document_index": idx.document_index,
                "sample_index": idx.sample_index,
                "shuffle_index": idx.shuffle_index,
                "meta": np.array([idx.num_epochs, idx.separate_final_epoch, idx.tokens_per_epoch], np.int64),
            }

        arrays = self._cached(key, description, build)
        meta = [int(v) for v in arrays["meta"]]
        indices = GPTIndices(
            arrays["document_index"],
            arrays["sample_index"],
            arrays["shuffle_index"],
            num_epochs=meta[0],
            separate_final_epoch=bool(meta[1]),
            tokens_per_epoch=meta[2],
        )
        self.keys[id(indices)] = key
        return indices

    def blend_indices(self, datasets, weights, size, split):
        description = {
            "kind": "blend-indices",
            "format": INDEX_FORMAT,
            "members": [self.keys.get(id(ds.indices)) for ds in datasets],
            "weights": list(weights),
            "size": size,
            "split": split.name,
            "surplus": self.config.mid_level_dataset_surplus,
        }
        key = content_key(description)

        def build():
            di, dsi = super(CachedBlendBuilder, self).blend_indices(datasets, weights, size, split)
            return {"dataset_index": di, "dataset_sample_index": dsi}

        arrays = self._cached(key, description, build)
        self.keys[("blend", split)] = key
        return arrays["dataset_index"], arrays["dataset_sample_index"]


class BundleMembers(Sequence):
    """The members of a blend split read from a bundle entry, each GPTDataset made on first use.

    A rank that reads a few sources of a 10,000-source blend makes a few member objects,
    not 10,000, and the plan is read from the bundle's table without making any. Member
    arrays are views of the bundle's (no copies).
    """

    def __init__(self, sources, bookend, buffers, split: Split, gpt: GPTDatasetConfig, arrays: dict, key: str):
        self.sources, self.bookend, self.buffers, self.split, self.gpt = sources, bookend, buffers, split, gpt
        self.arrays, self.key = arrays, key
        self._made: dict[int, GPTDataset] = {}

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_made"} | {"_made": {}}

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, d):
        if isinstance(d, slice):
            return [self[i] for i in range(*d.indices(len(self)))]
        d = range(len(self))[d]  # bounds and negative indices as a list has them
        member = self._made.get(d)
        if member is None:
            offsets, arrays = self.arrays["offsets"], self.arrays
            (a0, b0, c0), (a1, b1, c1) = offsets[d].tolist(), offsets[d + 1].tolist()
            epochs, separate, tokens = arrays["members"][d].tolist()
            indices = GPTIndices(
                arrays["document_index"][a0:a1],
                arrays["sample_index"][b0:b1],
                arrays["shuffle_index"][c0:c1],
                num_epochs=epochs,
                separate_final_epoch=bool(separate),
                tokens_per_epoch=tokens,
            )
            source = self.sources[d]
            documents = range(*split_bounds(self.bookend, len(source)))
            member = self._made.setdefault(
                d, GPTDataset(source, documents, self.buffers[d], self.split, self.gpt, indices=indices)
            )
        return member

    def lengths(self) -> list[int]:
        """Samples per member (sample-index rows minus one)."""
        return (np.diff(self.arrays["offsets"][:, 1]) - 1).tolist()

    def plan_columns(self) -> tuple[list, list, list, list, list]:
        """Per member: prefix, documents, tokens per epoch, epochs, cache key."""
        table = self.arrays["members"]
        documents = [_width(split_bounds(self.bookend, len(src))) for src in self.sources]
        return ([src.path_prefix for src in self.sources], documents, table[:, 2].tolist(), table[:, 0].tolist(),
                [self.key] * len(self))


class _ProgressBuilder(BlendBuilder):
    """The plain builder over already opened sources, reporting members as they are built."""

    def __init__(self, config, open_source, progress, total: int):
        super().__init__(config, open_source)
        self.progress, self.total, self.done, self.lock = progress, total, 0, threading.Lock()

    def gpt_indices(self, *args):
        indices = super().gpt_indices(*args)
        if self.progress is not None:
            with self.lock:
                self.done += 1
                self.progress(self.done, self.total)
        return indices


def _bundle(ds: BlendedDataset) -> dict:
    """A split's arrays as one bundle entry (see :class:`CachedBlendBuilder`)."""
    indices = [m.indices for m in ds.datasets]
    out: dict = {}
    for name in ("document_index", "sample_index", "shuffle_index"):
        parts = [getattr(i, name) for i in indices]
        dtype = np.result_type(*parts)  # one member past 2^31 samples widens the whole bundle
        out[name] = [p.astype(dtype, copy=False) for p in parts]
    lengths = np.array([[len(i.document_index), len(i.sample_index), len(i.shuffle_index)] for i in indices])
    out["offsets"] = np.concatenate([np.zeros((1, 3), np.int64), np.cumsum(lengths, axis=0, dtype=np.int64)])
    out["members"] = np.array(
        [[i.num_epochs, i.separate_final_epoch, i.tokens_per_epoch] for i in indices], np.int64
    ).reshape(-1, 3)
    out["dataset_index"], out["dataset_sample_index"] = ds.dataset_index, ds.dataset_sample_index
    out["size"] = np.array([-1 if ds.size is None else ds.size], np.int64)
    return out


def _array_digest(arr) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _blend(pairs: list[tuple[float, str]], exhaustive: bool) -> Blend:
    prefixes = tuple(p for _, p in pairs)
    return Blend(prefixes, None if exhaustive else tuple(w for w, _ in pairs))


def check_tokenizers(metas: dict[str, SourceMeta]) -> str | None:
    """Refuse sources made with tokenizers that give different ids (compared by
    :func:`~tokenloom.indexed.manifest.ids_key`, so file names do not matter); the common
    key (None if no source has a manifest)."""
    seen: dict[str, list[str]] = {}
    for prefix, meta in metas.items():
        if meta.tokenizer is not None:
            seen.setdefault(meta.tokenizer, []).append(prefix)
    if len(seen) > 1:
        def name(prefix: str) -> str:
            try:
                return manifest.tokenizer_name((manifest.read(prefix) or {})["tokenizer"])
            except (OSError, ValueError, KeyError, TypeError):
                return "an unreadable manifest"

        groups = "; ".join(f"{name(ps[0])}: {', '.join(ps)}" for ps in seen.values())
        raise TokenloomError(
            f"sources were tokenized with different tokenizers ({groups}); their ids do not "
            "mean the same tokens, so they cannot be blended"
        )
    return next(iter(seen), None)


def _width(bounds: tuple[int, int]) -> int:
    return bounds[1] - bounds[0]


def _sizes(cfg: BuildConfig, builder: BlendBuilder) -> list[int | None]:
    """Samples per split; unspecified valid/test counts follow the split weights (0 where a source's
    split is empty, which skips that split)."""
    sizes = list(cfg.num_samples) + [None] * (3 - len(cfg.num_samples))
    if cfg.train_tokens is not None:
        sizes[0] = math.ceil(cfg.train_tokens / cfg.seq_length)
    if sizes[0] is None or cfg.split is None or cfg.data_per_split is not None:
        return sizes
    shares, bookends = parse_split(cfg.split), split_matrix(cfg.split)
    for s in (1, 2):
        if sizes[s] is not None:
            continue
        bookend = bookends[s]
        empty = bookend is None or any(  # cfg.data is given: data_per_split is not
            _width(split_bounds(bookend, len(builder.source(p)))) == 0 for _, p in cfg.data or ()
        )
        sizes[s] = 0 if empty or shares[0] == 0 else math.ceil(sizes[0] * shares[s] / shares[0])
    return [s if s is None else int(s) for s in sizes]


def _check_token_mix(
    builder: BlendBuilder, cfg: BuildConfig, pairs, split: Split, size: int, bookend
) -> None:
    """tokens mode: refuse, with the numbers, a mix that repeats a source more than max_repeat times."""
    weights = normalize([w for w, _ in pairs])
    targets = sample_budgets(weights, [size])
    problems = []
    for (w, prefix), (target,) in zip(pairs, targets, strict=True):
        source = builder.source(prefix)
        docs = split_documents(bookend, len(source))
        available = int(np.asarray(source.sequence_lengths)[docs].sum(dtype=np.int64))
        needed = target * cfg.seq_length
        repeat = needed / available if available else math.inf
        if repeat > cfg.max_repeat:
            share = weights[pairs.index((w, prefix))]
            fit = cfg.max_repeat * available / (size * cfg.seq_length)
            problems.append(
                f"{prefix}: share {share:.4g} of {size * cfg.seq_length} {split.name} tokens = "
                f"{needed} tokens, but its {split.name} split holds {available} ({repeat:.2f} passes > "
                f"max_repeat {cfg.max_repeat}); largest share that fits: {fit:.4g}"
            )
    if problems:
        raise TokenloomError(
            "impossible mix: " + " | ".join(problems) + " (lower those weights, add data, raise "
            "--max-repeat, or ask for fewer tokens)"
        )


def build(cfg: BuildConfig, open_source=None, shared=None) -> BuildResult:
    """Build (or load from cache) the train/valid/test datasets of ``cfg`` and their plan.

    ``shared``: in a distributed run, a :class:`tokenloom.blending.cache.SharedBuild` so
    that ranks sharing the cache filesystem build once (every rank must call this).
    """
    with _collector_paused():
        return _build_shared(cfg, open_source, shared)


@contextlib.contextmanager
def _collector_paused():
    """CPython's cyclic collector off for the build: a blend of 10,000 sources allocates some
    10^5 small records and views (none of them cyclic garbage), and each allocation burst makes
    the collector rescan every live object of the process -- most of a warm start in a process
    that has torch loaded (``bench/sources_bench.py``; see bench/RESULTS.md). Re-enabled on the
    way out (if it was on)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _build_shared(cfg: BuildConfig, open_source, shared) -> BuildResult:
    if shared is None or not cfg.cache_dir or cfg.dry_run:
        return _build(cfg, open_source, True)

    def lead(progress):
        result = _build(cfg, open_source, True, progress=progress)
        return result, {"sources": {p: dataclasses.asdict(m) for p, m in result.sources.items()}}

    def follow(payload):  # the builder's source records: no per-source file access here
        metas = {p: SourceMeta(**m) for p, m in payload["sources"].items()}
        return _build(cfg, open_source, False, metas=metas)

    return shared.run(cfg.cache_dir, lead, follow)


def _build(cfg: BuildConfig, open_source, may_build: bool, progress=None, metas=None) -> BuildResult:
    if cfg.mode not in ("megatron", "tokens"):
        raise TokenloomError(f"--mode must be megatron or tokens, got {cfg.mode!r}")
    if cfg.mode == "megatron" and cfg.train_tokens is not None:
        raise TokenloomError("--train-tokens belongs to --mode tokens; in megatron mode give --num-samples")
    if (cfg.data is None) == (cfg.data_per_split is None):
        raise TokenloomError("give the sources either as --data WEIGHT PREFIX ... or a blend file")
    gpt = GPTDatasetConfig(
        seq_length=cfg.seq_length,
        seed=cfg.seed,
        split=None if cfg.data_per_split is not None else cfg.split,
        mode="exact" if cfg.mode == "tokens" else "megatron",
        packing=cfg.packing,  # type: ignore[arg-type]  # GPTDatasetConfig refuses other values
    )
    if cfg.data is not None:
        blend_cfg = BlendConfig(gpt=gpt, blend=_blend(cfg.data, cfg.exhaustive))
        all_pairs = {s: cfg.data for s in Split}
        bookends = split_matrix(cast(str, cfg.split))  # BlendConfig refused a blend without one
    else:
        per_split = cfg.data_per_split or {}  # given: exactly one of data and data_per_split is
        per = tuple(
            _blend(per_split[s.name], cfg.exhaustive) if per_split.get(s.name) else None
            for s in Split
        )
        blend_cfg = BlendConfig(gpt=gpt, blend_per_split=per)
        all_pairs = {s: per_split.get(s.name) or [] for s in Split}
        bookends = [(0.0, 1.0) if all_pairs[s] else None for s in Split]
    cache = ArrayCache(cfg.cache_dir) if cfg.cache_dir and not cfg.dry_run else None
    prefixes = sorted({p for pairs in all_pairs.values() for _, p in pairs})
    if metas is None or set(metas) != set(prefixes):
        metas = source_metadata(prefixes, cache.dir if cache is not None else None)
    check_tokenizers(metas)
    builder = CachedBlendBuilder(
        blend_cfg, cache, may_build, metas, progress, **({"open_source": open_source} if open_source else {})
    )
    sizes = _sizes(cfg, builder)
    if cfg.mode == "tokens":
        for s in Split:
            bookend, size = bookends[s], sizes[s]
            if bookend is not None and all_pairs[s] and size:
                _check_token_mix(builder, cfg, all_pairs[s], s, size, bookend)
    datasets = builder.build(sizes)
    result = BuildResult(datasets, sources=metas)
    for s in Split:
        ds = datasets[s]
        if ds is None:
            continue
        result.plan.extend(_plan_rows(builder, s, ds))
        result.keys[s.name] = builder.keys.get(("blend", s)) or builder.keys.get(id(ds.indices), "")
    result.fingerprint = content_key({"splits": result.keys, "seq_length": cfg.seq_length})
    result.hits, result.builds = builder.hits, builder.builds
    return result


def _plan_rows(builder, split: Split, ds) -> list[SourceRow]:
    members = ds.datasets if isinstance(ds, BlendedDataset) else [ds]
    if isinstance(members, BundleMembers):
        prefixes, documents, tokens, epochs, keys = members.plan_columns()
        lengths = members.lengths()
    else:
        prefixes = [m.source.path_prefix for m in members]
        documents = [len(m.documents) for m in members]
        tokens = [m.indices.tokens_per_epoch for m in members]
        epochs = [int(m.indices.num_epochs) for m in members]
        keys = [builder.keys.get(id(m.indices), "") for m in members]
        lengths = [len(m) for m in members]
    if isinstance(ds, BlendedDataset):
        drawn = np.bincount(np.asarray(ds.dataset_index), minlength=len(members))
        requested = list(ds.weights) if ds.size is not None else [n / len(ds) for n in lengths]
    else:
        drawn, requested = np.array([len(ds)]), [1.0]
    name, drawn = split.name, drawn.tolist()
    total = max(1, sum(drawn))
    rows = [
        SourceRow(name, str(prefixes[m] or "mock"), documents[m], tokens[m], float(requested[m]), drawn[m] / total,
                  drawn[m], epochs[m], keys[m][:12])
        for m in range(len(members))
    ]
    if builder.config.gpt.packing != "concat":
        for m, row in enumerate(rows):
            member = members[m]
            lo, hi = (member.documents.start, member.documents.stop) if isinstance(member.documents, range) \
                else (None, None)
            all_lengths = np.asarray(member.source.sequence_lengths)
            doc_lengths = all_lengths[lo:hi] if lo is not None else all_lengths[np.asarray(member.documents)]
            cost = packing_cost(member.indices, doc_lengths, builder.config.gpt)
            row.packed_samples, row.padding, row.padding_share = cost.samples, cost.padding, cost.padding_share
            row.cut, row.concat_cut = cost.cut, cost.concat_cut
    return rows




def schedule_configs(cfg: BuildConfig, schedule: list[dict], names: list[str | None] | None,
                     where: str) -> list[tuple[int, int, BuildConfig]]:
    """``(phase, start_iter, config)`` per phase of a blend file's ``schedule`` (at ``where``):
    the train blend each phase draws, built as the trainer builds it (``cfg``'s options, the
    whole train sample count, no valid/test), so ``build`` fills the cache a scheduled run reads.
    Refuses (one line) a schedule without one blend of every source or without a train count."""
    if cfg.data is None:
        raise TokenloomError(f"{where}: a schedule needs 'data' (one blend listing every source), not one per split")
    train = cfg.num_samples[0] if cfg.num_samples else None
    if train is None:
        raise TokenloomError(f"{where}: a schedule's phases are built for the run's train samples: give "
                             "--num-samples TRAIN (train_iters x global_batch_size)")
    keys = phase_sources([str(p) for _, p in cfg.data], names, f"{where}: names")
    phases = resolve_schedule([(p["start_iter"], p["blend"]) for p in schedule], keys, "schedule",
                              "the file's data", file=where)
    return [(k, start, dataclasses.replace(cfg, data=pairs, num_samples=(train, 0, 0)))
            for k, (start, pairs) in enumerate(phases)]
