"""LayerNorm over the last dimension: fp32 statistics and affine, one cast back (as :mod:`.rms_norm`),
biased variance (as ``nn.LayerNorm``); ``bias=None`` for ``GPTConfig(bias=False)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._common import upcast


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """x: [..., hidden]; weight, bias: [hidden]. Returns a tensor like ``x``."""
    xf = upcast(x)
    mean = xf.mean(dim=-1, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * upcast(weight)
    if bias is not None:
        y = y + upcast(bias)
    return y.to(x.dtype)


def layer_norm_with(fused: Callable) -> Callable:
    """ATen's ``F.layer_norm`` on fp32 (already one fused kernel; a compiled rebuild is slower,
    bench/RESULTS.md), ``fused`` otherwise (ATen's bf16 weight grad breaks this module's policy)."""

    def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5):
        if x.dtype == weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32):
            return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
        return fused(x, weight, bias, eps)

    return layer_norm
