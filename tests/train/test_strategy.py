"""Strategy choices visible at one rank: ZeRO-1 without a process group, and the settings a
layout cannot honour (refused naming the field)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_loop import losses, tiny

from tokenloom.errors import TokenloomError
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.checkpoint import format as ckpt_format
from tokenloom.train.loop import run, start_run
from tokenloom.train.strategy import refuse_unsupported


def test_zero1_on_one_rank_checkpoints_layout_free_and_resumes_without_it(tmp_path: Path):
    """zero1 at dp 1 (one shard, no torch.distributed: what ``cli.py train --zero1`` runs on one
    rank) writes a layout-free checkpoint (AdamW state per parameter) that a run without zero1
    continues with the same losses. (ZeRO-1 at dp 1 against AdamW: test_zero.py.)"""
    kw = dict(train_iters=4, eval_interval=0)
    run(tiny(tmp_path / "zero", zero1=True, save_interval=2, **kw))
    saved = tmp_path / "zero" / "checkpoints" / "iter_0000002"
    _, optim = ckpt_format.read(saved)
    assert optim and all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in optim.values())
    run(tiny(tmp_path / "resumed", resume=str(saved), **kw))
    zero, resumed = losses(tmp_path / "zero"), losses(tmp_path / "resumed")
    assert [i for i, _ in resumed] == [3, 4]
    assert max(abs(a - b) for (_, a), (_, b) in zip(resumed, zero[2:], strict=True)) < 1e-5
    assert checkpoint.is_complete(checkpoint.find_latest(tmp_path / "resumed" / "checkpoints"))


@pytest.mark.parametrize("overrides, match", [
    (dict(overlap_grad_reduce=True), "overlap_grad_reduce applies to zero1"),
    (dict(pp=2, overlap_grad_reduce=False), "overlap_grad_reduce applies to zero1"),
    (dict(overlap_param_gather=True), "overlap_param_gather applies to zero1"),
    (dict(tp=2, overlap_param_gather=False), "overlap_param_gather applies to zero1"),
    (dict(fsdp=True, zero1=True), "zero1 cannot be combined with fsdp"),
    (dict(fsdp=True, ddp_bucket_cap_mb=1.0), "ddp_bucket_cap_mb cannot be combined with fsdp"),
    (dict(fsdp=True, overlap_grad_reduce=False), "overlap_grad_reduce cannot be combined with fsdp"),
    (dict(fsdp=True, tp=2, overlap_param_gather=True), "overlap_param_gather cannot be combined with fsdp"),
    (dict(fsdp=True, fp8="tensorwise"), "fp8 cannot be combined with fsdp"),
])
def test_settings_a_layout_cannot_honour_are_refused(tmp_path: Path, overrides, match):
    with pytest.raises(TokenloomError, match=match):
        refuse_unsupported(tiny(tmp_path, **overrides))


@pytest.mark.parametrize("overrides", [dict(tp=2), dict(pp=2), dict(pp=2, vpp=2)])
def test_zero1_overlap_and_bucket_size_are_accepted_in_tp_and_pp_layouts(tmp_path: Path, overrides):
    """ZeRO-1 buckets and overlaps its reductions in every layout (test_compose.py's zero1 layouts)."""
    refuse_unsupported(tiny(tmp_path, zero1=True, ddp_bucket_cap_mb=0.5, overlap_grad_reduce=False,
                            overlap_param_gather=True, **overrides))


def test_overlap_and_bucket_size_are_accepted_for_zero1_at_tp_pp_1(tmp_path: Path):
    r = start_run(tiny(tmp_path, zero1=True, overlap_grad_reduce=False, overlap_param_gather=False,
                       ddp_bucket_cap_mb=0.01, train_iters=1))
    assert not r.strategy.optimizer.overlap and len(r.strategy.optimizer.main_shards) > 3
    assert r.strategy.optimizer.optimizer.defaults["fused"]  # torch's fused AdamW on the host, as without ZeRO-1


@pytest.mark.parametrize("overrides", [dict(tp=2), dict(pp=2), dict(pp=2, vpp=2)])
def test_bucket_size_is_accepted_for_ddp_in_tp_and_pp_layouts(tmp_path: Path, overrides):
    """tp/pp layouts reduce over dp in DDP's buckets too (test_staged_ddp.py), so the cap applies."""
    refuse_unsupported(tiny(tmp_path, ddp_bucket_cap_mb=0.5, **overrides))


def test_fsdp_in_one_process_without_torch_distributed_is_the_plain_run(tmp_path: Path):
    """fsdp at dp 1 without a process group (``cli.py train --fsdp`` on one rank, no torchrun)
    has nothing to shard: the same losses as the plain run, a checkpoint whose layout says fsdp,
    and a plain run resumes it. (Sharded: parallel/test_fsdp.py; one NCCL rank: the GPU checks.)"""
    kw = dict(train_iters=4, eval_interval=0)
    r = start_run(tiny(tmp_path / "fsdp", fsdp=True, save_interval=2, **kw))
    assert r.strategy.fsdp_group is None
    r.train()
    run(tiny(tmp_path / "plain", **kw))
    assert losses(tmp_path / "fsdp") == losses(tmp_path / "plain")
    saved = tmp_path / "fsdp" / "checkpoints" / "iter_0000002"
    assert checkpoint.read_state(saved)["layout"]["fsdp"] is True
    run(tiny(tmp_path / "resumed", resume=str(saved), **kw))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "plain")[2:]
