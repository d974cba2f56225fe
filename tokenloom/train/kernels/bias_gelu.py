"""Bias + GELU: ``gelu(x + bias)``, fusing the bias of the first MLP GEMM into the
activation (Megatron's ``bias_gelu``).

``approximate="tanh"`` is Megatron's / GPT-2's formula
``0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``; ``"none"`` is the exact
``0.5 z (1 + erf(z / sqrt(2)))``. They differ by up to 4.7e-4 absolute (at z = 2.7), so a checkpoint
must be evaluated with the variant it was trained with. Computed in fp32, cast to
``x.dtype``.
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
    """``bias_gelu`` that calls ``fused`` when there is a bias to fuse and ATen's GELU when
    there is none: ``F.gelu`` is one kernel already (fp32 math for bf16 inputs, one rounding),
    and compiling it alone is slower on CPU (see bench/RESULTS.md, notes)."""

    def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: Approximate = "tanh"):
        if bias is None:
            return F.gelu(x, approximate=approximate)
        return fused(x, bias, approximate)

    return bias_gelu
