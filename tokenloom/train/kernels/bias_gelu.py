"""Bias + GELU: ``gelu(x + bias)``, the first MLP GEMM's bias fused in (Megatron's ``bias_gelu``).

``approximate="tanh"`` (Megatron's / GPT-2's) or ``"none"`` (exact erf); evaluate a checkpoint
with the variant it was trained with. Computed in fp32, cast to ``x.dtype``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from ._common import upcast

Approximate = Literal["tanh", "none"]


def bias_gelu_reference(
    x: torch.Tensor, bias: torch.Tensor | None = None, approximate: Approximate = "tanh"
) -> torch.Tensor:
    """x: [..., ffn]; bias: [ffn] or None. Returns ``gelu(x + bias)`` like ``x``."""
    z = upcast(x) if bias is None else upcast(x) + upcast(bias)
    return F.gelu(z, approximate=approximate).to(x.dtype)


def bias_gelu_with(fused: Callable) -> Callable:
    """``fused`` with a bias, else ATen's ``F.gelu`` (one kernel already; compiled alone is slower)."""

    def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: Approximate = "tanh"):
        if bias is None:
            return F.gelu(x, approximate=approximate)
        return fused(x, bias, approximate)

    return bias_gelu
