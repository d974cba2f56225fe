"""Helpers for the pipeline-parallel and ZeRO-1 tests (gloo ranks on CPU).

:func:`launch` spawns one process per rank (``multiprocessing`` spawn context,
``init_method=file://`` in a temporary folder, so no ports), runs the named scenarios
in order inside one process group and returns every rank's results (a dict per
scenario, tensors allowed). A hang fails the test after ``deadline_s``; a crash on any
rank is reported with its traceback. :func:`reference_train` is the one-process run
every parallel layout is compared with.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import rank_launcher
import torch
import torch.distributed as dist
from torch import nn

from tokenloom.errors import TokenloomError
from tokenloom.train.model import GPT, GPTConfig, pipeline_stage
from tokenloom.train.optim import param_groups
from tokenloom.train.parallel import p2p, schedules
from tokenloom.train.parallel.p2p import P2PComm
from tokenloom.train.parallel.schedules import (
    allreduce_tied_embedding_grads,
    forward_backward,
    get_schedule,
)
from tokenloom.train.parallel.zero import ZeroAdamW

VOCAB, SEQ, D_MODEL, MB = 64, 16, 32, 2
LR, WD = 1e-2, 0.1
COLLECTIVE_TIMEOUT_S = 60.0


def with_loss(loss_fn):
    """A schedule ``forward_step`` from a stage module and a ``loss_fn(output, batch)``."""

    def forward_step(module, hidden, batch, last):
        y = module(hidden, batch)
        return loss_fn(y, batch) if last else y

    return forward_step


def gpt_step(module, hidden, batch, last):
    """The schedule ``forward_step`` of a :func:`pipeline_stage` on a ``(tokens, labels)`` batch."""
    tokens, labels = batch
    tokens = tokens if hidden is None else None
    return module(tokens, labels, hidden=hidden) if last else module(tokens, hidden=hidden)


def tiny_cfg(n_layers: int) -> GPTConfig:
    """gpt2 flavour without biases: the key bias has an exactly-zero true gradient
    (softmax ignores a per-query constant), so its computed grad is rounding noise that
    AdamW normalises into ~1e-5 updates of random sign, different per summation order."""
    return GPTConfig(
        bias=False,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=64,
        seq_len=SEQ,
        n_layers=n_layers,
        n_heads=4,
        d_model=D_MODEL,
    )


def microbatch(step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``k`` of global batch ``step``: ``(tokens, labels)``, each [MB, SEQ]."""
    g = torch.Generator().manual_seed(1000 * step + k)
    x = torch.randint(0, VOCAB, (MB, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def reference_train(
    n_layers: int, steps: int, num_micro: int, *, max_grad_norm: float | None = None, full_batch: bool = False,
    groups: bool = False,
) -> dict[str, Any]:
    """One process, torch AdamW: per step micro-batches ``0..num_micro-1``, either
    accumulated (loss / num_micro each) or concatenated into one full batch. ``groups``:
    optim.py's decay / no-decay groups instead of decay on every parameter."""
    torch.manual_seed(0)
    model = GPT(tiny_cfg(n_layers))
    opt = torch.optim.AdamW(param_groups(model, WD) if groups else model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        batches = [microbatch(step, k) for k in range(num_micro)]
        if full_batch:
            loss = model(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
            loss.backward()
            losses.append([loss.item()])
        else:
            step_losses = []
            for x, y in batches:
                loss = model(x, y)
                (loss / num_micro).backward()
                step_losses.append(loss.item())
            losses.append(step_losses)
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        opt.step()
    params = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params}


# ---------------------------------------------------------------------- launching


def launch(scenarios: list[tuple[str, dict]], world_size: int, tmp_path: Path, deadline_s: float = 240.0):
    """Run ``scenarios`` (name, kwargs) of this module on ``world_size`` ranks; per-rank result lists."""
    return rank_launcher.launch(__name__, scenarios, world_size, tmp_path, deadline_s=deadline_s,
                                collective_timeout_s=COLLECTIVE_TIMEOUT_S)


# ---------------------------------------------------------------------- scenarios


def p2p_exchange(rank: int, numel: int) -> dict:
    """Both ranks send at the same time (each direction, then all four at once) with
    tensors big enough (numel floats) that an unpaired blocking send would stall."""
    shape = (numel,)
    comm = P2PComm.from_group(None, shape, torch.float32)
    mine = torch.full(shape, float(rank + 1))
    if rank == 0:
        dy = p2p.send_forward_recv_backward(mine, comm)
        got = {"dy": dy[0].item()}
    else:
        x = p2p.send_backward_recv_forward(mine, comm)
        got = {"x": x[0].item(), "x_requires_grad": x.requires_grad}
    x, dy = p2p.send_forward_backward_recv_forward_backward(mine, mine * 10, True, True, comm)
    got["ring_x"], got["ring_dy"] = x[0].item(), dy[0].item()
    p2p.wait_sends(comm)
    got["wait_s"], got["pending_after_wait"] = comm.wait_s, len(comm.pending_sends)
    try:
        p2p.send_forward(torch.zeros(3), comm)
        got["shape_error"] = ""
    except TokenloomError as e:
        got["shape_error"] = str(e)
    return got


def _groups(pp: int, dp: int) -> tuple[Any, Any, Any, int, int]:
    """Megatron's layout with tp = 1: global = dp_rank + dp * pp_rank. Every rank creates
    every group in the same order and keeps its own."""
    rank = dist.get_rank()
    mine = {}
    for d in range(dp):
        ranks = [d + dp * s for s in range(pp)]
        g = dist.new_group(ranks)
        e = dist.new_group([ranks[0], ranks[-1]]) if pp > 1 else None
        if rank in ranks:
            mine["pp"], mine["emb"] = g, e
    for s in range(pp):
        ranks = [d + dp * s for d in range(dp)]
        g = dist.new_group(ranks)
        if rank in ranks:
            mine["dp"] = g
    return mine["pp"], mine["dp"], mine["emb"], rank // dp, rank % dp


def train_pipeline(
    rank: int,
    *,
    pp: int,
    n_layers: int,
    num_micro: int,
    steps: int,
    chunks: int = 1,
    dp: int = 1,
    max_grad_norm: float | None = None,
) -> dict:
    """Train the tiny GPT split over ``pp`` x ``chunks`` stages (x ``dp`` replicas with
    ZeRO-1, else torch AdamW) and return losses, stage parameters by name, norms."""
    pp_group, dp_group, emb_group, pp_rank, dp_rank = _groups(pp, dp)
    torch.manual_seed(0)
    stages = [pipeline_stage(tiny_cfg(n_layers), pp_size=pp, pp_rank=pp_rank, num_chunks=chunks, chunk=c)
              for c in range(chunks)]
    params = [p for s in stages for p in s.parameters()]
    if dp > 1 or max_grad_norm is not None:
        opt: Any = ZeroAdamW(
            params, dp_group, lr=LR, weight_decay=WD, max_grad_norm=max_grad_norm, norm_group=pp_group
        )
    else:
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    comm = P2PComm.from_group(pp_group, (MB, SEQ, D_MODEL), torch.float32)
    schedule = get_schedule(pp, chunks)
    losses, norms, bubbles = [], [], []
    released, release = [], schedules.release_output  # count the sent outputs the schedule frees

    def counting_release(y):
        release(y)
        released.append(y is not None and y.numel() == 1)

    schedules.release_output = counting_release
    for step in range(steps):
        opt.zero_grad()
        batches = iter([microbatch(step, dp_rank * num_micro + j) for j in range(num_micro)])
        res = forward_backward(
            schedule, stages if chunks > 1 else stages[0], batches, num_micro, gpt_step, comm=comm
        )
        allreduce_tied_embedding_grads(stages, emb_group)
        norms.append(opt.step())
        losses.append([loss.item() for loss in res.losses])
        bubbles.append(res.stats.bubble_fraction)
    named = {}
    for s in stages:
        named.update({n: t.detach().clone() for n, t in s.state_dict().items()})
    tied = {}
    if stages[0].pre:
        tied["first"] = stages[0].tok_emb.weight.detach().clone()
    if stages[-1].post:
        tied["last"] = stages[-1].lm_head.weight.detach().clone()
    schedules.release_output = release
    return {"losses": losses, "params": named, "tied": tied, "norms": norms, "pp_rank": pp_rank,
            "released": sum(released)}


def eval_pipeline(rank: int, *, n_layers: int, chunks: int, num_micro: int) -> dict:
    """``forward_only`` over the whole world as the pipeline: losses, no grads."""
    pp = dist.get_world_size()
    stages = [pipeline_stage(tiny_cfg(n_layers), pp_size=pp, pp_rank=rank, num_chunks=chunks, chunk=c)
              for c in range(chunks)]
    comm = P2PComm.from_group(None, (MB, SEQ, D_MODEL), torch.float32)
    data = iter([microbatch(0, k) for k in range(num_micro)])
    model_arg = stages if chunks > 1 else stages[0]
    res = forward_backward(
        get_schedule(pp, chunks), model_arg, data, num_micro, gpt_step, comm=comm, forward_only=True
    )
    no_grads = all(p.grad is None for s in stages for p in s.parameters())
    return {"losses": [loss.item() for loss in res.losses], "no_grads": no_grads}


class _Traced(torch.autograd.Function):
    """Identity that appends ``("F", name)`` to ``log`` forward and ``("B", name)`` backward."""

    @staticmethod
    def forward(ctx, x, log, name):
        log.append(("F", name))
        ctx.log, ctx.name = log, name
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("B", ctx.name))
        return grad, None, None


class TracedStage(nn.Module):
    """A stage that logs its forwards and backwards (see :func:`schedule_trace`)."""

    def __init__(self, shape: tuple[int, ...], log: list, name: int) -> None:
        super().__init__()
        self.shape, self.log, self.name = shape, log, name
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, hidden, batch):
        x = torch.ones(self.shape) if hidden is None else hidden
        return _Traced.apply(x * self.scale, self.log, self.name)


def schedule_trace(rank: int, *, runs: list[tuple[str, int, int]]) -> dict:
    """Each run's program order on this rank, for ``(schedule, chunks, micro-batches)``: its
    forwards and backwards ``("F" | "B", chunk)``, p2p posts ``("post", sends, receives)``
    (a send is its channel ``(from rank, to rank, "act" | "grad")``, a receive ``(id,
    channel)``) and the first wait on each receive ``("wait", id)``."""
    shape = (2, 4, 8)
    comm = P2PComm.from_group(None, shape, torch.float32)
    post, wait = p2p.post, p2p.Incoming.wait
    log: list = []

    def traced_post(comm, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        got = post(comm, send_next=send_next, send_prev=send_prev, recv_prev=recv_prev, recv_next=recv_next)
        sends = [(rank, comm.next_rank, "act")] if send_next is not None else []
        sends += [(rank, comm.prev_rank, "grad")] if send_prev is not None else []
        receives = []
        for incoming, channel in zip(got, [(comm.prev_rank, rank, "act"), (comm.next_rank, rank, "grad")], strict=True):
            if incoming is not None:
                incoming.trace_id = len(log)
                receives.append((len(log), channel))
        if sends or receives:
            log.append(("post", sends, receives))
        return got

    def traced_wait(self):
        if self.work is not None:
            log.append(("wait", self.trace_id))
        return wait(self)

    p2p.post, p2p.Incoming.wait = traced_post, traced_wait
    out = {}
    try:
        for schedule, chunks, num_micro in runs:
            log.clear()
            stages = [TracedStage(shape, log, c) for c in range(chunks)]
            forward_backward(schedule, stages if chunks > 1 else stages[0], iter([None] * num_micro), num_micro,
                             with_loss(lambda y, b: y.mean()), comm=comm)
            out[f"{schedule}_m{num_micro}"] = list(log)
    finally:
        p2p.post, p2p.Incoming.wait = post, wait
    return out


def zero_train(rank: int, *, steps: int, max_grad_norm: float | None, resume_at: int) -> dict:
    """ZeRO-1 over the whole world (dp = world size) with optim.py's decay / no-decay
    groups and 4 KB buckets reduce-scattered during backward: rank d trains on micro-batch
    d of each global batch. Also checkpoints after
    ``resume_at`` steps (the parameters and :meth:`ZeroAdamW.gathered_param_states`, rank
    0's sent to every rank as a checkpoint file would be read), resumes into a fresh
    model + optimizer and replays the remaining steps."""

    def run(model, opt, first, last, ckpt=None):
        losses, norms, launched = [], [], []
        for step in range(first, last):
            if step == resume_at and ckpt is not None:
                ckpt["model"] = copy.deepcopy(model.state_dict())
                states = opt.gathered_param_states()
                box = [copy.deepcopy(states)]
                dist.broadcast_object_list(box, src=0)
                ckpt["opt"] = box[0]
            opt.zero_grad()
            loss = model(*microbatch(step, rank))
            loss.backward()
            launched.append(len(opt.main_shards) - 1 - opt._next)  # buckets reduce-scattered in backward
            norms.append(opt.step())
            losses.append(loss.item())
        return losses, norms, launched

    def make(model):
        return ZeroAdamW(param_groups(model, WD), None, lr=LR, max_grad_norm=max_grad_norm, bucket_bytes=4096,
                         overlap_grad_reduce=True)

    torch.manual_seed(0)
    model = GPT(tiny_cfg(2))
    opt = make(model)
    ckpt: dict[str, Any] = {}
    losses, norms, launched = run(model, opt, 0, steps, ckpt)
    resumed = GPT(tiny_cfg(2))
    resumed.load_state_dict(ckpt["model"])
    opt2 = make(resumed)
    opt2.load_param_states(ckpt["opt"])
    resumed_losses, _, _ = run(resumed, opt2, resume_at, steps)
    return {
        "losses": losses,
        "norms": norms,
        "params": {n: t.detach().clone() for n, t in model.state_dict().items()},
        "resumed_params": {n: t.detach().clone() for n, t in resumed.state_dict().items()},
        "resumed_losses": resumed_losses,
        "launched_in_backward": launched,
        "buckets": len(opt.main_shards),
        "bucket_numels": [sum(p.numel() for p, k in zip(opt.params, opt._bucket_of, strict=True) if k == b)
                          for b in range(len(opt.main_shards))],
        "shard_numel": opt.shard_size,
        "exp_avg_numel": sum(opt.optimizer.state[m]["exp_avg"].numel() for m in opt.main_shards),
        "state_bytes": opt.state_bytes(),
        "numel": opt.numel,
        "grads_are_views": all(
            p.grad.data_ptr() == v.data_ptr() for p, v in zip(opt.params, opt._grad_views, strict=True)
        ),
    }


SCENARIOS = {
    "p2p_exchange": p2p_exchange,
    "train_pipeline": train_pipeline,
    "schedule_trace": schedule_trace,
    "zero_train": zero_train,
    "eval_pipeline": eval_pipeline,
}
