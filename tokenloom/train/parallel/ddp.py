"""Bucketed DistributedDataParallel, built on PyTorch's reducer design.

In a synced backward a post-accumulate-grad hook per parameter makes ``param.grad`` its bucket
view (torch's ``gradient_as_bucket_view``), divided by the world size, and marks it ready; full
buckets launch async all_reduce(SUM) strictly in bucket order; a callback queued on the autograd
engine waits for them, so ``loss.backward()`` returns averaged grads. Do not ``detach_()`` or
replace ``param.grad``.

* **Buckets**: :func:`compute_bucket_assignment_by_size` is a Python twin of torch's. Bucketing
  from iteration 0 keeps launch order equal on all ranks; ``rebuild_buckets`` re-buckets once
  from rank 0's grad-ready order; ``grad_units`` never end inside a bucket.
* **Weight-gradient fusion** (``wgrad_fusion``, Megatron's ``gradient_accumulation_fusion``): the
  block matmuls' wgrad GEMM writes the view itself (:func:`wgrad_into_view`).
* **Completion** in backward (the loop cannot forget to wait), or with ``finish_in_backward=False``
  in :meth:`finish_grad_sync` after a pipeline schedule (Megatron's). ``no_sync()`` is decided at
  backward time (torch: forward time), as a schedule runs the last forward before earlier backwards.
* **Unused parameters**: ``find_unused_parameters`` costs a graph walk and a small all-reduce per
  iteration; without it a missing grad raises naming the parameter. A dead or silent peer raises
  :class:`TokenloomError` from backward.
* **Dtype**: one buffer per dtype, in the parameters' (fp32 under bf16 autocast: Megatron's
  ``grad_reduce_in_fp32``). Sparse gradients are refused. ``bench/ddp_bench.py`` compares torch's.
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
    """Buckets by byte size -> ``(bucket_indices, per_bucket_limits)``, as torch's
    ``dist._compute_bucket_assignment_by_size`` (per ``(dtype, device)``, each key walking the
    limits; a bucket closes once its bytes reach one; ``tensor_indices`` on the rebuild path).
    ``units`` (ours): tensors sharing a unit id >= 0 get grads from one autograd node, so a bucket
    stays open to the unit's last tensor (one ending inside would hold back later buckets). Unlike
    torch's, rebuilt leftover buckets of several dtypes come in first-seen order."""
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

    Args as torch's where named alike. ``bucket_cap_mb`` None: 25 MiB with a 1 MiB first bucket
    (an explicit value caps the first too unless ``first_bucket_cap_mb``). ``rebuild_buckets`` is
    ignored with ``find_unused_parameters``. ``params_and_buffers_to_ignore`` merges the module's
    ``_ddp_params_and_buffers_to_ignore``. ``init_sync``: check shapes across ranks and broadcast
    rank 0's state. ``finish_in_backward``: see the module docstring. ``grad_units``: submodules
    compiled in place (one backward node each). ``wgrad_fusion``: fused linears write their weight
    grads into the buckets; False copies every grad in, as torch DDP (same rebuilt layout then).
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
        """With ``finish_in_backward=False``: wait for the last synced backward's buckets and check
        every parameter got a grad; a no-op otherwise or when none ran since."""
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
        """Compare every rank's (name, shape, stride, dtype) with rank 0's, so all raise alike."""
        mine = [
            (n, tuple(p.shape), tuple(p.stride()), str(p.dtype))
            for n, p in zip(self.param_names, self._params, strict=True)
        ]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.process_group)
        ref = gathered[0]
        for rank, meta in enumerate(gathered[1:], start=1):
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
        """Parameter ``i``'s wgrad sink: the GEMM writes its view (averaged if synced); the hook marks it."""
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
        """Make ``p.grad`` its bucket view, averaged when ``average`` (:func:`grad_into_view`)."""
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
        """Queued on the autograd engine (once, after backward) or called by :meth:`finish_grad_sync`."""
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
    """Per parameter, the index in ``units`` of the first module holding it (-1: none), for
    :func:`compute_bucket_assignment_by_size`. Pass the modules compiled in place (their grads
    arrive together); the caller names them rather than this reading torch's private marker."""
    unit_of: dict[int, int] = {}
    for u, module in enumerate(units):
        for p in module.parameters():
            unit_of.setdefault(id(p), u)
    return [unit_of.get(id(p), -1) for p in params]


def grad_into_view(param: torch.Tensor, view: torch.Tensor, divisor: int) -> None:
    """Make ``param.grad`` ``view`` (its slice of a flat buffer), divided by ``divisor`` on the way
    as torch's reducer: a fresh grad is scaled while copied in, one already in the view is divided
    in place, none zeroes the view; no whole-bucket pass precedes the collective. DDP and ZeRO-1
    fill their buffers through it."""
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
    """:func:`grad_into_view` for a weight gradient not yet computed: ``grad_out^T @ inp`` is
    written into ``view`` with ``1/divisor`` in ``alpha`` / ``beta`` (``beta=0`` for a fresh grad),
    saving a pass and a grad-sized allocation. Returns False, writing nothing, when ``param.grad``
    is another tensor. The wgrad sink of DDP and ZeRO-1."""
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
    """Broadcast ``tensors`` from global rank ``src`` in flat chunks per dtype and device."""
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
