"""LM-head cross entropy that never materialises the full ``[tokens, vocab]`` logits.

Contract: ``chunked_cross_entropy(hidden, weight, targets)`` equals ``F.cross_entropy(hidden @
weight.T, targets)``, logits computed ``chunk_size`` tokens at a time in one autograd function, in
fp32 (fp64 for fp64 inputs); the weight gradient accumulates in fp32.

Trade-offs:

* **Memory** O(chunk x vocab): one chunk buffer, turned into ``exp(logits - max)`` then the
  gradient in place (tests/train/kernels/test_kernel_cross_entropy.py bounds it).
* **Gradients in forward** when the reduction fixes them (``mean`` / ``sum`` in training, as Liger's
  fused linear cross entropy): three LM-head GEMMs like full logits, both gradients held until
  backward. Otherwise forward keeps the log-sum-exp and backward recomputes the logits, so
  evaluation never pays for gradients.
* **Few, large chunks** (:func:`default_chunk_size`), as each chunk streams the whole weight.

Vocab parallelism: with ``group``, ``weight`` is this rank's even vocab shard and ``hidden`` /
``targets`` are replicated; per chunk, Megatron's stable math (training-stack.md section c:
all-reduce MAX of the row max, SUM of target logit and sum-exp); the hidden gradient is all-reduced
here, as the GEMM is inside. ``group=None`` runs no collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

Reduction = Literal["mean", "sum", "none"]


CHUNK_LOGITS = 1 << 26
"""Most logits one default chunk holds (256 MB in fp32); see :func:`default_chunk_size`."""


def default_chunk_size(tokens: int, vocab: int) -> int:
    """Rows per chunk: the fewest equal chunks within :data:`CHUNK_LOGITS`, at least two (full
    logits never exist) and 16 rows unless that leaves one chunk. Few because every chunk streams
    the whole weight through three GEMMs (bench/RESULTS.md, notes)."""
    chunks = max(2, -(-tokens * vocab // CHUNK_LOGITS))
    half = -(-tokens // 2)
    return max(min(16, half), -(-tokens // chunks), 1)


def _target_slots(t_local: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target in this shard's ``[0, vocab)``; its column [rows, 1], clamped to stay in bounds)."""
    return (t_local >= 0) & (t_local < vocab), t_local.clamp(0, vocab - 1).unsqueeze(1)


def target_and_sumexp(
    logits: torch.Tensor, row_max: torch.Tensor, t_local: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logit - row_max, 0 outside the shard; sum exp(logits - row_max)). Overwrites
    ``logits`` with ``exp(logits - row_max)``, where :func:`_gradient_from_exp` starts."""
    in_shard, slot = _target_slots(t_local, logits.shape[1])
    z_t = logits.gather(1, slot).squeeze(1)
    shifted_target = torch.where(in_shard, z_t - row_max, torch.zeros_like(z_t))
    sum_exp = logits.sub_(row_max.unsqueeze(1)).exp_().sum(dim=1)
    return shifted_target, sum_exp


def _gradient_from_exp(
    exp_shifted: torch.Tensor, t_local: torch.Tensor, sum_exp: torch.Tensor, coef: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(softmax - onehot) * coef[:, None]`` as ``(matrix, row_scale)``, gradient ``row_scale[:,
    None] * matrix`` (``matrix`` when None); overwrites ``exp_shifted``. In the buffer's dtype the
    per-row factor is left to the caller's ``[rows, H]`` GEMM operands (a pass over ``rows x H``,
    not ``rows x vocab``); a narrower ``out_dtype`` casts anyway, so it is applied first."""
    in_shard, slot = _target_slots(t_local, exp_shifted.shape[1])
    at_target = torch.where(in_shard, -sum_exp, torch.zeros_like(sum_exp))
    exp_shifted.scatter_add_(1, slot, at_target.unsqueeze(1))
    row_scale = coef / sum_exp
    if out_dtype == exp_shifted.dtype:
        return exp_shifted, row_scale
    return exp_shifted.mul_(row_scale.unsqueeze(1)).to(out_dtype), None


