"""ZeRO-1 (:class:`ZeroAdamW`) at dp = 2 against one process on the full global batch, both
with optim/adamw.py's decay / no-decay parameter groups; at dp = 1 (no process group) against
torch's AdamW, and its layout-free optimizer state in both directions. The parameter
all-gather overlapped with the next forward (overlap_param_gather), with gathers that land
only when waited for: modules wait before they read, checkpoints, loads and eval with
gathers pending, a weight read outside its module, compiled blocks."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))  # the pipeline launch helpers
from pp_helpers import launch, reference_train  # noqa: E402

from tokenloom.errors import TokenloomError
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.optim.adamw import param_groups
from tokenloom.train.optim.zero import ZeroAdamW

TOL = 1e-5
STEPS, RESUME_AT, MAX_NORM = 5, 3, 1.0
pytestmark = pytest.mark.slow  # one 2-rank launch


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero")
    kw = {"steps": STEPS, "max_grad_norm": MAX_NORM, "resume_at": RESUME_AT}
    return launch([("zero_train", kw), ("zero_param_gather", {"steps": 3}),
                   ("zero_overlap_checkpoint", {"out": str(tmp / "strategy")}),
                   ("zero_compiled_blocks", {"steps": 3}), ("zero_accumulation", {})], 2, tmp)


@pytest.fixture(scope="module")
def dp2(launched):
    return [r[0] for r in launched]


@pytest.fixture(scope="module")
def gather(launched):
    return [r[1] for r in launched]


@pytest.fixture(scope="module")
def strategy(launched):
    return [r[2] for r in launched]


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
    """Per bucket ceil(N_k / 2) elements of each moment: padding only."""
    for res in dp2:
        assert res["buckets"] > 5 and sum(res["bucket_numels"]) == res["numel"]
        assert res["shard_numel"] == sum(-(-n // 2) for n in res["bucket_numels"])
        assert res["exp_avg_numel"] == res["shard_numel"]
        assert res["state_bytes"] == 2 * 4 * res["shard_numel"] + 4 * res["buckets"]  # moments and steps
        assert res["grads_are_views"]


def test_every_bucket_is_reduce_scattered_during_backward(dp2):
    for res in dp2:
        assert res["launched_in_backward"] == [res["buckets"]] * STEPS


def test_state_dict_round_trip_resumes_exactly(dp2):
    for res in dp2:
        assert res["resumed_losses"] == res["losses"][RESUME_AT:]
        for name, t in res["params"].items():
            assert (t == res["resumed_params"][name]).all(), name


def test_param_gathers_are_pending_after_step_and_each_module_waits_for_its_own(gather):
    """overlap_param_gather: step() returns with every bucket's all-gather launched and none
    waited for (some parameters still the previous step's: a forward that did not wait would
    read them); the next forward waits for all of them, and every module, when it starts,
    holds exactly the parameters of the run without overlap, so losses are equal bit for bit.
    (The gathers only land when waited for: pp_helpers.DeferredGathers.)"""
    for res in gather:
        assert all(all(f) and len(f) > 10 for f in res["fresh"]), res["fresh"]
        assert res["losses"] == res["plain_losses"]
        n = res["buckets"]
        assert n > 5
        assert res["after_step"] == [(True, n, 0, True)] * 3  # pending, launched, waited in step, stale
        assert res["waits_in_forward"] == [0, n, n]
        assert res["eval"][0] == res["eval"][1] and all(res["eval_fresh"])
        assert not res["pending_after_finish"] and res["params_equal"]


def test_a_weight_read_outside_its_module_is_gathered_first(gather):
    """A parent reading a child's weight without calling the child (GPT.head's fused loss and
    ``lm_head.weight``): the layer before waits for the next layer's buckets too, so the losses
    equal the synchronous gather's bit for bit."""
    for res in gather:
        (on, buckets), (off, _) = res["parent_reads_child"]
        assert buckets == 3 and on == off


