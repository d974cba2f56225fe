"""Blends that change on resume: the train order as *segments*, each source continuing where it stopped.

Megatron fixes a blend's global order by (sources, weights, seed, sequence length, sample
count); resuming with other weights builds another order, in which samples a source
already served come again and others are never reached (https://github.com/NVIDIA/Megatron-LM/issues/457).

Policy: a source's *order* is the GPT dataset it got in the first segment that listed it
(Megatron's member dataset, every sample of its built epochs). The run's history is a
list of segments ``(start, train_samples, blend)``; segment k serves global samples
``[start_k, start_{k+1})`` by drawing from its own blend (the greedy error-minimising
interleave of :func:`~tokenloom.blending.blend.build_blend_indices`, whose prefix does not
depend on the blend's size), and its j-th draw from source d is sample ``c_k[d] + j`` of
d's order, where ``c_k[d]`` is what the earlier segments took from d. So nothing is served
twice and nothing skipped, at any data-parallel size (the order is global); a run that
never changes is one segment, Megatron's blend itself. Sources are identified by content
(their ``.idx``/manifest digest), so a moved prefix keeps its place.

A data schedule (``data.schedule``) is this planned ahead: its phases are the segments from
the start, so a switch at iteration N draws exactly what a resume at N with the next phase's
blend draws, and :func:`continue_history` resumes either within the plan.

Costs and limits: each segment's blend is built (cached) for the whole run length of its
time, of which only the part up to the next change is read; a source asked after a change
for more samples than its built epochs hold starts its order again (the same shuffle, a
warning says so), where Megatron would have built more, differently shuffled, epochs.

Worked example (a unit test): sources A, B at 0.5/0.5 for 8 samples interleave as
``A0 B0 A1 B1 A2 B2 A3 B3``. Changed at sample 4 to 0.25/0.75, the new segment's interleave
is ``B A B B`` and continues each source after what it served: ``A0 B0 A1 B1 | B2 A2 B3 B4``.
Megatron's order for the new weights would serve ``A1 B3 B4 B5`` from sample 4: A1 again,
B2 never.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from tokenloom.errors import TokenloomError

if TYPE_CHECKING:  # annotations only: the blends are built by the caller
    from tokenloom.blending.gpt import GPTDataset

FORMAT = 1
"""Version of the history record kept in checkpoints."""


@dataclass(frozen=True)
class Segment:
    """One stretch of the train order: the blend that decides it from global sample ``start`` on."""

    start: int
    """First global sample of the segment (the consumed samples when the blend changed)."""
    train_samples: int
    """The run's train sample count when this blend was set (what its blend was built for)."""
    blend: tuple[tuple[float, str, str], ...]
    """(weight, prefix, content digest) per source, in the order of ``--data``."""

    def same_blend(self, other: Segment) -> bool:
        """The same draws: weights, contents and run length (prefixes may have moved)."""
        def key(s: Segment):
            return s.train_samples, [(w, d) for w, _, d in s.blend]

        return key(self) == key(other)

    def same_mix(self, other: Segment) -> bool:
        """The same weights and contents (prefixes may have moved, the run length may differ):
        what a person calls the same blend, though a new run length draws a new order."""
        return [(w, d) for w, _, d in self.blend] == [(w, d) for w, _, d in other.blend]

    def to_json(self) -> dict:
        return {"start": self.start, "train_samples": self.train_samples, "blend": [list(b) for b in self.blend]}

    @classmethod
    def from_json(cls, doc: dict) -> Segment:
        return cls(int(doc["start"]), int(doc["train_samples"]),
                   tuple((float(w), str(p), str(d)) for w, p, d in doc["blend"]))


def history_json(invariants: dict, segments: Sequence[Segment]) -> dict:
    """The record a checkpoint keeps (``state.json``'s ``data_history``)."""
    return {"format": FORMAT, "invariants": invariants, "segments": [s.to_json() for s in segments]}


def read_history(doc: dict, where: str) -> tuple[dict, list[Segment]]:
    """``(invariants, segments)`` of a ``data_history`` record."""
    if doc.get("format") != FORMAT:
        raise TokenloomError(f"{where}: data history format {doc.get('format')!r}, this tokenloom reads {FORMAT}")
    return dict(doc["invariants"]), [Segment.from_json(s) for s in doc["segments"]]


def continue_history(segments: Sequence[Segment], plan: Sequence[Segment], consumed: int) -> list[Segment]:
    """The history after resuming at ``consumed`` samples with the planned segments ``plan`` (this
    config's: one segment, its blend, or a data schedule's phases, the first starting at 0).

    What was served stays: the history's segments that start before ``consumed``. The plan's
    segment in force at ``consumed`` goes on from there: as the last served segment when it
    draws as that one does, else as a new segment starting at ``consumed``; the plan's later
    segments follow as planned. Segments of the history that start at ``consumed`` or later
    served nothing and give way to the plan's."""
    if not plan or plan[0].start != 0:
        raise ValueError("a plan of segments, the first starting at 0")
    if consumed <= 0:
        return list(plan)
    if plan[-1].train_samples <= consumed:  # nothing left to draw: keep what was
        return [s for s in segments if s.start < consumed]
    served = [s for s in segments if s.start < consumed]
    k = bisect.bisect_right([s.start for s in plan], consumed) - 1
    active, later = plan[k], list(plan[k + 1:])
    if served and served[-1].same_blend(active):
        return served + later
    return served + [replace(active, start=consumed)] + later