def logits_grad(
    logits: torch.Tensor, lse: torch.Tensor, t_local: torch.Tensor, coef: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(softmax - onehot) * coef[:, None]`` in ``out_dtype``, in place (one chunk buffer, not four)."""
    in_shard, slot = _target_slots(t_local, logits.shape[1])
    grad = logits.sub_(lse.unsqueeze(1)).exp_()
    grad.scatter_add_(1, slot, -in_shard.to(grad.dtype).unsqueeze(1))
    return grad.mul_(coef.unsqueeze(1)).to(out_dtype)


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_weight += grad_logits.T @ h``, in place when dtypes agree (no weight-sized temporary)."""
    if grad_weight.dtype == grad_logits.dtype == h.dtype:
        grad_weight.addmm_(grad_logits.T, h)
    else:  # bf16/fp16 inputs: the fp32 accumulator needs the product converted first
        grad_weight += (grad_logits.T @ h).to(grad_weight.dtype)


def _chunk_losses(logits, t_rows, group, stats_fn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row (log-sum-exp, loss, sum-exp), all-reduced over ``group``; leaves exp in ``logits``."""
    row_max = logits.amax(dim=1)  # not max(): its argmax costs several reductions' time
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted_target, sum_exp = stats_fn(logits, row_max, t_rows)
    if group is not None:
        dist.all_reduce(shifted_target, group=group)
        dist.all_reduce(sum_exp, group=group)
    log_sum_exp = sum_exp.log()
    return row_max + log_sum_exp, log_sum_exp - shifted_target, sum_exp


class _ChunkGrads:
    """The hidden and weight gradients of the LM-head GEMM, filled chunk by chunk."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, bool]) -> None:
        need_hidden, self.need_weight = needs
        self.weight = weight
        self.hidden = torch.empty_like(hidden) if need_hidden else None
        self.acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        self.weight_grad: torch.Tensor | None = None  # the first chunk's product, then accumulated

    def add(self, rows: slice, grad_logits: torch.Tensor, h: torch.Tensor,
            row_scale: torch.Tensor | None = None) -> None:
        """Add the chunk's share for ``row_scale[:, None] * grad_logits`` (scale on the [rows, H] side)."""
        if self.hidden is not None:
            grad_h = grad_logits @ self.weight
            self.hidden[rows] = grad_h if row_scale is None else grad_h.mul_(row_scale.unsqueeze(1))
        if self.need_weight:
            if row_scale is not None:
                h = h * row_scale.unsqueeze(1)
            if self.weight_grad is None:  # no zero-filled accumulator to read back: one weight-sized pass less
                self.weight_grad = (grad_logits.T @ h).to(self.acc_dtype)
            else:
                _accumulate_weight_grad(self.weight_grad, grad_logits, h)

    def result(self, group) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden grad summed over the vocab shards of ``group``, weight grad in the weight's dtype)."""
        if self.hidden is not None and group is not None:
            dist.all_reduce(self.hidden, group=group)
        weight_grad = self.weight_grad
        if self.need_weight and weight_grad is None:  # no rows at all
            weight_grad = torch.zeros(self.weight.shape, dtype=self.acc_dtype, device=self.weight.device)
        return self.hidden, (weight_grad.to(self.weight.dtype) if weight_grad is not None else None)


def _shard_targets(weight: torch.Tensor, targets: torch.Tensor, group) -> torch.Tensor:
    """``targets`` as ids into this rank's shard (rank r owns ``[r * V_r, (r + 1) * V_r)``)."""
    vocab_start = weight.shape[0] * dist.get_rank(group) if group is not None else 0
    return targets - vocab_start


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token losses [N] from hidden [N, H], weight [V_r, H], targets [N]."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, group, fns):
        stats_fn, grad_fn = fns
        compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
        t_local = _shard_targets(weight, targets, group)
        lse = torch.empty(hidden.shape[0], dtype=compute_dtype, device=hidden.device)
        losses = torch.empty_like(lse)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows] @ weight.T).to(compute_dtype)
            lse[rows], losses[rows], _ = _chunk_losses(logits, t_local[rows], group, stats_fn)
            del logits
        losses.masked_fill_(targets == ignore_index, 0.0)
        ctx.save_for_backward(hidden, weight, t_local, lse, targets == ignore_index)
        ctx.chunk_size, ctx.group, ctx.grad_fn = chunk_size, group, grad_fn
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, t_local, lse, ignored = ctx.saved_tensors
        coef = grad_losses.to(lse.dtype).masked_fill(ignored, 0.0)
        grads = _recomputed_grads(hidden, weight, t_local, lse, coef, ctx.chunk_size, ctx.group, ctx.grad_fn,
                                  ctx.needs_input_grad[:2])
        return (*grads, None, None, None, None, None)


