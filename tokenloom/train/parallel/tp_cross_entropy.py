"""Cross entropy over logits whose vocabulary is split over the tensor-parallel group.

:func:`vocab_parallel_cross_entropy` mirrors Megatron-core's ``tensor_parallel/cross_entropy.py``
(rank r holds ids ``[r V/tp, (r+1) V/tp)``; any leading dims). Per token, in fp32::

    m = all_reduce_MAX(max_local z);  z -= m
    p = all_reduce_SUM(z_t if t in this shard else 0)          # = z_t - m
    S = all_reduce_SUM(sum_local exp z)
    loss = log S - p                                            # = logsumexp(z) - z_t
    backward: dz = softmax - onehot(t)   (local shard only: no communication)

The two SUMs are one stacked all-reduce (two per call, not Megatron's three). Label smoothing is
``F.cross_entropy``'s with the global V (one more reduced statistic), so it equals the one-process
loss at every tp, where Megatron's uses the local shard's size and mean. ``ignore_index`` tokens get
loss 0 and no gradient. The saved fp32 local softmax is overwritten in place by backward.

:func:`vocab_parallel_lm_head_cross_entropy`: the fused LM head + loss, over
:func:`tokenloom.train.kernels.cross_entropy.chunked_cross_entropy` with the tp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenloom.train.kernels.cross_entropy import Reduction, chunked_cross_entropy
from tokenloom.train.parallel.mappings import Group, gather_from_sequence_parallel_region


def _all_reduce(x: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, label_smoothing, ignore_index):
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        z = logits.to(compute_dtype)
        if z is logits:
            z = z.clone()
        local_vocab = z.shape[-1]
        rank = dist.get_rank(group) if group is not None else 0
        world = dist.get_world_size(group) if group is not None else 1
        row_max = z.max(dim=-1).values
        _all_reduce(row_max, group, dist.ReduceOp.MAX)
        z.sub_(row_max.unsqueeze(-1))

        local_t = targets - rank * local_vocab
        in_shard = (local_t >= 0) & (local_t < local_vocab)
        local_t = local_t.masked_fill(~in_shard, 0)
        target_z = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)
        stats = [target_z]
        if label_smoothing > 0:
            stats.append(z.sum(dim=-1))
        exp_z = z.exp_()  # z is no longer needed: reuse its storage for the softmax
        stats.append(exp_z.sum(dim=-1))
        stats = torch.stack(stats)
        _all_reduce(stats, group)  # one all-reduce for the target logit, (sum z) and sum exp
        target_z, sum_exp = stats[0], stats[-1]
        lse = sum_exp.log()  # logsumexp(z) - m
        losses = lse - target_z
        if label_smoothing > 0:
            mean_z = stats[1] / (local_vocab * world)
            losses = (1.0 - label_smoothing) * losses + label_smoothing * (lse - mean_z)
        ignored = targets == ignore_index
        losses = losses.masked_fill(ignored, 0.0)

        softmax = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, in_shard & ~ignored, ignored)
        ctx.label_smoothing, ctx.world, ctx.logits_dtype = label_smoothing, world, logits.dtype
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        softmax, local_t, hit, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # in place: the saved softmax is not needed after this
        if eps > 0:
            grad.sub_(eps / (grad.shape[-1] * ctx.world))
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(1.0 - eps) * hit.to(grad.dtype).unsqueeze(-1))
        coef = grad_losses.to(grad.dtype).masked_fill(ignored, 0.0)
        grad.mul_(coef.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: Group,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token fp32 losses from ``logits[..., V/tp]`` and replicated global ``targets``: equals
    ``F.cross_entropy(full_logits.float(), targets, reduction="none", ...)``."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} leading dims differ"
        )
    return _VocabParallelCrossEntropy.apply(logits, targets, group, label_smoothing, ignore_index)


def vocab_parallel_lm_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    group: Group,
    loss_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    chunk_size: int | None = None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """Fused LM head + vocab-parallel loss with this rank's ``[V/tp, h]`` ``weight``. ``hidden`` is
    replicated; do **not** ``copy_to_region`` it (the kernel all-reduces its grad). With
    ``sequence_parallel`` it is the ``[s/tp, b, h]`` shard, gathered here, and ``targets`` full."""
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, group, tensor_parallel_output_grad=False)
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    return chunked_cross_entropy(
        hidden, weight, targets, loss_mask, ignore_index, reduction, chunk_size, group=group
    )
