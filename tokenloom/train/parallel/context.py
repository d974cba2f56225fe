"""Context parallelism: each of ``cp`` ranks holds 1/cp of every sequence, as chunks ``r`` and
``2 * cp - 1 - r`` of ``2 * cp`` (Megatron's causal load balancing; :func:`local_index`).

Attention all-gathers the group's K/V per layer (:func:`gather_sequence`; RoPE applied before, at
each token's position), then each of the rank's two query chunks runs one SDPA over the keys up to
its end (:class:`CausalChunks`): no work on later keys, no log-sum-exp merge. Masks relate global
positions (:func:`chunk_mask`): a lower-right ``CausalBias`` on CUDA without documents, else
additive masks built once per forward. This is Megatron's ``all_gather`` cp type, not its ring: one
collective per layer, for holding the whole sequence's K/V and no overlap with attention.

Loss: rank ``r``'s is ``cp * (its tokens' loss sum) / (sample token count)`` (:func:`loss_scale`),
so the dp x cp gradient average is the one-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tokenloom.train.kernels.attention import document_ids
from tokenloom.train.parallel.mappings import all_gather_first_dim, reduce_scatter_first_dim

Group = dist.ProcessGroup | None


def local_index(seq: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Ascending positions of ``rank``'s tokens (``seq`` divisible by ``2 * cp``, as configs check)."""
    chunk = seq // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def take_local(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim`` (a batch's sequence dim)."""
    return x.index_select(dim, local_index(x.shape[dim], cp, rank, x.device))


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_first_dim(x.movedim(dim, 0).contiguous(), group).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_first_dim(grad.movedim(ctx.dim, 0).contiguous(), ctx.group).movedim(0, ctx.dim), \
            None, None


def gather_sequence(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Every cp rank's ``x`` joined along ``dim`` in rank order; backward reduce-scatters."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, dim, group)


@dataclass(frozen=True)
class CausalChunks:
    """A cp rank's attention plan: its two query chunks see keys up to ``ends`` (global order) under
    ``masks`` (additive [batch or 1, 1, chunk, end], shared by every layer, or a ``CausalBias``).
    Built outside compiled code: dynamo takes a ``CausalBias`` but cannot construct one."""

    cp: int
    chunk: int
    ends: tuple[int, int]
    masks: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def of(cls, seq: int, cp: int, rank: int, device: torch.device, dtype: torch.dtype,
           cu_seqlens: torch.Tensor | None = None) -> CausalChunks:
        """``cu_seqlens``: document boundaries [batch, seq + 1] under inter-document masking."""
        chunk = seq // (2 * cp)
        ends = ((rank + 1) * chunk, (2 * cp - rank) * chunk)
        masks: tuple[torch.Tensor, ...]
        if cu_seqlens is None and device.type == "cuda":
            from torch.nn.attention.bias import causal_lower_right  # lazy: start-up (loads dynamo)

            masks = tuple(causal_lower_right(chunk, end) for end in ends)
        else:
            masks = tuple(additive_mask(chunk_mask(end, chunk, cu_seqlens, device), dtype) for end in ends)
        return cls(cp, chunk, ends, (masks[0], masks[1]))


def global_order(t: torch.Tensor, cp: int, chunk: int) -> torch.Tensor:
    """``t`` [B, heads, T, d] from :func:`gather_sequence`'s order to global order."""
    parts = t.unflatten(2, (cp, 2, chunk))  # [B, heads, cp, 2, chunk, d]
    return torch.cat([parts[:, :, :, 0], parts[:, :, :, 1].flip(2)], 2).flatten(2, 3)


def causal_chunks_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: CausalChunks,
                            dropout_p: float = 0.0) -> torch.Tensor:
    """q [B, h, 2 chunk, d], k/v [B, h_kv, T, d] gathered -> [B, h, 2 chunk, d]. GQA: ``enable_gqa``
    on CPU, repeated heads on CUDA (its causal and masked kernels need equal head counts)."""
    k, v = global_order(k, chunks.cp, chunks.chunk), global_order(v, chunks.cp, chunks.chunk)
    gqa = k.shape[1] != q.shape[1]
    if gqa and q.device.type != "cpu":
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    c = chunks.chunk
    out = [F.scaled_dot_product_attention(q[:, :, i * c:(i + 1) * c], k[:, :, :end], v[:, :, :end], attn_mask=mask,
                                          dropout_p=dropout_p, enable_gqa=gqa)
           for i, (end, mask) in enumerate(zip(chunks.ends, chunks.masks, strict=True))]
    return torch.cat(out, 2)


def chunk_mask(end: int, chunk: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Boolean ``[batch or 1, 1, chunk, end]``: lower-right causal for the ``chunk`` queries ending at
    ``end``, and with ``cu_seqlens`` within each query's document."""
    mask = torch.ones(chunk, end, dtype=torch.bool, device=device).tril(end - chunk)[None]  # [1, chunk, end]
    if cu_seqlens is not None:
        docs = document_ids(cu_seqlens.to(device), end)  # [batch, end]
        mask = mask & (docs[:, -chunk:, None] == docs[:, None, :])
    return mask.unsqueeze(1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as additive 0 / -inf in ``dtype``: one copy held for backward, not one per layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def loss_scale(loss_mask: torch.Tensor | None, local_mask: torch.Tensor | None, cp: int, seq: int) -> torch.Tensor | float:
    """Factor from the model's local mean loss (count clamped at 1, as ``masked_mean``) to ``cp *
    local loss sum / sample token count``; every cp rank knows the full mask's sum."""
    if loss_mask is None or local_mask is None:
        return 1.0  # every rank holds seq / cp of the tokens: cp * (seq / cp) / seq
    local = local_mask.float().sum().clamp(min=1.0)
    total = loss_mask.float().sum().clamp(min=1.0)
    return cp * local / total
