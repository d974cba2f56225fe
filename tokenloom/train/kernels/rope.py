"""Rotary embedding, "rotate half" layout (GPT-NeoX, HF Llama, Megatron's default):
``rope(x) = x * cos + [-x2, x1] * sin`` with [seq, head_dim] tables whose halves repeat the
frequencies ``theta ** (-2i / head_dim)``, built in float64, stored fp32; rotation in fp32. The
interleaved (GPT-J) layout is not compatible with these tables.
"""

from __future__ import annotations

import torch

from ._common import upcast


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos, sin: [seq, head_dim]. Returns like ``x``."""
    x1, x2 = upcast(x).chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (upcast(x) * cos + rotated * sin).to(x.dtype)
