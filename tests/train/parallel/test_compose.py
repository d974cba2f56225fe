"""tp x pp x dp training through the one loop (tokenloom.train.loop) against its one-process
run: 20-step losses, grad norms, validation loss and final parameters for nine layouts,
tp forwards with and without sequence parallelism and fused kernels (llama: RoPE, SwiGLU, GQA;
gpt2; biases),
and checkpoint resharding from (dp, tp, pp) = (1, 2, 2) into (2, 1, 1) and (1, 1, 1).

Three launches (4, 2 and 1 gloo ranks, oversubscribed on small machines), so the whole
module is ``slow``."""

from __future__ import annotations

import pytest
from compose_helpers import STEPS, launch, logged_losses, merged_params, reference

TOL = 1e-5
pytestmark = pytest.mark.slow

# name -> (world size, TrainConfig overrides); layouts are (dp, tp, pp)
LAYOUTS = {
    "dp1_tp2_pp1": (2, dict(tp=2)),
    "dp1_tp2_pp1_sp": (2, dict(tp=2, sp=True)),
    "dp1_tp1_pp2": (2, dict(pp=2)),
    "dp1_tp1_pp2_vpp2": (2, dict(pp=2, vpp=2)),
    "dp1_tp2_pp2": (4, dict(tp=2, pp=2)),
    "dp2_tp2_pp1": (4, dict(tp=2)),
    "dp2_tp1_pp2": (4, dict(pp=2)),
    "dp2_tp1_pp1_zero1": (2, dict(zero1=True)),  # weight decay per group, as optim.py's
    "dp1_tp2_pp1_zero1": (2, dict(tp=2, zero1=True)),
}
HALF = STEPS // 2


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("compose")


@pytest.fixture(scope="module")
def ref(tmp):
    return reference(tmp / "ref")


def _scenarios(world: int, tmp) -> list[tuple[str, dict]]:
    return [("train", dict(out=str(tmp / name), **kw)) for name, (w, kw) in LAYOUTS.items() if w == world]


@pytest.fixture(scope="module")
def runs(tmp):
    """Every launch once: layout runs, then the (1, 2, 2) checkpoint and its continuations."""
    ckpt = tmp / "ckpt_122"
    saved = ckpt / f"iter_{HALF:07d}"
    w4 = _scenarios(4, tmp) + [
        ("train", dict(out=str(tmp / "save_122"), tp=2, pp=2, exit_interval=HALF, checkpoint_dir=str(ckpt))),
        ("train", dict(out=str(tmp / "cont_122"), tp=2, pp=2, resume=str(saved),
                       checkpoint_dir=str(tmp / "ckpt_cont_122"))),
    ]
    w2 = _scenarios(2, tmp) + [
        ("train", dict(out=str(tmp / "cont_211"), resume=str(saved), checkpoint_dir=str(tmp / "ckpt_211"))),
        ("forward_tp", {}),
        ("forward_tp", {"sp": True}),
        ("forward_tp", {"arch": "gpt2", "kernels": "compiled"}),
        ("forward_tp", {"sp": True, "kernels": "compiled"}),
    ]
    w1 = [
        ("train", dict(out=str(tmp / "cont_111"), resume=str(saved), checkpoint_dir=str(tmp / "ckpt_111"))),
        ("forward_tp", {}),
    ]
    names = {4: [n for n, (w, _) in LAYOUTS.items() if w == 4] + ["save_122", "cont_122"],
             2: [n for n, (w, _) in LAYOUTS.items() if w == 2] + ["cont_211", "llama_tp2", "llama_tp2_sp",
                                                                         "gpt2_tp2_compiled", "llama_tp2_sp_compiled"],
             1: ["cont_111", "llama_tp1"]}
    out = {}
    for world, scen in ((4, w4), (2, w2), (1, w1)):
        (tmp / f"w{world}").mkdir()
        results = launch(scen, world, tmp / f"w{world}")
        for i, name in enumerate(names[world]):
            out[name] = [r[i] for r in results]
    return out


def _deltas(rs, ref, first: int = 0):
    losses = logged_losses(rs)
    params = merged_params(rs)
    assert sorted(params) == sorted(ref["params"])
    dl = max(abs(a - b) for a, b in zip(losses, ref["losses"][first:], strict=True))
    dp = max((params[n] - t).abs().max().item() for n, t in ref["params"].items())
    return len(losses), dl, dp


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(runs, ref, name):
    n, dl, dp = _deltas(runs[name], ref)
    print(f"{name}: max loss delta {dl:.2e}, max param delta {dp:.2e}")
    assert n == STEPS
    assert dl < TOL and dp < TOL
    summary = runs[name][0]["summary"]
    assert summary["iteration"] == STEPS
    assert abs(summary["val_loss"] - ref["summary"]["val_loss"]) < TOL
    norms = runs[name][0]["norms"]
    assert max(abs(a - b) / b for a, b in zip(norms, ref["norms"], strict=True)) < TOL
    assert max(ref["norms"]) > 0.5  # clipping (grad_clip 0.5) was active


@pytest.mark.parametrize("name", ["cont_122", "cont_211", "cont_111"])
def test_resharded_resume_continues_exactly(runs, ref, name):
    save_losses = logged_losses(runs["save_122"])
    assert max(abs(a - b) for a, b in zip(save_losses, ref["losses"][:HALF], strict=True)) < TOL
    n, dl, dp = _deltas(runs[name], ref, first=HALF)
    print(f"{name}: max loss delta {dl:.2e}, max param delta {dp:.2e}")
    assert n == STEPS - HALF
    assert dl < TOL and dp < TOL
    same = logged_losses(runs["cont_122"])
    assert max(abs(a - b) for a, b in zip(logged_losses(runs[name]), same, strict=True)) < TOL


def test_resume_in_the_same_layout_is_bitwise_the_uninterrupted_run(runs):
    """Across layouts only the summation order differs (hence TOL above); saved and resumed in
    the same (1, 2, 2) layout, nothing may differ: every loss and parameter bit for bit."""
    whole, resumed = runs["dp1_tp2_pp2"], runs["cont_122"]
    assert logged_losses(resumed) == logged_losses(whole)[HALF:]
    a, b = merged_params(whole), merged_params(resumed)
    assert sorted(a) == sorted(b) and all(a[n].equal(b[n]) for n in a)


@pytest.mark.parametrize("name", ["llama_tp1", "llama_tp2", "llama_tp2_sp", "gpt2_tp2_compiled",
                                  "llama_tp2_sp_compiled"])
def test_tp_forward_backward(runs, name):
    """Every layer tp-split (sp, fused kernels: bias_gelu with its bias, bias_dropout_add,
    the fused vocab-parallel LM head + loss) equals the one-process reference model."""
    tol = 1e-5 if name.endswith("compiled") else 1e-6  # fp32 norms, another log-sum-exp order
    for r in runs[name]:
        assert r["same_names"]
        assert r["loss_delta"] < tol and r["param_delta"] == 0.0 and r["norm_grad_delta"] < tol
