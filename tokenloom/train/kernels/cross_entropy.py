"""LM-head cross entropy that never materialises the full ``[tokens, vocab]`` logits.

Contract: ``chunked_cross_entropy(hidden, weight, targets)`` equals
``F.cross_entropy(hidden @ weight.T, targets)``, computing the logits ``chunk_size`` tokens
at a time inside one autograd function. Logits and softmax are fp32 (fp64 for fp64 inputs)
whatever the input dtype; the weight gradient accumulates in fp32 across chunks.

Trade-offs:

* **Memory** is O(chunk x vocab): one fp32 chunk buffer at a time, turned into
  ``exp(logits - max)`` and then the gradient in place, plus the weight gradient any
  implementation needs (``bench/kernels_bench.py`` measures it;
  tests/train/kernels/test_kernel_cross_entropy.py bounds it).
* **Gradients in forward when the reduction fixes them** (``"mean"`` / ``"sum"`` with
  grad wanted, as Liger's fused linear cross entropy): each chunk's ``softmax - onehot``
  becomes the hidden and weight gradients while its logits are at hand, and backward only
  scales them: three LM-head GEMMs, as with full logits, with both gradients held until
  backward. The per-row factor goes on the GEMMs' ``[rows, hidden]`` sides, not the
  ``[rows, vocab]`` chunk. Otherwise (``"none"``, or evaluation) forward keeps only the
  per-token log-sum-exp and backward recomputes the logits (4/3 of the compute), so
  evaluation never pays for gradients.
* **Few, large chunks** (:func:`default_chunk_size`: at least two, at most 2^26 logits
  each), because each chunk streams the whole weight through its GEMMs; at those sizes the
  time is that of full logits (``bench/kernels_bench.py``).

Vocab parallelism: with ``group`` set, ``weight`` is this rank's even shard of the vocabulary
(rank r owns ids ``[r * V_r, (r + 1) * V_r)``) and ``hidden`` / ``targets`` are replicated. Per
chunk the forward does Megatron's stable math (training-stack.md section c): all-reduce MAX of
the row max, SUM of the masked target logit, SUM of the shifted sum-exp. Backward needs no
communication for the logits, but the hidden gradient is all-reduced (SUM) here because the
LM-head GEMM is inside this function. ``group=None`` runs no collectives.
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
    """Rows per chunk for ``tokens`` rows of ``vocab`` logits: as few chunks as keep each within
    :data:`CHUNK_LOGITS`, and at least two, of equal size; at least 16 rows, unless that would
    leave a single chunk.

    Two chunks at least, so the full logits never exist, whatever the batch. Few, large
    chunks otherwise, because every chunk streams the whole LM-head weight through each of
    its three GEMMs: smaller chunks make the loss measurably slower than full logits on CPU
    (see bench/RESULTS.md, notes). On a GPU, 256 MB is small next to a
    large model's activations, and its bandwidth makes the extra weight reads cheap.
    """
    chunks = max(2, -(-tokens * vocab // CHUNK_LOGITS))
    half = -(-tokens // 2)
    return max(min(16, half), -(-tokens // chunks), 1)


def _target_slots(t_local: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each target id falls in this shard's ``[0, vocab)``; its column as a ``[rows, 1]``
    index, clamped into the shard so that gather and scatter stay in bounds)."""
    return (t_local >= 0) & (t_local < vocab), t_local.clamp(0, vocab - 1).unsqueeze(1)


