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


def rope_cache(
    seq_len: int, head_dim: int, theta: float = 10000.0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each fp32 ``[seq_len, head_dim]`` (same as the model's own)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos, sin: [seq, head_dim]. Returns like ``x``."""
    x1, x2 = upcast(x).chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (upcast(x) * cos + rotated * sin).to(x.dtype)
