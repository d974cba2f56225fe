"""Every layout trains with the process default device set to ``meta`` (issue 15,
acceptance 3; issue 43's expert-parallel layouts too; the dense tp x pp x dp layouts in test_compose.py): model and strategy construction, steps,
evaluation and a checkpoint save. A tensor made anywhere in the run without naming the run's
device would be a ``meta`` tensor, and the run would crash (a collective, ``.item()`` or data on
``meta``) or log losses that differ from the plain one-process run's (the MoE one-process run's
for the MoE layouts, the one-process Muon runs for the Muon layouts).

Two launches (2 and 4 gloo ranks), so ``slow``."""

from __future__ import annotations

import pytest
from compose_helpers import launch, launches_timeout, logged_losses, reference

STEPS = 4
RUN = dict(train_iters=STEPS, eval_interval=2, save_interval=2)
MUON = {"name": "muon", "muon_ns_dtype": "fp32"}

# The dense tp x pp x dp layouts (ZeRO-1 and compiled blocks among them) run with the meta default
# device in parallel/test_compose.py, against the one-process run; here the layouts it does not run.
# name -> (world size, TrainConfig overrides)
LAYOUTS = {
    "cp2": (2, dict(cp=2)),  # context parallelism: key/value gathers, the mask and the loss scale
    "cp4": (4, dict(cp=4)),
    "cp2_tp2_sp": (4, dict(cp=2, tp=2, sp=True)),
    "cp2_pp2": (4, dict(cp=2, pp=2)),
    "cp2_pp2_vpp2": (4, dict(cp=2, pp=2, vpp=2)),
    "cp2_dp2_zero1": (4, dict(cp=2, zero1=True, ddp_bucket_cap_mb=0.02)),
    # fully sharded: per-block gathers and reduce-scatters, alone, under tp with sp and under vpp
    "dp2_tp1_pp1_fsdp": (2, dict(fsdp=True)),
    "dp2_tp2_pp1_sp_fsdp": (4, dict(tp=2, sp=True, fsdp=True)),
    "dp2_tp1_pp2_vpp2_fsdp": (4, dict(pp=2, vpp=2, fsdp=True)),
    "cp2_dp2_fsdp": (4, dict(cp=2, fsdp=True)),  # sharded over dp x cp
    # expert parallelism: ep2, ep2 x dp4, x tp2 + sp, x pp2, + ZeRO-1 and the allgather dispatcher run with
    # the meta default device in parallel/test_expert_parallel.py; here the combinations it does not run:
    # ZeRO-1's expert buckets with tp (+ sp: experts whole on each tp rank) and with pp, against the
    # one-process MoE run
    "ep2_tp2_sp_zero1": (4, dict(moe=True, ep=2, tp=2, sp=True, zero1=True, ddp_bucket_cap_mb=0.02)),
    "ep2_pp2_zero1": (4, dict(moe=True, ep=2, pp=2, zero1=True, ddp_bucket_cap_mb=0.02)),
    # Muon (issue 51): updates broadcast by their owner over dp, tp shards gathered, experts shared over
    # the expert-data-parallel group, fsdp's sharded updates gathered to their owner and scattered back,
    # against the one-process Muon runs
    "muon_dp2": (2, dict(optim=MUON)),
    "muon_dp2_fsdp": (2, dict(fsdp=True, optim=MUON)),
    "muon_ep2": (2, dict(moe=True, ep=2, optim=MUON)),
    "muon_dp2_tp2_sp": (4, dict(tp=2, sp=True, optim=MUON)),
    "muon_tp2_pp2": (4, dict(tp=2, pp=2, optim=MUON)),
}

pytestmark = [pytest.mark.slow, launches_timeout(len(LAYOUTS), references=4)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("meta")
    out = {"reference": reference(tmp / "reference", **RUN)["losses"],
           "reference_moe": reference(tmp / "reference_moe", moe=True, **RUN)["losses"],
           "reference_muon": reference(tmp / "reference_muon", optim=MUON, **RUN)["losses"],
           "reference_moe_muon": reference(tmp / "reference_moe_muon", moe=True, optim=MUON, **RUN)["losses"]}
    for world in (2, 4):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        scenarios = [("train_on_meta", dict(out=str(tmp / n), **LAYOUTS[n][1], **RUN)) for n in names]
        (tmp / f"w{world}").mkdir()
        results = launch(scenarios, world, tmp / f"w{world}")
        out.update({n: logged_losses([r[i] for r in results]) for i, n in enumerate(names)})
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_runs_with_meta_default_device(runs, name):
    kw = LAYOUTS[name][1]
    losses, ref = runs[name], runs["reference" + ("_moe" if kw.get("moe") else "") + ("_muon" if "optim" in kw else "")]
    assert len(losses) == len(ref) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < 1e-5
