"""Bucketed DistributedDataParallel, built on PyTorch's reducer design.

One synced iteration: ``forward()`` rebuilds the buckets once (after iteration 0), broadcasts
buffers from rank 0 and runs the module (with ``find_unused_parameters``, then walks the graph for
parameters it cannot reach). In backward, the fused linears (:mod:`tokenloom.train.parallel.wgrad`)
write their weight grads into their bucket views; a post-accumulate-grad hook per parameter makes
``param.grad`` its bucket view, divided by the world size, and marks it ready; complete buckets
launch as async all_reduce(SUM), strictly in bucket order. A callback queued on the autograd engine
waits for every bucket, so ``loss.backward()`` returns with averaged grads.

Invariants and trade-offs:

* **Buckets**: :func:`compute_bucket_assignment_by_size` is a Python twin of torch's (tests check
  equality). Unlike torch we bucket from iteration 0: launches go by bucket index, identical on
  every rank. ``rebuild_buckets`` (only without ``find_unused_parameters``) recomputes the layout
  once from the first synced backward's grad-ready order, broadcast from rank 0. ``grad_units``
  (compiled blocks) never end inside a bucket, at the cost of buckets up to one block over the cap.
* **Grads are bucket views** (torch's ``gradient_as_bucket_view=True``): no second copy; averaging
  happens per grad in its hook. Under ``no_sync()`` grads accumulate in their views too, at the
  price of dividing the accumulated view once per step. Do not ``detach_()`` or replace
  ``param.grad`` with a tensor you still need.
* **Weight-gradient fusion** (``wgrad_fusion``, Megatron's ``gradient_accumulation_fusion``): the
  block matmuls' weight-gradient GEMM writes into the bucket view (:func:`wgrad_into_view`), with
  no grad-sized allocation; it changes the rebuilt layout, and ``wgrad_fusion=False`` gives torch's.
* **Completion in backward** (torch's ``queue_callback``): the loop cannot forget to wait; the cost
  is exactly one backward per synced forward. ``finish_in_backward=False`` (the tp/pp layouts)
  waits in :meth:`finish_grad_sync` after the schedule instead (Megatron's), keeping a stage's
  reduction tail off the pipeline's critical path; a forward before it raises.
* **no_sync()**: a backward inside it never syncs, even after a synced forward (torch decides at
  forward time), because a pipeline schedule runs the last forward before earlier backwards.
* **Unused parameters**: ``find_unused_parameters=True`` costs a graph walk and one small
  all-reduce per iteration; a parameter used on some ranks gets the average with zeros (as torch).
  With False, a parameter without a grad raises :class:`TokenloomError` naming it.
* A dead or silent peer surfaces as :class:`TokenloomError` from ``backward()`` (a silent one
  after the timeout given to :func:`tokenloom.train.dist.init_from_env`).
* **Dtype**: one flat buffer per dtype, in the parameters' dtype (fp32 under bf16 autocast:
  Megatron's ``grad_reduce_in_fp32``). Sparse gradients are refused.

``bench/ddp_bench.py`` measures step time against torch DDP, eager and compiled, with ``no_sync``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from tokenloom.errors import TokenloomError
from tokenloom.train.parallel.wgrad import gemm_into, set_wgrad_sink, wgrad_sink

FIRST_BUCKET_BYTES = 1024 * 1024
"""Cap of the small first bucket when ``bucket_cap_mb`` is left at its default (torch's value)."""
DEFAULT_BUCKET_CAP_MB = 25.0
"""Default bucket cap in MiB (torch's value)."""
_BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def compute_bucket_assignment_by_size(
    tensors: Sequence[torch.Tensor],
    bucket_size_limits: Sequence[int],
    expect_sparse_gradient: Sequence[bool] = (),
    tensor_indices: Sequence[int] = (),
    units: Sequence[int] = (),
) -> tuple[list[list[int]], list[int]]:
    """Group tensors into buckets by byte size; same result as torch's
    ``dist._compute_bucket_assignment_by_size`` for the same arguments.

    Tensors are taken in the given order and accumulated per ``(dtype, device)``; each
    key walks ``bucket_size_limits`` on its own (the last limit repeats). A bucket closes
    as soon as its bytes reach the current limit (``>=``: the tensor that crosses the
    limit stays in). ``tensor_indices`` (rebuild path: tensors in grad-ready order) gives
    the index reported for each tensor; without it the index is the position and the
    buckets are sorted by their smallest index. Sparse-gradient tensors get a bucket of
    their own with limit 0. Returns ``(bucket_indices, per_bucket_limits)``.

    Worked example (fp32 sizes 0.38, 0.76, 11.4, 19.1, 0.004 MiB, limits [1 MiB, 25 MiB])
    -> buckets [[0, 1], [2, 3], [4]], limits [1048576, 26214400, 26214400].

    ``units`` (ours, not torch's; one entry per tensor, in the given order): tensors with
    the same unit id >= 0 get their grads at one moment, from one autograd node (a module
    compiled in place: :func:`grad_unit_ids`), so a bucket that crossed its limit stays
    open until the unit's last tensor of its key is in. A bucket that ended inside a unit
    would wait for the rest of it anyway, and hold back every bucket after it in launch
    order; -1 is a tensor on its own. Empty (torch's behaviour): no units.

    Only difference from torch: on the rebuild path with several dtypes, leftover
    (not full) buckets come out in first-seen order; torch's order there comes from an
    ``unordered_map`` and is unspecified.
    """
    if not bucket_size_limits:
        raise ValueError("bucket_size_limits must not be empty")
    if tensor_indices and len(tensor_indices) != len(tensors):
        raise ValueError("tensor_indices must have one entry per tensor")
    if units and len(units) != len(tensors):
        raise ValueError("units must have one entry per tensor")
    # unit of the next tensor with the same key (-1: none, or no unit), for the closing rule
    next_unit = [-1] * len(tensors)
    if units:
        last_unit: dict[tuple[torch.dtype, torch.device], int] = {}
        for i in reversed(range(len(tensors))):
            key = (tensors[i].dtype, tensors[i].device)
            next_unit[i] = last_unit.get(key, -1)
            last_unit[key] = units[i]
    result: list[tuple[list[int], int]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], list] = {}  # key -> [indices, bytes, limit]
    limit_pos: dict[tuple[torch.dtype, torch.device], int] = {}
    for i, t in enumerate(tensors):
        if t.is_sparse:
            raise ValueError("No support for sparse tensors.")
        idx = tensor_indices[i] if tensor_indices else i
        if expect_sparse_gradient and expect_sparse_gradient[idx]:
            result.append(([idx], 0))
            continue
        key = (t.dtype, t.device)
        bucket = open_buckets.setdefault(key, [[], 0, 0])
        pos = limit_pos.setdefault(key, 0)
        bucket[0].append(idx)
        bucket[1] += t.numel() * t.element_size()
        bucket[2] = bucket_size_limits[pos]
        if bucket[1] >= bucket[2] and not (units and units[i] >= 0 and next_unit[i] == units[i]):
            result.append((bucket[0], bucket[2]))
            open_buckets[key] = [[], 0, 0]
            limit_pos[key] = min(pos + 1, len(bucket_size_limits) - 1)
    result.extend((b[0], b[2]) for b in open_buckets.values() if b[0])
    if not tensor_indices:
        result.sort(key=lambda r: min(r[0]))
    return [r[0] for r in result], [r[1] for r in result]


