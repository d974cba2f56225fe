"""The learning rate of a step as a pure function of the iteration (:func:`lr_at`, written into every
param group before each step): resume needs only the iteration, and a changed schedule is refused
unless ``override_opt_param_scheduler``. Warmup ``lr * (it + 1) / warmup_iters`` (no zero step),
then Megatron's ``--lr-decay-style``s, each ``min_lr`` from ``lr_decay_iters`` on.
"""

from __future__ import annotations

import math

import torch

from tokenloom.train.optim.adamw import OptimConfig


def lr_at(it: int, cfg: OptimConfig, train_iters: int) -> float:
    """Learning rate of 0-based step ``it`` (Megatron's ``OptimizerParamScheduler.get_lr``, in steps)."""
    decay_iters = cfg.lr_decay_iters or train_iters
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / cfg.warmup_iters
    if cfg.decay_style == "constant":
        return cfg.lr
    if it >= decay_iters:
        return cfg.min_lr
    if cfg.decay_style == "inverse-square-root":
        return max(cfg.min_lr, cfg.lr * math.sqrt(max(cfg.warmup_iters, 1) / max(it, 1)))
    if cfg.decay_style == "WSD":
        wsd_iters = cfg.wsd_decay_iters or 1
        progress = max(0.0, (it - (decay_iters - wsd_iters)) / wsd_iters)
        coeff = {"linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
                 "exponential": 2.0 * 0.5 ** progress - 1.0, "minus_sqrt": 1.0 - math.sqrt(progress)}
        return cfg.min_lr + coeff[cfg.wsd_decay_style] * (cfg.lr - cfg.min_lr)
    progress = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    if cfg.decay_style == "linear":
        return cfg.min_lr + (1.0 - progress) * (cfg.lr - cfg.min_lr)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
