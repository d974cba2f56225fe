"""Each TP mapping's forward and backward equal the one-process computation they stand for.

The one-process reference of a mapping is the whole tp group's computation in one
process: every rank's local loss ``(out_r * w_r).sum()`` with rank-specific weights
``w_r``, summed. Each rank can rebuild every other rank's data from seeds, so it
computes that reference with plain autograd and compares its own slice. Subgroups
other than WORLD (tp 2 inside world 4) are exercised by the layer, random and state
tests, which go through these mappings.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tp_helpers import assert_close, det_randn, run_ranks

from tokenloom.train.parallel import mappings as M

S, B, H = 8, 2, 12  # divisible by 2 and 4


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def _check_copy_and_reduce(rank: int, world: int, group) -> None:
    x = det_randn(S, B, H, seed=1)
    ws = [det_randn(S, B, H, seed=100 + r) for r in range(world)]
    # copy_to_region: identity forward, every rank's loss flows back to the replicated x.
    ref = _leaf(x)
    sum((ref * w).sum() for w in ws).backward()
    mine = _leaf(x)
    out = M.copy_to_region(mine, group)
    assert_close(out, x, "copy forward")
    (out * ws[rank]).sum().backward()
    assert_close(mine.grad, ref.grad, "copy backward")

    # reduce_from_region: sum of partial results forward; a replicated loss counted once.
    xs = [det_randn(S, B, H, seed=200 + r) for r in range(world)]
    w = det_randn(S, B, H, seed=300)
    refs = [_leaf(t) for t in xs]
    total = sum(refs)
    (total * w).sum().backward()
    mine = _leaf(xs[rank])
    out = M.reduce_from_region(mine, group)
    assert_close(out, total.detach(), "reduce forward")
    (out * w).sum().backward()
    assert_close(mine.grad, refs[rank].grad, "reduce backward")


def _check_last_dim(rank: int, world: int, group) -> None:
    x = det_randn(S, B, H, seed=2)
    ws = [det_randn(S, B, H // world, seed=400 + r) for r in range(world)]
    # scatter_to_region: each rank keeps its chunk of the last dim.
    ref = _leaf(x)
    sum((c * w).sum() for c, w in zip(ref.chunk(world, -1), ws, strict=True)).backward()
    mine = _leaf(x)
    out = M.scatter_to_region(mine, group)
    assert_close(out, x.chunk(world, -1)[rank], "scatter forward")
    (out * ws[rank]).sum().backward()
    assert_close(mine.grad, ref.grad, "scatter backward")

    # gather_from_region: concatenated chunks; replicated consumer.
    w = det_randn(S, B, H, seed=500)
    ref = _leaf(x)
    (ref * w).sum().backward()
    mine = _leaf(x.chunk(world, -1)[rank])
    out = M.gather_from_region(mine, group)
    assert_close(out, x, "gather forward")
    (out * w).sum().backward()
    assert_close(mine.grad, ref.grad.chunk(world, -1)[rank], "gather backward")


def _check_sequence_dim(rank: int, world: int, group) -> None:
    x = det_randn(S, B, H, seed=3)
    shard_ws = [det_randn(S // world, B, H, seed=600 + r) for r in range(world)]
    full_ws = [det_randn(S, B, H, seed=700 + r) for r in range(world)]

    ref = _leaf(x)
    sum((c * w).sum() for c, w in zip(ref.chunk(world, 0), shard_ws, strict=True)).backward()
    mine = _leaf(x)
    out = M.scatter_to_sequence_parallel_region(mine, group)
    assert_close(out, x.chunk(world, 0)[rank], "sp scatter forward")
    (out * shard_ws[rank]).sum().backward()
    assert_close(mine.grad, ref.grad, "sp scatter backward")

    # gather, consumer tensor-parallel: each rank's loss differs, grads reduce-scattered.
    ref = _leaf(x)
    sum((ref * w).sum() for w in full_ws).backward()
    mine = _leaf(x.chunk(world, 0)[rank])
    out = M.gather_from_sequence_parallel_region(mine, group)
    assert_close(out, x, "sp gather forward")
    (out * full_ws[rank]).sum().backward()
    assert_close(mine.grad, ref.grad.chunk(world, 0)[rank], "sp gather backward (reduce-scatter)")

    # gather, consumer replicated: one loss, grads just split.
    ref = _leaf(x)
    (ref * full_ws[0]).sum().backward()
    mine = _leaf(x.chunk(world, 0)[rank])
    out = M.gather_from_sequence_parallel_region(mine, group, tensor_parallel_output_grad=False)
    (out * full_ws[0]).sum().backward()
    assert_close(mine.grad, ref.grad.chunk(world, 0)[rank], "sp gather backward (split)")

    # reduce-scatter: partial full-sequence results summed, each rank keeps its chunk.
    xs = [det_randn(S, B, H, seed=800 + r) for r in range(world)]
    refs = [_leaf(t) for t in xs]
    total = sum(refs)
    sum((c * w).sum() for c, w in zip(total.chunk(world, 0), shard_ws, strict=True)).backward()
    mine = _leaf(xs[rank])
    out = M.reduce_scatter_to_sequence_parallel_region(mine, group)
    assert_close(out, total.detach().chunk(world, 0)[rank], "sp reduce-scatter forward")
    (out * shard_ws[rank]).sum().backward()
    assert_close(mine.grad, refs[rank].grad, "sp reduce-scatter backward")


def _check_add_does_not_alias(rank: int, world: int, group) -> None:
    """``a + b`` hands one grad tensor to both inputs: the all-reduce must not corrupt b's grad."""
    a, b = _leaf(det_randn(4, seed=9)), _leaf(det_randn(4, seed=10))
    (M.copy_to_region(a, group) + b).sum().backward()
    assert_close(b.grad, torch.ones(4), "b.grad untouched")
    assert_close(a.grad, torch.full((4,), float(world)), "a.grad all-reduced")


def _mappings_worker(rank: int, world: int, tp: int) -> None:
    groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    group = groups[rank // tp]
    tp_rank = dist.get_rank(group)
    _check_copy_and_reduce(tp_rank, tp, group)
    _check_last_dim(tp_rank, tp, group)
    _check_sequence_dim(tp_rank, tp, group)
    _check_add_does_not_alias(tp_rank, tp, group)


@pytest.mark.slow
@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4)], ids=["w2tp2", "w4tp4"])
def test_mappings_match_one_process(tmp_path, world, tp):
    run_ranks(_mappings_worker, world, tmp_path, tp)


def test_single_rank_group_passes_through():
    x = torch.randn(4, 2, 6)
    for fn in (
        M.copy_to_region,
        M.reduce_from_region,
        M.scatter_to_region,
        M.gather_from_region,
        M.scatter_to_sequence_parallel_region,
        M.gather_from_sequence_parallel_region,
        M.reduce_scatter_to_sequence_parallel_region,
    ):
        assert fn(x, None) is x
