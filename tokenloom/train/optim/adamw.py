"""AdamW with the usual no-decay groups, the one gradient norm, and :class:`OptimConfig` (optimizer
and :mod:`.schedule` settings). Weight decay only on matmul matrices that are not embedding tables
(nanoGPT / Megatron). Fused AdamW by default where torch has the kernel (bench/RESULTS.md, notes;
torchtitan's GPU default): not bit-identical to torch's default, so comparisons with plain
``torch.optim.AdamW`` set ``fused=False``. One gradient norm (:func:`global_grad_norm`) for every
layout and optimizer: each parameter once per replica (Megatron's rule), no host sync.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from tokenloom.errors import TokenloomError


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW or Muon, warmup + decay (cosine, linear or constant), gradient clipping."""

    name: Literal["adamw", "muon"] = "adamw"
    """The optimizer (Megatron's --optimizer): adamw everywhere, or muon for the hidden matrices (Q, K, V
    apart) with AdamW for embeddings, an untied head, biases and norms (tokenloom.train.optim.muon)."""

    lr: float = 6e-4
    """Peak learning rate (reached after warmup)."""
    min_lr: float = 6e-5
    """Learning rate at the end of the decay and after it (not used by decay_style constant)."""
    warmup_iters: int = 100
    """Iterations of linear warmup from lr/warmup_iters to lr."""
    lr_decay_iters: int | None = None
    """Iteration at which the decay reaches min_lr; None means train_iters."""
    decay_style: Literal["cosine", "linear", "constant", "WSD", "inverse-square-root"] = "cosine"
    """After warmup (--lr-decay-style): cosine or linear to min_lr at lr_decay_iters; WSD (lr, then the last
    wsd_decay_iters to min_lr); inverse-square-root (lr x sqrt(warmup / step), >= min_lr); or constant."""
    wsd_decay_iters: int | None = None
    """WSD (required): iterations of the final decay, ending at lr_decay_iters (--lr-wsd-decay-iters)."""
    wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """WSD: the shape of the final decay (Megatron's --lr-wsd-decay-style, the same default)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matmul weights (not on biases, norms, embeddings)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    fused: bool | None = None
    """Fused AdamW kernel: None uses it where torch has one for the device (CPU, CUDA), False never."""
    muon_lr: float | None = None
    """Muon's peak learning rate (the schedule scales it like lr); None: lr (with match_rms_adamw
    scaling AdamW's rate fits Muon, Moonshot's finding)."""
    muon_weight_decay: float | None = None
    """Muon's decoupled weight decay; None: weight_decay."""
    muon_momentum: float = 0.95
    """Muon's momentum (Megatron's --muon-momentum)."""
    muon_nesterov: bool = True
    """Nesterov momentum for Muon (Megatron's --muon-use-nesterov)."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations (quintic, Keller Jordan's coefficients; Megatron's --muon-num-ns-steps)."""
    muon_scale: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon's step size per A x B (out x in) matrix: match_rms_adamw (0.2 sqrt(max(A, B)), the update RMS of
    AdamW, Moonshot's) or original (sqrt(max(1, A / B)), Keller Jordan's)."""
    muon_ns_dtype: Literal["bf16", "fp32"] = "bf16"
    """Newton-Schulz matmul precision: bf16 (torch.optim.Muon's) or fp32 (slower on GPUs, less rounding)."""
    muon_tp_mode: Literal["duplicated", "blockwise"] = "duplicated"
    """At tp > 1: duplicated orthogonalises each gathered tp-split matrix whole on every tp rank (the
    one-process update, Megatron's); blockwise each shard alone (no communication, NOT one-process)."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise TokenloomError(f"need 0 <= optim.min_lr <= optim.lr and lr > 0, got lr={self.lr}, "
                                 f"min_lr={self.min_lr}")
        if self.warmup_iters < 0 or self.grad_clip < 0:
            raise TokenloomError("optim.warmup_iters and optim.grad_clip must be >= 0")
        if self.name not in ("adamw", "muon"):
            raise TokenloomError(f"optim.name (--optimizer) must be adamw or muon, got {self.name!r}")
        if self.name == "muon":
            if self.muon_lr is not None and self.muon_lr <= 0 or not 0 <= self.muon_momentum < 1:
                raise TokenloomError(f"need optim.muon_lr > 0 and 0 <= optim.muon_momentum < 1, got muon_lr="
                                     f"{self.muon_lr}, muon_momentum={self.muon_momentum}")
            if self.muon_ns_steps < 1 or self.muon_ns_steps >= 100:
                raise TokenloomError(f"optim.muon_ns_steps must be in 1..99, got {self.muon_ns_steps}")
            choices = (("muon_scale", ("match_rms_adamw", "original")), ("muon_ns_dtype", ("bf16", "fp32")),
                       ("muon_tp_mode", ("duplicated", "blockwise")))
            for key, allowed in choices:
                if getattr(self, key) not in allowed:
                    raise TokenloomError(f"optim.{key} must be one of {', '.join(allowed)}, got "
                                         f"{getattr(self, key)!r}")
        if self.decay_style not in DECAY_STYLES:
            raise TokenloomError(f"optim.decay_style must be one of {', '.join(DECAY_STYLES)}, got "
                                 f"{self.decay_style!r}")
        if self.wsd_decay_style not in WSD_DECAY_STYLES:
            raise TokenloomError(f"optim.wsd_decay_style must be one of {', '.join(WSD_DECAY_STYLES)}, got "
                                 f"{self.wsd_decay_style!r}")
        if self.decay_style == "WSD" and (self.wsd_decay_iters is None or self.wsd_decay_iters < 1):
            raise TokenloomError(f"optim.decay_style WSD needs optim.wsd_decay_iters >= 1 (--lr-wsd-decay-iters), "
                                 f"got {self.wsd_decay_iters}")


DECAY_STYLES = ("cosine", "linear", "constant", "WSD", "inverse-square-root")
"""The learning-rate decays :func:`~tokenloom.train.optim.schedule.lr_at` implements (:attr:`OptimConfig.decay_style`)."""

WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
"""The shapes of WSD's final decay (:attr:`OptimConfig.wsd_decay_style`)."""


def param_groups(modules: nn.Module | Iterable[nn.Module], weight_decay: float) -> list[dict]:
    """Two AdamW groups over ``modules``: decayed matmul weights, and the rest (biases, norms,
    ``nn.Embedding`` or ``is_embedding``-tagged tables); tied tensors once, first-seen order."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    embeddings = {id(m.weight) for mod in modules for m in mod.modules() if isinstance(m, nn.Embedding)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():  # parameters() de-duplicates tied tensors within a module
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            embedding = id(p) in embeddings or getattr(p, "is_embedding", False)
            (decay if p.dim() >= 2 and not embedding else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(modules: nn.Module | Iterable[nn.Module], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`; the learning rate is set per step from :func:`lr_at`."""
    groups = param_groups(modules, cfg.weight_decay)
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=use_fused(cfg, [p for g in groups for p in g["params"]]),
    )


def global_grad_norm(grads: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup | None] = (),
                     *, device: torch.device) -> torch.Tensor:
    """L2 norm (0-dim fp32 on ``device``) of ``grads`` this rank counts, the square all-reduced over
    each of ``groups`` in turn; with none exactly ``clip_grad_norm_``'s."""
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
    if not groups:
        return local
    sq = local.double().square()
    for group in groups:
        dist.all_reduce(sq, group=group)
    return sq.sqrt().float()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's ``min(1, max_norm / (norm + 1e-6))`` as a device tensor (1 when ``max_norm <= 0``)."""
    max_norm = max_norm if max_norm > 0 else math.inf
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def use_fused(cfg: OptimConfig, params: list[torch.Tensor]) -> bool | None:
    """torch's ``fused`` argument for these parameters (None: torch's default implementation)."""
    if cfg.fused is False or not params:
        return None
    supported = torch.utils._foreach_utils._get_fused_kernels_supported_devices()
    if all(p.device.type in supported and p.is_floating_point() for p in params):
        return True
    if cfg.fused:
        devices = sorted({p.device.type for p in params})
        raise TokenloomError(f"optim.fused: torch has no fused AdamW for parameters on {devices}")
    return None
