"""Pipeline schedules (Megatron-core's ``schedules.py``): :func:`forward_backward` runs ``M``
micro-batches through this rank's chunk(s), gradients accumulating in ``.grad``.

* ``"no_pipelining"`` (pp = 1): gradient accumulation.
* ``"1f1b"``: ``min(p - r - 1, M)`` warmup forwards on rank ``r``, then 1F1B, then cooldown.
* ``"interleaved"``: ``v`` chunks per rank (chunk ``c`` is virtual stage ``c * p + r``), groups of
  ``p`` micro-batches (``M`` a multiple of ``p``): bubble ``(p - 1) / (v M + p - 1)`` instead of
  ``(p - 1) / (M + p - 1)``, for ``v`` times the p2p messages.

Contract: the loss is taken on the last virtual stage only, divided by ``M`` before backward. DP
reduction is gated, not done: all but each chunk's last micro-batch run in its ``no_sync``; then
:func:`allreduce_tied_embedding_grads` and the optimizer step (``finalize_model_grads``'s order).
Unlike Megatron, all ``M`` micro-batches are fetched up front (token ids are small). Bubble:
:class:`PipelineStats`, :func:`pipeline_bubble_fraction` (``bench/parallel_bench.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from tokenloom.errors import TokenloomError
from tokenloom.train.parallel import p2p
from tokenloom.train.parallel.p2p import P2PComm

Schedule = Literal["no_pipelining", "1f1b", "interleaved"]
ForwardStep = Callable[[nn.Module, "torch.Tensor | None", Any, bool], torch.Tensor]
NoSync = Callable[[], AbstractContextManager]


@dataclass
class PipelineStats:
    """Where this rank's time went during one :func:`forward_backward` call."""

    compute_s: float = 0.0
    """Seconds inside stage forwards, losses and backwards."""
    wait_s: float = 0.0
    """Seconds inside p2p calls (sending, and waiting for neighbours)."""
    total_s: float = 0.0
    """Wall-clock seconds of the whole call."""

    @property
    def bubble_fraction(self) -> float:
        """This rank's ``wait / (wait + compute)`` (:func:`pipeline_bubble_fraction`: the pipeline's)."""
        busy = self.compute_s + self.wait_s
        return self.wait_s / busy if busy > 0 else 0.0

    def __add__(self, other: PipelineStats) -> PipelineStats:
        """Both runs' times together (the trainer sums the steps of a log interval)."""
        return PipelineStats(self.compute_s + other.compute_s, self.wait_s + other.wait_s,
                             self.total_s + other.total_s)


@dataclass
class PipelineResult:
    losses: list[torch.Tensor] = field(default_factory=list)
    """Per-micro-batch losses (detached, not divided by M); empty except on the last stage."""
    stats: PipelineStats = field(default_factory=PipelineStats)


