"""Training layouts over :class:`~tokenloom.train.staged_gloo.StagedGloo` with every call staged
through host buffers (CPU tensors standing in for a GPU's) against the same layouts over plain
gloo: the staging only copies, so the losses, grad norms and final parameters are bit for bit
the same. The layouts cover what the staging carries on a GPU: dp 2 with ZeRO-1 (bucketed
reduce-scatter during backward, all-gather of the parameters) and tp 2 with sequence
parallelism (all-gathers and reduce-scatters of activations); the pipeline's sends and receives
are tests/train/test_staged_gloo.py's.

Two launches of 2 gloo ranks (plain, staged), two short runs each; ``slow``."""

from __future__ import annotations

import pytest
import torch
from compose_helpers import MIN_TIMEOUT_S, SCENARIO_BUDGET_S, launch

SHORT = dict(train_iters=4, eval_interval=2, eval_iters=1, save_interval=4)
LAYOUTS = {
    "dp2_zero1": dict(zero1=True, ddp_bucket_cap_mb=0.02),
    "tp2_sp": dict(tp=2, sp=True),
}
DEADLINE_S = 3 * SCENARIO_BUDGET_S * (len(LAYOUTS) + 1)
"""A launch's hang deadline: three scenario budgets per scenario (a start of torch in each spawned rank
and two short runs, which on the developers' 2 cores shared with other jobs took several times
their unloaded time)."""

# the timeout: the two launches' hang deadlines, at least the suite's default (compose_helpers.MIN_TIMEOUT_S)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(max(MIN_TIMEOUT_S, 2 * DEADLINE_S + 30))]


def _runs(tmp_path, staged: bool):
    kind = "staged" if staged else "plain"
    (tmp_path / kind).mkdir()  # the launch's init file and results go there
    scenarios = [("train", dict(out=str(tmp_path / f"{kind}_{name}"), **SHORT, **kw)) for name, kw in LAYOUTS.items()]
    return launch([*scenarios, ("staged_calls", {})], 2, tmp_path / kind, deadline_s=DEADLINE_S, staged=staged)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("staged")
    return _runs(tmp, False), _runs(tmp, True)


def test_staging_carried_every_kind_of_call(both):
    plain, staged = both
    assert plain[0][-1] == {} and plain[1][-1] == {}  # plain gloo: nothing staged
    for rank in (0, 1):
        calls = staged[rank][-1]
        for kind in ("allreduce", "reduce_scatter_single", "all_gather_single"):
            assert calls.get(kind, 0) > 0, (rank, kind, calls)


@pytest.mark.parametrize("index,name", list(enumerate(LAYOUTS)))
def test_staged_run_equals_plain_gloo(both, index, name):
    plain, staged = both
    a, b = plain[0][index], staged[0][index]
    assert len(a["losses"]) == SHORT["train_iters"]
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"], name
    assert a["summary"]["val_loss"] == b["summary"]["val_loss"], name
    assert sorted(a["params"]) == sorted(b["params"])
    for key, t in a["params"].items():
        assert torch.equal(t, b["params"][key]), (name, key)
