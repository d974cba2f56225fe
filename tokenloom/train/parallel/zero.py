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

* **Memory** per fp32 parameter: 8 bytes (param + grad) + 12/d (fp32 master shard +
  two moments). Megatron's fp32 case is 8 + 8/d: it steps the fp32 param slice in
  place; we always keep a separate master shard (4/d more, same code path for bf16).
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
* **State dict is per rank** (this shard's master weights and moments, Megatron's
  non-reshardable per-rank layout): it can only be loaded with the same DP size and
  parameter list. Loading all-gathers the master weights back into the parameters,
  so it is a collective.
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
        dp_group: data-parallel group (None: the default group).
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
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
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
        self.main_shard = nn.Parameter(self.param_buffer[lo:hi].float().clone())
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
        groups = [self.dp_group] + ([self.norm_group] if self.norm_group is not None else [])
        return global_grad_norm([grad_shard * self._norm_weight], groups, device=grad_shard.device)

    def _all_gather_params(self) -> None:
        shard = self.main_shard.detach().to(self.param_buffer.dtype)
        dist.all_gather_single(self.param_buffer, shard, group=self.dp_group)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: master weights, AdamW moments and step, plus the layout."""
        return {
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "numel": self.numel,
            "main_shard": self.main_shard.detach().clone(),
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a shard saved by :meth:`state_dict` on the same DP rank and layout,
        then all-gather the master weights into the parameters (collective)."""
        found = (state["dp_rank"], state["dp_size"], state["numel"])
        expected = (self.dp_rank, self.dp_size, self.numel)
        if found != expected:
            raise TokenloomError(
                f"ZeRO-1 optimizer state is for (dp_rank, dp_size, numel) = {found}, this run has "
                f"{expected}; load it with the same data-parallel size and model"
            )
        self.main_shard.copy_(state["main_shard"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # decay is applied by step(), never by the inner AdamW
            group["weight_decay"] = 0.0
        self._all_gather_params()


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
