"""tokenloom.train.staged_gloo: every collective the trainer uses, on 2 spawned ranks, gives over
StagedGloo staging every call (CPU tensors standing in for a GPU's) what plain gloo gives, and the
staging is really taken (its counter) or, unforced on CPU tensors, not taken at all."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tl_testing import timed

from tokenloom.train import staged_gloo
from tokenloom.train.kernels import choose_compile

pytestmark = pytest.mark.timeout(120)  # one launch of 2 ranks: process start and torch import, a few s


def collectives(group) -> dict[str, list]:
    """The trainer's calls (ZeRO, tp mappings, MoE dispatch, pipeline p2p, checkpoint, stop flags) over ``group``."""
    rank, out = dist.get_rank(group), {}
    t = torch.arange(6.) + rank
    dist.all_reduce(t, group=group)
    out["all_reduce"] = t
    t = torch.arange(4.) * (rank + 1)
    dist.broadcast(t, src=1, group=group)
    out["broadcast"] = t
    o = torch.empty(8)
    dist.all_gather_single(o, torch.arange(4.) + 10 * rank, group=group)
    out["all_gather_single"] = o
    o = torch.empty(3)
    work = dist.reduce_scatter_single(o, torch.arange(6.) * (rank + 1), group=group, async_op=True)
    work.wait()
    out["reduce_scatter_single"] = o
    parts = [torch.empty(2) for _ in range(2)]
    dist.all_gather(parts, torch.full((2,), float(rank)), group=group)
    out["all_gather"] = torch.cat(parts)
    splits = [[1, 2], [2, 3]]  # uneven, as MoE's token dispatch: rank r sends splits[r][j] rows to j
    o = torch.empty(sum(splits[rank]), 2)
    dist.all_to_all_single(o, torch.arange(2. * sum(splits[rank])).view(-1, 2) + 100 * rank,
                           [splits[0][rank], splits[1][rank]], splits[rank], group=group)
    out["all_to_all_single"] = o
    got = [torch.empty(2) for _ in range(2)] if rank == 0 else None
    dist.gather(torch.full((2,), rank + 5.), got, dst=dist.get_global_rank(group, 0), group=group)
    out["gather"] = torch.cat(got) if got else torch.zeros(0)
    peer = dist.get_global_rank(group, 1 - rank)
    sent, recv = torch.full((3,), rank + 1.), torch.empty(3)
    ops = [dist.P2POp(dist.isend, sent, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    for work in dist.batch_isend_irecv(ops):  # both ranks send first: the staged send must not block
        work.wait()
    out["p2p"] = recv
    objs: list = [None, None]
    dist.all_gather_object(objs, {"rank": rank}, group=group)
    out["all_gather_object"] = torch.tensor([o["rank"] for o in objs])
    dist.barrier(group=group)
    return {k: v.tolist() for k, v in out.items()}


def _worker(rank: int, init: str, result: str) -> None:
    torch.set_num_threads(1)
    try:
        staged_gloo.register(stage_all=True)
        dist.init_process_group(staged_gloo.BACKEND, init_method=f"file://{init}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        world = dist.group.WORLD
        plain = dist.new_group(backend="gloo")
        out = {"backend": dist.get_backend(), "plain": collectives(plain)}
        out["staged"] = collectives(world)
        out["calls"] = dict(staged_gloo.STAGED)
        world.stage_all = False  # CPU tensors, unforced: gloo runs them all itself
        out["unforced"] = collectives(world)
        out["calls_after"] = dict(staged_gloo.STAGED)
        dist.destroy_process_group()
    except Exception:
        out = {"crash": traceback.format_exc()}
    torch.save(out, result)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("staged_gloo")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, str(tmp / "init"), str(tmp / f"r{r}.pt"))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        with timed("staged_gloo ranks", 100) as limit:
            for p in procs:
                p.join(timeout=limit)
        assert not any(p.is_alive() for p in procs), "ranks still running (hang?)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    out = [torch.load(tmp / f"r{r}.pt", weights_only=True) for r in range(2)]
    for r, res in enumerate(out):
        assert "crash" not in res, f"rank {r}:\n{res.get('crash')}"
    return out


def test_staged_collectives_equal_plain_gloo(ranks):
    for res in ranks:
        assert res["backend"] == staged_gloo.BACKEND
        assert res["staged"] == res["plain"]
        assert res["unforced"] == res["plain"]
    assert ranks[0]["plain"]["all_reduce"] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]  # the reference is right too
    assert ranks[1]["plain"]["p2p"] == [1.0, 1.0, 1.0] and ranks[0]["plain"]["p2p"] == [2.0, 2.0, 2.0]
    assert ranks[1]["plain"]["all_to_all_single"] == [[2.0, 3.0], [4.0, 5.0], [104.0, 105.0], [106.0, 107.0],
                                                      [108.0, 109.0]]


def test_staging_is_taken_when_forced_and_only_then(ranks):
    for res in ranks:
        kinds = {"allreduce", "broadcast", "all_gather_single", "reduce_scatter_single", "allgather",
                 "all_to_all_single", "gather", "send", "recv"}
        assert kinds <= set(res["calls"]), res["calls"]
        assert res["calls_after"] == res["calls"]  # unforced, CPU tensors: nothing more staged


def test_only_allreduce_and_broadcast_run_on_gpu_tensors_unstaged():
    assert staged_gloo.NATIVE_ON_CUDA == {"allreduce", "broadcast", "barrier"}
    group = staged_gloo.StagedGloo.__new__(staged_gloo.StagedGloo)  # the decision only: no store, no peers
    group.stage_all = False
    gpu = torch.empty(1, device="meta")  # any non-CPU device counts as one the staging serves
    assert not group._staged("allreduce", [gpu], []) and not group._staged("broadcast", [gpu], [])
    for kind in ("all_gather_single", "reduce_scatter_single", "all_to_all_single", "send", "recv", "gather"):
        assert group._staged(kind, [gpu], [])
    assert not group._staged("send", [torch.empty(1)], [])


def test_compile_auto_leaves_blocks_eager_where_their_collectives_cannot_be_captured():
    assert choose_compile("auto", "cuda", capturable=False) == (
        False, "off: the blocks' collectives over gloo's staged group cannot be compiled")
    assert choose_compile(True, "cuda", capturable=False) == (True, "set")  # the strategy refuses this one
    assert staged_gloo.blocks_compile_with(2, 2, 2)  # no process group: nothing staged
