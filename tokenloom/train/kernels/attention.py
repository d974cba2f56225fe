"""Causal self-attention through ``F.scaled_dot_product_attention``.

SDPA picks the fused kernel for the device (flash / memory-efficient / cuDNN on CUDA,
``_scaled_dot_product_flash_attention_for_cpu`` on CPU), so no mode needs its own
attention: every :class:`~.selector.KernelSet` uses :func:`attention_sdpa`.
:func:`attention_reference` is the textbook softmax(QK^T / sqrt(d)) V that materialises
the ``[batch, heads, seq, seq]`` scores; it exists as the test oracle, not for training.

Document-isolated attention (``documents``, megatron-core's inter-document masking): a
query attends to earlier keys of its own document only. Each row of ``cu_seqlens``
([batch, seq + 1], int32, padded with ``seq``) becomes a document id per position, and
:func:`document_attention_mask` turns them into the mask every layer of one forward
shares (the model builds it once per micro-batch, outside any compiled block):

* on CUDA without dropout, a flex-attention ``BlockMask`` (:func:`document_block_mask`),
  run by one ``torch.compile``'d ``flex_attention``: whole 128 x 128 tiles across
  documents are skipped and ``seq x seq`` is never materialised;
* elsewhere, the boolean ``causal & same document`` mask ([batch, 1, seq, seq]) for SDPA
  (which then uses its memory-efficient or math kernel instead of flash).

Grouped-query attention (fewer K/V heads than Q heads) repeats K/V with
``repeat_interleave``: this costs ``heads / kv_heads`` copies of K and V but works on
every torch >= 2.4 (``enable_gqa`` needs 2.5).
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
    """[batch, seq] index of the document each position belongs to, from ``cu_seqlens``
    ([batch, n] document starts followed by ``seq``, padded with ``seq``)."""
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
    """The ``causal & same document`` rule as a flex-attention ``BlockMask``, built from
    each tile's first and last document id: O(batch x (seq / block)^2) work and memory.

    Document ids never decrease along a row, so for a key tile ``j`` before a query tile
    ``i`` the two share a document exactly when ``last[j] == first[i]`` (the tile pair is
    then partial) and every pair attends when ``first[j] == last[i]`` (full: the kernel
    skips the mask); the diagonal tile is partial (causal), later tiles are empty.

    Written here rather than taken from ``create_block_mask``: that one evaluates the rule
    on every ``seq x seq`` pair (eagerly: ``batch x seq^2`` booleans per call), and its
    compiled form, traced inside our compiled blocks, made an illegal memory access on
    CUDA (the first evaluation of a ``compile: true`` run; see bench/RESULTS.md, notes). The mask's
    rule (``mask_mod``) reads ids padded to whole tiles, so no index is ever out of range.
    """
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
"""Smallest head dimension flex attention compiles on CUDA (Triton's ``tl.dot`` needs 16;
torch's lowering raised NotImplementedError below it)."""


def flex_usable(device: torch.device, dropout_p: float, head_dim: int) -> bool:
    """Whether document masking runs on flex attention: CUDA (its fused kernel is Triton's),
    no dropout (flex has none), heads of at least :data:`FLEX_MIN_HEAD_DIM` and a torch that
    has it. Otherwise SDPA takes the dense ``[batch, 1, seq, seq]`` mask: seq^2 booleans per
    sample, affordable for the small models whose heads are that narrow (seen on an H100:
    head dim 8 with document masking died in flex's lowering before this check)."""
    return (device.type == "cuda" and not dropout_p and head_dim >= FLEX_MIN_HEAD_DIM
            and flex_attention is not None)


def document_attention_mask(cu_seqlens: torch.Tensor, seq: int, *, flex: bool) -> torch.Tensor | BlockMask:
    """The mask of ``cu_seqlens`` that :func:`attention_sdpa` takes as ``documents``: a
    ``BlockMask`` when ``flex`` (see :func:`flex_usable`), else the dense boolean mask.
    Build it once per forward and give it to every layer."""
    return document_block_mask(cu_seqlens, seq) if flex else document_mask(cu_seqlens, seq)


@functools.cache
def _compiled_flex_attention():
    """``flex_attention`` compiled once per process: uncompiled it runs an unfused reference
    that materialises the scores (torchtitan compiles it the same way). For eager callers
    only: inside a compiled block :func:`attention_sdpa` calls ``flex_attention`` itself, as
    torch split the block's graph at a nested compiled function (seen on CUDA with
    ``TORCH_LOGS=recompiles``: flex and two resumed halves of the block compiled apart)."""
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
    """q: [batch, heads, seq, head_dim]; k, v: [batch, kv_heads, seq, head_dim];
    ``documents``: optional, causal within each document: a :func:`document_attention_mask`
    (a ``BlockMask`` or the dense boolean mask), or the ``cu_seqlens`` [batch, seq + 1] it
    is built from here (context parallelism's masks go to
    :func:`~tokenloom.train.parallel.context.causal_chunks_attention` instead)."""
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
