"""Muon (``optim.name: muon``) in the parallel layouts against its one-process run (issue 51,
acceptance 2 and 3): 10-step losses and final parameters of dp 2, dp 2 + zero1, dp 2 + fsdp, tp 2 +
sp, pp 2, ep 2 (an MoE model) at 2 ranks, and dp 4, dp 4 + zero1 and tp 2 x pp 2 at 4 ranks, through
the one loop in launched gloo ranks; a dp 2 + zero1 checkpoint at step 10 resumed at tp 2 + sp and
under fsdp (2 ranks) and at dp 1 (in this process), and the dp 2 + fsdp one at dp 1, log the
one-process run's later losses (momentum saved and loaded per parameter in the one layout-free format,
sharded rows under fsdp); zero1's per-rank state at dp 4.

Newton-Schulz runs in fp32 here (``muon_ns_dtype``): in bf16 a dp reduction's last-bit rounding
may flip a bf16 rounding of the input, which the one-process comparison would read as a difference.

One launch per world size (2 and 4) plus four one-process runs (two references, two resumes), so ``slow``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from compose_helpers import (  # noqa: E402
    LAUNCH_START_S,
    STEPS,
    deltas,
    launch,
    launches_timeout,
    logged_losses,
    reference,
)

from tokenloom.train.checkpoint import format as ckpt_format  # noqa: E402

TOL = 1e-5
HALF = STEPS // 2
MUON = {"name": "muon", "muon_ns_dtype": "fp32"}


def _worlds(tmp) -> dict[int, list[tuple[str, dict]]]:
    saved = str(tmp / "dp2_zero1" / "checkpoints" / f"iter_{HALF:07d}")
    return {2: [("dp2", {}), ("dp2_zero1", dict(zero1=True, save_interval=HALF)), ("tp2_sp", dict(tp=2, sp=True)),
                ("pp2", dict(pp=2)), ("ep2", dict(ep=2, moe=True)), ("dp2_fsdp", dict(fsdp=True, save_interval=HALF)),
                ("zero1_at_tp2_sp", dict(tp=2, sp=True, resume=saved, checkpoint_dir=str(tmp / "ckpt_at_tp2"))),
                ("zero1_at_fsdp", dict(fsdp=True, resume=saved, checkpoint_dir=str(tmp / "ckpt_at_fsdp")))],
            4: [("dp4", {}), ("dp4_zero1", dict(zero1=True)), ("tp2_pp2", dict(tp=2, pp=2))]}


MUON_SCENARIO_S = 135.0
"""Hang budget per scenario (the Muon steps, with fp32 Newton-Schulz; 4 ranks oversubscribe 2 cores, so a
4-rank scenario counts twice): a scenario takes a few seconds on the developers' machine."""
LAUNCHED = sum(len(v) * w // 2 for w, v in _worlds(Path()).items())
pytestmark = [pytest.mark.slow, launches_timeout(LAUNCHED, references=4, per_scenario_s=MUON_SCENARIO_S)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon")
    out = {"reference": reference(tmp / "reference", optim=MUON, save_interval=HALF),
           "reference_moe": reference(tmp / "reference_moe", optim=MUON, moe=True)}
    for world, layouts in _worlds(tmp).items():
        # 4 ranks oversubscribe 2 cores: twice a scenario's budget each
        results = launch([("train", dict(out=str(tmp / name), optim=MUON, **kw)) for name, kw in layouts], world, tmp,
                         deadline_s=LAUNCH_START_S + MUON_SCENARIO_S * len(layouts) * world / 2)
        for i, (name, _) in enumerate(layouts):
            out[name] = [r[i] for r in results]
    for name, run in (("zero1", "dp2_zero1"), ("fsdp", "dp2_fsdp")):
        saved = tmp / run / "checkpoints" / f"iter_{HALF:07d}"
        out[f"{name}_at_dp1"] = reference(tmp / f"{name}_at_dp1", optim=MUON, resume=str(saved),
                                          checkpoint_dir=str(tmp / f"ckpt_{name}_at_dp1"))
    return out


@pytest.mark.parametrize("name", ["dp2", "dp2_zero1", "dp2_fsdp", "tp2_sp", "pp2", "ep2", "dp4", "dp4_zero1",
                                  "tp2_pp2"])
def test_muon_layout_equals_one_process(runs, name):
    ref = runs["reference_moe" if name == "ep2" else "reference"]
    n, dl, dp = deltas(runs[name], ref)
    print(f"{name}: max loss delta {dl:.2e}, max param delta {dp:.2e}")
    assert n == STEPS and dl < TOL and dp < TOL
    saved = Path(runs[name][0]["summary"]["checkpoint"])
    state = ckpt_format.read(saved)[1]  # the layout-free format holds Muon's momentum per matrix
    assert "momentum_buffer" in state["blocks.1.attn.qkv.weight"] and "exp_avg" in state["tok_emb.weight"]


@pytest.mark.parametrize("name", ["zero1_at_tp2_sp", "zero1_at_fsdp", "zero1_at_dp1", "fsdp_at_dp1"])
def test_muon_checkpoint_resumes_in_another_layout(runs, name):
    ref = runs["reference"]["losses"][HALF:]
    got = logged_losses(runs[name]) if isinstance(runs[name], list) else runs[name]["losses"]
    assert len(got) == len(ref) == STEPS - HALF
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < TOL


def test_zero1_shards_muon_state_by_whole_tensors(runs):
    """Acceptance 3: at dp 4 each rank keeps the state of the whole tensors it owns, at most 0.3x the
    unsharded state (dp 4 without zero1: every rank holds all of it), the imbalance of whole-tensor
    assignment included; together the ranks hold it once."""
    full = runs["dp4"][0]["state_bytes"]
    shards = [r["state_bytes"] for r in runs["dp4_zero1"]]
    print(f"per-rank Muon state at dp4 + zero1: {[round(b / full, 3) for b in shards]} of the unsharded {full} B")
    assert all(r["state_bytes"] == full for r in runs["dp4"])
    assert max(shards) <= 0.3 * full and min(shards) > 0
    assert abs(sum(shards) - full) <= 4 * 4 * len(runs["dp4"])  # AdamW's 0-dim steps aside: the state once


def test_fsdp_shards_muon_momentum_by_rows(runs):
    """Under fsdp the momentum lives sharded like the parameter (its rows on each rank): each dp 2 rank
    holds about half of dp 2's replicated state, together all of it once (but AdamW's 0-dim steps,
    on every rank)."""
    full = runs["dp2"][0]["state_bytes"]
    shards = [r["state_bytes"] for r in runs["dp2_fsdp"]]
    print(f"per-rank Muon state at dp2 + fsdp: {[round(b / full, 3) for b in shards]} of the unsharded {full} B")
    assert max(shards) <= 0.6 * full and min(shards) > 0
    assert 0 <= sum(shards) - full <= 0.01 * full
