"""Bias + dropout + residual add: ``residual + dropout(x + bias, p)`` (Megatron's
``bias_dropout_add``), the tail of every attention and MLP sublayer.

With ``training=False`` (or ``p == 0``) dropout is the identity. The random mask comes
from the implementation's RNG: eager uses the global torch generator, ``torch.compile``
uses inductor's Philox stream, so the compiled and eager masks differ for the same seed
(the drop rate and ``1/(1-p)`` scaling are the same). Fusing saves two full passes over
the activations in eager-vs-compiled terms; on CPU it wins only at some sizes (see
bench/RESULTS.md, notes; training-stack.md section f), and it matters on GPUs, where the
op is bandwidth bound.
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
