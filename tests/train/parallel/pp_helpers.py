"""Helpers for the pipeline-parallel and ZeRO-1 tests (gloo ranks on CPU).

:func:`launch` spawns one process per rank (``multiprocessing`` spawn context,
``init_method=file://`` in a temporary folder, so no ports), runs the named scenarios
in order inside one process group and returns every rank's results (a dict per
scenario, tensors allowed). A hang fails the test after ``deadline_s``; a crash on any
rank is reported with its traceback. :func:`reference_train` is the one-process run
every parallel layout is compared with.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import rank_launcher
import torch
import torch.distributed as dist
from torch import nn

from tokenloom.errors import TokenloomError
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.model.pipeline_split import PipelineSplit, pipeline_stage
from tokenloom.train.optim.adamw import param_groups
from tokenloom.train.optim.zero import ZeroAdamW
from tokenloom.train.parallel import p2p, schedules
from tokenloom.train.parallel.p2p import P2PComm
from tokenloom.train.parallel.schedules import (
    allreduce_tied_embedding_grads,
    forward_backward,
    get_schedule,
)
from tokenloom.train.parallel.wgrad import linear as wgrad_linear
from tokenloom.train.parallel.wgrad import set_wgrad_sink, wgrad_sink

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
    optim/adamw.py's decay / no-decay groups instead of decay on every parameter."""
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


