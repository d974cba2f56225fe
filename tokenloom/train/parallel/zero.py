"""ZeRO-1: AdamW whose fp32 master weights and moments are sharded over data parallel.

Mirrors Megatron-core's distributed optimizer (``distrib_optimizer.py``) for one
buffer. Layout: all parameters, in the order given, are packed into one flat
``param_buffer`` (the parameters' ``.data`` are re-pointed into it) and one flat
``grad_buffer`` (each ``.grad`` is a view into it); both are padded with zeros up to a
multiple of the DP size and cut into DP equal contiguous shards. Rank ``r`` owns shard
``r``; shards ignore parameter boundaries, so a parameter can be split across ranks.

One :meth:`ZeroAdamW.step`::

    grads -> grad_buffer      (no copy when .grad is still the buffer view)
    grad_buffer /= dp_size; reduce_scatter(SUM) -> this rank's grad shard (the average)
    global grad norm          sum of squares of the shard (duplicate tied copies
                              excluded), all-reduced over DP and then over
                              ``norm_group`` (the pipeline / model-parallel group);
                              grads scaled by min(1, max_norm / (norm + 1e-6)) as
                              torch.nn.utils.clip_grad_norm_ does
    weight decay              p *= 1 - lr * wd on the shard's slices of each group's
                              parameters (decoupled, as AdamW applies it first)
    AdamW on the fp32 shard   (torch.optim.AdamW on one flat fp32 tensor, no decay)
    shard -> param_buffer; all_gather (equal sizes, flat output: works on gloo)

Choices and their costs:

* **Memory** per fp32 parameter: 8 bytes (param + grad) + 8/d (two moments), as
  Megatron's fp32 case: the fp32 parameters' own shard of the flat buffer is the master
  copy, stepped in place, so the optimizer state per rank is 1/d of plain AdamW's
  (:meth:`ZeroAdamW.state_bytes`; the only extra is the padding, < d elements).
  Lower-precision parameters get a separate fp32 master shard (4/d more).
* **One buffer, no buckets**: a single reduce-scatter and a single all-gather per step,
  nothing overlapped with backward or the next forward (Megatron buckets and overlaps
  both). Parameters must share one dtype. No 64-element alignment of parameter starts
  (Megatron's, for kernels that read whole params); padding is only at the end.
* **Pre-divide then SUM** (Megatron's default ``average_in_collective=False``): for
  power-of-two DP sizes the average is exact.
* **Weight decay per parameter group**: ``params`` may be torch-style groups
  (``{"params": [...], "weight_decay": wd}``), e.g. optim.py's decay / no-decay split, so
  a ZeRO-1 run equals the one-process run with the same groups. One flat AdamW cannot
  hold per-element hyperparameters, so the inner AdamW has ``weight_decay=0`` and the
  decay is applied here, on the (few, merged) contiguous runs of the shard that belong to
  decayed parameters: ``p *= 1 - lr * wd`` before the Adam update, which is where
  ``torch.optim.AdamW`` applies it. No per-element mask is stored. Other
  hyperparameters (lr, betas, eps) are shared by all groups.
* **Checkpoints are layout-free** (Megatron's ``dp_reshardable`` idea, not its per-rank
  ``fully_sharded`` one): :meth:`gathered_param_states` gathers the shards to dp rank 0
  and cuts them into one full ``exp_avg`` / ``exp_avg_sq`` / ``step`` per parameter, the
  form ``torch.optim.AdamW`` keeps, so :mod:`~tokenloom.train.parallel.reshard` writes
  them exactly as it writes the plain optimizer's state and any dp size, with or without
  ZeRO-1, reads them back (:meth:`load_param_states` cuts this rank's shard out of the
  full tensors). The cost: dp rank 0 holds the full moments (2 x 4 bytes per parameter of
  its model-parallel part) while saving. fp32 parameters are their own master copy (the
  all-gather copies the master shard bit for bit); with lower-precision parameters the
  fp32 master weights are saved too, as ``master_param``. A parameter without state
  loads zeros; states with different step counts load the largest (one flat AdamW has
  one step).
* **dp = 1** is allowed (one shard, the whole buffer; no collective, no process group
  needed), as Megatron allows it: the same code path and checkpoints as at dp > 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tokenloom.errors import TokenloomError
from tokenloom.train.optim import clip_coefficient, global_grad_norm


class ZeroAdamW:
    """AdamW with ZeRO-1 sharding over ``dp_group``; use it like a torch optimizer.

    Args:
        params: the model parameters, or torch-style groups of them (dicts with
            ``"params"`` and optionally ``"weight_decay"``; other keys are refused).
            Duplicates by identity are dropped (the first group wins). Their ``.data``
            are moved into a flat buffer at construction; they must be equal on every
            DP rank (same init).
        dp_group: data-parallel group (None: the default group, or a single rank when
            ``torch.distributed`` is not initialised).
        lr, betas, eps: as ``torch.optim.AdamW``.
        weight_decay: decoupled weight decay for parameters (or groups) that do not set
            their own.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        norm_group: extra group the squared norm is summed over after DP, e.g. the
            model-parallel group, so every stage clips by the whole model's norm.
        counts_in_norm: which parameters this rank counts in the norm (Megatron's rule:
            each once per replica). Default: all but those tagged ``shared = True`` (the
            last stage's copy of a tied embedding).
    """

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
        self.shard_size = -(-self.numel // self.dp_size)
        padded = self.shard_size * self.dp_size
        dtype, device = self.params[0].dtype, self.params[0].device
        if any(p.device != device for p in self.params):
            raise TokenloomError("ZeroAdamW needs every parameter on one device")
        self.param_buffer = torch.zeros(padded, dtype=dtype, device=device)
        self.grad_buffer = torch.zeros(padded, dtype=dtype, device=device)
        self._grad_views: list[torch.Tensor] = []
        self._offsets: list[tuple[int, int]] = []  # each parameter's [start, end) in the flat buffers
        norm_weight = torch.ones(padded, dtype=torch.float32, device=device)
        runs: list[tuple[int, int, float]] = []  # (start, end, weight decay) over the flat buffer
        offset = 0
        with torch.no_grad():
            for p, wd in zip(self.params, decays, strict=True):
                n = p.numel()
                self.param_buffer[offset : offset + n].copy_(p.reshape(-1))
                p.data = self.param_buffer[offset : offset + n].view(p.shape)
                view = self.grad_buffer[offset : offset + n].view(p.shape)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._grad_views.append(view)
                self._offsets.append((offset, offset + n))
                if not counts_in_norm(p):
                    norm_weight[offset : offset + n] = 0.0
                if runs and runs[-1][1] == offset and runs[-1][2] == wd:
                    runs[-1] = (runs[-1][0], offset + n, wd)
                else:
                    runs.append((offset, offset + n, wd))
                offset += n

        lo, hi = self.dp_rank * self.shard_size, (self.dp_rank + 1) * self.shard_size
        self._shard = slice(lo, hi)
        self._decay_runs = [(max(a, lo) - lo, min(b, hi) - lo, wd) for a, b, wd in runs
                            if wd != 0.0 and a < hi and b > lo]
        self._norm_weight = norm_weight[lo:hi]
        self._grad_shard = torch.zeros(self.shard_size, dtype=dtype, device=device)
        # fp32: the buffer's own shard is the master copy (stepped in place); else an fp32 copy
        own = self.param_buffer[lo:hi]
        self.main_shard = nn.Parameter(own if dtype == torch.float32 else own.float())
        self.optimizer = torch.optim.AdamW([self.main_shard], lr=lr, betas=betas, eps=eps, weight_decay=0.0)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (set ``lr`` here for a schedule)."""
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Zero the flat grad buffer and point every ``.grad`` back at its view."""
        self.grad_buffer.zero_()
        for p, view in zip(self.params, self._grad_views, strict=True):
            p.grad = view

    @torch.no_grad()
    def step(self) -> torch.Tensor | None:
        """Reduce, clip, update this shard, all-gather. Returns the global grad norm
        (before clipping, a device tensor) when ``max_grad_norm`` is set, else None."""
        for p, view in zip(self.params, self._grad_views, strict=True):
            if p.grad is None:
                view.zero_()
            elif p.grad is not view:
                view.copy_(p.grad)
            p.grad = view
        if self.dp_size == 1:
            self._grad_shard.copy_(self.grad_buffer)
        else:
            self.grad_buffer.div_(self.dp_size)
            dist.reduce_scatter_single(self._grad_shard, self.grad_buffer, group=self.dp_group)
        grad = self._grad_shard.float()
        norm = None
        if self.max_grad_norm is not None:
            norm = self.grad_norm(grad)
            grad.mul_(clip_coefficient(norm, self.max_grad_norm))
        self.main_shard.grad = grad
        lr = self.optimizer.param_groups[0]["lr"]
        for a, b, wd in self._decay_runs:
            self.main_shard[a:b].mul_(1 - lr * wd)
        self.optimizer.step()
        self.main_shard.grad = None
        self._all_gather_params()
        return norm

    def grad_norm(self, grad_shard: torch.Tensor) -> torch.Tensor:
        """L2 norm of the full gradient from this rank's (reduced) shard (a device tensor)."""
        groups = ([self.dp_group] if self.dp_size > 1 else []) + ([self.norm_group] if self.norm_group is not None else [])
        return global_grad_norm([grad_shard * self._norm_weight], groups, device=grad_shard.device)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: its shard of the two AdamW moments and
        the step, plus the fp32 master shard when the parameters are not fp32."""
        tensors = list(self.optimizer.state.get(self.main_shard, {}).values())
        if self.main_shard.data_ptr() != self.param_buffer[self._shard].data_ptr():
            tensors.append(self.main_shard)
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def _all_gather_params(self) -> None:
        shard = self.main_shard.detach()
        if self.dp_size == 1:
            if shard.data_ptr() != self.param_buffer.data_ptr():
                self.param_buffer.copy_(shard)
            return
        # an fp32 master shard is a view of the output: send a copy (transient, one shard)
        shard = shard.clone() if shard.dtype == self.param_buffer.dtype else shard.to(self.param_buffer.dtype)
        dist.all_gather_single(self.param_buffer, shard, group=self.dp_group)

    # ------------------------------------------------------------------ checkpoint

    @torch.no_grad()
    def gathered_param_states(self) -> list[dict[str, torch.Tensor]] | None:
        """Collective over ``dp_group``: the full AdamW state of every parameter, in
        :attr:`params` order, on dp rank 0 (None on the others). An entry holds
        ``exp_avg``, ``exp_avg_sq`` (fp32, the parameter's shape; views into one gathered
        tensor, clone them to save them alone) and ``step``, as ``torch.optim.AdamW``
        keeps them, plus ``master_param`` when the parameters are not fp32. Entries are
        empty before the first step."""
        inner = self.optimizer.state.get(self.main_shard)
        if not inner:
            return [{} for _ in self.params] if self.dp_rank == 0 else None
        shards = {"exp_avg": inner["exp_avg"], "exp_avg_sq": inner["exp_avg_sq"]}
        if self.param_buffer.dtype != torch.float32:
            shards["master_param"] = self.main_shard.detach()
        flats = {key: self._gather_to_first(shard) for key, shard in shards.items()}
        if self.dp_rank != 0:
            return None
        out = []
        for p, (a, b) in zip(self.params, self._offsets, strict=True):
            state = {key: flat[a:b].view(p.shape) for key, flat in flats.items()}
            state["step"] = inner["step"].detach().clone()
            out.append(state)
        return out

    @torch.no_grad()
    def load_param_states(self, states: list[dict[str, torch.Tensor] | None]) -> None:
        """Set this rank's shard from full per-parameter states (the form of
        :meth:`gathered_param_states`, in :attr:`params` order, saved at any dp size or by
        the plain AdamW); None or ``{}`` for a parameter without state (zero moments).
        The parameters must already hold the loaded values: the master shard is cut from
        them (or from ``master_param`` where given). Not a collective: every rank reads
        the full tensors and keeps its slice."""
        if len(states) != len(self.params):
            raise TokenloomError(f"ZeRO-1 got optimizer states for {len(states)} parameters, it has "
                                 f"{len(self.params)}")
        given = [s for s in states if s]
        master = self.param_buffer.float().clone()  # fp32 parameters hold the master values already
        if not given:  # a checkpoint written before the first step: nothing but the parameters
            self.optimizer.state.clear()
            self.main_shard.copy_(master[self._shard])
            return
        moments = {key: torch.zeros_like(master) for key in ("exp_avg", "exp_avg_sq")}
        for p, (a, b), state in zip(self.params, self._offsets, states, strict=True):
            for key, flat in (*moments.items(), ("master_param", master)):
                if state and key in state:
                    if state[key].numel() != p.numel():
                        raise TokenloomError(f"ZeRO-1 optimizer state {key} has {state[key].numel()} elements, "
                                             f"its parameter {tuple(p.shape)}")
                    flat[a:b].copy_(state[key].reshape(-1))
        self.main_shard.copy_(master[self._shard])
        inner = self.optimizer.state_dict()
        inner["state"] = {0: {"step": torch.tensor(max(float(s["step"]) for s in given)),
                              **{key: flat[self._shard].clone() for key, flat in moments.items()}}}
        self.optimizer.load_state_dict(inner)  # casts to the master shard's device, as torch resumes

    def _gather_to_first(self, shard: torch.Tensor) -> torch.Tensor | None:
        """The flat padded buffer whose ``dp_size`` shards the ranks hold, on dp rank 0."""
        if self.dp_size == 1:
            return shard
        full = torch.empty(self.dp_size * self.shard_size, dtype=shard.dtype, device=shard.device) \
            if self.dp_rank == 0 else None
        dist.gather(shard.contiguous(), list(full.chunk(self.dp_size)) if full is not None else None,
                    group=self.dp_group, group_dst=0)
        return full


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
