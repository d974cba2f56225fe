"""RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dimension.

Precision policy (as Transformer Engine and Megatron's fused norms): the statistics and
the affine step run in fp32 and the result is cast once to ``x.dtype``. This costs an
fp32 copy of ``x`` in eager mode (the compiled and Triton versions keep it in
registers). It is bit-identical to ``F.rms_norm`` (the model's ``nn.RMSNorm``) on bf16
inputs, and differs from Hugging Face Llama, which casts back to ``x.dtype`` before
multiplying by the weight: a part of the bf16 outputs differ, by at most 2 ulp (see
bench/RESULTS.md, notes).
"""

from __future__ import annotations

import torch

from ._common import upcast


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """x: [..., hidden]; weight: [hidden]. Returns a tensor like ``x``."""
    xf = upcast(x)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * upcast(weight)).to(x.dtype)
