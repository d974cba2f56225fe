"""Fully sharded data parallelism (``fsdp``) through the one loop against its one-process run
(issue 42's acceptance 1): 10-step losses, grad norms, validation loss and final parameters of
dp 2, dp 4, dp 2 x tp 2 (sequence parallelism, recomputed blocks) and dp 2 x pp 2 with fsdp; the dp 2 run's
checkpoint at HALF resumed at dp 1 without fsdp and at dp 4 with it, equal to the run that went
on; and each rank's optimizer state and checkpoint pieces being its dp shard.

The compose suite's harness (:mod:`compose_helpers`), three launches (2, 4 and 1 gloo ranks: the
resumes need the dp 2 checkpoint), so ``slow``."""

from __future__ import annotations

import json

import pytest
import torch
from compose_helpers import (
    STEPS,
    assert_matches_one_process,
    deltas,
    launch,
    launches_timeout,
    logged_losses,
    reference,
)

TOL = 1e-5
HALF = STEPS // 2

# name -> (world size, TrainConfig overrides); layouts are (dp, tp, pp)
LAYOUTS = {
    "dp2_fsdp": (2, dict(fsdp=True, save_interval=HALF)),
    "dp4_fsdp": (4, dict(fsdp=True)),
    # blocks recomputed in backward: their parameters gathered a third time, inside the recompute
    "dp2_tp2_sp_recompute_fsdp": (4, dict(fsdp=True, tp=2, sp=True, recompute=True)),
    "dp2_pp2_fsdp": (4, dict(fsdp=True, pp=2)),
}
SAVED = "dp2_fsdp"
RESUMES = {"dp2_fsdp_at_dp4_fsdp": (4, dict(fsdp=True)), "dp2_fsdp_at_dp1": (1, {})}
pytestmark = [pytest.mark.slow, launches_timeout(len(LAYOUTS) + len(RESUMES))]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def ref(tmp):
    return reference(tmp / "ref")


@pytest.fixture(scope="module")
def runs(tmp, ref):
    saved = tmp / SAVED / "checkpoints" / f"iter_{HALF:07d}"
    out = {}
    for world in (2, 4, 1):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        scenarios = [("train", dict(out=str(tmp / n), **LAYOUTS[n][1])) for n in names]
        resumes = [n for n, (w, _) in RESUMES.items() if w == world]
        scenarios += [("train", dict(out=str(tmp / n), resume=str(saved), checkpoint_dir=str(tmp / f"ckpt_{n}"),
                                     **RESUMES[n][1])) for n in resumes]
        (tmp / f"w{world}").mkdir()
        results = launch(scenarios, world, tmp / f"w{world}")
        out.update({n: [r[i] for r in results] for i, n in enumerate(names + resumes)})
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fsdp_layout_matches_one_process(runs, ref, name):
    assert_matches_one_process(runs[name], ref, STEPS, TOL)


@pytest.mark.parametrize("name", list(RESUMES))
def test_fsdp_checkpoint_resumes_at_another_dp_with_or_without_fsdp(runs, ref, name):
    n, dl, dp = deltas(runs[name], ref, first=HALF)
    went_on = logged_losses(runs[SAVED])
    dc = max(abs(a - b) for a, b in zip(logged_losses(runs[name]), went_on[HALF:], strict=True))
    print(f"{name}: max loss delta vs one process {dl:.2e} (params {dp:.2e}), vs the run that went on {dc:.2e}")
    assert n == STEPS - HALF
    assert dl < TOL and dp < TOL and dc < TOL


@pytest.mark.parametrize("name", ["dp2_fsdp", "dp4_fsdp"])
def test_fsdp_optimizer_state_per_rank_is_one_dp_shard(runs, name):
    """Each rank's AdamW moments hold its rows of every parameter: about 1/dp of plain AdamW's
    2 N elements (N: the trainable numel), short of it by at most the rows the last ranks lack."""
    dp = int(name[2])
    held = [r["state_bytes"] for r in runs[name]]
    full = 2 * 4 * runs[name][0]["numel"]
    assert sum(held) >= full  # every element of both moments somewhere (plus the steps)
    assert all(b <= full / dp * 1.1 for b in held), (held, full / dp)


def test_fsdp_checkpoint_pieces_are_each_ranks_own_shard(tmp, runs):
    """Each dp rank's piece file holds about half of the parameters and moments (its rows), and
    together they cover every tensor (reading the checkpoint asserts that)."""
    path = tmp / SAVED / "checkpoints" / f"iter_{HALF:07d}"
    sizes = []
    for f in sorted(path.glob("tp*_pp*_dp*.pt")):
        data = torch.load(f, weights_only=True)
        sizes.append(sum(r["data"].numel() for r in data["records"]))
    assert len(sizes) == 2
    assert abs(sizes[0] - sizes[1]) < 0.2 * max(sizes), sizes
    assert json.loads((path / "state.json").read_text())["layout"]["fsdp"] is True
