"""Training data: the ``data`` section of the train config -> train/valid/test datasets and loaders.

The section is either ``mock`` (Megatron's ``--mock-data``: a seeded synthetic source,
nothing read from disk) or ``blend`` (weighted ``.bin/.idx`` prefixes, a split string
and a cache directory)::

    data: {mock: {num_sequences: 2000, max_length: 512}}
    data: {blend: {prefixes: [[0.3, data/web], [0.7, data/code]], split: "969,30,1", cache_dir: cache}}

Sizes follow Megatron: train needs ``train_iters * global_batch_size`` samples, valid
``eval_iters * global_batch_size`` (every evaluation reads the *same* first validation
batches, so validation losses are comparable across the run and exactly reproducible
on resume; Megatron instead walks on through the validation set). The trainer asks no
test samples (it never reads them); a blend's split asked for 0 samples is not built.

Loaders are plain ``torch.utils.data.DataLoader`` over :class:`GPTSamples` with a
:class:`ConsumedSamplesSampler`, so the only data state is the consumed-samples count
(resume at any data-parallel size). The data fingerprint stored in checkpoints covers
what fixes the global train order: the section itself (minus loader knobs), the sample
shape, the built train sample count and, for blends, a digest of every source's
``.idx``. Mock data refuses a resume on another fingerprint unless ``force_data`` (it only
changes when its epoch count changes).

The loop holds one :class:`TrainData`: the datasets, the consumed count, and the data's
part of a checkpoint (``state_dict`` / ``load_state_dict``, where the resume rules live).

A blend's train order is a :class:`~tokenloom.blending.segments.SegmentedBlend`: one
segment (Megatron's blend itself) until a resume changes the weights, the sources or the
run length (``train_iters`` x ``global_batch_size``); then the checkpoint's history gets a
segment that continues each source after the samples it served (:func:`resume_order`).
A ``data.schedule`` plans those segments ahead: each phase is a segment from its start
(``start_iter`` x ``global_batch_size``), data.blend lists every source and gives the
validation set. The validation set is always this config's blend. Split, seed, sequence length, EOD
masking and a source's content may not change (``force_data`` takes the new order as is).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tokenloom.blending.args import phase_sources, resolve_schedule, source_names
from tokenloom.blending.blend import build_mock_datasets
from tokenloom.blending.build import BuildConfig
from tokenloom.blending.build import build as build_blend
from tokenloom.blending.cache import SharedBuild
from tokenloom.blending.gpt import PACKINGS, GPTDatasetConfig
from tokenloom.blending.loader import (
    ConsumedSamplesSampler,
    GPTSamples,
    SampleConfig,
    check_fingerprint,
    fingerprint,
)
from tokenloom.blending.mock import MockSource
from tokenloom.blending.plan import format_plan
from tokenloom.blending.segments import (
    Segment,
    SegmentedBlend,
    continue_history,
    history_json,
    in_force,
    read_history,
)
from tokenloom.errors import TokenloomError
from tokenloom.indexed.format import index_path
from tokenloom.tokenizers import load_tokenizer
from tokenloom.tokenizers.load import FILELESS

if TYPE_CHECKING:  # annotations only: build imports the builders where it uses them
    from tokenloom.blending.blend import BlendedDataset
    from tokenloom.blending.gpt import GPTDataset


@dataclass(kw_only=True)
class MockDataConfig:
    """Synthetic sequences (``tokenloom.blending.mock.MockSource``)."""

    num_sequences: int = 10_000
    """Number of synthetic documents."""
    max_length: int = 2048
    """Document lengths are uniform in [1, max_length) tokens, EOD included."""
    content: Literal["ramp", "random"] = "ramp"
    """"ramp": 1, 2, 3, ... (learnable, Megatron's mock); "random": uniform ids (loss floor ln(vocab))."""
    seed: int = 0
    """Seed of the lengths and the random content."""
    eod: int | None = None
    """End-of-document id; None means the tokenizer's EOD, else vocab_size - 1."""


@dataclass(kw_only=True)
class BlendDataConfig:
    """Weighted ``.bin/.idx`` token files split into train/valid/test."""

    prefixes: list[tuple[float, str]]
    """(weight, path prefix) pairs, e.g. [[0.3, "data/web"], [0.7, "data/code"]]."""
    names: list[str | None] | None = None
    """A name per source, in ``prefixes`` order, for its losses in metrics.jsonl, the progress
    line and loss.png (null, or a null entry: the prefix's basename); no two sources may share one."""
    split: str = "969,30,1"
    """Train/valid/test weights over each source's documents."""
    cache_dir: str | None = None
    """Directory for the built index arrays (reused across runs and ranks)."""
    build_timeout: float = 6 * 3600
    """Seconds a rank waits for another rank's index build in a shared or node-local cache_dir
    (it polls the cache and prints progress; builds of hours are normal for large blends)."""

    def __post_init__(self) -> None:
        if not self.build_timeout > 0:
            raise TokenloomError(f"data.blend.build_timeout must be > 0 seconds, got {self.build_timeout}")


@dataclass(kw_only=True)
class SchedulePhase:
    """One phase of a data schedule: the train blend from iteration ``start_iter`` on."""

    start_iter: int
    """Iterations trained before this phase begins (the first phase starts at 0; increasing)."""
    blend: list[tuple[float, str]]
    """(weight, source) pairs, weights > 0; a source is a data.blend.prefixes prefix or its name."""


@dataclass(kw_only=True)
class DataConfig:
    """Where samples come from (exactly one of ``mock`` / ``blend``) and how they are loaded."""

    mock: MockDataConfig | None = None
    """Synthetic data (no files needed)."""
    blend: BlendDataConfig | None = None
    """Real data: weighted token-file prefixes."""
    schedule: list[SchedulePhase] | None = None
    """Phases of the train blend by iteration, e.g. [{start_iter: 0, blend: [[1, web]]}, {start_iter: 1000,
    blend: [[0.5, web], [0.5, code]]}]: at each start the loader switches to the phase's blend, every source
    continuing after what it served. Needs data.blend, whose prefixes list every source (its weights are
    the validation blend's); null: data.blend's own weights for the whole run."""
    seed: int = 1234
    """Seed of the document and sample shuffles."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process)."""
    eod_mask_loss: bool = False
    """Do not train on predicting the token after an EOD."""
    packing: Literal["concat", "best-fit"] = "concat"
    """How documents become samples (``build --packing``). concat: Megatron's windows over the
    documents end to end (no padding; documents cut at sample boundaries). best-fit: every
    document no longer than a sample lies whole in one sample, longer ones cut into
    sample-sized pieces (their last pieces cut again where that fills whole samples' worth of
    room), the room left padding the loss skips; labels never cross a document."""
    inter_document_masking: bool | None = None
    """Attention never crosses a document boundary within a sample, and position ids restart
    at each document (megatron-core's inter_document_masking): each batch carries cu_seqlens.
    Costs a [seq x seq] mask per sample on CPU (block masks via flex_attention on CUDA).
    None (default): on with best-fit packing, off with concat."""

    @property
    def masks_documents(self) -> bool:
        """Whether the run masks attention at documents: :attr:`inter_document_masking`, or when
        that is None, whether packing is best-fit. Resolved here, not stored, so a saved config
        keeps None and follows a later change of ``packing``."""
        return self.packing == "best-fit" if self.inter_document_masking is None else self.inter_document_masking

    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise TokenloomError(f"data.packing must be one of {', '.join(PACKINGS)}, got {self.packing!r}")
        if (self.mock is None) == (self.blend is None):
            raise TokenloomError("the data section needs exactly one of data.mock or data.blend")
        if self.num_workers < 0:
            raise TokenloomError(f"data.num_workers must be >= 0, got {self.num_workers}")
        if self.schedule is not None:
            check_schedule(self)


def check_schedule(cfg: DataConfig, where: str = "data.schedule") -> None:
    """Refuse, in one line naming the phase, a schedule that is empty or on mock data, phases
    whose start iterations do not increase from 0, a phase blend that is empty, has a weight
    that is not > 0, names a source twice or one data.blend does not list, and two phases in a
    row with the same blend (one phase: say it once)."""
    if cfg.blend is None:
        raise TokenloomError(f"{where} needs data.blend (its prefixes list the sources the phases draw from)")
    phases = cfg.schedule or []
    if not phases:
        raise TokenloomError(f"{where} is empty; give phases [{{start_iter: 0, blend: [[w, source], ...]}}, ...] "
                             "or null")
    for k, phase in enumerate(phases):
        if not isinstance(phase, SchedulePhase):
            raise TokenloomError(f"{where}[{k}]: each phase is {{start_iter: N, blend: [[w, source], ...]}}, "
                                 f"got {phase!r}")
    resolve_schedule([(p.start_iter, p.blend) for p in phases], source_keys(cfg.blend), where,
                     "data.blend.prefixes")


def source_keys(blend: BlendDataConfig) -> dict[str, str]:
    """Prefix or name -> prefix of every source of ``blend`` (what a schedule phase may name)."""
    return phase_sources([str(p) for _, p in blend.prefixes], blend.names, "data.blend.names")


@dataclass
class Datasets:
    """The built datasets (valid/test may be None when the split gives them no documents)."""

    train: GPTDataset | BlendedDataset | SegmentedBlend
    valid: object | None
    test: object | None
    eod: int | None
    fingerprint: str
    description: dict
    plan: str = ""
    """What was built, for people: the blend plan ``build`` prints (per split and source:
    documents, tokens, requested vs realised share, epochs, cache key), or the mock source."""
    segments: list[Segment] | None = None
    """Blend data: the train order's history (see :mod:`tokenloom.blending.segments`); one
    segment, this config's Megatron blend, until a resume changes the blend."""
    invariants: dict | None = None
    """Blend data: what a resume may not change (split, sequence length, seed, EOD masking)."""
    source_names: list[str] | None = None
    """Blend data of two or more sources: their names (:func:`~tokenloom.blending.args.source_names`),
    in the order of the positions the samples carry as ``source``; None otherwise (one source: its
    loss is the loss)."""


def build(cfg: DataConfig, *, seq_len: int, vocab_size: int, sizes: tuple[int, int, int],
          tokenizer_eod: int | None = None, global_batch_size: int | None = None) -> Datasets:
    """Build train/valid/test for ``sizes`` samples each (train must not come out short); a data
    schedule's phases start at ``start_iter`` x ``global_batch_size`` samples (needed then)."""
    gpt = GPTDatasetConfig(seq_length=seq_len, seed=cfg.seed,
                           split=cfg.blend.split if cfg.blend else "1,1,1", packing=cfg.packing)
    eod: int | None
    train: GPTDataset | BlendedDataset | None
    if cfg.mock is not None:
        m = cfg.mock
        eod = m.eod if m.eod is not None else (tokenizer_eod if tokenizer_eod is not None else vocab_size - 1)
        source = MockSource(vocab_size, eod, num_sequences=m.num_sequences, max_length=m.max_length,
                            seed=m.seed, content=m.content)
        train, valid, test = build_mock_datasets(gpt, sizes, source)
        description = {"kind": "mock", **asdict(m), "eod": eod, "vocab_size": vocab_size}
        plan = (f"mock data ({m.content}): {m.num_sequences} synthetic documents of 1-{m.max_length - 1} tokens, "
                f"eod {eod}" + ("" if cfg.packing == "concat" else f"; packing {cfg.packing}"))
    else:
        if tokenizer_eod is None and cfg.eod_mask_loss:
            raise TokenloomError("data.eod_mask_loss needs the EOD id: set tokenizer")
        eod = tokenizer_eod
        blend = _blend_of(cfg)
        # with a schedule data.blend gives the validation set only; the phases give the train order
        built, plan = _build_blend(blend, gpt, (0, *sizes[1:]) if cfg.schedule else sizes)
        if cfg.schedule:
            plan = f"data.blend (validation):\n{plan}" if any(sizes[1:]) else ""
        train, valid, test = built.datasets
        description = {"kind": "blend", "prefixes": [[float(w), p] for w, p in blend.prefixes],
                       "split": blend.split, "indices": built.fingerprint}
        if cfg.schedule:
            phases = _schedule_phases(cfg, gpt, sizes[0], global_batch_size)
            train = phases[0][1]  # in Datasets until the segmented blend of every phase below
            plan = "\n".join(([plan] if plan else []) + [text for _, _, text in phases])
            description["schedule"] = [[seg.start, [[w, p] for w, p, _ in seg.blend]] for seg, _, _ in phases]
    if cfg.schedule:
        short = [(seg.start, len(t)) for seg, t, _ in phases if len(t) < sizes[0]]
    else:
        short = [(0, 0 if train is None else len(train))] if train is None or len(train) < sizes[0] else []
    if short:
        raise TokenloomError(f"the train split has {short[0][1]} samples, "
                             f"{sizes[0]} needed (train_iters x global_batch_size)")
    description.update(seq_len=seq_len, shuffle_seed=cfg.seed, eod_mask_loss=cfg.eod_mask_loss,
                       train_samples=sizes[0] if cfg.schedule else len(train))
    if cfg.packing != "concat":  # concat runs keep the fingerprints they had before packing came
        description["packing"] = cfg.packing
    out = Datasets(train, valid, test, eod, fingerprint(description), description, plan)
    if cfg.blend is not None:
        sources = [built.sources[str(p)].digest for _, p in cfg.blend.prefixes]
        if cfg.schedule:
            out.segments = [seg for seg, _, _ in phases]
            trains: list = [t for _, t, _ in phases]
        else:
            out.segments = [Segment(0, sizes[0], tuple((float(w), str(p), d)
                                                       for (w, p), d in zip(cfg.blend.prefixes, sources, strict=True)))]
            trains = [train]  # one segment: Megatron's blend itself
        out.invariants = {"data.blend.split": cfg.blend.split, "model.seq_len": seq_len, "data.seed": cfg.seed,
                          "data.eod_mask_loss": cfg.eod_mask_loss}
        if cfg.packing != "concat":  # absent: concat (histories saved before packing came)
            out.invariants["data.packing"] = cfg.packing
        out.train = SegmentedBlend(out.segments, trains, sources)
        if len(cfg.blend.prefixes) > 1:
            out.source_names = source_names([str(p) for _, p in cfg.blend.prefixes], cfg.blend.names,
                                            "data.blend.names")
    return out


def _schedule_phases(cfg: DataConfig, gpt: GPTDatasetConfig, train_samples: int,
                     global_batch_size: int | None) -> list[tuple[Segment, BlendedDataset, str]]:
    """Per phase of ``cfg.schedule``: its planned segment, its train blend (built for the whole
    run's ``train_samples``, as a resume with that blend builds it) and its plan text."""
    blend = _blend_of(cfg)
    if global_batch_size is None:
        raise ValueError("a data schedule needs the global batch size (its phases start at iterations)")
    out = []
    phases = cfg.schedule or []
    resolved = resolve_schedule([(p.start_iter, p.blend) for p in phases], source_keys(blend), "data.schedule",
                                "data.blend.prefixes")
    for k, phase in enumerate(phases):
        start = phase.start_iter * global_batch_size
        if start >= train_samples:
            raise TokenloomError(f"data.schedule[{k}].start_iter {phase.start_iter} is not before train_iters "
                                 f"{train_samples // global_batch_size}: the phase would train nothing; drop it "
                                 "or train longer")
        pairs = resolved[k][1]
        phase_cfg = BlendDataConfig(prefixes=pairs, split=blend.split, cache_dir=blend.cache_dir,
                                    build_timeout=blend.build_timeout)
        built, text = _build_blend(phase_cfg, gpt, (train_samples, 0, 0))
        seg = Segment(start, train_samples, tuple((w, p, built.sources[p].digest) for w, p in pairs))
        out.append((seg, built.train, f"data.schedule[{k}]: from iteration {phase.start_iter} (sample {start})\n"
                                      + text))
    return out


class TrainData:
    """The loop's data and its resume state, one object: the built datasets (``train``,
    ``valid``, ``eod``, ``plan``), the consumed-samples count the loop advances, and what a
    checkpoint keeps of them (:meth:`state_dict`) and how a resume takes it back
    (:meth:`load_state_dict`). The loop knows nothing of blends, histories or fingerprints.

    Invariant: ``consumed`` samples of ``train``'s global order have been trained on; the
    next global batch starts there (at any data-parallel size).
    """

    def __init__(self, cfg: DataConfig, *, seq_len: int, vocab_size: int, sizes: tuple[int, int, int],
                 tokenizer_eod: int | None = None, global_batch_size: int | None = None) -> None:
        """Build the datasets of ``cfg`` for ``sizes`` samples (see :func:`build`); nothing consumed."""
        self.cfg = cfg
        self.datasets = build(cfg, seq_len=seq_len, vocab_size=vocab_size, sizes=sizes, tokenizer_eod=tokenizer_eod,
                              global_batch_size=global_batch_size)
        self.switches: dict[int, int] = {}
        """Consumed samples -> schedule phase (index into ``data.schedule``) that starts there (after 0)."""
        if cfg.schedule and global_batch_size is not None:
            self.switches = {p.start_iter * global_batch_size: k for k, p in enumerate(cfg.schedule) if k}
        self.consumed = 0
        self.blend_changed = False
        """The resume (:meth:`load_state_dict`) changed the blend's weights or sources at ``consumed``."""

    @property
    def train(self) -> GPTDataset | BlendedDataset | SegmentedBlend:
        return self.datasets.train

    @property
    def valid(self) -> object | None:
        return self.datasets.valid

    @property
    def eod(self) -> int | None:
        return self.datasets.eod

    @property
    def plan(self) -> str:
        return self.datasets.plan

    @property
    def source_names(self) -> list[str] | None:
        """The blend's source names when it has two or more sources (losses per source), else None."""
        return self.datasets.source_names

    def state_dict(self) -> dict:
        """What a checkpoint's ``state.json`` keeps of the data: ``consumed_samples``,
        ``data_fingerprint`` and ``data_description``; for blend data also ``data_history``
        (the train order's segments and the settings a resume may not change) and
        ``data_consumed`` (where each source stands, for people). JSON-able."""
        d = self.datasets
        state: dict = {"consumed_samples": self.consumed, "data_fingerprint": d.fingerprint,
                       "data_description": d.description}
        if d.segments is not None and isinstance(d.train, SegmentedBlend) and d.invariants is not None:
            state["data_history"] = history_json(d.invariants, d.segments)
            state["data_consumed"] = d.train.consumed_json(self.consumed)
        return state

    def load_state_dict(self, saved: dict, *, force: bool = False, where: str = "the checkpoint") -> list[str]:
        """Resume from ``saved`` (a checkpoint's ``state.json``, read from ``where``): check that
        its data may continue here, continue its train order, take its consumed count. Returns
        notes for people (a changed blend, a source that wraps around).

        Blend data with a history continues it (:func:`resume_order`); blend data saved
        without one must have the same fingerprint; mock data must too. ``force``
        (``force_data``) skips every check and takes this config's order as it is."""
        d = self.datasets
        consumed, history = int(saved["consumed_samples"]), saved.get("data_history")
        notes: list[str] = []
        if history is not None and d.segments is not None and not force:
            notes = resume_order(d, self.cfg, history, consumed, where)
            self.blend_changed = any(n.startswith("the blend changed") for n in notes)
        elif d.segments is not None and not force and saved.get("data_fingerprint") != d.fingerprint:
            raise TokenloomError(f"{where} was trained on other data and saved before blends could change on resume "
                                 "(it has no data history); resume with its data or pass --set force_data=true")
        else:
            check_fingerprint(saved.get("data_fingerprint"), d.fingerprint, force)
        self.consumed = consumed
        return notes


def resume_order(data: Datasets, cfg: DataConfig, history: dict, consumed: int, where: str) -> list[str]:
    """Continue the train order of a checkpoint (``where``) whose ``data_history`` is ``history``
    at ``consumed`` samples: ``data.train`` and ``data.segments`` become the history continued
    with this config's blend (a new segment if it draws differently). Returns notes for people.

    Refuses, naming the setting, a change of anything but the blend's weights and sources and
    the run length, and a source whose content changed (its consumed samples cannot be found)."""
    if not isinstance(data.train, SegmentedBlend) or data.segments is None or data.invariants is None:
        raise TokenloomError(f"{where} has a blend history: it resumes with data.blend only")
    invariants, segments = read_history(history, where)
    unpacked = {"data.packing": "concat"}  # what a history without the key (concat, or older) means
    was, now = unpacked | invariants, unpacked | data.invariants
    changed = [f"{k} {was.get(k)!r} -> {v!r}" for k, v in now.items() if was.get(k) != v]
    if changed:
        raise TokenloomError(f"{where} was trained with other data settings ({'; '.join(changed)}); a resume may "
                             "change only the blend's weights and sources and train_iters: restore them, or pass "
                             "--set force_data=true to take the new order as it is")
    plan, planned = data.segments, data.train.blends  # this config's segments (a schedule's phases) and blends
    before = in_force(segments, consumed) if consumed > 0 else None
    segments = continue_history(segments, plan, consumed)
    blends = []
    for seg in segments:
        same = [b for p, b in zip(plan, planned, strict=True) if seg.same_blend(p)]
        blends.append(same[0] if same else _segment_blend(seg, cfg, data.invariants, plan, where))
    data.train, data.segments = SegmentedBlend(segments, blends, data.train.sources), segments
    notes = []
    after = in_force(segments, consumed) if consumed > 0 else None
    # a longer run alone draws a new segment, silently; a schedule's own switches are planned, not changes
    if before is not None and after is not None and after.start == consumed and not before.same_mix(after):
        shares = ", ".join(f"{p} {w:g}" for w, p, _ in after.blend)
        notes.append(f"the blend changed at sample {consumed} (segment {segments.index(after) + 1}): each source "
                     f"continues after the samples it served ({shares})")
    notes += [f"warning: {p} is asked for more samples than its built epochs hold; its order starts again"
              for p in data.train.wrapped]
    return notes


def _segment_blend(seg: Segment, cfg: DataConfig, invariants: dict, plan: list[Segment], where: str):
    """The train blend of an earlier segment, rebuilt (a cache hit when ``cache_dir`` is kept);
    a source is looked for where this config has its content, else at its recorded prefix."""
    moved = {d: p for current in plan for _, p, d in current.blend}
    pairs = [(w, moved.get(d, p)) for w, p, d in seg.blend]
    for (_, prefix), (_, old, _) in zip(pairs, seg.blend, strict=True):
        if not os.path.isfile(index_path(prefix)):
            raise TokenloomError(f"{where} drew samples from {old}, which is gone and not in --data under another "
                                 "name; restore it (its order is needed to continue the others exactly) or pass "
                                 "--set force_data=true")
    given = _blend_of(cfg)
    blend = BlendDataConfig(prefixes=pairs, split=given.split, cache_dir=given.cache_dir,
                            build_timeout=given.build_timeout)
    gpt = GPTDatasetConfig(seq_length=invariants["model.seq_len"], seed=cfg.seed, split=given.split,
                           packing=invariants.get("data.packing", "concat"))
    built, _ = _build_blend(blend, gpt, (seg.train_samples, 0, 0))
    for (_, prefix), (_, _, digest) in zip(pairs, seg.blend, strict=True):
        if built.sources[prefix].digest != digest:
            raise TokenloomError(f"{prefix} changed since {where} drew samples from it (its .idx/manifest digest "
                                 "differs), so where it stopped cannot be found; restore it or pass "
                                 "--set force_data=true")
    return built.train


def _blend_of(cfg: DataConfig) -> BlendDataConfig:
    """``cfg.blend`` of a config without mock data (``DataConfig`` holds exactly one of them)."""
    if cfg.blend is None:
        raise TokenloomError("the data section needs exactly one of data.mock or data.blend")
    return cfg.blend


def _build_blend(blend: BlendDataConfig, gpt: GPTDatasetConfig, sizes: tuple[int, int, int]):
    """The one call into the build stage for real data: cached indices, built once per filesystem;
    returns the build result and its printed plan.

    In a distributed run every rank calls this; ranks that share ``cache_dir`` elect one
    builder (see ``tokenloom.blending.cache``), the others poll the cache for up to
    ``build_timeout`` seconds and then load what it wrote.
    """
    if not blend.prefixes:
        raise TokenloomError("data.blend.prefixes is empty; give [[weight, prefix], ...]")
    shared = None
    if blend.cache_dir is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        run_id = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(run_id, src=0)
        shared = SharedBuild(dist.get_rank(), dist.get_world_size(), dist.barrier, str(run_id[0]),  # rank 0's
                             timeout=blend.build_timeout)
    cfg = BuildConfig(data=[(float(w), str(p)) for w, p in blend.prefixes], split=blend.split,
                      seq_length=gpt.seq_length, num_samples=tuple(sizes), seed=gpt.seed, cache_dir=blend.cache_dir,
                      packing=gpt.packing)
    built = build_blend(cfg, shared=shared)
    return built, format_plan(built, cfg)


def loader(dataset, *, eod: int | None, eod_mask_loss: bool, consumed_samples: int, micro_batch_size: int,
           dp_rank: int, dp_size: int, num_workers: int = 0, pin_memory: bool = False,
           total_samples: int | None = None, inter_document_masking: bool = False,
           vocab_size: int | None = None, source_ids: bool = False, packed: bool = False) -> DataLoader:
    """Micro-batches of this rank (dicts of ``tokens``, ``labels``, ``loss_mask``, ``position_ids``,
    ``cu_seqlens``/``max_seqlen`` with ``inter_document_masking``, ``source`` with ``source_ids``;
    ``packed``: best-fit samples, whose labels stay inside each document).

    The global order is the dataset's; rank ``r`` takes its slice of every global
    micro-step (see :class:`ConsumedSamplesSampler`). ``total_samples`` caps the samples used;
    a sample with an id at or above ``vocab_size`` raises an error naming its source.
    """
    total = len(dataset) if total_samples is None else min(total_samples, len(dataset))
    sampler = ConsumedSamplesSampler(total, consumed_samples, micro_batch_size, dp_rank, dp_size)
    samples = GPTSamples(dataset, SampleConfig(eod=eod, eod_mask_loss=eod_mask_loss,
                                               inter_document_masking=inter_document_masking,
                                               vocab_size=vocab_size, source_ids=source_ids,
                                               labels_within_documents=packed))
    # A private generator: DataLoader draws its worker base seed from the *global* torch RNG
    # otherwise (even with num_workers=0), which would shift dropout's stream on resume.
    generator = torch.Generator().manual_seed(consumed_samples)
    # torch types a map-style dataset nominally (a Dataset subclass); GPTSamples is one by protocol
    return DataLoader(samples, batch_sampler=sampler,  # type: ignore[arg-type]
                      num_workers=num_workers, pin_memory=pin_memory, generator=generator)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    non_blocking = device.type == "cuda"
    return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}


def open_tokenizer(name: str):
    """``load_tokenizer`` for a path, or for a file-less kind name such as ``"byte"``."""
    return load_tokenizer(kind=name) if name in FILELESS else load_tokenizer(name)
