"""Data-parallel gradient reduction under tensor and pipeline parallelism (issue 16): the
bucketed DDP of every model chunk launches its buckets during the chunk's own last
micro-batch backward (in the pipeline's cooldown), never after the schedule, and waits for
them only after the last backward, in dp2 x pp2 (1F1B), dp2 x tp2 (no pipelining),
dp2 x pp2 x vpp2 (interleaved) and dp2 x pp2 under bf16 autocast (grads and buckets stay
fp32); ZeRO-1's bucketed reduce-scatter the same way under pp, vpp and tp with sequence
parallelism. Equality with one process: test_compose.py (and test_meta_device.py).

One 4-rank launch (oversubscribed on 2 cores), so ``slow``."""

from __future__ import annotations

import pytest
from compose_helpers import launch

pytestmark = pytest.mark.slow
BUCKET_MB = 0.02  # ~20 KB buckets: several per chunk of the tiny model
M = 4  # micro-batches per dp rank and step (global batch 16, micro-batch 2, dp 2)
STEPS = 2  # the second step runs on the buckets rebuilt from the first backward's order

LAYOUTS = {  # name -> TrainConfig overrides, on 4 ranks: dp 2
    "dp2_tp1_pp2": dict(pp=2),
    "dp2_tp2_pp1": dict(tp=2),
    "dp2_tp1_pp2_vpp2": dict(pp=2, vpp=2),
    "dp2_tp1_pp2_bf16": dict(pp=2, precision="bf16"),
}
ZERO_LAYOUTS = {  # ZeRO-1's bucketed reduce-scatter, launched the same way
    "dp2_tp1_pp2_zero1": dict(pp=2, zero1=True),
    "dp2_tp1_pp2_vpp2_zero1": dict(pp=2, vpp=2, zero1=True),
    "dp2_tp2_pp1_sp_zero1": dict(tp=2, sp=True, zero1=True),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("staged_ddp")
    every = {**LAYOUTS, **ZERO_LAYOUTS}
    scenarios = [("dp_reduction_timeline", dict(out=str(tmp / name), steps=STEPS, ddp_bucket_cap_mb=BUCKET_MB, **kw))
                 for name, kw in every.items()]
    results = launch(scenarios, 4, tmp)
    return {name: [r[i] for r in results] for i, name in enumerate(every)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_chunk_reduces_every_bucket_during_its_last_backward(runs, name):
    """Per chunk and step: no launch in the backwards of micro-batches 0..M-2 (they run in
    no_sync), every bucket, each once, in micro-batch M-1's backward (the step's first layout,
    then the one rebuilt from its ready order); none outside a backward or after the schedule."""
    chunks = 2 if "vpp2" in name else 1
    for rank, res in enumerate(runs[name]):
        assert res["stray_launches"] == 0, rank
        assert sorted(res["bucket_bytes"]) == list(range(chunks))
        for step, launches in enumerate(res["launches"]):
            for c, per_micro in launches.items():
                assert [len(x) for x in per_micro[:-1]] == [0] * (M - 1), (rank, step, c)
                assert len(per_micro[-1]) >= 2, (rank, step, c)  # several buckets, launched one by one
                assert sum(per_micro[-1]) == sum(res["bucket_bytes"][c]), (rank, step, c)
        last = res["launches"][-1]  # after the rebuild: the layout reported at the end
        assert {c: sorted(x[-1]) for c, x in last.items()} == {c: sorted(b) for c, b in res["bucket_bytes"].items()}


def test_interleaved_chunks_sync_in_their_own_last_backward(runs):
    """vpp 2: chunk 1's last backward (micro-batch M-1) runs before chunk 0's last two
    backwards in the cooldown, and chunk 1's buckets are launched there, not at the end."""
    for rank, res in enumerate(runs["dp2_tp1_pp2_vpp2"]):
        assert res["backward_order"][-3:] == [(1, M - 1), (0, M - 2), (0, M - 1)], rank
        for launches in res["launches"]:
            assert launches[1][M - 1] and launches[0][M - 1] and not launches[0][M - 2], rank


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grads_are_fp32_bucket_views(runs, name):
    """Parameters stay fp32 and bf16 is autocast: every grad, and so every bucket, is fp32
    (Megatron's grad_reduce_in_fp32) and lives in its bucket's flat buffer."""
    for res in runs[name]:
        assert res["fp32_bucket_views"]
        for c, numel in res["chunk_numel"].items():
            assert sum(res["bucket_bytes"][c]) == 4 * numel, c


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_buckets_are_waited_for_after_the_last_backward(runs, name):
    """No backward waits for a reduction (a stage sends its input grad on at once, and under
    vpp chunk 0's last backwards run while chunk 1's buckets are in flight): every launch is
    waited for once, after the step's last backward."""
    for res in runs[name]:
        for launches, (waits, early) in zip(res["launches"], res["waits"], strict=True):
            assert waits == sum(len(x[-1]) for x in launches.values()) and early == 0


@pytest.mark.parametrize("name", list(ZERO_LAYOUTS))
def test_zero1_reduce_scatters_every_bucket_during_the_last_backwards(runs, name):
    """ZeRO-1 under tp/pp: no launch in the backwards of micro-batches 0..M-2, every bucket
    launched once in a chunk's last backward (under vpp chunk 1's in its own, before chunk 0's
    last backwards), none outside a backward; all waited for after the step's last backward."""
    for rank, res in enumerate(runs[name]):
        assert res["stray_launches"] == 0, rank
        for launches, (waits, early) in zip(res["launches"], res["waits"], strict=True):
            assert not any(x for per_micro in launches.values() for x in per_micro[:-1]), rank
            launched = sum(len(per_micro[-1]) for per_micro in launches.values())
            assert launched == res["zero_buckets"] >= 4, (rank, launched, res["zero_buckets"])
            assert waits == launched and early == 0, rank
            if "vpp2" in name:
                assert launches[1][M - 1], rank
