"""LayerNorm: ``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension.

Same precision policy as :mod:`.rms_norm`: fp32 statistics and affine, one cast back to
``x.dtype``; biased variance (as ``torch.nn.LayerNorm``). ``bias=None`` is the
bias-free LayerNorm of ``GPTConfig(bias=False)``.
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
    """``layer_norm`` that calls ATen's ``F.layer_norm`` on fp32 inputs and ``fused`` otherwise.

    On fp32, ATen's LayerNorm is already one fused kernel forward and one backward (CPU and
    CUDA), so compiling the reference can only rebuild it, and the rebuilt one is slower on
    CPU (see bench/RESULTS.md, notes) plus a compiled call's fixed cost. On bf16/fp16,
    ATen's backward rounds the weight gradient differently from this module's policy (off by
    many bf16 ulps), and ``fused`` keeps the fp32 upcast out of memory there.
    """

    def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5):
        if x.dtype == weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32):
            return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
        return fused(x, weight, bias, eps)

    return layer_norm