def _recomputed_grads(hidden, weight, t_local, lse, coef, chunk_size, group, grad_fn, needs):
    """(hidden grad, weight grad) for per-token ``coef``, logits recomputed from the saved lse."""
    grads = _ChunkGrads(hidden, weight, needs)
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        h = hidden[rows]
        logits = (h @ weight.T).to(lse.dtype)
        grads.add(rows, grad_fn(logits, lse[rows], t_local[rows], coef[rows], hidden.dtype), h)
        del logits
    return grads.result(group)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Reduced scalar loss with per-token weights ``coef`` [N], gradients computed in forward (3
    GEMMs, not 4). Backward scales them in place (no second weight-sized copy at the peak); a
    second backward (``retain_graph``, gradcheck) recomputes them from the saved lse."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, coef, chunk_size, group, fns):
        stats_fn, grad_fn = fns
        compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
        t_local = _shard_targets(weight, targets, group)
        coef = coef.to(compute_dtype)
        grads = _ChunkGrads(hidden, weight, ctx.needs_input_grad[:2])
        total = torch.zeros((), dtype=compute_dtype, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=compute_dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows]
            logits = (h @ weight.T).to(compute_dtype)
            lse[rows], losses, sum_exp = _chunk_losses(logits, t_local[rows], group, stats_fn)
            total += (losses * coef[rows]).sum()
            grad_logits, row_scale = _gradient_from_exp(logits, t_local[rows], sum_exp, coef[rows], hidden.dtype)
            grads.add(rows, grad_logits, h, row_scale)
            del logits, grad_logits  # the same buffer: free it before the next chunk's GEMM
        ctx.save_for_backward(hidden, weight, t_local, lse, coef)
        ctx.grads = grads.result(group)  # plain attributes: scaled in place by backward
        ctx.chunk_size, ctx.group, ctx.grad_fn = chunk_size, group, grad_fn
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grads is not None:  # the first backward: the gradients computed in forward
            grads = [g.mul_(grad_total) if g is not None else None for g in ctx.grads]
            ctx.grads = None
        else:
            hidden, weight, t_local, lse, coef = ctx.saved_tensors
            grads = _recomputed_grads(hidden, weight, t_local, lse, coef * grad_total, ctx.chunk_size, ctx.group,
                                      ctx.grad_fn, ctx.needs_input_grad[:2])
        return (*grads, None, None, None, None, None)


def _reduce(
    losses: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor | None,
    ignore_index: int,
    reduction: Reduction,
) -> torch.Tensor:
    """Apply ``loss_mask`` and ``reduction``; ``mean`` over kept tokens clamped to >= 1, so an
    all-masked batch gives 0, not nan."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if reduction == "none":
        return losses if loss_mask is None else losses * loss_mask.reshape(-1).to(losses.dtype)
    if loss_mask is None:  # no weights to multiply in: the ignored tokens' losses are 0 already
        total = losses.sum()
        return total if reduction == "sum" else total / (targets != ignore_index).sum().clamp(min=1)
    weights = (targets != ignore_index).to(losses.dtype) * loss_mask.reshape(-1).to(losses.dtype)
    total = (losses * weights).sum()
    return total if reduction == "sum" else total / weights.sum().clamp(min=1.0)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    chunk_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    _fns: tuple[Callable, Callable] = (target_and_sumexp, logits_grad),
) -> torch.Tensor:
    """Cross entropy of ``hidden`` [..., H] @ ``weight.T`` ([V, H], a shard with ``group``) against
    ``targets``: an fp32 scalar, or losses [N] with ``reduction="none"``."""
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    flat_targets = targets.reshape(-1)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if chunk_size is None:
        chunk_size = default_chunk_size(flat_hidden.shape[0], weight.shape[0])
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if reduction in ("mean", "sum") and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        # training: the reduction's token weights are known, so gradients come out of forward
        coef = (flat_targets != ignore_index).to(torch.promote_types(hidden.dtype, torch.float32))
        if loss_mask is not None:
            coef = coef * loss_mask.reshape(-1).to(coef.dtype)
        if reduction == "mean":
            coef = coef / coef.sum().clamp(min=1.0)
        return _FusedLinearCrossEntropy.apply(flat_hidden, weight, flat_targets, coef, chunk_size, group, _fns)
    losses = _ChunkedCrossEntropy.apply(flat_hidden, weight, flat_targets, ignore_index, chunk_size, group, _fns)
    return _reduce(losses, flat_targets, loss_mask, ignore_index, reduction)


def cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Same contract as :func:`chunked_cross_entropy` (single process), full fp32 logits."""
    compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = (hidden @ weight.T).to(compute_dtype).reshape(-1, weight.shape[0])
    flat_targets = targets.reshape(-1)
    losses = F.cross_entropy(logits, flat_targets, ignore_index=ignore_index, reduction="none")
    return _reduce(losses, flat_targets, loss_mask, ignore_index, reduction)


FULL_LOGITS_BELOW = 1 << 22
"""Fewer logits than this (16 MB in fp32) make :func:`full_logits_below` take full logits."""


def full_logits_below(chunked: Callable) -> Callable:
    """``chunked``, except a single-process default-chunked loss under :data:`FULL_LOGITS_BELOW`
    logits takes full logits: memory is not at stake there and chunking's fixed cost is
    (bench/RESULTS.md, notes). ``group`` or ``chunk_size`` always go to ``chunked``."""

    @functools.wraps(chunked)
    def cross_entropy(hidden, weight, targets, loss_mask=None, ignore_index=-100, reduction="mean",
                      chunk_size=None, group=None):
        tokens = hidden.numel() // max(hidden.shape[-1], 1)
        if group is None and chunk_size is None and tokens * weight.shape[0] < FULL_LOGITS_BELOW:
            return cross_entropy_reference(hidden, weight, targets, loss_mask, ignore_index, reduction)
        return chunked(hidden, weight, targets, loss_mask, ignore_index, reduction, chunk_size, group)

    return cross_entropy
