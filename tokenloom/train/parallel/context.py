"""Context parallelism: each of ``cp`` ranks holds 1/cp of every sequence.

Layout (Megatron's load balancing for causal masks): a sequence of ``T`` tokens is cut
into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, so
under a causal mask every rank attends to about the same number of keys (a rank holding
only the first chunk would idle while the last one works). :func:`local_index` gives a
rank's token positions; :func:`take_local` cuts a batch tensor to them.

Attention: every layer all-gathers the keys and values of the cp group along the sequence
(:func:`gather_sequence`, whose backward reduce-scatters their gradients), and each rank
attends its own queries to all of them under :func:`attention_mask`, the causal (and,
with inter-document masking, same-document) relation of the *global* positions. Rotary
embeddings are applied before the gather, at each token's own position. The mask is
additive, built once per forward in the attention's dtype and shared by every layer. This is the
all-gather variant of context parallelism (Megatron's ``all_gather`` cp comm type, beside
its ring ``p2p``): one collective per layer instead of ``cp - 1`` ring steps, whose
trade-offs are holding the whole sequence's keys and values (``2 * kv_heads * head_dim`` per
token, a small share of a layer's activations), a dense mask of local queries x all keys,
and attention computing the masked-out half of that block too (no causal kernel skips it),
where a ring with a flash kernel per chunk and a log-sum-exp merge holds one peer's chunk
at a time, needs no mask and skips the blocks a causal mask hides (bench/RESULTS.md's
notes have the cost on CPU). Queries, the MLPs, norms and the loss
run on the local ``T / cp`` tokens, which is where the activation memory goes.

Loss and gradients: rank ``r``'s loss is ``cp * (its tokens' loss sum) / (the sample's
token count)`` (:func:`loss_scale` turns the model's local mean into it), so that the
gradient reduction, an average over the dp x cp ranks of one model shard, gives the
gradient of the sample's mean loss, as one process computes it; the reported loss is the
cp average of that.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


def gathered_index(seq: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions of the tokens of :func:`gather_sequence`'s output: every rank's
    :func:`local_index`, in rank order."""
    return torch.cat([local_index(seq, cp, r, device) for r in range(cp)])


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
    """Every cp rank's ``x`` joined along ``dim`` in rank order (tokens at
    :func:`gathered_index`); the backward sums the gradients and keeps this rank's part."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, dim, group)


def attention_mask(seq: int, cp: int, rank: int, cu_seqlens: torch.Tensor | None,
                   device: torch.device | str) -> torch.Tensor:
    """Which keys of :func:`gather_sequence`'s order each of this rank's queries attends to:
    boolean ``[batch or 1, 1, T / cp, T]``, True where the key's global position is at most
    the query's and, with ``cu_seqlens`` (``[batch, T + 1]`` document boundaries of the full
    sequence), in the same document."""
    q = local_index(seq, cp, rank, device)
    k = gathered_index(seq, cp, device)
    mask = (k[None, :] <= q[:, None]).unsqueeze(0)  # [1, Tq, Tk]
    if cu_seqlens is not None:
        bounds = cu_seqlens.to(device=device, dtype=torch.long)
        doc_q = torch.searchsorted(bounds, q.expand(bounds.shape[0], -1).contiguous(), right=True)
        doc_k = torch.searchsorted(bounds, k.expand(bounds.shape[0], -1).contiguous(), right=True)
        mask = mask & (doc_q[:, :, None] == doc_k[:, None, :])
    return mask.unsqueeze(1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`attention_mask` as attention adds it (0 where attended, -inf elsewhere), in the
    attention's ``dtype``: built once per forward and given to every layer, so one copy is
    held for backward instead of one conversion per layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def loss_scale(loss_mask: torch.Tensor | None, local_mask: torch.Tensor | None, cp: int, seq: int) -> torch.Tensor | float:
    """The factor that turns the model's mean loss over this rank's tokens (``local_mask``'s
    nonzero ones, the mean's count clamped at 1 as :func:`~tokenloom.train.model.masked_mean`
    does) into ``cp * local loss sum / sample token count`` (module docstring): the sum of the
    micro-batch's mask over all of its ``seq`` tokens is known to every cp rank."""
    if loss_mask is None or local_mask is None:
        return 1.0  # every rank holds seq / cp of the tokens: cp * (seq / cp) / seq
    local = local_mask.float().sum().clamp(min=1.0)
    total = loss_mask.float().sum().clamp(min=1.0)
    return cp * local / total
