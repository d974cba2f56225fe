"""Expert parallelism (issue 43, acceptance 2 and 3 for ep with plain data parallelism) through the
one loop against its one-process MoE run: 20-step losses, grad norms, the logged balance and z
losses and tokens per expert, and the final checkpoint's parameters (every expert under its
one-process name) of ep 2 at dp 2 and of ep 2 at dp 4 (two expert-data-parallel ranks per expert);
the ep 2 checkpoint at step 10 resumed at ep 1 and at ep 4 logs the losses ep 2 went on to log; each
rank holds its share of the experts. The ep 2 runs have the process default device set to ``meta``
(the meta default-device suite's check: the dispatch makes no tensor without naming the run's device).

Two launches (2 and 4 gloo ranks), so ``slow``."""

from __future__ import annotations

import pytest
from compose_helpers import STEPS, launch, logged_losses, merged_params, reference

TOL = 1e-5
HALF = STEPS // 2
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep")
    saved = str(tmp / "ep2_dp2" / "checkpoints" / f"iter_{HALF:07d}")
    out = {"reference": reference(tmp / "reference", moe=True)}
    worlds = {2: [("ep2_dp2", dict(ep=2, save_interval=HALF)), ("ep2_at_ep1", dict(resume=saved))],
              4: [("ep2_dp4", dict(ep=2)), ("ep2_at_ep4", dict(ep=4, resume=saved))]}
    for world, layouts in worlds.items():
        (tmp / f"w{world}").mkdir()
        # resuming reads checkpoints with host tensors made without a device: not on meta
        scenarios = [("train" if "resume" in kw else "train_on_meta",
                      dict(out=str(tmp / name), moe=True, checkpoint_dir=str(tmp / name / "checkpoints"), **kw))
                     for name, kw in layouts]
        results = launch(scenarios, world, tmp / f"w{world}")
        for i, (name, _) in enumerate(layouts):
            ranks = [r[i] for r in results]
            last = next(r for r in ranks if r["losses"])
            out[name] = {"losses": logged_losses(ranks), "norms": last["norms"], "moe": last["moe"],
                         "params": merged_params(ranks), "numel": [r["numel"] for r in ranks]}
    return out


@pytest.mark.parametrize(("name", "ep"), [("ep2_dp2", 2), ("ep2_dp4", 2), ("ep2_at_ep4", 4)])
def test_each_rank_holds_its_share_of_the_experts(runs, name, ep):
    ref = runs["reference"]["params"]
    experts = sum(t.numel() for n, t in ref.items() if ".mlp.experts." in n)
    total = sum(t.numel() for n, t in ref.items() if n != "lm_head.weight")  # tied to the embedding
    assert experts and runs[name]["numel"] == [total - experts + experts // ep] * len(runs[name]["numel"])


@pytest.mark.parametrize("name", ["ep2_dp2", "ep2_dp4"])
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


@pytest.mark.parametrize("name", ["ep2_at_ep1", "ep2_at_ep4"])
def test_expert_parallel_checkpoint_resumes_at_another_ep(runs, name):
    went_on = runs["ep2_dp2"]["losses"][HALF:]
    resumed = runs[name]["losses"]
    assert len(resumed) == len(went_on) == STEPS - HALF
    assert max(abs(a - b) for a, b in zip(resumed, went_on, strict=True)) < TOL
    diff = max((runs[name]["params"][n] - runs["ep2_dp2"]["params"][n]).abs().max().item()
               for n in runs["ep2_dp2"]["params"])
    assert diff < TOL
