"""Our DistributedDataParallel against torch's, on 2 and 4 gloo ranks (CPU).

All checks of one world size come from a single launch (``suite_results`` in
conftest.py) to keep the multi-process cost to one start-up per world size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/train: _dist_worker, the ranks' scenarios
from _dist_worker import CONFIGS, tiny_gpt  # noqa: E402

TOL = 1e-6
pytestmark = pytest.mark.slow  # multi-process: one interpreter start-up per rank


@pytest.mark.parametrize("config", list(CONFIGS))
def test_grads_and_params_match_torch_ddp(suite_results, config):
    """3 steps; SGD or AdamW; with and without no_sync accumulation; rank 1 starts from a
    different init (both wrappers must broadcast rank 0's weights)."""
    for rank, res in enumerate(suite_results):
        r = res[config]
        assert r["grad_diff"] <= TOL, (rank, r)
        assert r["param_diff"] <= TOL, (rank, r)
        assert r["grads_are_bucket_views"], rank
        assert r["ranks_agree"], rank


def test_rebuilt_buckets_match_torch(suite_results):
    """After the first iteration both re-bucket from the grad-ready order: same layout
    (weight-gradient fusion off: with it on, our model's graph, so its ready order, differs)."""
    for res in suite_results:
        r = res["gpt2_tied_sgd_unfused"]
        assert r["num_buckets"] == 4
        assert r["our_bucket_sizes"] == r["torch_rebuilt_bucket_sizes"]
        assert r["our_bucket_indices"] == r["torch_rebuilt_bucket_indices"]
        default = res["llama_gqa_untied_adamw_accum_unfused"]
        assert default["our_bucket_sizes"] == default["torch_rebuilt_bucket_sizes"]


def test_custom_first_bucket_cap(suite_results):
    """Torch's rule, applied by hand to the grad-ready order we ended with: parameters join
    the open bucket, which closes once it holds >= its cap (0.002 MiB for the first bucket,
    0.01 MiB for every later one)."""
    name = "gpt2_untied_sgd_accum_set_to_none_small_buckets"
    r = suite_results[0][name]
    nbytes = [p.numel() * p.element_size() for p in tiny_gpt(**CONFIGS[name][0]).parameters()]
    order = [i for bucket in r["our_bucket_indices"] for i in bucket]
    assert sorted(order) == list(range(len(nbytes)))
    expected, current, cap = [], [], 0.002 * 2**20
    for i in order:
        current.append(i)
        if sum(nbytes[j] for j in current) >= cap:
            expected.append(current)
            current, cap = [], 0.01 * 2**20
    expected += [current] if current else []
    assert r["our_bucket_indices"] == expected
    assert r["our_bucket_sizes"] == [sum(nbytes[j] for j in b) for b in expected]
    assert len(expected) > 4


def test_shape_mismatch_reported_on_every_rank(suite_results):
    for res in suite_results:
        msg = res["mismatch"]["mismatch_error"]
        assert "'blocks.0.mlp.fc.weight'" in msg
        assert "(64, 32)" in msg and "(48, 32)" in msg and "rank 1" in msg


def test_find_unused_parameters_matches_torch(suite_results):
    for rank, res in enumerate(suite_results):
        r = res["unused"]
        assert r["unused_diff"] <= TOL, rank
        assert r["never_grad_is_none"], rank  # unused on every rank: .grad untouched
        assert r["rank0_only_has_grad"], rank  # used on rank 0 only: averaged everywhere


def test_unused_parameter_without_flag_names_it(suite_results):
    for res in suite_results:
        msg = res["unused"]["strict_error"]
        assert "never.weight" in msg and "never.bias" in msg and "find_unused_parameters=True" in msg


def test_killed_rank_raises_instead_of_hanging(run_world):
    timeout_s = 15.0
    results = run_world("killed", 2, deadline_s=120.0, collective_timeout_s=timeout_s)
    assert results[1] is None  # the killed rank wrote nothing
    survivor = results[0]
    assert survivor["error_type"] == "TokenloomError", survivor
    assert "all-reduce" in survivor["error"] and "died" in survivor["error"]
    assert survivor["seconds"] < timeout_s + 5


def test_stalled_rank_raises_after_collective_timeout(run_world):
    timeout_s = 4.0
    results = run_world("stalled", 2, deadline_s=120.0, collective_timeout_s=timeout_s)
    assert results[1] is None
    survivor = results[0]
    assert survivor["error_type"] == "TokenloomError", survivor
    assert "all-reduce" in survivor["error"]
    assert timeout_s - 0.5 < survivor["seconds"] < timeout_s + 5