def in_force(segments: Sequence[Segment], consumed: int) -> Segment:
    """The segment of ``segments`` (starts increasing, the first at 0) that draws sample ``consumed``."""
    return segments[bisect.bisect_right([s.start for s in segments], consumed) - 1]


class SegmentedBlend:
    """The train order of a history: a map-style dataset of ``train_samples`` (of the last segment)
    samples. ``blends[k]`` is segment k's blended dataset (its members in ``segments[k].blend``'s
    order); each source's order is its member in the first segment listing its digest.
    ``sources`` (digests) orders the positions :meth:`source_of` gives; the last segment's by default."""

    def __init__(self, segments: Sequence[Segment], blends: Sequence, sources: Sequence[str] | None = None) -> None:
        if not segments or len(segments) != len(blends) or segments[0].start != 0:
            raise ValueError("one blend per segment, the first starting at 0")
        self.segments, self.blends = list(segments), list(blends)
        self.sources = list(sources) if sources is not None else [d for _, _, d in self.segments[-1].blend]
        self.starts = [s.start for s in self.segments]
        self.ends = self.starts[1:] + [self.segments[-1].train_samples]
        self.first: dict[str, tuple[int, int]] = {}  # digest -> (segment, member) holding its order
        self.prefixes: dict[str, str] = {}
        self.digests: list[list[str]] = []
        self.offsets: list[np.ndarray] = []  # per segment, per member: samples taken before the segment
        taken: dict[str, int] = {}
        self.wrapped: list[str] = []
        for k, (seg, blend, end) in enumerate(zip(self.segments, self.blends, self.ends, strict=True)):
            digests = [d for _, _, d in seg.blend]
            if len(set(digests)) != len(digests):
                raise TokenloomError(f"the blend from sample {seg.start} lists the same content twice "
                                     f"({', '.join(p for _, p, _ in seg.blend)}); give each source once")
            for m, (_, prefix, digest) in enumerate(seg.blend):
                self.first.setdefault(digest, (k, m))
                self.prefixes[digest] = prefix
            self.digests.append(digests)
            self.offsets.append(np.array([taken.get(d, 0) for d in digests], dtype=np.int64))
            drawn = np.bincount(np.asarray(blend.dataset_index[: end - seg.start]), minlength=len(digests))
            for d, n in zip(digests, drawn.tolist(), strict=True):
                taken[d] = taken.get(d, 0) + n
                # segment 0 is Megatron's blend, which never over-draws a member (nor makes one here)
                if k and n and taken[d] > len(self.order(d)) and self.prefixes[d] not in self.wrapped:
                    self.wrapped.append(self.prefixes[d])

    def source_of(self, i: int) -> int:
        """The position of global sample i's source in :attr:`sources` (the current config's
        sources), -1 for a source it does not list (only samples of segments a resumed run has
        passed, which it never reads, can have one)."""
        k = bisect.bisect_right(self.starts, i) - 1
        digest = self.digests[k][int(self.blends[k].dataset_index[i - self.starts[k]])]
        return self.sources.index(digest) if digest in self.sources else -1

    def order(self, digest: str) -> GPTDataset:
        """A source's order: its member in the first segment that listed it (made on first use)."""
        k, m = self.first[digest]
        return self.blends[k].datasets[m]

    def __len__(self) -> int:
        return self.ends[-1]

    def locate(self, i: int) -> tuple[GPTDataset, int]:
        """(source order, sample within it) of global sample i."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect.bisect_right(self.starts, i) - 1
        m, j = self.blends[k].locate(i - self.starts[k])
        order = self.order(self.digests[k][m])
        return order, int(self.offsets[k][m] + j) % len(order)

    def __getitem__(self, i: int) -> np.ndarray:
        order, k = self.locate(i)
        return order[k]

    def documents_of(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        order, k = self.locate(i)
        return order.documents_of(k)

    def consumed(self, n: int) -> dict[str, int]:
        """Samples taken from each source (by digest) by the first ``n`` global samples."""
        out = {d: 0 for d in self.first}
        for seg, blend, digests, offsets, end in zip(self.segments, self.blends, self.digests, self.offsets,
                                                     self.ends, strict=True):
            if seg.start >= n and seg.start > 0:
                break
            drawn = np.bincount(np.asarray(blend.dataset_index[: max(0, min(n, end) - seg.start)]),
                                minlength=len(digests))
            for d, c, m in zip(digests, offsets.tolist(), drawn.tolist(), strict=True):
                out[d] = c + m
        return out

    def consumed_json(self, n: int) -> list[dict]:
        """:meth:`consumed` for ``state.json``: prefix, digest and samples per source."""
        return [{"prefix": self.prefixes[d], "digest": d, "samples": c} for d, c in self.consumed(n).items()]
