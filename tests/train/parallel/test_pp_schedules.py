"""Pipeline schedules and GPT stages against the one-process model (gloo, CPU, fp32).

Multi-process checks share one 2-rank launch (``pp2`` fixture): p2p exchanges, 1F1B
and interleaved training against :func:`pp_helpers.reference_train`, and each schedule's
order of operations (:func:`pp_helpers.schedule_trace`), replayed by :func:`simulate` with
stages of known cost to give its bubble.
"""

from __future__ import annotations

import pytest
import torch
from pp_helpers import D_MODEL, MB, SEQ, gpt_step, launch, microbatch, reference_train, tiny_cfg

from tokenloom.errors import TokenloomError
from tokenloom.train.model.gpt import GPT
from tokenloom.train.model.pipeline_split import PipelineSplit, pipeline_stage
from tokenloom.train.parallel.p2p import P2PComm
from tokenloom.train.parallel.schedules import (
    backward_from,
    forward_backward,
    get_schedule,
    release_output,
    theoretical_bubble_fraction,
)

TOL = 1e-5
STEPS = 3
RUNS = {  # name: (kwargs of train_pipeline, micro-batches)
    "1f1b": dict(pp=2, n_layers=2, num_micro=3, steps=STEPS),
    "interleaved": dict(pp=2, n_layers=4, num_micro=4, steps=STEPS, chunks=2),
    "interleaved_m_eq_p": dict(pp=2, n_layers=4, num_micro=2, steps=2, chunks=2),
}

TRACES = [("1f1b", 1, 4), ("1f1b", 1, 8), ("interleaved", 2, 4), ("interleaved", 2, 8)]
"""(schedule, chunks, micro-batches) runs whose order of operations is traced."""


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    scenarios = [("p2p_exchange", {"numel": 1 << 20})]
    scenarios += [("train_pipeline", kw) for kw in RUNS.values()]
    scenarios += [("schedule_trace", {"runs": TRACES})]
    scenarios += [("eval_pipeline", {"n_layers": 4, "chunks": c, "num_micro": 4}) for c in (1, 2)]
    scenarios += [("bubble_fractions", {})]
    results = launch(scenarios, 2, tmp_path_factory.mktemp("pp2"))
    names = ["p2p", *RUNS, "trace", "eval_1f1b", "eval_interleaved", "bubbles"]
    return [dict(zip(names, per_rank, strict=True)) for per_rank in results]


# ---------------------------------------------------------------------- single process


def test_pipeline_split_follows_megatron():
    even = PipelineSplit(4, 2)
    assert even.layer_ids(0) == [0, 1] and even.layer_ids(1) == [2, 3] and even.is_even
    # interleaved: chunk c of rank r is virtual stage c * p + r
    assert [PipelineSplit(4, 2, 2).layer_ids(r, c) for c in range(2) for r in range(2)] == [[0], [1], [2], [3]]
    assert PipelineSplit(8, 2, 2).layer_ids(1, 1) == [6, 7]
    # uneven (megatron-core's own arrays: tests/interop/test_pipeline_split_megatron.py)
    assert PipelineSplit(6, 2, last=2).counts() == [[4, 2]]
    assert PipelineSplit(8, 4, first=1, last=1).counts() == [[1, 3, 3, 1]]
    assert PipelineSplit(7, 2, 2, loss_as_layer=True).counts() == [[2, 2], [2, 1]]
    assert PipelineSplit(2, 2, embedding_as_layer=True, loss_as_layer=True).layer_ids(1) == [1]
    assert not PipelineSplit(6, 2, last=2).is_even
    for kwargs, match in [(dict(n_layers=3, pp=2), r"n_layers 3 must be divisible by --pp 2 x --vpp 1"),
                          (dict(n_layers=4, pp=1, last=2), "need --pp >= 2"),
                          (dict(n_layers=4, pp=2, last=2, loss_as_layer=True), "do not go together"),
                          (dict(n_layers=8, pp=2, vpp=2, first=3), "first-pipeline-num-layers 3 must be >= 1 and a "
                           "multiple of --vpp 2"),
                          (dict(n_layers=8, pp=4, first=2, last=3), "leave 3 for 2 middle"),
                          (dict(n_layers=4, pp=2, first=1, last=2), "leave 1 for 0 middle"),
                          (dict(n_layers=5, pp=2, loss_as_layer=True, embedding_as_layer=True), "embedding \\+ the loss")]:
        with pytest.raises(TokenloomError, match=match):
            PipelineSplit(**kwargs)


def test_single_stage_equals_gpt_exactly():
    model = GPT(tiny_cfg(2))
    stage = pipeline_stage(tiny_cfg(2))
    assert stage.lm_head.weight is stage.tok_emb.weight  # one stage: one tied tensor
    assert set(stage.state_dict()) == set(model.state_dict())
    x, y = microbatch(0, 0)
    assert torch.equal(gpt_step(stage, None, (x, y), True), model(x, y))