def target_and_sumexp(
    logits: torch.Tensor, row_max: torch.Tensor, t_local: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logit - row_max, or 0 when the target is outside this shard; sum exp(logits - row_max)).

    Overwrites ``logits`` with ``exp(logits - row_max)``: no second chunk-sized buffer, and the
    training path's gradient starts from it (:func:`_gradient_from_exp`).
    """
    in_shard, slot = _target_slots(t_local, logits.shape[1])
    z_t = logits.gather(1, slot).squeeze(1)
    shifted_target = torch.where(in_shard, z_t - row_max, torch.zeros_like(z_t))
    sum_exp = logits.sub_(row_max.unsqueeze(1)).exp_().sum(dim=1)
    return shifted_target, sum_exp


def _gradient_from_exp(
    exp_shifted: torch.Tensor, t_local: torch.Tensor, sum_exp: torch.Tensor, coef: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(softmax - onehot) * coef[:, None]`` from ``exp(logits - row_max)`` and its (all-reduced)
    row sums, as ``(matrix, row_scale)``: the gradient is ``row_scale[:, None] * matrix``, or
    ``matrix`` itself when ``row_scale`` is None. Overwrites ``exp_shifted``.

    The matrix is ``exp_shifted - sum_exp * onehot``; the normalisation and ``coef`` make one
    per-row factor ``coef / sum_exp``. When ``out_dtype`` is the buffer's dtype (fp32, fp64)
    that factor is left to the caller, who applies it to the LM-head GEMMs' ``[rows, H]``
    operands: a pass over ``rows x H`` values instead of one over ``rows x vocab``. For a
    narrower ``out_dtype`` the cast is a full pass anyway, so the factor is applied before it.
    """
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
    """``(softmax(logits) - onehot(t_local)) * coef[:, None]`` in ``out_dtype``; overwrites ``logits``.

    In place so that eager mode holds one chunk-sized buffer here, not four.
    """
    in_shard, slot = _target_slots(t_local, logits.shape[1])
    grad = logits.sub_(lse.unsqueeze(1)).exp_()
    grad.scatter_add_(1, slot, -in_shard.to(grad.dtype).unsqueeze(1))
    return grad.mul_(coef.unsqueeze(1)).to(out_dtype)


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_weight += grad_logits.T @ h``, in place when the dtypes agree: the product is
    weight-sized, and a temporary for it would be the largest buffer of the whole loss."""
    if grad_weight.dtype == grad_logits.dtype == h.dtype:
        grad_weight.addmm_(grad_logits.T, h)
    else:  # bf16/fp16 inputs: the fp32 accumulator needs the product converted first
        grad_weight += (grad_logits.T @ h).to(grad_weight.dtype)


def _chunk_losses(logits, t_rows, group, stats_fn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp, loss, sum exp(logits - row max)) per row of one chunk's logits (this shard's,
    all-reduced over ``group``). Leaves ``exp(logits - row max)`` in ``logits``."""
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
        """Add the chunk's share for logits gradient ``row_scale[:, None] * grad_logits`` (see
        :func:`_gradient_from_exp`; the scale goes on the ``[rows, H]`` side of each GEMM)."""
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
    """``targets`` as ids into this rank's vocab shard ``weight`` (rank r owns ids
    ``[r * V_r, (r + 1) * V_r)``); ids outside the shard fall outside ``[0, V_r)``."""
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
    """(hidden grad, weight grad) for per-token gradient coefficients ``coef``, recomputing each
    chunk's logits from the saved log-sum-exp."""
    grads = _ChunkGrads(hidden, weight, needs)
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        h = hidden[rows]
        logits = (h @ weight.T).to(lse.dtype)
        grads.add(rows, grad_fn(logits, lse[rows], t_local[rows], coef[rows], hidden.dtype), h)
        del logits
    return grads.result(group)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The reduced loss (a scalar) from hidden [N, H], weight [V_r, H], targets [N] and per-token
    gradient coefficients ``coef`` [N] (the weight of each token's loss in the reduction).

    Training variant of :class:`_ChunkedCrossEntropy`: because the reduction is known, each
    chunk's ``softmax - onehot`` can be turned into the hidden and weight gradients in forward,
    while its logits are still at hand. That saves the backward's recompute GEMM (3 LM-head
    GEMMs instead of 4, as many as with full logits) at the price of holding the two gradients
    from forward to backward. Backward scales them in place and hands them over (a scaled
    copy would hold a second weight-sized gradient at the peak); a second backward of the
    same graph (``retain_graph=True``, gradcheck) recomputes them from the saved log-sum-exp.
    """

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
    """Apply ``loss_mask`` and ``reduction`` to per-token losses (ignored tokens are already 0).

    ``mean`` divides by the number of unmasked, non-ignored tokens, clamped to >= 1, so an
    all-masked batch gives 0 (``F.cross_entropy`` would give nan).
    """
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
    """Cross entropy of ``hidden @ weight.T`` against ``targets`` without full logits.

    hidden: [..., H]; weight: [V, H] (or this rank's [V / world, H] shard with ``group``);
    targets and loss_mask: hidden's leading shape. Returns an fp32 (fp64 for fp64 input)
    scalar, or per-token losses flattened to [N] with ``reduction="none"``.
    """
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    flat_targets = targets.reshape(-1)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if chunk_size is None:
        chunk_size = default_chunk_size(flat_hidden.shape[0], weight.shape[0])
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if reduction in ("mean", "sum") and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        # Training: the token weights of the reduction are known, so gradients come out of
        # forward (no recompute GEMM in backward).
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
    """``chunked`` (:func:`chunked_cross_entropy`, maybe with compiled chunk math), except that
    a single-process loss with fewer than :data:`FULL_LOGITS_BELOW` logits and the default
    chunking takes :func:`cross_entropy_reference`'s full logits.

    Chunking bounds memory, which is not at stake below 16 MB of logits, and costs a fixed
    amount per chunk (an autograd function, a dozen small ops) that makes small losses slower
    than full logits, up to about this size (see bench/RESULTS.md, notes). A vocab-parallel ``group`` or an explicit ``chunk_size`` always goes
    to ``chunked``.
    """

    @functools.wraps(chunked)
    def cross_entropy(hidden, weight, targets, loss_mask=None, ignore_index=-100, reduction="mean",
                      chunk_size=None, group=None):
        tokens = hidden.numel() // max(hidden.shape[-1], 1)
        if group is None and chunk_size is None and tokens * weight.shape[0] < FULL_LOGITS_BELOW:
            return cross_entropy_reference(hidden, weight, targets, loss_mask, ignore_index, reduction)
        return chunked(hidden, weight, targets, loss_mask, ignore_index, reduction, chunk_size, group)

    return cross_entropy