def test_checkpoint_load_and_eval_with_param_gathers_pending(strategy):
    """Through the loop's Strategy (overlap_param_gather on by default for zero1 at tp = pp = 1):
    a checkpoint saved right after a step holds the updated parameters, a checkpoint loaded
    while a step's gathers are in flight is not overwritten by them, and an eval forward with
    gathers pending gives the loss of the gathered parameters."""
    for res in strategy:
        assert res["overlap"]
        assert res["pending_at_save"] and res["saved_is_updated"]
        assert res["pending_at_load"] and res["loaded_kept"]
        assert res["pending_at_eval"] and res["eval"][0] == res["eval"][1]


def test_param_gather_hooks_leave_compiled_blocks_whole(launched):
    """With compiled blocks the hook of a block runs eagerly before its graph: no graph break,
    and the losses are the compiled run's without overlap, bit for bit."""
    for r in launched:
        res = r[3]
        assert res["graph_breaks"] == 0
        assert res["losses"][0] == res["losses"][1]


def _tiny(dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(bias=True, vocab_size=64, make_vocab_size_divisible_by=64, seq_len=8, n_layers=1, n_heads=2,
                    d_model=16)
    return GPT(cfg).to(dtype)


def _steps(model, opt, n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 64, (2, 9), generator=g)
        opt.zero_grad()
        model(x[:, :-1], x[:, 1:]).float().backward()
        opt.step()


def test_grads_accumulated_under_no_sync_and_missing_ones_are_averaged_as_adamw_sees_them(launched):
    """Averaging happens per parameter where its grad enters the buffer: grads from both
    micro-batches, from the no_sync one only, from the reducing one only, and a parameter
    with no grad after step 0 all step as torch's AdamW on the dp-averaged grads."""
    for r in launched:
        res = r[4]
        assert res["buckets overlap=True"] > 2
        assert res["overlap=True"] < 1e-6 and res["overlap=False"] < 1e-6, res
        # weight grads written by the GEMMs (tokenloom.train.parallel.wgrad): 3 steps x (a, b | a, c), d in step 0 twice
        assert res["overlap=True fused"] < 1e-6, res
        assert res["sink calls overlap=True fused"] == 3 * 4 + 2, res
        assert res["sink calls overlap=False"] == 0, res  # no hooks, no sinks: step() copies


def test_dp1_is_adamw_and_plain_state_loads_into_it():
    """One rank, no process group: ZeroAdamW steps as torch's AdamW with the same groups, its
    gathered state is AdamW's, and AdamW's state loaded into a fresh ZeroAdamW continues it."""
    plain_model, zero_model = _tiny(), _tiny()
    plain = torch.optim.AdamW(param_groups(plain_model, 0.1), lr=1e-2)
    zero = ZeroAdamW(param_groups(zero_model, 0.1), lr=1e-2)
    assert zero.dp_size == 1 and zero.state_bytes() == 0
    _steps(plain_model, plain, 3)
    _steps(zero_model, zero, 3)
    names = dict(plain_model.named_parameters())
    zero_names = {id(p): n for n, p in zero_model.named_parameters()}
    for p, state in zip(zero.params, zero.gathered_param_states(), strict=True):  # in ZeRO's (group) order
        name = zero_names[id(p)]
        assert (p - names[name]).abs().max() < 1e-6, name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert (state[key] - plain.state[names[name]][key]).abs().max() < 1e-6, (name, key)
    resumed_model = copy.deepcopy(plain_model)
    resumed = ZeroAdamW(param_groups(resumed_model, 0.1), lr=1e-2)
    resumed.load_param_states([plain.state[p] for g in plain.param_groups for p in g["params"]])
    _steps(plain_model, plain, 2, seed=1)
    _steps(resumed_model, resumed, 2, seed=1)
    for (name, p), q in zip(resumed_model.named_parameters(), plain_model.parameters(), strict=True):
        assert (p - q).abs().max() < 1e-6, name


def _fixed_grad_steps(model, opt, n: int, seed: int = 0) -> float:
    """``n`` steps of ``opt`` on seeded gradients (the same for every model of the same shapes, not
    recomputed from the parameters), spread over magnitudes 1e-9..1 so AdamW's normalisation sees grads
    near zero; returns the largest change of any parameter in one step."""
    g = torch.Generator().manual_seed(seed)
    largest = 0.0
    for _ in range(n):
        before = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            scale = 10.0 ** -torch.randint(0, 10, p.shape, generator=g).float()
            p.grad = torch.randn(p.shape, generator=g) * scale
        opt.step()
        largest = max(largest, max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before,
                                                                              strict=True)))
    return largest