def test_pipeline_stages_split_the_model_with_its_initial_values():
    model = GPT(tiny_cfg(4))
    first, last = (pipeline_stage(tiny_cfg(4), PipelineSplit(4, 2), r) for r in (0, 1))
    assert list(first.blocks) == ["0", "1"] and list(last.blocks) == ["2", "3"]
    assert last.lm_head.weight.shared and last.lm_head.weight.shared_embedding
    full = model.state_dict()
    for stage in (first, last):
        for name, t in stage.state_dict().items():
            assert torch.equal(t, full[name]), name
    assert torch.equal(last.lm_head.weight, model.tok_emb.weight)  # the tied duplicate starts equal


def test_no_pipelining_equals_gradient_accumulation():
    model, stage = GPT(tiny_cfg(2)), pipeline_stage(tiny_cfg(2))
    res = forward_backward("no_pipelining", stage, iter([microbatch(0, k) for k in range(3)]), 3, gpt_step)
    for k in range(3):
        (model(*microbatch(0, k)) / 3).backward()
    grads = dict(model.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-7, rtol=0), name
    assert len(res.losses) == 3 and res.stats.wait_s == 0.0


def test_interleaved_needs_microbatches_divisible_by_pp():
    comm = P2PComm(None, pp_rank=0, pp_size=2, prev_rank=1, next_rank=1, tensor_shape=(MB, SEQ, D_MODEL))
    chunks = [pipeline_stage(tiny_cfg(4), PipelineSplit(4, 2, 2), 0, c) for c in range(2)]
    with pytest.raises(TokenloomError, match=r"num_microbatches \(3\) divisible by the pipeline size \(2\)"):
        forward_backward(
            "interleaved", chunks, iter([microbatch(0, k) for k in range(3)]), 3, gpt_step, comm=comm
        )


def test_schedule_choice_and_theoretical_bubble():
    assert get_schedule(1) == "no_pipelining"
    assert get_schedule(2) == "1f1b" and get_schedule(2, 2) == "interleaved"
    assert theoretical_bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert theoretical_bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)


# ---------------------------------------------------------------------- 2 ranks


@pytest.mark.slow
def test_p2p_paired_exchange_does_not_deadlock(pp2):
    r0, r1 = pp2[0]["p2p"], pp2[1]["p2p"]
    assert r0["dy"] == 2.0 and r1["x"] == 1.0 and r1["x_requires_grad"]
    # 4-way ring at pp=2: the tag keeps activations (rank+1) apart from grads (10 * (rank+1))
    assert (r0["ring_x"], r0["ring_dy"]) == (2.0, 20.0)
    assert (r1["ring_x"], r1["ring_dy"]) == (1.0, 10.0)
    assert "expected (1048576,)" in r0["shape_error"]


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_pipeline_training_matches_one_process(pp2, run):
    kw = RUNS[run]
    ref = reference_train(kw["n_layers"], kw["steps"], kw["num_micro"])
    last = pp2[1][run]
    assert pp2[0][run]["losses"] == [[]] * kw["steps"]  # only the last stage has losses
    for got, want in zip(last["losses"], ref["losses"], strict=True):
        assert got == pytest.approx(want, abs=TOL, rel=0)
    seen = set()
    for res in pp2:
        for name, t in res[run]["params"].items():
            diff = (t - ref["params"][name]).abs().max().item()
            assert diff <= TOL, (run, name, diff)
            seen.add(name)
    assert seen == set(ref["params"])  # every parameter lives on some stage
    # every output sent on and kept for backward was freed after its send: the first stage sends
    # all its chunks' outputs, the last all but its last chunk's (the loss)
    chunks, per_step = kw.get("chunks", 1), kw["steps"] * kw["num_micro"]
    assert [res[run]["released"] for res in pp2] == [per_step * chunks, per_step * (chunks - 1)]


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_tied_embedding_copies_stay_equal(pp2, run):
    first, last = pp2[0][run]["tied"]["first"], pp2[1][run]["tied"]["last"]
    assert torch.equal(first, last)
    assert "last" not in pp2[0][run]["tied"] and "first" not in pp2[1][run]["tied"]


def simulate(traces: list[list], stage_forward: float, stage_backward: float, chunks: int,
             latency: float = 0.0) -> tuple[float, list[float]]:
    """Replay every rank's traced order of operations (:func:`pp_helpers.schedule_trace`) on
    stages of known cost: a chunk's forward takes ``stage_forward / chunks``, its backward
    ``stage_backward / chunks``; a message arrives ``latency`` after the later of its send and
    its receive being posted (gloo moves a message once both ends have posted; sends never
    block); a wait blocks until its receive has arrived. Messages of one channel match in
    posting order, as in gloo. Returns the makespan and each rank's compute time; fails if the
    ranks wait on one another in a cycle (a deadlock of the real schedule)."""
    cost = {"F": stage_forward / chunks, "B": stage_backward / chunks}
    n = len(traces)
    clock, compute, pos = [0.0] * n, [0.0] * n, [0] * n
    sent: dict[tuple, list[float]] = {}  # channel -> post time of each send
    posted: dict[tuple[int, int], tuple[tuple, int, float]] = {}  # (rank, id) -> (channel, index, post time)
    received: dict[tuple, int] = {}
    while any(pos[r] < len(traces[r]) for r in range(n)):
        progressed = False
        for r in range(n):
            while pos[r] < len(traces[r]):
                event = traces[r][pos[r]]
                if event[0] in cost:
                    clock[r] += cost[event[0]]
                    compute[r] += cost[event[0]]
                elif event[0] == "post":
                    for channel in event[1]:
                        sent.setdefault(channel, []).append(clock[r])
                    for rid, channel in event[2]:
                        posted[r, rid] = (channel, received.get(channel, 0), clock[r])
                        received[channel] = received.get(channel, 0) + 1
                else:  # wait
                    channel, index, at = posted[r, event[1]]
                    if len(sent.get(channel, [])) <= index:
                        break  # its send is not posted yet
                    clock[r] = max(clock[r], max(sent[channel][index], at) + latency)
                pos[r] += 1
                progressed = True
        assert progressed, f"deadlock at {pos}"
    return max(clock), compute


