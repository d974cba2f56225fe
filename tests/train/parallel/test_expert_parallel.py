"""Expert parallelism (issue 43, acceptance 2 and 3) through the one loop against its one-process
MoE run: 10-step losses, grad norms, the logged balance and z losses and tokens per expert, the final
checkpoint's parameters (every expert under its one-process name) of ep 2 at dp 2, ep 2 at dp 4 (two
expert-data-parallel ranks per expert), ep 2 x tp 2 with sequence parallelism, ep 2 x pp 2, ep 2 at dp 2
and ep 2 x tp 2 + sp with the allgather token dispatcher (every other layout: all-to-all), and ep 2
at dp 2 and dp 4 with ZeRO-1 (the experts' state sharded over the expert-data-parallel ranks: at dp 4
in small buckets, reduce-scattered and gathered overlapped; at dp 2 without the overlaps); every
rank's last-step expert gradients (the layouts without ZeRO-1, whose grads are whole tensors) and
the final checkpoints' expert AdamW moments (every step's expert gradients, decayed; all layouts)
equal the one-process run's; the ep 2 checkpoint at step 10 resumed at ep 1 and at ep 4, the ep 2 x
tp 2 one at ep 1 x dp 4, and the ep 2 + ZeRO-1 one at dp 4 at ep 1 without ZeRO-1, log the losses
their run went on to log; each rank holds its share of the experts, and ZeRO-1 its piece of their
AdamW state. The ep runs have the process default device set to ``meta`` (the meta default-device
suite's check: the dispatch and ZeRO-1's expert buckets make no tensor without naming the run's
device).

Two launches (2 and 4 gloo ranks), so ``slow``."""

from __future__ import annotations

from pathlib import Path

import pytest
from compose_helpers import STEPS, launch, launches_timeout, logged_losses, merged_params, on_meta, reference

from tokenloom.train.checkpoint import format as ckpt_format

TOL = 1e-5
HALF = STEPS // 2


def _worlds(tmp) -> dict[int, list[tuple[str, dict]]]:
    """World size -> (name, overrides) of the layouts launched at it."""
    saved = str(tmp / "ep2_dp2" / "checkpoints" / f"iter_{HALF:07d}")
    saved_tp = str(tmp / "ep2_tp2_sp" / "checkpoints" / f"iter_{HALF:07d}")
    saved_zero1 = str(tmp / "ep2_dp4_zero1" / "checkpoints" / f"iter_{HALF:07d}")
    return {2: [("ep2_dp2", dict(ep=2, save_interval=HALF)), ("ep2_at_ep1", dict(resume=saved)),
                  ("ep2_dp2_zero1", dict(ep=2, zero1=True, overlap_grad_reduce=False, overlap_param_gather=False)),
                  ("ep2_dp2_allgather", dict(ep=2, dispatcher="allgather"))],
              4: [("ep2_dp4", dict(ep=2)), ("ep2_at_ep4", dict(ep=4, resume=saved)),
                  ("ep2_tp2_sp", dict(ep=2, tp=2, sp=True, save_interval=HALF)), ("ep2_pp2", dict(ep=2, pp=2)),
                  ("ep2_tp2_at_ep1", dict(resume=saved_tp)),
                  ("ep2_dp4_zero1", dict(ep=2, zero1=True, ddp_bucket_cap_mb=0.02, save_interval=HALF)),
                  ("ep2_zero1_at_ep1", dict(resume=saved_zero1)),
                  ("ep2_tp2_sp_allgather", dict(ep=2, tp=2, sp=True, dispatcher="allgather"))]}