def theoretical_bubble_fraction(pp_size: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """Idle share of a step for equal stages: ``(p - 1) / (v * M + p - 1)``."""
    return (pp_size - 1) / (num_chunks * num_microbatches + pp_size - 1)


def pipeline_bubble_fraction(stats: PipelineStats, pp_group: dist.ProcessGroup | None, *,
                             busiest: bool = False) -> float:
    """Pipeline-wide bubble (collective over ``pp_group``): ``1 - sum(compute) / (pp_size *
    max(total))``, idle counted against the slowest rank's end (the step waits for it).
    ``busiest``: ``1 - max(compute) / max(total)`` (the Megatron paper's), which leaves out the
    idle that unequal stages force on the lighter ranks; equal for equal stages."""
    device = stats_device(pp_group)
    compute = torch.tensor([stats.compute_s], dtype=torch.float64, device=device)
    total = torch.tensor([stats.total_s], dtype=torch.float64, device=device)
    dist.all_reduce(compute, op=dist.ReduceOp.MAX if busiest else dist.ReduceOp.SUM, group=pp_group)
    dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
    return 1.0 - compute.item() / ((1 if busiest else dist.get_world_size(pp_group)) * total.item())


def stats_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device of a small collective's tensor: the current CUDA device on NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_schedule(pp_size: int, num_chunks: int = 1) -> Schedule:
    """Megatron's ``get_forward_backward_func`` choice."""
    if pp_size == 1:
        return "no_pipelining"
    return "interleaved" if num_chunks > 1 else "1f1b"


def forward_backward(
    schedule: Schedule,
    model: nn.Module | Sequence[nn.Module],
    data_iterator: Iterator[Any],
    num_microbatches: int,
    forward_step: ForwardStep,
    *,
    comm: P2PComm | None = None,
    forward_only: bool = False,
    no_sync: NoSync | Sequence[NoSync] | None = None,
) -> PipelineResult:
    """Run one global batch through this rank's stage(s); grads accumulate in ``.grad``.

    ``model``: a stage module or this rank's chunks (interleaved). ``forward_step(module, hidden,
    batch, is_last)`` (Megatron's ``forward_step_func``) returns the mean loss on the last stage,
    else the activation to send. ``comm``: needed when pipelined. ``no_sync``: a context factory or
    one per chunk (Megatron's ``no_sync_func``), entered for all but each chunk's last micro-batch.
    """
    chunks = list(model) if isinstance(model, (Sequence, nn.ModuleList)) else [model]
    if schedule not in ("no_pipelining", "1f1b", "interleaved"):
        raise TokenloomError(f"unknown schedule {schedule!r}; use 'no_pipelining', '1f1b' or 'interleaved'")
    if num_microbatches < 1:
        raise TokenloomError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if schedule != "no_pipelining" and comm is None:
        raise TokenloomError(f"schedule {schedule!r} needs a P2PComm (comm=...)")
    if schedule != "interleaved" and len(chunks) != 1:
        raise TokenloomError(f"schedule {schedule!r} takes one stage module, got {len(chunks)} chunks")
    pp_size = comm.pp_size if comm is not None else 1
    if schedule == "interleaved" and pp_size < 2:
        raise TokenloomError("the interleaved schedule needs a pipeline of at least 2 ranks")
    if schedule == "interleaved" and num_microbatches % pp_size:
        raise TokenloomError(
            f"interleaved schedule needs num_microbatches ({num_microbatches}) divisible by the "
            f"pipeline size ({pp_size}); change the global batch or the micro-batch size"
        )
    if no_sync is not None and not callable(no_sync) and len(no_sync) != len(chunks):
        raise TokenloomError(f"no_sync: one context per model chunk, got {len(no_sync)} for {len(chunks)} chunks")
    runner = _Runner(
        chunks, [next(data_iterator) for _ in range(num_microbatches)], forward_step, comm, forward_only, no_sync
    )
    start = time.perf_counter()
    wait0 = comm.wait_s if comm else 0.0
    {"no_pipelining": runner.no_pipelining, "1f1b": runner.one_f_one_b, "interleaved": runner.interleaved}[
        schedule
    ]()
    if comm is not None:
        p2p.wait_sends(comm)
    runner.result.stats.total_s = time.perf_counter() - start
    runner.result.stats.wait_s = (comm.wait_s - wait0) if comm else 0.0
    return runner.result


def release_output(y: torch.Tensor | None) -> None:
    """Free a sent output's storage, keeping its autograd node (Megatron's
    ``deallocate_output_tensor``): backward never reads ``y``'s values. A posted send and a node
    that saved its output keep their own references; views are left alone (their base's storage)."""
    if y is not None and y.requires_grad and y._base is None and y.numel() > 1:
        y.data = torch.empty((1,), device=y.device, dtype=y.dtype)


def backward_from(y: torch.Tensor, dy: torch.Tensor) -> None:
    """``torch.autograd.backward(y, dy)`` for a released ``y`` (the public call checks shapes): the
    engine's private entry point, as Megatron's ``custom_backward``."""
    torch.autograd.Variable._execution_engine.run_backward(  # noqa: SLF001
        tensors=(y,), grad_tensors=(dy,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


class _Runner:
    """State of one schedule run: micro-batches, kept activations, timings."""

    def __init__(
        self,
        chunks: list[nn.Module],
        batches: list[Any],
        forward: ForwardStep,
        comm: P2PComm | None,
        forward_only: bool,
        no_sync: NoSync | Sequence[NoSync] | None = None,
    ) -> None:
        self.chunks, self.batches, self.forward = chunks, batches, forward
        self.comm, self.forward_only = comm, forward_only
        self.no_sync = [no_sync] * len(chunks) if callable(no_sync) else no_sync
        self.num_microbatches = len(batches)
        self.backwards_done = [0] * len(chunks)  # per chunk: its backwards run in micro-batch order
        self.result = PipelineResult()

    def pipe(self) -> P2PComm:
        """The P2PComm of a pipelined schedule (the caller refused one without it)."""
        if self.comm is None:
            raise TokenloomError("a pipelined schedule needs a P2PComm (comm=...)")
        return self.comm

    def sync_context(self, chunk: int, microbatch: int) -> AbstractContextManager:
        """``chunk``'s ``no_sync`` context, except for its last micro-batch (gradients reduce there)."""
        if self.no_sync is None or microbatch == self.num_microbatches - 1:
            return nullcontext()
        return self.no_sync[chunk]()

    # ------------------------------------------------------------------ steps

    def forward_step(self, chunk: int, microbatch: int, x: torch.Tensor | None, last: bool) -> torch.Tensor:
        """Stage forward; on the last stage the loss divided by M (Megatron's scaling)."""
        start = time.perf_counter()
        batch = self.batches[microbatch]
        with torch.set_grad_enabled(not self.forward_only), self.sync_context(chunk, microbatch):
            y = self.forward(self.chunks[chunk], x, batch, last)
            if last:
                self.result.losses.append(y.detach())
                y = y / self.num_microbatches
        self.result.stats.compute_s += time.perf_counter() - start
        return y

    def backward_step(
        self, x: torch.Tensor | None, y: torch.Tensor, dy: torch.Tensor | None, chunk: int = 0
    ) -> torch.Tensor | None:
        """Backprop ``dy`` (None: ``y`` is the loss) through ``chunk``; the input's grad."""
        start = time.perf_counter()
        if x is not None:
            x.retain_grad()
        if dy is not None and dy.dtype != y.dtype:  # received in the pipeline dtype
            dy = dy.to(y.dtype)
        microbatch = self.backwards_done[chunk]
        self.backwards_done[chunk] += 1
        with self.sync_context(chunk, microbatch):
            if dy is not None and y.shape != dy.shape:  # released after it was sent
                backward_from(y, dy)
            else:
                torch.autograd.backward(y, grad_tensors=dy)
        self.result.stats.compute_s += time.perf_counter() - start
        return None if x is None else x.grad

    # ------------------------------------------------------------------ schedules

    def no_pipelining(self) -> None:
        for k in range(self.num_microbatches):
            y = self.forward_step(0, k, None, last=True)
            if not self.forward_only:
                self.backward_step(None, y, None)

    def one_f_one_b(self) -> None:
        comm = self.pipe()
        M, last = self.num_microbatches, comm.is_last
        warmup = min(comm.pp_size - comm.pp_rank - 1, M)
        if self.forward_only:
            warmup = M
        remaining = M - warmup
        kept: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        for k in range(warmup):
            x = p2p.recv_forward(comm)
            y = self.forward_step(0, k, x, last)
            p2p.send_forward(y, comm)
            if not self.forward_only:
                if not last:
                    release_output(y)
                kept.append((x, y))
        x = p2p.recv_forward(comm) if remaining > 0 else None
        for i in range(remaining):
            y = self.forward_step(0, warmup + i, x, last)
            kept.append((x, y))
            dy = p2p.send_forward_recv_backward(y, comm)
            if not last:
                release_output(y)
            x0, y0 = kept.pop(0)
            dx = self.backward_step(x0, y0, dy)
            if i == remaining - 1:
                p2p.send_backward(dx, comm)
            else:
                x = p2p.send_backward_recv_forward(dx, comm)
        for _ in range(len(kept)):  # cooldown
            dy = p2p.recv_backward(comm)
            x0, y0 = kept.pop(0)
            p2p.send_backward(self.backward_step(x0, y0, dy), comm)

    def interleaved(self) -> None:
        """Megatron's interleaved 1F1B (group size ``p``, ``overlap_p2p_comm``): sends and the next
        receives are posted right after each compute and waited for only when needed, so transfers
        run under the next compute."""
        comm = self.pipe()
        v, p = len(self.chunks), comm.pp_size
        total = self.num_microbatches * v
        all_warmup = False
        if self.forward_only:
            warmup = total
        elif self.num_microbatches == p:
            warmup, all_warmup = total, True
        else:
            warmup = min((p - comm.pp_rank - 1) * 2 + (v - 1) * p, total)
        remaining = total - warmup

        def chunk_of(k: int, forward: bool) -> int:
            c = (k % (p * v)) // p
            return c if forward else v - c - 1

        def microbatch_of(k: int) -> int:
            return (k // (p * v)) * p + k % p

        def first_virtual(c: int) -> bool:
            return comm.is_first and c == 0

        def last_virtual(c: int) -> bool:
            return comm.is_last and c == v - 1

        # per chunk, in arrival order: inputs and output grads (posted receives until waited), outputs
        inputs: list[list[torch.Tensor | p2p.Incoming | None]] = [[] for _ in range(v)]
        outputs: list[list[torch.Tensor]] = [[] for _ in range(v)]
        output_grads: list[list[torch.Tensor | p2p.Incoming | None]] = [[] for _ in range(v)]

        def forward_k(k: int) -> torch.Tensor:
            c = chunk_of(k, forward=True)
            if first_virtual(c) and len(inputs[c]) == len(outputs[c]):
                inputs[c].append(None)
            inputs[c][-1] = x = _arrived(inputs[c][-1])
            y = self.forward_step(c, microbatch_of(k), x, last_virtual(c))
            outputs[c].append(y)
            if self.forward_only:
                inputs[c].pop()
                outputs[c].pop()
            return y

        def backward_k(k: int) -> torch.Tensor | None:
            c = chunk_of(k, forward=False)
            if last_virtual(c) and not output_grads[c]:
                output_grads[c].append(None)
            dy = _arrived(output_grads[c].pop(0))
            dx = self.backward_step(_arrived(inputs[c].pop(0)), outputs[c].pop(0), dy, c)  # forward_k waited
            return None if first_virtual(c) else dx

        def post_forward(k: int, y: torch.Tensor, recv_prev: bool, next_c: int) -> None:
            """Send forward ``k``'s output on; post the receive of chunk ``next_c``'s next input."""
            send = None if last_virtual(chunk_of(k, forward=True)) else y
            x, _ = p2p.post(comm, send_next=send, recv_prev=recv_prev)
            if not self.forward_only:
                release_output(send)
            if recv_prev:
                inputs[next_c].append(x)

        def post_backward(dx: torch.Tensor | None, recv_next: bool, next_c: int) -> None:
            """Send a backward's input grad back; post the receive of ``next_c``'s next output grad."""
            _, dy = p2p.post(comm, send_prev=dx, recv_next=recv_next)
            if recv_next:
                output_grads[next_c].append(dy)

        inputs[0].append(None if comm.is_first else p2p.post(comm, recv_prev=True)[0])
        for k in range(warmup):
            y = forward_k(k)
            next_c = chunk_of(k + 1, forward=True)
            post_forward(k, y, not (comm.is_first and next_c == 0) and k != total - 1, next_c)
            if k == warmup - 1 and not self.forward_only and not all_warmup:
                # the first steady backward's output grad (Megatron posts it with the last warmup send)
                post_backward(None, not comm.is_last, v - 1)

        for i in range(remaining):  # steady state: one forward and one backward
            fk, bk = warmup + i, i
            y = forward_k(fk)
            recv_prev = i != remaining - 1
            if comm.is_first:  # the last rank runs p - 1 forwards behind
                next_fc = chunk_of(fk - (p - 1), forward=True)
                recv_prev = recv_prev and next_fc != v - 1
                next_fc += 1
            else:
                next_fc = chunk_of(fk + 1, forward=True)
            post_forward(fk, y, recv_prev, next_fc)
            dx = backward_k(bk)
            recv_next = True
            if comm.is_last:  # the first rank runs p - 1 backwards behind
                next_bc = chunk_of(bk - (p - 1), forward=False)
                recv_next = next_bc != 0
                next_bc -= 1
            else:
                next_bc = chunk_of(bk + 1, forward=False)
            post_backward(dx, recv_next, next_bc)

        if self.forward_only:
            return
        if all_warmup:
            post_backward(None, not comm.is_last, v - 1)
        for k in range(remaining, total):  # cooldown
            dx = backward_k(k)
            next_bc = chunk_of(k + 1, forward=False)
            post_backward(dx, not (comm.is_last and next_bc == v - 1) and k != total - 1, next_bc)


def _arrived(t: torch.Tensor | p2p.Incoming | None) -> torch.Tensor | None:
    """``t``, or once it has arrived the tensor a posted receive fills."""
    return t.wait() if isinstance(t, p2p.Incoming) else t


# ---------------------------------------------------------------------- gradient finalisation


def is_tied_embedding(param: nn.Parameter) -> bool:
    """A copy of the tied embedding (tag ``shared_embedding``) under pipeline parallelism."""
    return bool(getattr(param, "shared_embedding", False))


def allreduce_tied_embedding_grads(
    stages: nn.Module | Sequence[nn.Module], embedding_group: dist.ProcessGroup | None
) -> None:
    """Sum ``shared_embedding`` grads over the first and last stage (Megatron's
    ``_allreduce_word_embedding_grads``), after the schedule and before the optimizer step (and its
    DP reduction, as ZeRO-1's). No-op when ``embedding_group`` is None (pp = 1)."""
    if embedding_group is None:
        return
    modules = list(stages) if isinstance(stages, (Sequence, nn.ModuleList)) else [stages]
    for module in modules:
        for param in module.parameters():
            if is_tied_embedding(param):
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=embedding_group)
