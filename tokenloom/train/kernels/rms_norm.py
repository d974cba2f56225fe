"""RMSNorm: ``x / sqrt(mean(x^2) + eps) * weight``. Statistics and affine in fp32, one cast to
``x.dtype`` (Transformer Engine's and Megatron's policy; bit-identical to ``F.rms_norm`` on bf16,
unlike HF Llama, which casts before the weight). Eager pays an fp32 copy of ``x``.
"""

from __future__ import annotations

import torch

from ._common import upcast


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """x: [..., hidden]; weight: [hidden]. Returns a tensor like ``x``."""
    xf = upcast(x)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * upcast(weight)).to(x.dtype)