MOE_SCENARIO_S = 100.0  # a few MoE steps at ep 2 / 4: a few seconds each here, 23 s in the suite on a 3x slower box
pytestmark = [pytest.mark.slow, launches_timeout(sum(len(w) for w in _worlds(Path("/sizes-only")).values()),
                                                per_scenario_s=MOE_SCENARIO_S)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep")
    out = {"reference": reference(tmp / "reference", moe=True)}
    for world, layouts in _worlds(tmp).items():
        (tmp / f"w{world}").mkdir()
        scenarios = [(on_meta("train", kw),
                      dict(out=str(tmp / name), moe=True, checkpoint_dir=str(tmp / name / "checkpoints"), **kw))
                     for name, kw in layouts]
        results = launch(scenarios, world, tmp / f"w{world}", per_scenario_s=MOE_SCENARIO_S)
        for i, (name, _) in enumerate(layouts):
            ranks = [r[i] for r in results]
            last = next(r for r in ranks if r["losses"])
            out[name] = {"losses": logged_losses(ranks), "norms": last["norms"], "moe": last["moe"],
                         "params": merged_params(ranks), "numel": [r["numel"] for r in ranks],
                         "expert_grads": [r["expert_grads"] for r in ranks],
                         "state_bytes": [r["state_bytes"] for r in ranks],
                         "checkpoint": last["summary"]["checkpoint"]}
    return out


@pytest.mark.parametrize(("name", "ep"), [("ep2_dp2", 2), ("ep2_dp4", 2), ("ep2_at_ep4", 4), ("ep2_dp2_zero1", 2),
                                          ("ep2_dp4_zero1", 2), ("ep2_dp2_allgather", 2)])
def test_each_rank_holds_its_share_of_the_experts(runs, name, ep):
    ref = runs["reference"]["params"]
    experts = sum(t.numel() for n, t in ref.items() if ".mlp.experts." in n)
    total = sum(t.numel() for n, t in ref.items() if n != "lm_head.weight")  # tied to the embedding
    assert experts and runs[name]["numel"] == [total - experts + experts // ep] * len(runs[name]["numel"])


EP_LAYOUTS = ["ep2_dp2", "ep2_dp4", "ep2_tp2_sp", "ep2_pp2", "ep2_dp2_allgather", "ep2_tp2_sp_allgather"]
ZERO1_LAYOUTS = ["ep2_dp2_zero1", "ep2_dp4_zero1"]


@pytest.mark.parametrize(("name", "dp", "expert_dp"), [("ep2_dp2_zero1", 2, 1), ("ep2_dp4_zero1", 4, 2)])
def test_zero1_shards_dense_state_over_dp_and_expert_state_over_expert_dp(runs, name, dp, expert_dp):
    """Two fp32 moments per element: each rank holds 1/dp of the dense parameters' and 1/expert-dp of
    its experts' (plus under a bucket of padding and a step count per bucket)."""
    ref = runs["reference"]["params"]
    experts = sum(t.numel() for n, t in ref.items() if ".mlp.experts." in n) // 2  # this ep rank's share
    dense = sum(t.numel() for n, t in ref.items() if ".mlp.experts." not in n and n != "lm_head.weight")
    for got in runs[name]["state_bytes"]:
        moments = 8 * (dense / dp + experts / expert_dp)
        assert moments <= got < moments + 1024


@pytest.mark.parametrize("name", EP_LAYOUTS + ZERO1_LAYOUTS)
def test_expert_parallel_equals_one_process(runs, name):
    got, ref = runs[name], runs["reference"]
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)) < TOL
    assert max(abs(a - b) for a, b in zip(got["norms"], ref["norms"], strict=True)) < TOL
    assert len(got["moe"]) == len(ref["moe"]) == STEPS
    for (balance, z, tokens), (ref_balance, ref_z, ref_tokens) in zip(got["moe"], ref["moe"], strict=True):
        assert abs(balance - ref_balance) < TOL and abs(z - ref_z) < TOL
        assert tokens == ref_tokens
    assert sorted(got["params"]) == sorted(ref["params"])
    experts = [n for n in ref["params"] if ".mlp.experts." in n]
    assert experts and all(got["params"][n].shape == ref["params"][n].shape for n in experts)
    diff = max((got["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"])
    assert diff < TOL


@pytest.mark.parametrize("name", EP_LAYOUTS)
def test_expert_gradients_equal_one_process(runs, name):
    """Every rank's last-step expert grads (after the tp, expert-dp and clipping) are the one-process
    grads of the experts it holds; together the ranks hold every expert of every MoE layer."""
    ref = runs["reference"]["expert_grads"]
    held = set()
    for rank in runs[name]["expert_grads"]:
        for n, (first, grad) in rank.items():
            assert (grad - ref[n][1][first:first + grad.shape[0]]).abs().max().item() < TOL
            held.update((n, e) for e in range(first, first + grad.shape[0]))
    assert held == {(n, e) for n, (_, grad) in ref.items() for e in range(grad.shape[0])}


@pytest.mark.parametrize("name", EP_LAYOUTS + ZERO1_LAYOUTS)
def test_expert_adam_moments_equal_one_process(runs, name):
    """The final checkpoint's AdamW moments of every expert (``exp_avg``: the decayed sum of the
    clipped gradients of every step; ``exp_avg_sq``: of their squares), written by each rank's
    pieces under ZeRO-1, equal the one-process run's: the expert gradients were the one-process
    ones at every step, scale included."""
    ref = ckpt_format.read(Path(runs["reference"]["summary"]["checkpoint"]))[1]
    got = ckpt_format.read(Path(runs[name]["checkpoint"]))[1]
    experts = [n for n in ref if ".mlp.experts." in n]
    assert experts and sorted(got) == sorted(ref)
    for n in experts:
        for key in ("exp_avg", "exp_avg_sq"):
            scale = ref[n][key].abs().max().item()
            assert scale > 0 and (got[n][key] - ref[n][key]).abs().max().item() < 1e-4 * scale, (n, key)
        assert float(got[n]["step"]) == float(ref[n]["step"]) == STEPS


@pytest.mark.parametrize(("name", "saved"), [("ep2_at_ep1", "ep2_dp2"), ("ep2_at_ep4", "ep2_dp2"),
                                             ("ep2_tp2_at_ep1", "ep2_tp2_sp"), ("ep2_zero1_at_ep1", "ep2_dp4_zero1")])
def test_expert_parallel_checkpoint_resumes_at_another_ep(runs, name, saved):
    went_on = runs[saved]["losses"][HALF:]
    resumed = runs[name]["losses"]
    assert len(resumed) == len(went_on) == STEPS - HALF
    assert max(abs(a - b) for a, b in zip(resumed, went_on, strict=True)) < TOL
    diff = max((runs[name]["params"][n] - runs[saved]["params"][n]).abs().max().item()
               for n in runs[saved]["params"])
    assert diff < TOL
