"""Bias + dropout + residual: ``residual + dropout(x + bias, p)`` (Megatron's ``bias_dropout_add``),
the tail of every sublayer. Eager draws from the global generator, compiled from inductor's
Philox stream, so their masks differ for one seed (same rate and scaling). Fusing matters on GPUs,
where the op is bandwidth bound (training-stack.md section f).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bias_dropout_add_reference(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool = True,
) -> torch.Tensor:
    """x, residual: [..., hidden]; bias: [hidden] or None. Returns like ``residual``."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)
