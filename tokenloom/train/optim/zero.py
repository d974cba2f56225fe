"""ZeRO-1: AdamW whose fp32 master weights and moments are sharded over data parallel.

Layout (Megatron-core's ``distrib_optimizer.py``): flat ``param_buffer`` and ``grad_buffer``
(``.data``, ``.grad`` views) in buckets of whole parameters, padded to a multiple of dp; rank ``r``
owns piece ``r`` of each bucket, across parameter boundaries. A step: grads enter divided by dp,
buckets reduce-scatter (from grad hooks with ``overlap_grad_reduce``, last first, one order on all
ranks), then grad norm, weight decay before the update (as ``torch.optim.AdamW``: equal to one
process), AdamW on the fp32 shard and one all-gather per bucket.

* **Memory**: 1/dp of the moments plus < dp padding elements per bucket (``bench/parallel_bench.py``).
* **Overlapped parameter all-gather** (``overlap_param_gather``): a pre-hook per layer waits for the
  buckets of its parameters *or the next layer's* (``GPT.head`` reads ``lm_head.weight``); readers
  outside a forward call :meth:`~ZeroAdamW.finish_param_sync`.
* **Sums over other groups follow the dp reduction** (:meth:`~ZeroAdamW.all_reduce_grads`); tied
  copies get their own bucket to be cut alike. Checkpoints need no gather (any dp loads them).
* **Expert parameters**: buckets over ``expert_dp_group``, divided by the whole dp (their sum is
  the one-process gradient; the norm counts each piece once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tokenloom.errors import TokenloomError
from tokenloom.train.optim.adamw import clip_coefficient, global_grad_norm
from tokenloom.train.parallel.ddp import (
    compute_bucket_assignment_by_size,
    grad_into_view,
    grad_unit_ids,
    wgrad_into_view,
)
from tokenloom.train.parallel.mappings import all_reduce_in_place
from tokenloom.train.parallel.wgrad import WgradSink, set_wgrad_sink


class ZeroAdamW:
    """AdamW with ZeRO-1 sharding over ``dp_group``, used like a torch optimizer. ``params``: equal on
    every dp rank. ``norm_group``: summed over after dp (every stage clips by the whole norm);
    ``counts_in_norm``: each parameter once per replica. ``overlap_*``: module docstring (``modules``:
    the chunks the pre-hooks go on). ``own_bucket``: Megatron's ``_does_param_require_new_bucket``."""

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        dp_group: dist.ProcessGroup | None = None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        max_grad_norm: float | None = None,
        norm_group: dist.ProcessGroup | None = None,
        counts_in_norm: Callable[[nn.Parameter], bool] | None = None,
        bucket_bytes: int | None = None,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        modules: Iterable[nn.Module] = (),
        own_bucket: Callable[[nn.Parameter], bool] | None = None,
        grad_units: Iterable[nn.Module] = (),
        fused: bool | None = None,
        is_expert: Callable[[nn.Parameter], bool] | None = None,
        expert_dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        if counts_in_norm is None:
            def counts_in_norm(p: nn.Parameter) -> bool:
                return not getattr(p, "shared", False)
        unique: dict[int, tuple[nn.Parameter, float]] = {}
        for p, wd in _flatten_groups(params, weight_decay):
            if p.requires_grad:
                unique.setdefault(id(p), (p, wd))
        self.params = [p for p, _ in unique.values()]
        decays = [wd for _, wd in unique.values()]
        if not self.params:
            raise TokenloomError("ZeroAdamW got no trainable parameters")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise TokenloomError(f"ZeroAdamW needs parameters of one dtype, got {sorted(map(str, dtypes))}")
        self.dp_group, self.norm_group = dp_group, norm_group
        distributed = dp_group is not None or dist.is_initialized()
        self.dp_size = dist.get_world_size(dp_group) if distributed else 1
        self.dp_rank = dist.get_rank(dp_group) if distributed else 0
        self.max_grad_norm = max_grad_norm
        self.numel = sum(p.numel() for p in self.params)
        dtype, device = self.params[0].dtype, self.params[0].device
        if any(p.device != device for p in self.params):
            raise TokenloomError("ZeroAdamW needs every parameter on one device")

        # buckets: contiguous runs of parameters, each padded to a multiple of its group's size
        dp = self.dp_size
        assignment = [list(range(len(self.params)))] if bucket_bytes is None else \
            compute_bucket_assignment_by_size(self.params, [bucket_bytes],
                                              units=grad_unit_ids(self.params, grad_units))[0]
        expert = [bool(is_expert is not None and is_expert(p)) for p in self.params]
        if any(expert):
            assignment = _split_runs(assignment, expert)
        if own_bucket is not None:
            assignment = _isolate(assignment, [own_bucket(p) for p in self.params])
        expert_shards = (expert_dp_group, dist.get_world_size(expert_dp_group) if expert_dp_group else 1,
                         dist.get_rank(expert_dp_group) if expert_dp_group else 0)
        self._bucket_of = [0] * len(self.params)
        self._offsets: list[tuple[int, int]] = []  # each parameter's [start, end) in the flat buffers
        self._buckets: list[tuple[int, int]] = []  # each bucket's [start, end) in the flat buffers
        self._shards: list[tuple[dist.ProcessGroup | None, int, int]] = []  # each bucket's (group, size, rank)
        offset = 0
        for k, indices in enumerate(assignment):
            start = offset
            for i in indices:
                self._bucket_of[i] = k
                self._offsets.append((offset, offset + self.params[i].numel()))
                offset += self.params[i].numel()
            shards = expert_shards if expert[indices[0]] else (dp_group, dp, self.dp_rank)
            offset = start + -(-(offset - start) // shards[1]) * shards[1]
            self._buckets.append((start, offset))
            self._shards.append(shards)
        self._pieces = [slice(a + rank * (b - a) // size, a + (rank + 1) * (b - a) // size)
                        for (a, b), (_, size, rank) in zip(self._buckets, self._shards, strict=True)]
        self.shard_size = sum(pc.stop - pc.start for pc in self._pieces)
        """Elements of the flat buffers this rank owns: ceil(numel / dp) per bucket (per expert
        bucket ceil(numel / expert-dp size))."""

        self.param_buffer = torch.zeros(offset, dtype=dtype, device=device)
        self.grad_buffer = torch.zeros(offset, dtype=dtype, device=device)
        self._grad_views: list[torch.Tensor] = []
        norm_weight = torch.ones(offset, dtype=torch.float32, device=device)
        runs: list[tuple[int, int, float]] = []  # (start, end, weight decay) over the flat buffer
        with torch.no_grad():
            for p, wd, (a, b) in zip(self.params, decays, self._offsets, strict=True):
                self.param_buffer[a:b].copy_(p.reshape(-1))
                p.data = self.param_buffer[a:b].view(p.shape)
                view = self.grad_buffer[a:b].view(p.shape)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._grad_views.append(view)
                if not counts_in_norm(p):
                    norm_weight[a:b] = 0.0
                if wd != 0.0:
                    runs.append((a, b, wd))

        # this rank's shard, pieces back to back, and one master per piece (fp32: the buffer itself)
        self._grad_shard = torch.zeros(self.shard_size, dtype=dtype, device=device)
        self._norm_weight = torch.cat([norm_weight[pc] for pc in self._pieces])
        self._grad_pieces, self.main_shards, self._decay_runs = [], [], []
        self._index = {id(p): i for i, p in enumerate(self.params)}
        at = 0
        for k, pc in enumerate(self._pieces):
            size = pc.stop - pc.start
            self._grad_pieces.append(self._grad_shard[at : at + size])
            own = self.param_buffer[pc]
            self.main_shards.append(nn.Parameter(own if dtype == torch.float32 else own.float()))
            self._decay_runs += [(k, max(a, pc.start) - pc.start, min(b, pc.stop) - pc.start, wd)
                                 for a, b, wd in runs if a < pc.stop and b > pc.start]
            at += size
        self.optimizer = torch.optim.AdamW(self.main_shards, lr=lr, betas=betas, eps=eps, weight_decay=0.0,
                                           fused=fused)

        # overlap: a hook per parameter launches complete buckets, strictly last to first
        self.overlap = overlap_grad_reduce and dp > 1
        self._sync = True  # flipped by no_sync()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(self.params)] if self.overlap else []
        # with the hooks, the model's fused linears write weight grads into their views (as in DDP)
        self._in_view = [False] * len(self.params)
        if self.overlap:
            for i, p in enumerate(self.params):
                set_wgrad_sink(p, self._make_sink(i))
        self._reset_reduction()

        # overlap_param_gather: buckets [0, _gathered) of _gathers (work, sent piece) are done
        self.overlap_param_gather = overlap_param_gather and dp > 1
        self._gathers: list[tuple[Any, torch.Tensor | None]] = []
        self._gathered = 0
        self._gather_hooks = self._register_gather_hooks(list(modules)) if self.overlap_param_gather else []

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (set ``lr`` here for a schedule)."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a step's gradients. ``set_to_none``: ``.grad`` None, the buffer untouched (each
        first grad is copied into its view by its hook: no memset, no pass). False: zero the
        buffer and point ``.grad`` at the views."""
        for p, view in zip(self.params, self._grad_views, strict=True):
            p.grad = None if set_to_none else view
        if not set_to_none:
            self.grad_buffer.zero_()
        self._reset_reduction()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate (every micro-batch but a step's last)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _reset_reduction(self) -> None:
        self._reduced = False
        self._pending = [0] * len(self._buckets)
        for k in self._bucket_of:
            self._pending[k] += 1
        self._ready = [False] * len(self.params)
        self._works: list[Any] = [None] * len(self._buckets)
        self._next = len(self._buckets) - 1  # the next bucket to launch

    def _into_view(self, i: int, p: torch.Tensor, *, average: bool) -> None:
        """``p.grad`` into its view, averaged when ``average`` (``ddp.grad_into_view``)."""
        grad_into_view(p, self._grad_views[i], self.dp_size if average else 1)

    def _make_sink(self, i: int) -> WgradSink:
        def sink(grad_out: torch.Tensor, inp: torch.Tensor) -> bool:
            """Parameter ``i``'s wgrad into its view, averaged when its hook launches."""
            synced = self._sync and not self._ready[i]
            p, view = self.params[i], self._grad_views[i]
            self._in_view[i] = wgrad_into_view(p, view, self.dp_size if synced else 1, grad_out, inp)
            return self._in_view[i]

        return sink

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            synced = self._sync and not self._ready[i]
            if self._in_view[i]:  # its sink wrote it, averaged as synced says
                self._in_view[i] = False
            else:
                self._into_view(i, p, average=synced)
            if not synced:
                return
            self._ready[i] = True
            self._pending[self._bucket_of[i]] -= 1
            while self._next >= 0 and self._pending[self._next] == 0:
                self._launch(self._next, async_op=True)

        return hook

    def _launch(self, k: int, async_op: bool) -> None:
        """Reduce-scatter bucket ``k`` into this rank's grad piece, over the bucket's group."""
        (a, b), (group, size, _) = self._buckets[k], self._shards[k]
        if size == 1:
            self._grad_pieces[k].copy_(self.grad_buffer[a:b])
        else:  # its parameters' grads were averaged into the buffer (_into_view)
            self._works[k] = dist.reduce_scatter_single(self._grad_pieces[k], self.grad_buffer[a:b],
                                                        group=group, async_op=async_op)
        self._next = k - 1

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Reduce every bucket (wait for launched ones); the grad shard then holds the dp average."""
        if self._reduced:
            return
        self.finish_param_sync()  # buckets no forward waited for: the gathers write the master shard
        for i, p in enumerate(self.params):  # grads no hook averaged (no overlap, or not in this backward)
            if not self._ready[i]:
                self._into_view(i, p, average=True)
        while self._next >= 0:  # not launched during backward (no overlap, or a grad never came)
            self._launch(self._next, async_op=False)
        for work in self._works:
            if work is not None:
                work.wait()
        self._reset_reduction()
        self._reduced = True

    @torch.no_grad()
    def all_reduce_grads(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        """Sum over ``group`` the reduced grads of ``params`` in this shard (one all-reduce), between
        :meth:`finish_grad_sync` and :meth:`step` (sp and tied-embedding sums). Every rank of
        ``group`` must cut them alike (same layout, or ``own_bucket``)."""
        if not self._reduced:
            raise TokenloomError("ZeroAdamW.all_reduce_grads: call finish_grad_sync() first")
        held = []
        for p in params:
            i = self._index[id(p)]
            (a, b), k = self._offsets[i], self._bucket_of[i]
            pc = self._pieces[k]
            lo, hi = max(a, pc.start), min(b, pc.stop)
            if lo < hi:
                held.append(self._grad_pieces[k][lo - pc.start : hi - pc.start])
        all_reduce_in_place(held, group)

    @torch.no_grad()
    def step(self) -> torch.Tensor | None:
        """Reduce, clip, update this shard, all-gather (left in flight with ``overlap_param_gather``).
        Returns the unclipped global grad norm (device tensor) with ``max_grad_norm``, else None."""
        self.finish_grad_sync()
        self._reduced = False
        grad = self._grad_shard.float()
        norm = None
        if self.max_grad_norm is not None:
            norm = self.grad_norm(grad)
            grad.mul_(clip_coefficient(norm, self.max_grad_norm))
        at = 0
        for master in self.main_shards:
            master.grad = grad[at : at + master.numel()]
            at += master.numel()
        lr = self.optimizer.param_groups[0]["lr"]
        for k, a, b, wd in self._decay_runs:
            self.main_shards[k][a:b].mul_(1 - lr * wd)
        self.optimizer.step()
        for master in self.main_shards:
            master.grad = None
        self._all_gather_params()
        return norm

    def grad_norm(self, grad_shard: torch.Tensor) -> torch.Tensor:
        """L2 norm of the full gradient from this shard, squares summed over dp, then ``norm_group``."""
        groups = ([self.dp_group] if self.dp_size > 1 else []) + ([self.norm_group] if self.norm_group is not None else [])
        return global_grad_norm([grad_shard * self._norm_weight], groups, device=grad_shard.device)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held here: moments, steps and non-aliased fp32 masters."""
        tensors = [t for m in self.main_shards for t in self.optimizer.state.get(m, {}).values()]
        tensors += [m for m, pc in zip(self.main_shards, self._pieces, strict=True)
                    if m.data_ptr() != self.param_buffer[pc].data_ptr()]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def _all_gather_params(self) -> None:
        """Every bucket's updated pieces into ``param_buffer``, first bucket first."""
        gathers: list[tuple[Any, torch.Tensor | None]] = []
        for (a, b), pc, master, (group, size, _) in zip(self._buckets, self._pieces, self.main_shards, self._shards,
                                                       strict=True):
            own = self.param_buffer[pc]
            if size == 1:
                if master.data_ptr() != own.data_ptr():
                    own.copy_(master.detach())
                gathers.append((None, None))  # bucket k stays entry k
                continue
            # an fp32 master piece is a view of the output: send a copy, kept until waited for
            piece = master.detach().clone() if master.dtype == own.dtype else master.detach().to(own.dtype)
            work = dist.all_gather_single(self.param_buffer[a:b], piece, group=group,
                                          async_op=self.overlap_param_gather)
            if self.overlap_param_gather:
                gathers.append((work, piece))
        if self.overlap_param_gather:
            self._gathers, self._gathered = gathers, 0

    @property
    def param_sync_pending(self) -> bool:
        """Whether some bucket's all-gather has not been waited for (its parameters may be stale)."""
        return self._gathered < len(self._gathers)

    def finish_param_sync(self) -> None:
        """Wait for every pending all-gather; call before using parameters outside a forward."""
        self._wait_gathers(len(self._gathers) - 1)

    def _wait_gathers(self, last: int) -> None:
        """Wait for the all-gathers of buckets ``0..last`` (those not waited for yet)."""
        last = min(last, len(self._gathers) - 1)
        while self._gathered <= last:
            work = self._gathers[self._gathered][0]
            if work is not None:
                work.wait()
            self._gathers[self._gathered] = (None, None)  # frees the sent piece
            self._gathered += 1
        if self._gathered == len(self._gathers):
            self._gathers, self._gathered = [], 0

    def _register_gather_hooks(self, modules: list[nn.Module]) -> list[Any]:
        """A forward pre-hook per layer of ``modules`` (module docstring)."""
        if not modules:
            raise TokenloomError("ZeroAdamW: overlap_param_gather needs the model chunk(s) as modules")
        bucket = {id(p): k for p, k in zip(self.params, self._bucket_of, strict=True)}
        layers = []  # (layer, last bucket holding its parameters)
        covered: set[int] = set()
        for module in modules:
            for layer, recurse in _layers(module):
                held = [bucket[id(p)] for p in layer.parameters(recurse=recurse) if id(p) in bucket]
                covered.update(id(p) for p in layer.parameters(recurse=recurse))
                if held:
                    layers.append((layer, max(held)))
        missing = [tuple(p.shape) for p in self.params if id(p) not in covered]
        if missing:
            raise TokenloomError(f"ZeroAdamW: overlap_param_gather needs every parameter in modules; "
                                 f"{len(missing)} are not, shapes {missing[:3]}")
        hooks = []
        for j, (layer, last) in enumerate(layers):
            ahead = layers[j + 1][1] if j + 1 < len(layers) else last
            hooks.append(layer.register_forward_pre_hook(self._gather_hook(max(last, ahead))))
        return hooks

    def _gather_hook(self, last: int) -> Callable[[nn.Module, Any], None]:
        @torch.compiler.disable  # a compiled block runs it eagerly before its graph, no break inside
        def hook(module: nn.Module, args: Any) -> None:
            self._wait_gathers(last)

        return hook

    # ------------------------------------------------------------------ checkpoint

    @torch.no_grad()
    def gathered_param_states(self) -> list[dict[str, torch.Tensor]] | None:
        """Collective: every parameter's full AdamW state on dp rank 0 (None elsewhere), as
        ``torch.optim.AdamW`` keeps it (``exp_avg``, ``exp_avg_sq`` as views of one tensor,
        ``step``; ``master_param`` when not fp32); empty before the first step."""
        self.finish_param_sync()
        inner = [st for st in (self.optimizer.state.get(m) for m in self.main_shards) if st]
        if len(inner) != len(self.main_shards):  # a shard without state yet
            return [{} for _ in self.params] if self.dp_rank == 0 else None
        pieces = {"exp_avg": [st["exp_avg"] for st in inner], "exp_avg_sq": [st["exp_avg_sq"] for st in inner]}
        if self.param_buffer.dtype != torch.float32:
            pieces["master_param"] = [m.detach() for m in self.main_shards]
        flats = {key: self._gather_to_first(values) for key, values in pieces.items()}
        if self.dp_rank != 0:
            return None
        out = []
        for p, (a, b) in zip(self.params, self._offsets, strict=True):
            state = {key: flat[a:b].view(p.shape) for key, flat in flats.items() if flat is not None}  # all, here
            state["step"] = inner[0]["step"].detach().clone()
            out.append(state)
        return out

    @torch.no_grad()
    def own_param_states(self) -> list[tuple[torch.Tensor | None, dict[str, tuple[int, torch.Tensor]]]]:
        """Not a collective: per parameter (``step`` or None, pieces): key -> (start in the
        flattened parameter, 1-d view) of this rank's elements (one range at most: a parameter
        lies in one bucket); ``master_param`` too when not fp32."""
        self.finish_param_sync()
        inner = [self.optimizer.state.get(m) for m in self.main_shards]
        if not all(inner):  # before the first step
            return [(None, {}) for _ in self.params]
        states = [st for st in inner if st]
        step = states[0]["step"].detach()
        out: list[tuple[torch.Tensor | None, dict[str, tuple[int, torch.Tensor]]]] = []
        for a, b in self._offsets:
            own: dict[str, tuple[int, torch.Tensor]] = {}
            for k, pc in enumerate(self._pieces):
                lo, hi = max(a, pc.start), min(b, pc.stop)
                if lo >= hi:
                    continue
                window = slice(lo - pc.start, hi - pc.start)
                own = {key: (lo - a, states[k][key][window]) for key in ("exp_avg", "exp_avg_sq")}
                if self.param_buffer.dtype != torch.float32:
                    own["master_param"] = (lo - a, self.main_shards[k].detach()[window])
            out.append((step, own))
        return out

    @torch.no_grad()
    def load_param_states(self, states: list[dict[str, torch.Tensor] | None]) -> None:
        """Set this shard from full per-parameter states (:meth:`gathered_param_states`' form, any dp;
        None or ``{}``: zero moments). Not a collective. The parameters must hold the loaded values
        already (the master is cut from them, or ``master_param``), loaded after
        :meth:`finish_param_sync` or the gathers overwrite them."""
        self.finish_param_sync()
        if len(states) != len(self.params):
            raise TokenloomError(f"ZeRO-1 got optimizer states for {len(states)} parameters, it has "
                                 f"{len(self.params)}")
        given = [s for s in states if s]
        master = self.param_buffer.float().clone()  # fp32 parameters hold the master values already
        moments = {key: torch.zeros_like(master) for key in ("exp_avg", "exp_avg_sq")}
        for p, (a, b), state in zip(self.params, self._offsets, states, strict=True):
            for key, flat in (*moments.items(), ("master_param", master)):
                if state and key in state:
                    if state[key].numel() != p.numel():
                        raise TokenloomError(f"ZeRO-1 optimizer state {key} has {state[key].numel()} elements, "
                                             f"its parameter {tuple(p.shape)}")
                    flat[a:b].copy_(state[key].reshape(-1))
        for m, pc in zip(self.main_shards, self._pieces, strict=True):
            m.copy_(master[pc])
        if not given:  # a checkpoint written before the first step: nothing but the parameters
            self.optimizer.state.clear()
            return
        step = max(float(s["step"]) for s in given)
        inner = self.optimizer.state_dict()
        inner["state"] = {k: {"step": torch.tensor(step, dtype=torch.float32, device="cpu"), **{key: flat[pc].clone() for key, flat in moments.items()}}
                          for k, pc in enumerate(self._pieces)}
        # AdamW keeps a non-fused step on the CPU whatever the parameters' device (a fused one on the
        # device); load_state_dict moves the step and moments there, as torch's own resume does.
        self.optimizer.load_state_dict(inner)

    def _gather_to_first(self, pieces: list[torch.Tensor]) -> torch.Tensor | None:
        """The flat buffer of the ranks' ``pieces`` on dp rank 0 (None elsewhere), per bucket group."""
        first = any(rank == 0 for _, _, rank in self._shards)  # some bucket gathers here
        full = torch.empty(len(self.param_buffer), dtype=pieces[0].dtype, device=pieces[0].device) if first else None
        for (a, b), piece, (group, size, rank) in zip(self._buckets, pieces, self._shards, strict=True):
            here = full[a:b] if full is not None and rank == 0 else None
            if size == 1 and here is not None:  # rank 0 of a one-rank group: the whole bucket is its piece
                here.copy_(piece)
            elif size > 1:
                dist.gather(piece.contiguous(), list(here.chunk(size)) if here is not None else None, group=group,
                            group_dst=0)
        return full if self.dp_rank == 0 else None


def _split_runs(assignment: list[list[int]], kind: list[bool]) -> list[list[int]]:
    """``assignment``'s buckets cut where ``kind`` changes (never expert and dense together)."""
    out: list[list[int]] = []
    for bucket in assignment:
        out.append([bucket[0]])
        for i in bucket[1:]:
            if kind[i] == kind[out[-1][-1]]:
                out[-1].append(i)
            else:
                out.append([i])
    return out


def _isolate(assignment: list[list[int]], alone: list[bool]) -> list[list[int]]:
    """``assignment``'s buckets, each parameter flagged in ``alone`` cut out into a bucket of its own."""
    out: list[list[int]] = []
    for bucket in assignment:
        run: list[int] = []
        for i in bucket:
            if alone[i]:
                out += [run, [i]] if run else [[i]]
                run = []
            else:
                run.append(i)
        if run:
            out.append(run)
    return out


def _layers(module: nn.Module) -> list[tuple[nn.Module, bool]]:
    """(module, recurse) pairs in registration order, containers (never called) opened."""
    out = [(module, False)]
    for child in module.children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            out += [(m, recurse) for m, recurse in _layers(child) if m is not child]
        else:
            out.append((child, True))
    return out


def _flatten_groups(params: Iterable[Any], default_wd: float) -> list[tuple[nn.Parameter, float]]:
    """(parameter, weight decay) pairs from parameters or torch-style groups, in order."""
    out: list[tuple[nn.Parameter, float]] = []
    for item in params:
        if not isinstance(item, dict):
            out.append((item, default_wd))
            continue
        extra = set(item) - {"params", "weight_decay"}
        if extra:
            raise TokenloomError(f"ZeroAdamW groups take only 'params' and 'weight_decay', got {sorted(extra)}")
        group = item["params"]
        group = [group] if isinstance(group, torch.Tensor) else list(group)
        out.extend((p, float(item.get("weight_decay", default_wd))) for p in group)
    return out