def traced(pp2, schedule: str, chunks: int, num_micro: int) -> list[list]:
    return [res["trace"][f"{schedule}_m{num_micro}"] for res in pp2]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,chunks,num_micro", TRACES)
def test_schedule_order_gives_the_theoretical_bubble(pp2, schedule, chunks, num_micro):
    """Replayed on equal stages (backward twice the forward) with free communication, each
    schedule's order of forwards, backwards, posts and waits idles exactly (p - 1) / (v M + p - 1)
    of the pipeline's time, as ``pipeline_bubble_fraction`` computes it: the order has no wait
    the theory does not have."""
    traces = traced(pp2, schedule, chunks, num_micro)
    assert [sum(e[0] == "F" for e in t) for t in traces] == [chunks * num_micro] * 2
    assert [sum(e[0] == "B" for e in t) for t in traces] == [chunks * num_micro] * 2
    makespan, compute = simulate(traces, 1.0, 2.0, chunks)
    assert 1 - sum(compute) / (2 * makespan) == pytest.approx(theoretical_bubble_fraction(2, num_micro, chunks))


@pytest.mark.slow
def test_interleaved_transfers_run_under_compute(pp2):
    """A message taking a quarter of a chunk's forward lengthens the interleaved step only by
    the first micro-batch's trip through the v p virtual stages and back, 2 (v p - 1)
    latencies, at M = 4 as at M = 8: in the steady state every transfer runs under the other
    half of a step. (Posting a step's sends and receives together after its backward, as
    before, also cost about one latency per step.)"""
    latency = 0.25 * 1.0 / 2
    for m in (4, 8):
        traces = traced(pp2, "interleaved", 2, m)
        extra = simulate(traces, 1.0, 2.0, 2, latency)[0] - simulate(traces, 1.0, 2.0, 2)[0]
        assert extra == pytest.approx(2 * (2 * 2 - 1) * latency), (m, extra)


@pytest.mark.slow
def test_bubble_fractions_pipeline_wide_and_of_the_busiest_rank(pp2):
    """Pipeline-wide: 1 - (1.0 + 1.2) / (2 x 1.5); the busiest rank's: 1 - 1.2 / 1.5."""
    for res in pp2:
        assert res["bubbles"]["pipeline"] == pytest.approx(1 - 2.2 / 3.0)
        assert res["bubbles"]["busiest"] == pytest.approx(1 - 1.2 / 1.5)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["eval_1f1b", "eval_interleaved"])
def test_forward_only_gives_losses_and_no_grads(pp2, run):
    model = GPT(tiny_cfg(4))
    with torch.no_grad():
        want = [model(*microbatch(0, k)).item() for k in range(4)]
    assert pp2[0][run]["losses"] == []
    assert pp2[1][run]["losses"] == pytest.approx(want, abs=1e-6, rel=0)
    assert pp2[0][run]["no_grads"] and pp2[1][run]["no_grads"]


@pytest.mark.parametrize("saves_output", [False, True])
def test_a_released_output_backpropagates_as_the_kept_one(saves_output):
    """A stage output freed after its send (one element left) gives the same gradients as the kept
    one, whether its node saved nothing of it (a residual add) or its own output (tanh)."""
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(0))
    dy = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def stage():
        h = lin(x)
        return torch.tanh(h) if saves_output else h.relu() + x

    torch.autograd.backward(stage(), dy)
    want = (x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone())
    x.grad, lin.weight.grad, lin.bias.grad = None, None, None
    y = stage()
    release_output(y)
    assert y.numel() == 1 and y.untyped_storage().nbytes() == 4 and y.grad_fn is not None
    with pytest.raises(RuntimeError, match="[Mm]ismatch in shape"):
        torch.autograd.backward(y, dy, retain_graph=True)  # why the schedules call backward_from
    backward_from(y, dy)
    assert torch.equal(x.grad, want[0]) and torch.equal(lin.weight.grad, want[1]) and torch.equal(lin.bias.grad, want[2])


def test_views_and_tensors_without_grad_are_not_released():
    base = torch.randn(4, 8, requires_grad=True)
    view = base[1:]
    release_output(view)
    plain = torch.randn(4, 8)
    release_output(plain)
    assert view.shape == (3, 8) and plain.shape == (4, 8)