ADAMW_ROUNDINGS = 32
"""Rounded operations behind one AdamW update of one element, with margin: the two moment updates,
the bias corrections, sqrt, + eps, the division, the lr and decay products and the subtraction (about
ten, each within one ulp), doubled for the moments' error carried from earlier steps, and doubled again."""


def _adamw_rounding_bound(steps: int, step_size: float, model) -> float:
    """How far two correct fp32 AdamW implementations (fused vs for-each: other operation orders) can
    drift apart in ``steps`` steps on the same gradients: per step, ``ADAMW_ROUNDINGS`` ulps of the
    update (at most ``step_size``) plus two ulps of the parameter itself. With the gradients fixed the
    errors add up linearly; recomputing gradients from the drifting parameters instead (the earlier form
    of this test) lets a grad near zero change sign and the normalised update flip, a difference bounded
    only by the step itself, which is why the bound no longer depends on the machine."""
    eps = torch.finfo(torch.float32).eps
    largest = max(float(p.abs().max()) for p in model.parameters())
    return steps * eps * (ADAMW_ROUNDINGS * step_size + 2 * largest)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_inner_adamw_steps_as_torch_adamw(fused):
    """ZeRO-1 with torch's fused AdamW inside (the strategy's choice where torch has it) steps as
    torch's AdamW, fused or not, with the same groups; a fused one resumes a plain one's state.
    The bound is derived from fp32 rounding (:func:`_adamw_rounding_bound`), not measured."""
    plain_model, zero_model = _tiny(), _tiny()
    plain = torch.optim.AdamW(param_groups(plain_model, 0.1), lr=1e-2, fused=fused)
    zero = ZeroAdamW(param_groups(zero_model, 0.1), lr=1e-2, fused=True)
    assert zero.optimizer.defaults["fused"] is True
    step = _fixed_grad_steps(plain_model, plain, 3)
    assert _fixed_grad_steps(zero_model, zero, 3) == pytest.approx(step, rel=1e-3)
    tol = _adamw_rounding_bound(3, step, plain_model)
    for (name, p), q in zip(zero_model.named_parameters(), plain_model.parameters(), strict=True):
        assert (p - q).abs().max() <= tol, (name, float((p - q).abs().max()), tol)
    resumed_model = copy.deepcopy(plain_model)
    resumed = ZeroAdamW(param_groups(resumed_model, 0.1), lr=1e-2, fused=True)
    resumed.load_param_states([plain.state[p] for g in plain.param_groups for p in g["params"]])
    step = max(_fixed_grad_steps(plain_model, plain, 2, seed=1), _fixed_grad_steps(resumed_model, resumed, 2, seed=1))
    tol = _adamw_rounding_bound(2, step, plain_model)
    for (name, p), q in zip(resumed_model.named_parameters(), plain_model.parameters(), strict=True):
        assert (p - q).abs().max() <= tol, (name, float((p - q).abs().max()), tol)
    assert float(resumed.gathered_param_states()[0]["step"]) == 5
    # the bound is tight enough to matter: one lr off (a real bug) is far outside it
    assert tol < 1e-3 * step


