"""LayerNorm: ``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension.

Same precision policy as :mod:`.rms_norm`: fp32 statistics and affine, one cast back to
``x.dtype``; biased variance (as ``torch.nn.LayerNorm``). ``bias=None`` is the
bias-free LayerNorm of ``GPTConfig(bias=False)``.
"""

from __future__ import annotations

import torch

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
