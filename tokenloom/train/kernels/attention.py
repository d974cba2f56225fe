"""Causal self-attention through ``F.scaled_dot_product_attention``.

SDPA picks the fused kernel for the device (flash / memory-efficient / cuDNN on CUDA,
``_scaled_dot_product_flash_attention_for_cpu`` on CPU), so no mode needs its own
attention: every :class:`~.selector.KernelSet` uses :func:`attention_sdpa`.
:func:`attention_reference` is the textbook softmax(QK^T / sqrt(d)) V that materialises
the ``[batch, heads, seq, seq]`` scores; it exists as the test oracle, not for training.

Document-isolated attention (``documents=cu_seqlens``, megatron-core's inter-document
masking): a query attends to earlier keys of its own document only. Each row of
``cu_seqlens`` ([batch, seq + 1], int32, padded with ``seq``) becomes a document id per
position, and SDPA gets the boolean mask ``causal & same document`` ([batch, 1, seq, seq];
SDPA then uses its memory-efficient or math kernel instead of flash). On CUDA with
``torch.nn.attention.flex_attention`` the same rule is a block mask instead, which skips
whole blocks across documents and never materialises ``seq x seq``.

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


def document_ids(cu_seqlens: torch.Tensor, seq: int) -> torch.Tensor:
    """[batch, seq] index of the document each position belongs to, from ``cu_seqlens``
    ([batch, n] document starts followed by ``seq``, padded with ``seq``)."""
    positions = torch.arange(seq, device=cu_seqlens.device).expand(cu_seqlens.shape[0], seq).contiguous()
    return torch.searchsorted(cu_seqlens[:, 1:].contiguous().to(torch.int64), positions, right=True)


def document_mask(cu_seqlens: torch.Tensor, seq: int) -> torch.Tensor:
    """[batch, 1, seq, seq] boolean, True where a query may attend: causal and same document."""
    docs = document_ids(cu_seqlens, seq)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=cu_seqlens.device).tril()
    return (docs[:, :, None] == docs[:, None, :]).logical_and_(causal).unsqueeze(1)


def _flex_documents(q, k, v, cu_seqlens, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    docs = document_ids(cu_seqlens, q.shape[-2])

    def rule(b, h, qi, ki):
        return (qi >= ki) & (docs[b, qi] == docs[b, ki])

    mask = create_block_mask(rule, q.shape[0], None, q.shape[-2], k.shape[-2], device=q.device)
    return flex_attention(q, k, v, block_mask=mask, scale=scale)


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [batch, heads, seq, head_dim]; k, v: [batch, kv_heads, seq, head_dim];
    ``documents``: optional ``cu_seqlens`` [batch, seq + 1] (causal within each document)."""
    k, v = _expand_kv(q, k, v)
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
    if not causal:
        raise ValueError("document masking is causal")
    if q.device.type == "cuda" and not dropout_p:
        try:
            return _flex_documents(q, k, v, documents, scale)
        except ImportError:  # torch without flex_attention: the dense mask below
            pass
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents, q.shape[-2]),
                                          dropout_p=dropout_p, scale=scale)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Naive attention (softmax in fp32 or wider), same signature as :func:`attention_sdpa`; no
    dropout. With ``documents``, each document of each sample is attended on its own."""
    if dropout_p:
        raise ValueError("attention_reference has no dropout; it is a test oracle")
    if documents is not None:  # one causal attention per document slice, concatenated
        out = torch.empty_like(q)
        for b, starts in enumerate(documents.tolist()):
            for s, e in zip(starts[:-1], starts[1:], strict=True):
                if e > s:
                    out[b:b + 1, :, s:e] = attention_reference(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e],
                                                               v[b:b + 1, :, s:e], causal, 0.0, scale)
        return out
    k, v = _expand_kv(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = upcast(q @ k.transpose(-2, -1)) * scale
    if causal:
        # top-left aligned, as SDPA's is_causal
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1).to(v.dtype) @ v).to(q.dtype)
