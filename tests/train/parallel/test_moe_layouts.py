"""Mixture-of-experts models in the parallel layouts against their one-process run (issue 43,
acceptance 2 without expert parallelism): 10-step losses, grad norms, the logged balance and z
losses and tokens per expert, and the final parameters (experts and routers included) of dp 2,
tp 2 with sequence parallelism (eager and compiled), pp 2 and dp 2 with ZeRO-1, every layout trained with the process
default device set to ``meta`` (the meta default-device suite's check: no tensor made without
naming the run's device).

One launch of 2 gloo ranks, so ``slow``."""

from __future__ import annotations

import pytest
from compose_helpers import STEPS, launch, launches_timeout, merged_params, reference

TOL = 1e-5

LAYOUTS = {  # name -> TrainConfig overrides on 2 ranks; (dp, tp, pp)
    "dp2_tp1_pp1": {},
    "dp1_tp2_pp1_sp": dict(tp=2, sp=True),
    "dp1_tp1_pp2": dict(pp=2),
    "dp2_tp1_pp1_zero1": dict(zero1=True, ddp_bucket_cap_mb=0.02),
    # compiled blocks (compile's default on CUDA): fp32 experts fall back to the loop under compile
    "dp1_tp2_pp1_sp_compile": dict(tp=2, sp=True, compile=True),
}
MOE_SCENARIO_S = 180.0  # the MoE model's steps on 2 ranks: about a dozen seconds here, 3x that on a slow box
pytestmark = [pytest.mark.slow, launches_timeout(len(LAYOUTS), per_scenario_s=MOE_SCENARIO_S)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    out = {"reference": reference(tmp / "reference", moe=True)}
    scenarios = [("train_on_meta", dict(out=str(tmp / n), moe=True, **kw)) for n, kw in LAYOUTS.items()]
    (tmp / "w2").mkdir()
    results = launch(scenarios, 2, tmp / "w2", per_scenario_s=MOE_SCENARIO_S)
    for i, name in enumerate(LAYOUTS):
        ranks = [r[i] for r in results]
        last = next(r for r in ranks if r["losses"])
        out[name] = {"losses": last["losses"], "norms": last["norms"], "moe": last["moe"],
                     "params": merged_params(ranks)}
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_equals_one_process(runs, name):
    got, ref = runs[name], runs["reference"]
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)) < TOL
    assert max(abs(a - b) for a, b in zip(got["norms"], ref["norms"], strict=True)) < TOL
    assert len(got["moe"]) == len(ref["moe"]) == STEPS
    for (balance, z, tokens), (ref_balance, ref_z, ref_tokens) in zip(got["moe"], ref["moe"], strict=True):
        assert abs(balance - ref_balance) < TOL and abs(z - ref_z) < TOL
        assert tokens == ref_tokens
    assert sorted(got["params"]) == sorted(ref["params"])
    assert any(".mlp.experts.fc" in n for n in ref["params"])
    diff = max((got["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"])
    assert diff < TOL
