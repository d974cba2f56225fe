"""Rotary position embedding, "rotate half" layout (GPT-NeoX, Llama in Hugging Face,
Megatron's default ``rotary_interleaved=False``).

For a head vector split into halves ``x = [x1, x2]``:
``rope(x) = x * cos + [-x2, x1] * sin`` with ``cos``/``sin`` tables of shape
``[seq, head_dim]`` whose two halves repeat the same ``head_dim / 2`` frequencies
``theta ** (-2i / head_dim)``. The tables are built once in float64 and stored as fp32
(bf16 would keep only 2-3 significant digits of each value); the rotation
runs in fp32 and is cast back to ``x.dtype``. The interleaved (GPT-J) layout pairs
``x[2i], x[2i+1]`` instead and is not compatible with these tables.
"""

from __future__ import annotations

import torch

from ._common import upcast


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos, sin: [seq, head_dim]. Returns like ``x``."""
    x1, x2 = upcast(x).chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (upcast(x) * cos + rotated * sin).to(x.dtype)