def bubble_fractions(rank: int) -> dict:
    """Both bubbles of stats made up per rank: compute 1.0 / 1.2 s, totals 1.5 / 1.4 s."""
    stats = schedules.PipelineStats(compute_s=[1.0, 1.2][rank], total_s=[1.5, 1.4][rank])
    return {"pipeline": schedules.pipeline_bubble_fraction(stats, None),
            "busiest": schedules.pipeline_bubble_fraction(stats, None, busiest=True)}


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
    x, dy = p2p.communicate(comm, send_next=mine, send_prev=mine * 10, recv_prev=True, recv_next=True)
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
    stages = [pipeline_stage(tiny_cfg(n_layers), PipelineSplit(n_layers, pp, chunks), pp_rank, c)
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
    stages = [pipeline_stage(tiny_cfg(n_layers), PipelineSplit(n_layers, pp, chunks), rank, c)
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

    def traced_post(comm, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False, background=True):
        got = post(comm, send_next=send_next, send_prev=send_prev, recv_prev=recv_prev, recv_next=recv_next,
                   background=background)
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
    """ZeRO-1 over the whole world (dp = world size) with optim/adamw.py's decay / no-decay
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


class DeferredGathers:
    """While active, an asynchronous ``all_gather_single`` reaches its output only when its
    work is waited for (the gather itself runs at once, into a side buffer): a reader that
    does not wait sees the previous values however fast the transport, so a missing wait
    shows in the losses and parameters, not only by chance. Counts the waits."""

    def __init__(self) -> None:
        self.real, self.waits, self.launched = dist.all_gather_single, 0, 0

    def __enter__(self) -> DeferredGathers:
        dist.all_gather_single = self._gather
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_single = self.real

    def _gather(self, out, piece, group=None, async_op=False):
        if not async_op:
            return self.real(out, piece, group=group)
        result = torch.empty_like(out)
        self.real(result, piece, group=group)
        self.launched += 1
        deferred = self

        class Work:
            def wait(self) -> bool:
                out.copy_(result)
                deferred.waits += 1
                return True

        return Work()


def zero_param_gather(rank: int, *, steps: int) -> dict:
    """ZeRO-1 with ``overlap_param_gather`` (gathers deferred until waited for,
    :class:`DeferredGathers`) beside the same model and optimizer without it, both at dp =
    world size on micro-batch ``rank``: after each step the gathers are pending and the
    parameters stale; in the next forward every module finds its parameters equal to the
    synchronous run's when it starts (a check hook registered after ZeroAdamW's), and the
    losses, an eval forward and the final parameters are equal bit for bit."""

    def make(overlap: bool):
        torch.manual_seed(0)
        model = GPT(tiny_cfg(2))
        opt = ZeroAdamW(param_groups(model, WD), None, lr=LR, max_grad_norm=1.0, bucket_bytes=4096,
                        overlap_grad_reduce=True, overlap_param_gather=overlap, modules=[model])
        return model, opt

    (model, opt), (plain, plain_opt) = make(True), make(False)
    expected = dict(plain.named_parameters(remove_duplicate=False))
    fresh: list[bool] = []  # per module call: its parameters were the gathered ones when it started

    def check(module, args):
        prefix = module_names[module]
        fresh.append(all(p.equal(expected[prefix + n]) for n, p in module.named_parameters(recurse=False)))

    module_names = {m: f"{name}." if name else "" for name, m in model.named_modules()}
    for m in module_names:
        if any(True for _ in m.parameters(recurse=False)):
            m.register_forward_pre_hook(check)
    out: dict[str, Any] = {"losses": [], "plain_losses": [], "fresh": [], "waits_in_forward": [], "after_step": []}
    with DeferredGathers() as gathers:
        for step in range(steps):
            fresh.clear()
            gathers.launched = gathers.waits = 0
            opt.zero_grad()
            loss = model(*microbatch(step, rank))
            out["fresh"].append(list(fresh))
            out["waits_in_forward"].append(gathers.waits)
            loss.backward()
            opt.step()
            plain_opt.zero_grad()
            plain_loss = plain(*microbatch(step, rank))
            plain_loss.backward()
            plain_opt.step()
            stale = any(not p.equal(expected[n]) for n, p in model.named_parameters())
            waited = gathers.waits - out["waits_in_forward"][-1]
            # pending, launched, waited for in the step, some parameter stale (not the plain run's)
            out["after_step"].append((opt.param_sync_pending, gathers.launched, waited, stale))
            out["losses"].append(loss.item())
            out["plain_losses"].append(plain_loss.item())
        fresh.clear()
        model.eval()
        plain.eval()
        with torch.no_grad():  # an eval forward waits for the gathers as a training one does
            out["eval"] = (model(*microbatch(99, rank)).item(), plain(*microbatch(99, rank)).item())
        out["eval_fresh"] = list(fresh)
        opt.finish_param_sync()
        out["pending_after_finish"] = opt.param_sync_pending
        out["buckets"] = len(opt.main_shards)
        out["params_equal"] = all(p.equal(expected[n]) for n, p in model.named_parameters())
        out["parent_reads_child"] = [_parent_reads_child(rank, steps, overlap) for overlap in (True, False)]
    return out


def zero_compiled_blocks(rank: int, *, steps: int) -> dict:
    """overlap_param_gather on a GPT whose blocks are compiled (``compile: true``): the pre-hook
    of a compiled block runs outside its graph (no graph break), gathers deferred until waited
    for (:class:`DeferredGathers`); losses with the compiled model without overlap."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses = []
    with DeferredGathers():
        for overlap in (True, False):
            torch.manual_seed(0)
            model = GPT(tiny_cfg(2))
            model.compile_blocks()
            opt = ZeroAdamW(model.parameters(), None, lr=LR, bucket_bytes=4096, overlap_param_gather=overlap,
                            modules=[model])
            run = []
            for step in range(steps):
                opt.zero_grad()
                loss = model(*microbatch(step, rank))
                loss.backward()
                opt.step()
                run.append(loss.item())
            losses.append(run)
    return {"losses": losses, "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values())}


class ReadsChildWeight(nn.Module):
    """A parent that reads its last child's weight without calling the child (as GPT.head's
    fused loss reads ``lm_head.weight``), the child in a bucket of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.norm, self.head = nn.Linear(8, 8, bias=False), nn.LayerNorm(8), nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.norm(self.body(x)) @ self.head.weight.T).square().mean()


def _parent_reads_child(rank: int, steps: int, overlap: bool) -> tuple[list[float], int]:
    """Losses of ``steps`` ZeRO-1 steps of :class:`ReadsChildWeight` (and its bucket count)."""
    torch.manual_seed(0)
    model = ReadsChildWeight()
    opt = ZeroAdamW(model.parameters(), None, lr=0.1, bucket_bytes=64, overlap_param_gather=overlap,
                    modules=[model])
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, 8, generator=g))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, len(opt.main_shards)


def zero_overlap_checkpoint(rank: int, *, out: str) -> dict:
    """A ZeRO-1 run of the loop's Strategy (dp = world size, small buckets, overlap_param_gather
    by default, gathers deferred until waited for: :class:`DeferredGathers`): a checkpoint saved
    right after a step, gathers pending, holds the updated parameters; loaded right after the
    next step, no late gather overwrites it; an eval forward with gathers pending equals the
    same eval once they are done."""
    import compose_helpers

    from tokenloom.train import loop
    from tokenloom.train.checkpoint import commit as checkpoint
    from tokenloom.train.checkpoint import format as ckpt_format

    cfg = compose_helpers.tiny_cfg(Path(out), zero1=True, ddp_bucket_cap_mb=0.004, train_iters=3, eval_interval=0)
    trainer = loop.start_run(cfg)
    s = trainer.strategy
    batches = s.global_batches(trainer.data.train, eod=trainer.data.eod, consumed=0,
                               total=cfg.train_iters * cfg.global_batch_size)
    res: dict[str, Any] = {"overlap": s.optimizer.overlap_param_gather}
    with DeferredGathers():
        s.train_step(next(batches))
        res["pending_at_save"] = s.optimizer.param_sync_pending
        path = s.save(1, {"consumed_samples": cfg.global_batch_size})
        s.saver.wait()  # written in the background (async_save)
        saved = ckpt_format.read(path)[0]
        s.finish_param_sync()  # a gather the save did not wait for would land here, after the files
        res["saved_is_updated"] = all(saved[n].equal(p) for n, p in s.chunks[0].named_parameters())
        s.train_step(next(batches))
        res["pending_at_load"] = s.optimizer.param_sync_pending
        s.load(path, checkpoint.read_state(path))
        s.finish_param_sync()  # a gather left pending by load would land here
        res["loaded_kept"] = all(saved[n].equal(p) for n, p in s.chunks[0].named_parameters())
        batch = next(batches)
        s.train_step(batch)
        res["pending_at_eval"] = s.optimizer.param_sync_pending
        pending = s.eval_loss_sum(batch).item()
        s.finish_param_sync()
        res["eval"] = [pending, s.eval_loss_sum(batch).item()]
    return res


def zero_accumulation(rank: int, *, steps: int = 3) -> dict:
    """ZeRO-1 at dp = world, two micro-batches per step (the first in ``no_sync``), with and
    without overlap, against torch's AdamW on the dp-averaged sums of the same local grads:
    ``a`` has grads in both micro-batches, ``b`` only in the ``no_sync`` one (no hook in the
    reducing backward), ``c`` only in the reducing one, ``d`` in step 0 only (its view must not
    keep step 0's grad; the flat buffer gives it zeros, as Megatron's does). ``fused``: the
    layers run as :func:`tokenloom.train.parallel.wgrad.linear`, so with overlap the weight grads are
    written by their GEMMs (fresh, accumulated, averaged or not) and must step the same."""
    torch.manual_seed(0)
    base = nn.ModuleDict({k: nn.Linear(8, 8) for k in "abcd"})

    def losses(model, x, micro, step, fused=False):
        def run(k):
            return wgrad_linear(x, model[k].weight, model[k].bias) if fused else model[k](x)

        if micro == 0:
            out = run("a").sum() + run("b").pow(2).sum()
        else:
            out = 2 * run("a").sum() + run("c").pow(2).sum()
        return out + (run("d").sum() if step == 0 else 0)

    res: dict[str, Any] = {}
    for overlap, fused in ((True, False), (False, False), (True, True)):
        model, ref = copy.deepcopy(base), copy.deepcopy(base)
        # eps = 1: Adam's update is no longer scale-invariant, so a grad left unaveraged shows
        opt = ZeroAdamW(model.parameters(), None, lr=0.01, eps=1.0, weight_decay=0.0, bucket_bytes=300,
                        overlap_grad_reduce=overlap)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, eps=1.0, weight_decay=0.0)
        g = torch.Generator().manual_seed(rank)
        taken = []
        for k in "abcd":
            sink = wgrad_sink(model[k].weight)
            if sink is not None:
                set_wgrad_sink(model[k].weight, lambda g_, x_, sink=sink, taken=taken: taken.append(1) or sink(g_, x_))
        for step in range(steps):
            opt.zero_grad()
            ref_opt.zero_grad()
            for micro in range(2):
                x = torch.randn(4, 8, generator=g)
                with opt.no_sync() if micro == 0 else contextlib.nullcontext():
                    losses(model, x, micro, step, fused).backward()
                losses(ref, x, micro, step).backward()
            for p in ref.parameters():  # the dp average, zeros where no micro-batch gave a grad
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            opt.step()
            ref_opt.step()
        name = f"overlap={overlap}" + (" fused" if fused else "")
        res[name] = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))
        res[f"buckets {name}"] = len(opt.main_shards)
        res[f"sink calls {name}"] = len(taken)
    return res


SCENARIOS = {
    "p2p_exchange": p2p_exchange,
    "train_pipeline": train_pipeline,
    "schedule_trace": schedule_trace,
    "zero_train": zero_train,
    "zero_param_gather": zero_param_gather,
    "zero_overlap_checkpoint": zero_overlap_checkpoint,
    "zero_compiled_blocks": zero_compiled_blocks,
    "zero_accumulation": zero_accumulation,
    "eval_pipeline": eval_pipeline,
    "bubble_fractions": bubble_fractions,
}
