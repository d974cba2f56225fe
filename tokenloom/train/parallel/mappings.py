"""Autograd-aware communication at the edges of tensor-parallel regions.

The seven functions of Megatron-core's ``tensor_parallel/mappings.py`` that dense
TP + sequence parallelism need (training-stack.md section c)::

    function                                     forward                  backward
    copy_to_region                               identity                 all-reduce
    reduce_from_region                           all-reduce               identity
    scatter_to_region                            split last dim           all-gather last dim
    gather_from_region                           all-gather last dim      split last dim
    scatter_to_sequence_parallel_region          split dim 0              all-gather dim 0
    gather_from_sequence_parallel_region         all-gather dim 0         reduce-scatter dim 0 (or split)
    reduce_scatter_to_sequence_parallel_region   reduce-scatter dim 0     all-gather dim 0

Sequence-parallel activations are ``[seq, batch, hidden]``, split on dim 0 (Megatron's
layout). Every function takes the group explicitly (there is no global state) and
passes the tensor through unchanged when the group is None or has one rank.

Choices:

* Gathers go through ``all_gather_into_tensor`` into a flat output that is then viewed
  as ``[world, *shape]``: the only all-gather form gloo accepts besides lists (it rejects
  uneven sizes and stacked outputs). A last-dim gather re-arranges that output with one
  ``cat``. Buffers take device and dtype from the input (Megatron allocates on the
  current CUDA device, so its helpers do not run on CPU).
* Reductions are out of place (a clone, then the collective). Megatron all-reduces in
  place, which is safe for a fresh GEMM output but not for an arbitrary input, and in
  backward autograd may hand the same gradient tensor to several consumers (e.g. both
  inputs of an ``add``). The clone costs one activation-sized copy per call.
* No async overlap of the collectives with compute: on CPU/gloo the gain is small;
  ``bench/parallel_bench.py``'s exposed-communication share bounds what it could win
  (``ColumnParallelLinear`` says where Megatron overlaps).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tokenloom.errors import TokenloomError

Group = dist.ProcessGroup | None

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _world(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _check_divisible(size: int, world: int, what: str) -> None:
    if size % world:
        raise TokenloomError(
            f"{what} of size {size} cannot be split evenly over {world} tensor-parallel ranks"
        )


# ---- the raw collectives (no autograd)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, out of place."""
    if _world(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def all_reduce_in_place(tensors: Sequence[torch.Tensor], group: Group) -> None:
    """Sum ``tensors`` over the group in place through one flat all-reduce: one collective for
    many small tensors, at the price of a copy in and out. None or one rank: nothing to do."""
    if not tensors or _world(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, new in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(new.view_as(t))


def _all_gather_stacked(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[world, *x.shape]``: every rank's ``x`` (gathered through a flat buffer)."""
    world = _world(group)
    flat = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    _all_gather_flat(flat, x.contiguous().view(-1), group=group)
    return flat.view(world, *x.shape)


def all_gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    return torch.cat(_all_gather_stacked(x, group).unbind(0), dim=-1)


def all_gather_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    stacked = _all_gather_stacked(x, group)
    return stacked.view(stacked.shape[0] * x.shape[0], *x.shape[1:])


def split_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's contiguous chunk of the last dim."""
    world = _world(group)
    if world == 1:
        return x
    _check_divisible(x.shape[-1], world, "last dimension")
    return x.chunk(world, dim=-1)[dist.get_rank(group)].contiguous()


def split_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's contiguous chunk of dim 0 (the sequence)."""
    world = _world(group)
    if world == 1:
        return x
    _check_divisible(x.shape[0], world, "sequence (first) dimension")
    return x.chunk(world, dim=0)[dist.get_rank(group)].contiguous()


def reduce_scatter_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, keep this rank's chunk of dim 0."""
    world = _world(group)
    if world == 1:
        return x
    _check_divisible(x.shape[0], world, "sequence (first) dimension")
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, x.contiguous(), group=group)
    return out


# ---- autograd functions


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.tensor_parallel_output_grad = group, tensor_parallel_output_grad
        return all_gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_first_dim(grad, ctx.group), None, None
        return split_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first_dim(grad, ctx.group), None


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce backward."""
    return x if _world(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward."""
    return x if _world(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's chunk of the last dim; backward all-gathers it."""
    return x if _world(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate the ranks' chunks along the last dim; backward keeps this rank's chunk."""
    return x if _world(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's chunk of the sequence (dim 0); backward all-gathers it."""
    return x if _world(group) == 1 else _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Group, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather the sequence (dim 0).

    Backward reduce-scatters when the consumer is tensor-parallel (each rank holds a
    partial gradient of the full sequence: ``tensor_parallel_output_grad=True``, the
    default), or just keeps this rank's chunk when the consumer is replicated and every
    rank already holds the full gradient (``False``).
    """
    if _world(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum partial results and keep this rank's chunk of the sequence; backward all-gathers."""
    return x if _world(group) == 1 else _ReduceScatterToSequenceParallelRegion.apply(x, group)
