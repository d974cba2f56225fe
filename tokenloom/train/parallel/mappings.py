"""Autograd-aware communication at the edges of tensor-parallel regions: the seven functions of
Megatron-core's ``tensor_parallel/mappings.py`` for dense TP + sequence parallelism::

    function                                     forward                  backward
    copy_to_region                               identity                 all-reduce
    reduce_from_region                           all-reduce               identity
    scatter_to_region                            split last dim           all-gather last dim
    gather_from_region                           all-gather last dim      split last dim
    scatter_to_sequence_parallel_region          split dim 0              all-gather dim 0
    gather_from_sequence_parallel_region         all-gather dim 0         reduce-scatter dim 0 (or split)
    reduce_scatter_to_sequence_parallel_region   reduce-scatter dim 0     all-gather dim 0

sp activations are ``[seq, batch, hidden]`` split on dim 0. The group is always explicit; None or
one rank passes the tensor through. Gathers use ``all_gather_into_tensor`` into a flat buffer
(gloo's only non-list form), allocated like the input (Megatron's CUDA-only allocation does not run
on CPU). Reductions are out of place (one activation-sized clone): Megatron's in-place all-reduce is
unsafe for an arbitrary input or a gradient autograd hands to several consumers. No async overlap
(``bench/parallel_bench.py``'s exposed-communication share bounds the gain).
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
    """Sum ``tensors`` in place through one flat all-reduce (one collective for a copy in and out)."""
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
    """All-gather the sequence (dim 0). Backward reduce-scatters partial grads of a tp consumer
    (``tensor_parallel_output_grad``), else keeps this rank's chunk of the full grad."""
    if _world(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum partial results and keep this rank's chunk of the sequence; backward all-gathers."""
    return x if _world(group) == 1 else _ReduceScatterToSequenceParallelRegion.apply(x, group)
