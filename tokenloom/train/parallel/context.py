"""Context parallelism: each of ``cp`` ranks holds 1/cp of every sequence.

Layout (Megatron's load balancing for causal masks): a sequence of ``T`` tokens is cut
into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, so
under a causal mask every rank attends to about the same number of keys (a rank holding
only the first chunk would idle while the last one works). :func:`local_index` gives a
rank's token positions; :func:`take_local` cuts a batch tensor to them.

Attention: every layer all-gathers the keys and values of the cp group along the sequence
(:func:`gather_sequence`, whose backward reduce-scatters their gradients). Rotary embeddings
are applied before the gather, at each token's own position. Then the gathered keys are put
in global order and each of the rank's two query chunks runs one SDPA call over the keys up to
its own end (:class:`CausalChunks`, :func:`causal_chunks_attention`): a query chunk never sees
the keys after it, so no work goes to them, and one call over the whole visible prefix needs
no log-sum-exp merge (a ring, holding one peer's chunk at a time, does). Each call's mask is
the causal (and, with inter-document masking, same-document) relation of the chunk's *global*
positions to the prefix's (:func:`chunk_mask`): without documents on CUDA, torch's lower-right
``CausalBias`` (no mask tensor: a flash or memory-efficient kernel, which skips the masked
blocks); otherwise additive masks, built once per forward in the attention's dtype and shared
by every layer.

This is the all-gather variant of context parallelism (Megatron's ``all_gather`` cp comm
type, beside its ring ``p2p``): one collective per layer instead of ``cp - 1`` ring steps, at
the price of holding the whole sequence's keys and values (``2 * kv_heads * head_dim`` per
token, a small share of a layer's activations) and of the collective not overlapping the
attention (a ring overlaps each step's exchange with the previous chunk's compute).
Queries, the MLPs, norms and the loss run on the local ``T / cp`` tokens, which is where the
activation memory goes.

Loss and gradients: rank ``r``'s loss is ``cp * (its tokens' loss sum) / (the sample's
token count)`` (:func:`loss_scale` turns the model's local mean into it), so that the
gradient reduction, an average over the dp x cp ranks of one model shard, gives the
gradient of the sample's mean loss, as one process computes it; the reported loss is the
cp average of that.
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
    """Positions (in ``[0, seq)``, ascending) of the tokens rank ``rank`` of ``cp`` holds:
    chunks ``rank`` and ``2 * cp - 1 - rank`` of ``2 * cp``. ``seq`` must be divisible by
    ``2 * cp`` (checked by the config)."""
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
    """Every cp rank's ``x`` joined along ``dim`` in rank order (each rank's tokens at its
    :func:`local_index`); the backward sums the gradients and keeps this rank's part."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, dim, group)


@dataclass(frozen=True)
class CausalChunks:
    """The attention of one cp rank's queries, in place of one mask: the rank's two chunks of
    ``chunk`` tokens are global chunks ``rank`` and ``2 * cp - 1 - rank``, whose queries see the keys
    up to ``ends`` (in global order), each under its ``masks`` entry: :func:`chunk_mask` as an
    additive mask [batch or 1, 1, chunk, end], built once per forward in the attention's dtype and
    shared by every layer (SDPA would otherwise convert a boolean one per call and keep it for
    backward); or, causal without documents on CUDA, torch's lower-right ``CausalBias`` (no tensor;
    SDPA runs a causal kernel). Built outside any compiled region: dynamo cannot construct a
    ``CausalBias``, but takes one as input."""

    cp: int
    chunk: int
    ends: tuple[int, int]
    masks: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def of(cls, seq: int, cp: int, rank: int, device: torch.device, dtype: torch.dtype,
           cu_seqlens: torch.Tensor | None = None) -> CausalChunks:
        """``cu_seqlens``: the batch's document boundaries ([batch, seq + 1]) under inter-document
        masking, else None."""
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
    """``t`` [B, heads, T, d] in :func:`gather_sequence`'s order (every rank's two chunks, rank by
    rank) -> the same tokens in global order: the ranks' first chunks in rank order, then their
    second chunks in reverse rank order."""
    parts = t.unflatten(2, (cp, 2, chunk))  # [B, heads, cp, 2, chunk, d]
    return torch.cat([parts[:, :, :, 0], parts[:, :, :, 1].flip(2)], 2).flatten(2, 3)


def causal_chunks_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: CausalChunks,
                            dropout_p: float = 0.0) -> torch.Tensor:
    """q [B, h, 2 chunk, d] (this rank's tokens), k/v [B, h_kv, T, d] (:func:`gather_sequence`'s
    order) -> [B, h, 2 chunk, d]: each query chunk attends causally to the keys up to its own end
    (module docstring). Grouped heads are SDPA's ``enable_gqa`` on CPU and repeated key/value
    heads on CUDA (its lower-right causal kernel and its masked kernel take equal head counts)."""
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
    """Which of the keys at global positions ``0 .. end`` the ``chunk`` queries ending at ``end``
    attend to: boolean ``[batch or 1, 1, chunk, end]``, lower-right causal (query ``i`` sees keys up
    to ``end - chunk + i``) and, with ``cu_seqlens`` (``[batch, T + 1]`` document boundaries of the
    full sequence), within the query's document (:func:`~tokenloom.train.kernels.attention.document_ids`)."""
    mask = torch.ones(chunk, end, dtype=torch.bool, device=device).tril(end - chunk)[None]  # [1, chunk, end]
    if cu_seqlens is not None:
        docs = document_ids(cu_seqlens.to(device), end)  # [batch, end]
        mask = mask & (docs[:, -chunk:, None] == docs[:, None, :])
    return mask.unsqueeze(1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (:func:`chunk_mask`) as attention adds it (0 where attended, -inf elsewhere),
    in the attention's ``dtype``: built once per forward and given to every layer, so one copy is
    held for backward instead of one conversion per layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def loss_scale(loss_mask: torch.Tensor | None, local_mask: torch.Tensor | None, cp: int, seq: int) -> torch.Tensor | float:
    """The factor that turns the model's mean loss over this rank's tokens (``local_mask``'s
    nonzero ones, the mean's count clamped at 1 as :func:`~tokenloom.train.model.gpt.masked_mean`
    does) into ``cp * local loss sum / sample token count`` (module docstring): the sum of the
    micro-batch's mask over all of its ``seq`` tokens is known to every cp rank."""
    if loss_mask is None or local_mask is None:
        return 1.0  # every rank holds seq / cp of the tokens: cp * (seq / cp) / seq
    local = local_mask.float().sum().clamp(min=1.0)
    total = loss_mask.float().sum().clamp(min=1.0)
    return cp * local / total
