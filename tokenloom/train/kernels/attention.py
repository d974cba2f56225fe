"""Causal self-attention through ``F.scaled_dot_product_attention``.

SDPA picks the fused kernel for the device (flash / memory-efficient / cuDNN on CUDA,
``_scaled_dot_product_flash_attention_for_cpu`` on CPU), so no mode needs its own
attention: every :class:`~.selector.KernelSet` uses :func:`attention_sdpa`.
:func:`attention_reference` is the textbook softmax(QK^T / sqrt(d)) V that materialises
the ``[batch, heads, seq, seq]`` scores; it exists as the test oracle, not for training.

Grouped-query attention (fewer K/V heads than Q heads) repeats K/V with
``repeat_interleave``: this costs ``heads / kv_heads`` copies of K and V but works on
every torch >= 2.4 (``enable_gqa`` needs 2.5).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._common import upcast


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads == kv_heads:
        return k, v
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    rep = heads // kv_heads
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """q: [batch, heads, seq, head_dim]; k, v: [batch, kv_heads, seq, head_dim]."""
    k, v = _expand_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive attention (softmax in fp32 or wider), same signature as :func:`attention_sdpa`; no dropout."""
    if dropout_p:
        raise ValueError("attention_reference has no dropout; it is a test oracle")
    k, v = _expand_kv(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = upcast(q @ k.transpose(-2, -1)) * scale
    if causal:
        # top-left aligned, as SDPA's is_causal
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1).to(v.dtype) @ v).to(q.dtype)
