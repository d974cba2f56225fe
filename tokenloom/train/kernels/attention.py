"""Causal self-attention through ``F.scaled_dot_product_attention``.

SDPA picks the device's fused kernel, so every :class:`~.selector.KernelSet` uses
:func:`attention_sdpa`; :func:`attention_reference` (materialised scores) is the test oracle.

Document-isolated attention (``documents``, megatron-core's inter-document masking): a query sees
earlier keys of its own document only. :func:`document_attention_mask` turns ``cu_seqlens``
([batch, seq + 1], padded with ``seq``) into the mask every layer of a forward shares: a
flex-attention ``BlockMask`` on CUDA without dropout (tiles across documents skipped, no ``seq x
seq`` tensor), else the dense ``causal & same document`` boolean mask for SDPA.

GQA repeats K/V with ``repeat_interleave`` (copies of K and V, but no need for ``enable_gqa``).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ._common import upcast

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # older torch: document masking takes the dense mask everywhere
    BlockMask = flex_attention = None  # type: ignore[misc, assignment]  # names kept, checked for None


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads == kv_heads:
        return k, v
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    rep = heads // kv_heads
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def document_ids(cu_seqlens: torch.Tensor, seq: int) -> torch.Tensor:
    """[batch, seq] document index of each position, from ``cu_seqlens``."""
    positions = torch.arange(seq, device=cu_seqlens.device).expand(cu_seqlens.shape[0], seq).contiguous()
    return torch.searchsorted(cu_seqlens[:, 1:].contiguous().to(torch.int64), positions, right=True)


def document_mask(cu_seqlens: torch.Tensor, seq: int) -> torch.Tensor:
    """[batch, 1, seq, seq] boolean, True where a query may attend: causal and same document."""
    docs = document_ids(cu_seqlens, seq)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=cu_seqlens.device).tril()
    return (docs[:, :, None] == docs[:, None, :]).logical_and_(causal).unsqueeze(1)


FLEX_BLOCK = 128
"""Tile edge of :func:`document_block_mask` (flex attention's default block size)."""


def document_block_mask(cu_seqlens: torch.Tensor, seq: int, block: int = FLEX_BLOCK) -> BlockMask:
    """``causal & same document`` as a ``BlockMask`` from each tile's first and last document id,
    O(batch x (seq / block)^2). Ids never decrease, so key tile ``j`` before query tile ``i`` is
    partial when ``last[j] == first[i]`` and full when ``first[j] == last[i]``; the diagonal is
    partial. Not ``create_block_mask``: it evaluates every ``seq x seq`` pair, and compiled inside
    our blocks it made an illegal memory access on CUDA (bench/RESULTS.md, notes). ``mask_mod``
    reads ids padded to whole tiles, so no index is out of range."""
    batch, tiles = cu_seqlens.shape[0], -(-seq // block)
    docs = document_ids(cu_seqlens, seq)
    padded = torch.full((batch, tiles * block), -1, dtype=docs.dtype, device=docs.device)
    padded[:, :seq] = docs
    first = docs[:, ::block]  # [batch, tiles]
    last = docs[:, torch.clamp(torch.arange(1, tiles + 1, device=docs.device) * block, max=seq) - 1]
    earlier = torch.ones(tiles, tiles, dtype=torch.bool, device=docs.device).tril(-1)  # key tile j < query tile i
    shared = earlier & (last[:, None, :] == first[:, :, None])  # [batch, i, j]
    whole = torch.ones(tiles, dtype=torch.bool, device=docs.device)
    whole[-1] = seq % block == 0  # a tile cut by the sequence's end is never full
    full = shared & (first[:, None, :] == last[:, :, None]) & whole[None, :, None]
    partial = (shared & ~full) | torch.eye(tiles, dtype=torch.bool, device=docs.device)

    def blocks(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = keep.sum(-1, dtype=torch.int32)[:, None]  # [batch, 1 head, tiles]
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]
        return count, order  # kept tiles first, in ascending order

    def rule(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (padded[b, q_idx] == padded[b, kv_idx])

    return BlockMask.from_kv_blocks(*blocks(partial), *blocks(full), BLOCK_SIZE=block, mask_mod=rule,
                                    seq_lengths=(seq, seq))


FLEX_MIN_HEAD_DIM = 16
"""Smallest head dimension flex attention compiles on CUDA (Triton's ``tl.dot`` needs 16)."""


def flex_usable(device: torch.device, dropout_p: float, head_dim: int) -> bool:
    """Whether document masking runs on flex attention: CUDA, no dropout, heads of at least
    :data:`FLEX_MIN_HEAD_DIM`, torch has it. Else the dense mask (affordable for models that
    small: narrow heads died in flex's lowering on an H100)."""
    return (device.type == "cuda" and not dropout_p and head_dim >= FLEX_MIN_HEAD_DIM
            and flex_attention is not None)


def document_attention_mask(cu_seqlens: torch.Tensor, seq: int, *, flex: bool) -> torch.Tensor | BlockMask:
    """``BlockMask`` when ``flex``, else the dense mask; build once per forward for every layer."""
    return document_block_mask(cu_seqlens, seq) if flex else document_mask(cu_seqlens, seq)


@functools.cache
def _compiled_flex_attention():
    """``flex_attention`` compiled once (uncompiled it materialises the scores; torchtitan does
    the same). Eager callers only: a nested compiled function split compiled blocks' graphs."""
    return torch.compile(flex_attention, dynamic=False)


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
    documents: torch.Tensor | BlockMask | None = None,
) -> torch.Tensor:
    """q: [batch, heads, seq, head_dim]; k, v: [batch, kv_heads, seq, head_dim]; ``documents``:
    a :func:`document_attention_mask` or the ``cu_seqlens`` to build one from."""
    k, v = _expand_kv(q, k, v)
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
    if not causal:
        raise ValueError("document masking is causal")
    if isinstance(documents, torch.Tensor) and documents.dtype != torch.bool:  # cu_seqlens
        documents = document_attention_mask(documents, q.shape[-2], flex=flex_usable(q.device, dropout_p, q.shape[-1]))
    if isinstance(documents, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=documents, dropout_p=dropout_p, scale=scale)
    if dropout_p:
        raise ValueError("flex attention has no dropout: build the documents' dense mask for dropout")
    if torch.compiler.is_compiling():  # inside a compiled block: dynamo captures flex itself
        return flex_attention(q, k, v, block_mask=documents, scale=scale)
    return _compiled_flex_attention()(q, k, v, block_mask=documents, scale=scale)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Naive fp32 attention, :func:`attention_sdpa`'s signature, no dropout; ``documents``: cu_seqlens."""
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
