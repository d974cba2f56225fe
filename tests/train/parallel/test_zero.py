"""ZeRO-1 (:class:`ZeroAdamW`) at dp = 2 against one process on the full global batch, both
with optim.py's decay / no-decay parameter groups."""

from __future__ import annotations

import pytest
import torch
from pp_helpers import launch, reference_train

from tokenloom.errors import TokenloomError
from tokenloom.train.parallel.zero import ZeroAdamW

TOL = 1e-5
STEPS, RESUME_AT, MAX_NORM = 5, 3, 1.0
pytestmark = pytest.mark.slow  # one 2-rank launch


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    kw = {"steps": STEPS, "max_grad_norm": MAX_NORM, "resume_at": RESUME_AT}
    return [r[0] for r in launch([("zero_train", kw)], 2, tmp_path_factory.mktemp("zero"))]


@pytest.fixture(scope="module")
def ref():
    return reference_train(2, STEPS, 2, max_grad_norm=MAX_NORM, full_batch=True, groups=True)


def test_losses_norms_and_params_match_full_batch(dp2, ref):
    for step in range(STEPS):
        mean = (dp2[0]["losses"][step] + dp2[1]["losses"][step]) / 2
        assert mean == pytest.approx(ref["losses"][step][0], abs=TOL, rel=0), step
    for res in dp2:
        assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        for name, t in res["params"].items():
            diff = (t - ref["params"][name]).abs().max().item()
            assert diff <= TOL, (name, diff)
    assert max(ref["norms"]) > MAX_NORM  # clipping was exercised


def test_ranks_hold_identical_params_after_all_gather(dp2):
    for name, t in dp2[0]["params"].items():
        assert (t == dp2[1]["params"][name]).all(), name


def test_optimizer_state_is_sharded(dp2):
    for res in dp2:
        assert res["shard_numel"] == -(-res["numel"] // 2)
        assert res["exp_avg_numel"] == res["shard_numel"]
        assert res["grads_are_views"]


def test_state_dict_round_trip_resumes_exactly(dp2):
    for res in dp2:
        assert res["resumed_losses"] == res["losses"][RESUME_AT:]
        for name, t in res["params"].items():
            assert (t == res["resumed_params"][name]).all(), name


def test_state_dict_layout_mismatch_is_a_clear_error(dp2):
    msg = dp2[0]["load_error"]
    assert "same data-parallel size" in msg and "(0, 3," in msg


def test_groups_with_other_hyperparameters_are_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(TokenloomError, match="only 'params' and 'weight_decay'.*'lr'"):
        ZeroAdamW([{"params": [p], "lr": 0.1}])
