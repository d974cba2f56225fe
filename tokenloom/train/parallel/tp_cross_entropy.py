"""Cross entropy over logits whose vocabulary dim is split over the tensor-parallel group.

:func:`vocab_parallel_cross_entropy` mirrors Megatron-core's
``tensor_parallel/cross_entropy.py``. Rank r holds ``logits[..., V/tp]`` for ids
``[r V/tp, (r+1) V/tp)``; the leading dims are free (Megatron passes ``[s, b, V/tp]``,
tokenloom's one-process GPT ``[b, s, V]``: both work, the losses come back with the
targets' shape). Per token, in fp32 (training-stack.md section c)::

    m = all_reduce_MAX(max_local z);  z -= m
    p = all_reduce_SUM(z_t if t in this shard else 0)          # = z_t - m
    S = all_reduce_SUM(sum_local exp z)
    loss = log S - p                                            # = logsumexp(z) - z_t
    backward: dz = softmax - onehot(t)   (local shard only: no communication)

The two SUM all-reduces are fused into one (a stacked ``[2, tokens]`` tensor), so the
forward costs two small all-reduces per call instead of Megatron's three.

Label smoothing follows ``F.cross_entropy(label_smoothing=eps)``: the target
distribution is ``(1 - eps) onehot + eps / V`` with the global (padded) V, so
``loss = (1 - eps)(lse - z_t) + eps (lse - mean_v z_v)``; the mean needs one more
all-reduce. Megatron's branch uses the *local* shard's size and mean without a tp
reduction (wrong for tp > 1) and a ``V/(V-1)`` rescaled eps; ours equals the
one-process loss at every tp. Tokens whose target is ``ignore_index`` get loss 0 and
no gradient (Megatron has no ignore index; it masks with ``loss_mask`` afterwards).
The saved tensor is the fp32 softmax of the local shard (``tokens * V/tp * 4`` bytes),
as in Megatron; backward overwrites it in place.

:func:`vocab_parallel_lm_head_cross_entropy` is the fused path: LM-head GEMM plus loss
without full logits, a thin wrapper over
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
    """Per-token losses (fp32, ``targets.shape``) from vocab-sharded ``logits[..., V/tp]``.

    ``targets`` are global ids in ``[0, V)`` (or ``ignore_index``), replicated over the
    group. Equals ``F.cross_entropy(full_logits.float(), targets, reduction="none",
    label_smoothing=..., ignore_index=...)`` on the gathered logits. Reduce (mean over
    a loss mask, ...) with ordinary torch ops afterwards.
    """
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
    """Fused LM head + vocab-parallel loss: ``chunked_cross_entropy(hidden, weight_shard, ...)``.

    ``weight`` is this rank's ``[V/tp, h]`` shard (e.g. a :class:`VocabParallelEmbedding`'s
    weight when tied, or a ``ColumnParallelLinear``'s). ``hidden`` is replicated over the
    group, ``[..., h]`` matching ``targets``; do **not** pass it through
    ``copy_to_region``: the kernel already all-reduces the hidden gradient over ``group``.
    With ``sequence_parallel``, ``hidden`` is this rank's ``[s/tp, b, h]`` shard and
    ``targets`` the full ``[s, b]``; hidden is all-gathered here and its (already summed)
    gradient split back in backward.
    """
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, group, tensor_parallel_output_grad=False)
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    return chunked_cross_entropy(
        hidden, weight, targets, loss_mask, ignore_index, reduction, chunk_size, group=group
    )
