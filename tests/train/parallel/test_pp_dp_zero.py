"""Four gloo ranks: a 4-stage 1F1B pipeline (middle stages), and pipeline x data
parallel (pp = 2, dp = 2) with ZeRO-1, global-norm clipping and the tied embedding,
both against one process accumulating the same micro-batches."""

from __future__ import annotations

import pytest
from pp_helpers import launch, reference_train

TOL = 1e-5
pytestmark = pytest.mark.slow  # one 4-rank launch (oversubscribed on 2 cores)
RUNS = {
    "pp4": dict(pp=4, n_layers=4, num_micro=8, steps=2),
    "pp2_dp2_zero": dict(pp=2, dp=2, n_layers=2, num_micro=2, steps=3, max_grad_norm=1.0),
    "pp2_dp2_zero_interleaved": dict(pp=2, dp=2, n_layers=4, num_micro=2, steps=2, chunks=2),
}


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    results = launch([("train_pipeline", kw) for kw in RUNS.values()], 4, tmp_path_factory.mktemp("w4"))
    return [dict(zip(RUNS, per_rank, strict=True)) for per_rank in results]


@pytest.mark.parametrize("run", list(RUNS))
def test_matches_one_process(world4, run):
    kw = RUNS[run]
    dp, pp = kw.get("dp", 1), kw["pp"]
    ref = reference_train(
        kw["n_layers"], kw["steps"], kw["num_micro"] * dp, max_grad_norm=kw.get("max_grad_norm")
    )
    # Global rank = dp_rank + dp * pp_rank: the last stage of replica d is rank d + dp * (pp - 1).
    last_ranks = [d + dp * (pp - 1) for d in range(dp)]
    for step in range(kw["steps"]):
        got = [loss for r in last_ranks for loss in world4[r][run]["losses"][step]]
        assert got == pytest.approx(ref["losses"][step], abs=TOL, rel=0), step
    if kw.get("max_grad_norm"):
        for res in world4:
            assert res[run]["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    seen = set()
    for rank, res in enumerate(world4):
        for name, t in res[run]["params"].items():
            diff = (t - ref["params"][name]).abs().max().item()
            assert diff <= TOL, (run, rank, name, diff)
            seen.add(name)
        tied = res[run]["tied"]
        if tied:
            assert (tied.get("first", tied.get("last")) == world4[last_ranks[0]][run]["tied"]["last"]).all()
    assert seen == set(ref["params"])