def test_bf16_parameters_save_their_fp32_master_weights():
    model = _tiny(torch.bfloat16)
    opt = ZeroAdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, 2)
    states = opt.gathered_param_states()
    assert all(s["master_param"].dtype == torch.float32 for s in states)
    assert opt.state_bytes() == (2 + 1) * 4 * opt.shard_size + 4  # moments, master shard, step
    again = copy.deepcopy(model)
    fresh = ZeroAdamW(again.parameters(), lr=1e-2)
    fresh.load_param_states(states)
    assert fresh.main_shards[0].equal(opt.main_shards[0])
    assert not fresh.main_shards[0].equal(fresh.param_buffer.float())  # the low bits bf16 drops are kept


def test_state_that_does_not_fit_is_a_clear_error():
    opt = ZeroAdamW(_tiny().parameters())
    with pytest.raises(TokenloomError, match="states for 1 parameters, it has"):
        opt.load_param_states([{}])
    bad = [{"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3), "step": torch.tensor(1.0)}] * len(opt.params)
    with pytest.raises(TokenloomError, match="exp_avg has 3 elements, its parameter"):
        opt.load_param_states(bad)


def test_groups_with_other_hyperparameters_are_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(TokenloomError, match="only 'params' and 'weight_decay'.*'lr'"):
        ZeroAdamW([{"params": [p], "lr": 0.1}])


def test_own_bucket_parameters_are_cut_out_alone_and_all_reduce_grads_needs_a_reduction():
    """``own_bucket``: each flagged parameter is a bucket of its own, the others stay in order around
    it (one rank: one piece per bucket, its whole size); ``all_reduce_grads`` only after the reduction."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (10, 20, 30, 40)]
    alone = {id(params[1]), id(params[3])}
    opt = ZeroAdamW(params, own_bucket=lambda p: id(p) in alone)
    assert [m.numel() for m in opt.main_shards] == [10, 20, 30, 40]
    assert [m.numel() for m in ZeroAdamW([torch.nn.Parameter(p.detach().clone()) for p in params]).main_shards] == [100]
    with pytest.raises(TokenloomError, match="call finish_grad_sync"):
        opt.all_reduce_grads(params[1:2], None)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.finish_grad_sync()
    opt.all_reduce_grads([], None)  # nothing held: no collective (none exists here)
    opt.step()


def test_grad_units_are_never_cut_into_two_buckets():
    """``grad_units`` (the strategy passes the compiled blocks under ``compile: true``): a
    bucket that reached ``bucket_bytes`` inside a unit takes the rest of it, as DDP's do (one
    rank: one piece per bucket, its whole size)."""
    torch.manual_seed(0)

    def sizes(units):  # three Linear(8, 8): weight 64 + bias 8 elements each, buckets of 100 bytes
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
        opt = ZeroAdamW(model.parameters(), bucket_bytes=100, grad_units=[model[k] for k in units])
        return [m.numel() for m in opt.main_shards]

    assert sizes([]) == [64, 72, 72, 8]
    assert sizes([0, 1, 2]) == [72, 72, 72]
    assert sizes([1]) == [64, 80, 64, 8]


def test_expert_parameters_get_buckets_of_their_own_and_step_as_adamw():
    """``is_expert``: each run of expert parameters is cut out of the dense buckets (a bucket never
    mixes the two), in order, and their group defaults to this rank alone (one rank: one piece per
    bucket, its whole size); the update is torch's AdamW's with the same decay groups."""
    torch.manual_seed(0)
    sizes = (10, 20, 30, 40, 50)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
    experts = {id(params[1]), id(params[2]), id(params[4])}
    opt = ZeroAdamW([{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}],
                    lr=1e-2, is_expert=lambda p: id(p) in experts)
    assert [m.numel() for m in opt.main_shards] == [10, 50, 40, 50]
    ref = torch.optim.AdamW([{"params": plain[:3], "weight_decay": 0.1}, {"params": plain[3:], "weight_decay": 0.0}],
                            lr=1e-2)
    for step in range(3):
        for p, q in zip(params, plain, strict=True):
            p.grad = torch.full_like(p, 0.5 + step) * torch.arange(p.numel())
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(params, plain, strict=True):
        assert (p - q).abs().max() < 1e-6
