"""Segments: the train order of a blend whose weights or sources change on resume."""

from __future__ import annotations

import numpy as np
import pytest

from tokenloom.blending import helpers
from tokenloom.blending.segments import Segment, SegmentedBlend, continue_history, history_json, read_history
from tokenloom.blending.split import normalize
from tokenloom.errors import TokenloomError


class Blend:
    """What SegmentedBlend reads of a BlendedDataset: members, the two arrays, ``locate``."""

    def __init__(self, members: list[list[str]], weights: list[float], size: int):
        self.datasets = members
        # members may be short here (a source that runs out); the real blend's members never are
        self.dataset_index, self.dataset_sample_index = helpers.blending_indices(normalize(normalize(weights)), size)

    def locate(self, i: int) -> tuple[int, int]:
        return int(self.dataset_index[i]), int(self.dataset_sample_index[i])


def order(name: str, n: int = 10) -> list[str]:
    return [f"{name}{k}" for k in range(n)]


def seg(start: int, total: int, *blend: tuple[float, str]) -> Segment:
    return Segment(start, total, tuple((w, f"data/{d}", f"digest-{d}") for w, d in blend))


def test_worked_example_of_the_module_docstring():
    a, b = order("A"), order("B")
    first, second = seg(0, 8, (0.5, "a"), (0.5, "b")), seg(4, 8, (0.25, "a"), (0.75, "b"))
    # the second segment's own blend has other member objects: the first segment's orders are kept
    blends = [Blend([a, b], [0.5, 0.5], 8), Blend([order("x"), order("y")], [0.25, 0.75], 8)]
    assert [blends[0].datasets[d][k] for d, k in map(blends[0].locate, range(8))] == \
        ["A0", "B0", "A1", "B1", "A2", "B2", "A3", "B3"]
    segmented = SegmentedBlend([first, second], blends)
    assert [segmented[i] for i in range(len(segmented))] == ["A0", "B0", "A1", "B1", "B2", "A2", "B3", "B4"]
    megatron = Blend([a, b], [0.25, 0.75], 8)  # the new weights from scratch, read on from sample 4
    assert [megatron.datasets[d][k] for d, k in map(megatron.locate, range(4, 8))] == ["A1", "B3", "B4", "B5"]
    assert segmented.consumed(4) == {"digest-a": 2, "digest-b": 2}
    assert segmented.consumed(8) == {"digest-a": 3, "digest-b": 5}
    assert segmented.consumed(0) == {"digest-a": 0, "digest-b": 0}


def test_added_and_dropped_sources_and_a_source_that_runs_out():
    a, b, c = order("A"), order("B", 3), order("C")
    segments = [seg(0, 12, (0.5, "a"), (0.5, "b")), seg(4, 12, (1.0, "c")), seg(8, 12, (0.5, "b"), (0.5, "c"))]
    blends = [Blend([a, b], [0.5, 0.5], 12), Blend([c], [1.0], 12), Blend([order("y"), order("z")], [0.5, 0.5], 12)]
    segmented = SegmentedBlend(segments, blends)
    got = [segmented[i] for i in range(12)]
    # b served 2 before it was dropped, then 1 more and starts its 3-sample order again; c continues at 4
    assert got == ["A0", "B0", "A1", "B1", "C0", "C1", "C2", "C3", "B2", "C4", "B0", "C5"]
    assert segmented.wrapped == ["data/b"]
    assert segmented.consumed_json(12) == [{"prefix": "data/a", "digest": "digest-a", "samples": 2},
                                           {"prefix": "data/b", "digest": "digest-b", "samples": 4},
                                           {"prefix": "data/c", "digest": "digest-c", "samples": 6}]
    with pytest.raises(IndexError):
        segmented[12]


def test_a_blend_listing_one_content_twice_is_refused():
    twice = Segment(0, 4, ((0.5, "data/a", "d"), (0.5, "data/copy-of-a", "d")))
    with pytest.raises(TokenloomError, match="lists the same content twice"):
        SegmentedBlend([twice], [Blend([order("A"), order("A")], [0.5, 0.5], 4)])


def test_history_continues_only_when_the_blend_draws_differently():
    old = [seg(0, 80, (0.5, "a"), (0.5, "b"))]
    moved = Segment(0, 80, ((0.5, "elsewhere/a", "digest-a"), (0.5, "data/b", "digest-b")))
    assert continue_history(old, [moved], 40) == old  # same contents and weights: Megatron's order goes on
    new = seg(0, 80, (0.2, "a"), (0.8, "b"))
    assert continue_history(old, [new], 40) == old + [seg(40, 80, (0.2, "a"), (0.8, "b"))]
    longer = seg(0, 120, (0.5, "a"), (0.5, "b"))  # a longer run: the rest drawn for its new length
    assert continue_history(old, [longer], 40)[-1].start == 40
    assert continue_history(old, [new], 0) == [new]  # nothing served yet: the new blend from the start
    assert continue_history(old, [seg(0, 40, (0.2, "a"), (0.8, "b"))], 40) == old  # nothing left to draw
    # a schedule's plan: its segments go on as planned, a resume within it changes nothing
    plan = [seg(0, 80, (0.5, "a"), (0.5, "b")), seg(40, 80, (0.2, "a"), (0.8, "b"))]
    assert continue_history(plan, plan, 20) == continue_history(plan, plan, 40) == plan
    assert continue_history(plan, plan, 60) == plan
    assert continue_history(old, plan, 20) == plan  # a schedule added before its switch
    assert continue_history(old, plan, 60) == old + [seg(60, 80, (0.2, "a"), (0.8, "b"))]  # and after it
    later = [plan[0], seg(50, 80, (0.2, "a"), (0.8, "b"))]  # the switch moved past the resume point: 40-45 stay
    assert continue_history(plan, later, 45) == [*plan, seg(45, 80, (0.5, "a"), (0.5, "b")), later[1]]
    invariants, segments = read_history(history_json({"data.seed": 1}, old + [new]), "ckpt")
    assert invariants == {"data.seed": 1} and segments == old + [new]
    with pytest.raises(TokenloomError, match="ckpt: data history format 9"):
        read_history({"format": 9}, "ckpt")


def test_one_segment_is_the_blend_itself():
    blend = Blend([order("A", 40), order("B", 40)], [0.3, 0.7], 50)
    segmented = SegmentedBlend([seg(0, 50, (0.3, "a"), (0.7, "b"))], [blend])
    expected = [blend.datasets[d][k] for d, k in map(blend.locate, range(50))]
    assert [segmented[i] for i in range(50)] == expected
    assert segmented.consumed(50) == {"digest-a": int(np.sum(blend.dataset_index == 0)),
                                      "digest-b": int(np.sum(blend.dataset_index == 1))}