@dataclass
class _Bucket:
    """One flat gradient buffer and the parameters (by index) whose grads live in it."""

    indices: list[int]
    buffer: torch.Tensor
    pending: int = 0
    work: Any = None


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper: averages gradients across ``process_group`` during backward.

    Args:
        module: the model; its parameters must already be on this rank's device.
        process_group: group to average over (default: the global group).
        bucket_cap_mb: bucket size cap in MiB. ``None`` means 25 MiB with a small first
            bucket of 1 MiB; an explicit value also caps the first bucket unless
            ``first_bucket_cap_mb`` is given (torch's rule).
        first_bucket_cap_mb: cap of the first bucket in MiB (see above).
        find_unused_parameters: tolerate parameters that get no grad in an iteration
            (graph walk per forward + one extra tiny all-reduce per iteration).
        rebuild_buckets: re-bucket once from the observed grad-ready order (ignored
            with ``find_unused_parameters``).
        broadcast_buffers: broadcast rank 0's buffers before every synced forward.
        params_and_buffers_to_ignore: fully qualified names to leave alone (not
            synced at init, not reduced); merged with the module attribute
            ``_ddp_params_and_buffers_to_ignore`` when present (torch's convention).
        init_sync: verify parameter shapes across ranks and broadcast rank 0's
            parameters and buffers at construction (rank 0 of ``process_group``).
        finish_in_backward: wait for the buckets from a callback at the end of the synced
            backward (torch's way); False: the caller calls :meth:`finish_grad_sync`
            after it (Megatron's way, for pipeline schedules).
        grad_units: submodules whose backward is one autograd node (compiled in place, as
            ``GPT.compile_blocks`` does each block): their parameters' grads all arrive when
            it ends, so no bucket ends inside one (:func:`grad_unit_ids`).
        wgrad_fusion: let the model's fused linears (:func:`tokenloom.train.parallel.wgrad.linear`)
            write their weight gradients straight into the buckets, scaled in the GEMM
            (Megatron's gradient accumulation fusion); False: every grad comes from autograd
            and is copied in, as in torch DDP (whose grad-ready order, and so rebuilt
            layout, ours then equals on the same model).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        first_bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        rebuild_buckets: bool = True,
        broadcast_buffers: bool = True,
        params_and_buffers_to_ignore: Iterable[str] = (),
        init_sync: bool = True,
        finish_in_backward: bool = True,
        grad_units: Iterable[nn.Module] = (),
        wgrad_fusion: bool = True,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise TokenloomError("DistributedDataParallel needs an initialised process group (init_from_env)")
        self.module = module
        # WORLD is typed optional: it is None only before init_process_group
        self.process_group = process_group or cast(dist.ProcessGroup, dist.group.WORLD)
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._src = dist.get_global_rank(self.process_group, 0)
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.finish_in_backward = finish_in_backward
        cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
        if first_bucket_cap_mb is not None:
            first = int(first_bucket_cap_mb * 1024 * 1024)
        else:
            first = FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
        self.bucket_size_limits = [first, cap]

        ignore = set(params_and_buffers_to_ignore) | set(
            getattr(module, "_ddp_params_and_buffers_to_ignore", ())
        )
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignore]
        self.param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buffers_to_sync = [b for n, b in module.named_buffers() if n not in ignore]
        self._check_no_sparse(module)

        if init_sync:
            self._verify_params_across_ranks()
            _broadcast_coalesced(self._params + self._buffers_to_sync, self._src, self.process_group)

        self._units = grad_unit_ids(self._params, grad_units)
        buckets, _ = compute_bucket_assignment_by_size(self._params, self.bucket_size_limits, units=self._units)
        self._build_buckets(list(reversed(buckets)))
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)
        ]
        self._sinks = {i: self._make_sink(i) for i in range(len(self._params))} if wgrad_fusion else {}
        for i, sink in self._sinks.items():
            set_wgrad_sink(self._params[i], sink)
        self._in_view = [False] * len(self._params)  # a sink wrote this grad, scaled: the hook only marks it

        self._sync_enabled = True  # flipped by no_sync()
        self._expect_hooks = False  # a synced forward ran and its backward is awaited
        self._backward_started = False
        self._next_bucket = 0
        self._marked = [False] * len(self._params)
        # which parameters got a grad on this rank since the last synced backward (a host list: a
        # device tensor written from every hook would launch a kernel per parameter per backward)
        self._locally_used = [0] * len(self._params)
        self._unused: list[int] = []
        self._grad_was_none: set[int] = set()
        self._rebuild_enabled = rebuild_buckets and not find_unused_parameters
        self._ready_order: list[int] | None = [] if self._rebuild_enabled else None
        self._rebuild_pending = False

    # ------------------------------------------------------------------ public API

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._backward_started and not self.finish_in_backward:
            raise TokenloomError("DistributedDataParallel(finish_in_backward=False): call finish_grad_sync() after "
                                 "the synced backward, before the next forward")
        if self._rebuild_pending:
            self._rebuild()
        sync = self._sync_enabled and torch.is_grad_enabled()
        if sync and self.broadcast_buffers and self._buffers_to_sync:
            with torch.no_grad():
                _broadcast_coalesced(self._buffers_to_sync, self._src, self.process_group)
        out = self.module(*args, **kwargs)
        self._expect_hooks = sync
        if sync:
            self._prepare_for_backward(out)
        return out

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads locally; the forward must run inside the context."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """With ``finish_in_backward=False``: wait for the buckets the last synced backward
        launched (grads are averaged when it returns), and check that every parameter got
        its grad. A no-op when no synced backward ran since the last call, and with
        ``finish_in_backward=True`` (backward waited already)."""
        if self._backward_started and not self.finish_in_backward:
            self._backward_started = False
            self._finish_backward()

    def remove_hooks(self) -> None:
        """Detach our gradient hooks from the module's parameters (before re-wrapping it)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for i, sink in self._sinks.items():
            if wgrad_sink(self._params[i]) is sink:
                set_wgrad_sink(self._params[i], None)
        self._sinks = {}

    @property
    def bucket_indices(self) -> list[list[int]]:
        """Current buckets in launch order, as indices into :attr:`param_names`."""
        return [list(b.indices) for b in self._buckets]

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        """Byte size of each bucket's flat buffer, in launch order."""
        return [b.buffer.numel() * b.buffer.element_size() for b in self._buckets]

    # ------------------------------------------------------------------ construction

    def _check_no_sparse(self, module: nn.Module) -> None:
        tracked = {id(p) for p in self._params}
        for name, m in module.named_modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and id(m.weight) in tracked:
                raise TokenloomError(
                    f"module {name!r} produces sparse gradients (sparse=True), which our DDP does not "
                    "support; build it with sparse=False or list its weight in params_and_buffers_to_ignore"
                )

    def _verify_params_across_ranks(self) -> None:
        """Every rank gathers every rank's (name, shape, stride, dtype) list and compares
        it with rank 0's, so all ranks raise the same error (none is left waiting)."""
        mine = [
            (n, tuple(p.shape), tuple(p.stride()), str(p.dtype))
            for n, p in zip(self.param_names, self._params, strict=True)
        ]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.process_group)
        ref = gathered[0]
        for rank, meta in enumerate(gathered[1:], start=1):
            # Per-parameter differences first (they name a parameter), then the count.
            for (n0, s0, st0, d0), (n1, s1, st1, d1) in zip(ref, meta, strict=False):
                if (s0, st0, d0) != (s1, st1, d1):
                    name = n0 if n0 == n1 else f"{n0}' (named '{n1}' on rank {rank})"
                    raise TokenloomError(
                        f"DDP parameter mismatch: parameter '{name}' has shape {s0} stride {st0} {d0} on "
                        f"rank 0 but shape {s1} stride {st1} {d1} on rank {rank}; all ranks must build the "
                        "same model"
                    )
            if len(meta) != len(ref):
                extra = [m[0] for m in (meta[len(ref) :] or ref[len(meta) :])]
                raise TokenloomError(
                    f"DDP parameter mismatch: rank 0 has {len(ref)} parameters, rank {rank} has {len(meta)} "
                    f"(first unmatched: {extra[:5]})"
                )

    def _build_buckets(self, assignment: list[list[int]]) -> None:
        """Allocate one flat buffer per bucket and point every ``param.grad`` into it."""
        self._buckets: list[_Bucket] = []
        self._bucket_of = [0] * len(self._params)
        self._views: list[torch.Tensor] = [None] * len(self._params)  # type: ignore[list-item]  # every slot set below
        for b, indices in enumerate(assignment):
            ref = self._params[indices[0]]
            numel = sum(self._params[i].numel() for i in indices)
            bucket = _Bucket(indices, torch.zeros(numel, dtype=ref.dtype, device=ref.device))
            offset = 0
            for i in indices:
                p = self._params[i]
                view = bucket.buffer[offset : offset + p.numel()].view(p.shape)
                if p.grad is not None:
                    view.copy_(p.grad)
                    p.grad = view
                self._views[i] = view
                self._bucket_of[i] = b
                offset += p.numel()
            self._buckets.append(bucket)

    def _rebuild(self) -> None:
        """Re-bucket from the first synced backward's ready order (rank 0's wins)."""
        self._rebuild_pending = False
        order = list(self._ready_order or [])
        seen = set(order)
        order += [i for i in reversed(range(len(self._params))) if i not in seen]
        tensors = [self._params[i] for i in order]
        assignment, _ = compute_bucket_assignment_by_size(tensors, self.bucket_size_limits, (), order,
                                                          [self._units[i] for i in order])
        box = [assignment]
        dist.broadcast_object_list(box, src=self._src, group=self.process_group)
        self._build_buckets(box[0])
        self._ready_order = None

    # ------------------------------------------------------------------ backward machinery

    def _prepare_for_backward(self, out: Any) -> None:
        self._backward_started = False
        self._next_bucket = 0
        self._marked = [False] * len(self._params)
        self._grad_was_none = set()
        for b in self._buckets:
            b.pending, b.work = len(b.indices), None
        self._unused = []
        if self.find_unused_parameters:
            reached = _reachable_leaves(out)
            self._unused = [i for i, p in enumerate(self._params) if id(p) not in reached]

    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad_accumulated(i, param)

        return hook

    def _make_sink(self, i: int):
        def sink(grad_out: torch.Tensor, inp: torch.Tensor) -> bool:
            return self._take_wgrad(i, grad_out, inp)

        return sink

    def _take_wgrad(self, i: int, grad_out: torch.Tensor, inp: torch.Tensor) -> bool:
        """Parameter ``i``'s weight-gradient sink (:mod:`tokenloom.train.parallel.wgrad`): the GEMM
        writes into its bucket view (:func:`wgrad_into_view`), averaged when this backward
        syncs, and the hook that follows only marks it ready."""
        synced = self._expect_hooks and self._sync_enabled
        taken = wgrad_into_view(self._params[i], self._views[i], self.world_size if synced else 1, grad_out, inp)
        self._in_view[i] = taken
        return taken

    def _on_grad_accumulated(self, i: int, p: torch.Tensor) -> None:
        synced = self._expect_hooks and self._sync_enabled
        if self._in_view[i]:
            self._in_view[i] = False
        else:
            self._into_bucket(i, p, average=synced)
        self._locally_used[i] = 1
        if not synced:
            return  # no_sync (or backward without a synced forward): accumulate only
        if not self._backward_started:
            self._backward_started = True
            if self.finish_in_backward:
                Variable._execution_engine.queue_callback(self._finish_backward)
            for j in self._unused:
                self._mark_unused_ready(j)
        if self._ready_order is not None:
            self._ready_order.append(i)
        self._mark_ready(i)

    def _into_bucket(self, i: int, p: torch.Tensor, *, average: bool) -> None:
        """Make ``p.grad`` its bucket view, averaged over the world when ``average`` (the
        synced backward, just before its bucket may launch): :func:`grad_into_view`."""
        grad_into_view(p, self._views[i], self.world_size if average else 1)

    def _mark_unused_ready(self, i: int) -> None:
        p = self._params[i]
        if p.grad is None:
            self._views[i].zero_()
            self._grad_was_none.add(i)
        else:  # grads from earlier no_sync backwards: reduce them, averaged
            self._into_bucket(i, p, average=True)
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        if self._marked[i]:
            raise TokenloomError(
                f"parameter '{self.param_names[i]}' got its gradient twice in one backward (reentrant "
                "backward, or used by an output that find_unused_parameters did not see); this is not supported"
            )
        self._marked[i] = True
        self._buckets[self._bucket_of[i]].pending -= 1
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            bucket = self._buckets[self._next_bucket]
            bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
            self._next_bucket += 1

    def _finish_backward(self) -> None:
        """Queued on the autograd engine (runs once, after the whole backward pass), or
        called by :meth:`finish_grad_sync`."""
        self._expect_hooks = False
        if self._next_bucket < len(self._buckets):
            missing = [self.param_names[i] for i in range(len(self._params)) if not self._marked[i]]
            raise TokenloomError(
                f"{len(missing)} parameter(s) received no gradient in this backward: {missing[:20]}; pass "
                "find_unused_parameters=True to DistributedDataParallel, or make every parameter take part "
                "in the loss"
            )
        for k, bucket in enumerate(self._buckets):
            try:
                bucket.work.wait()
            except Exception as e:  # gloo/NCCL raise RuntimeError subclasses
                raise TokenloomError(
                    f"rank {self.rank}: gradient all-reduce of bucket {k} failed ({type(e).__name__}: {e}); "
                    "another rank has probably died or stalled past the collective timeout"
                ) from e
        if self.find_unused_parameters:
            # on the buckets' device: NCCL needs a GPU tensor
            used = torch.tensor(self._locally_used, dtype=torch.int32, device=self._buckets[0].buffer.device)
            dist.all_reduce(used, group=self.process_group)
            used = used.cpu()
            for i in self._grad_was_none:
                if used[i] > 0:
                    self._params[i].grad = self._views[i]
        self._locally_used = [0] * len(self._params)
        if self._ready_order is not None:
            self._rebuild_pending = True


def grad_unit_ids(params: Sequence[torch.Tensor], units: Iterable[nn.Module]) -> list[int]:
    """Per parameter of ``params``: the position in ``units`` of the first module holding it,
    -1 for parameters in none, the ``units`` argument of
    :func:`compute_bucket_assignment_by_size`. Pass the modules compiled in place: a compiled
    module's backward is one autograd node, so its parameters' grads all arrive when it ends,
    while eager layers hand each grad over as its own op finishes. The caller names them
    (``compile: true`` compiles each transformer block) rather than this reading torch's
    private marker of a compiled module."""
    unit_of: dict[int, int] = {}
    for u, module in enumerate(units):
        for p in module.parameters():
            unit_of.setdefault(id(p), u)
    return [unit_of.get(id(p), -1) for p in params]


def grad_into_view(param: torch.Tensor, view: torch.Tensor, divisor: int) -> None:
    """Make ``param.grad`` ``view`` (its slice of a flat gradient buffer), divided by
    ``divisor`` on the way, as torch's reducer does without a comm hook: a fresh grad (after
    ``zero_grad(set_to_none=True)``) is multiplied by ``1/divisor`` while it is copied in, one
    pass; a grad already accumulated in the view is divided in place while it is still in
    cache; no grad at all (a custom autograd.Function returned None) zeroes the view. So no
    pass over a whole bucket precedes its collective. ``divisor`` 1: no scaling. Our DDP and
    ZeRO-1 (``optim/zero.py``) both fill their buffers through it."""
    grad = param.grad
    if grad is None:
        view.zero_()
    elif grad is view or _same_tensor(grad, view):
        if divisor > 1:
            view.div_(divisor)
        return
    elif divisor > 1:
        torch.mul(grad, 1.0 / divisor, out=view)
    else:
        view.copy_(grad)
    param.grad = view


def wgrad_into_view(param: torch.Tensor, view: torch.Tensor, divisor: int, grad_out: torch.Tensor,
                    inp: torch.Tensor) -> bool:
    """:func:`grad_into_view` for a weight gradient not yet computed: the GEMM
    ``grad_out^T @ inp`` writes into ``view`` itself, the ``1/divisor`` in its ``alpha`` and
    ``beta``: ``view = g^T x / d`` for a fresh grad (``beta=0``: the stale view is not read),
    ``view = (view + g^T x) / d`` for one accumulated there; then ``param.grad`` is ``view``.
    Saves grad_into_view's pass over the grad and autograd's grad-sized allocation; bf16
    operands (autocast) write the fp32 view directly (:func:`~tokenloom.train.parallel.wgrad.gemm_into`). Returns
    False, writing nothing, when ``param.grad`` is some other tensor. The sink of
    :mod:`tokenloom.train.parallel.wgrad`, for our DDP and ZeRO-1 alike."""
    grad, s = param.grad, 1.0 / divisor
    if grad is None:
        gemm_into(view, grad_out.t(), inp, beta=0, alpha=s)
    elif grad is view or _same_tensor(grad, view):
        gemm_into(view, grad_out.t(), inp, beta=s, alpha=s)
    else:
        return False
    param.grad = view
    return True


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return (
        a is not None
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _output_tensors(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _output_tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _output_tensors(o)


def _reachable_leaves(out: Any) -> set[int]:
    """ids of the leaf tensors (parameters) reachable from ``out`` in the autograd graph."""
    found: set[int] = set()
    stack = []
    for t in _output_tensors(out):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            found.add(id(t))
    seen: set[Any] = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            found.add(id(variable))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return found


@torch.no_grad()
def _broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup) -> None:
    """Broadcast ``tensors`` from global rank ``src`` in flat chunks of up to 250 MiB,
    one chunk per run of tensors with the same dtype and device."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for same in groups.values():
        for chunk in _chunks_by_bytes(same, _BROADCAST_CHUNK_BYTES):
            flat = torch.cat([t.detach().reshape(-1) for t in chunk])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in chunk:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _chunks_by_bytes(tensors: list[torch.Tensor], cap: int) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    nbytes = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if chunk and nbytes + size > cap:
            yield chunk
            chunk, nbytes = [], 0
        chunk.append(t)
        nbytes += size
    if chunk:
        yield chunk


__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "FIRST_BUCKET_BYTES",
    "DistributedDataParallel",
    "compute_bucket_assignment_by_size",
    "grad_unit_ids",
]
