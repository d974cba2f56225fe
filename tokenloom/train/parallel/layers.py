"""Tensor-parallel layers after Megatron-core's ``tensor_parallel/layers.py`` (training-stack.md c).

* :class:`ColumnParallelLinear`: weight ``[out/tp, in]``; the input enters by
  :func:`copy_to_region` or, with ``sequence_parallel``, is all-gathered inside the GEMM function
  (input grad reduce-scattered); ``gather_output``, ``skip_bias_add`` as Megatron's.
* :class:`RowParallelLinear`: weight ``[out, in/tp]``; partial outputs all-reduced (reduce-scattered
  under sp), the replicated bias added after.
* :class:`VocabParallelEmbedding`: rank r owns ids ``[r V/tp, (r+1) V/tp)``; foreign ids read
  zeros, then all-reduce (or reduce-scatter to ``[s, b, h]``).

Both linears hand their weight gradient to the weight's sink (:mod:`.wgrad`, our
``gradient_accumulation_fusion``) unless ``wgrad_fusion`` is off.

Invariants: sp activations are ``[seq, batch, hidden]`` with seq split over tp; replicated
parameters seeing only this rank's tokens carry ``sequence_parallel = True`` and are summed over tp
after backward (:func:`sync_sequence_parallel_grads`); shards carry ``tensor_model_parallel`` and
``partition_dim``. ``split_sizes`` marks concatenated blocks (``[q, k, v]``, ``[gate, up]``), each
split evenly (Megatron's ``stride`` covers equal blocks only). Initialisation equals the
one-process layer's: on ``meta`` the GPT fills the shards; otherwise every rank draws the full
weight and keeps its shard (Megatron's CPU path; its GPU path does not equal one process).
Not mirrored: the async dgrad all-reduce overlapped with the wgrad GEMM, and expert layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tokenloom.errors import TokenloomError
from tokenloom.train.parallel.mappings import (
    Group,
    all_gather_first_dim,
    all_reduce_in_place,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_first_dim,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_region,
)
from tokenloom.train.parallel.random import get_rng_tracker
from tokenloom.train.parallel.wgrad import Linear, fusion_sink
from tokenloom.train.parallel.wgrad import linear as wgrad_linear

InitMethod = Callable[[torch.Tensor], object]
"""Fills a full fp32 master weight in place."""


def normal_init(std: float = 0.02, generator: torch.Generator | None = None) -> InitMethod:
    """normal(0, std) from ``generator`` (global RNG when None), Megatron's default init."""

    def init(weight: torch.Tensor) -> None:
        weight.normal_(0.0, std, generator=generator)

    return init


def _rank_world(group: Group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_split(size: int, world: int, split_sizes: Sequence[int] | None, what: str) -> None:
    blocks = list(split_sizes) if split_sizes else [size]
    if sum(blocks) != size:
        raise TokenloomError(f"split_sizes {blocks} of {what} add up to {sum(blocks)}, not {size}")
    bad = [b for b in blocks if b % world]
    if bad:
        raise TokenloomError(
            f"{what} {size} (blocks {blocks}) cannot be split evenly over {world} tensor-parallel ranks"
        )


def shard(
    full: torch.Tensor, dim: int, rank: int, world: int, split_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim`` (each of ``split_sizes`` blocks split evenly)."""
    blocks = full.split(list(split_sizes), dim) if split_sizes else [full]
    return torch.cat([b.chunk(world, dim)[rank] for b in blocks], dim).contiguous()


def unshard(
    shards: Sequence[torch.Tensor], dim: int, split_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from every rank's shard, in rank order."""
    if not split_sizes:
        return torch.cat(list(shards), dim)
    world = len(shards)
    pieces = [s.split([b // world for b in split_sizes], dim) for s in shards]
    return torch.cat([torch.cat([p[i] for p in pieces], dim) for i in range(len(split_sizes))], dim)


def _gather_shards(local: torch.Tensor, dim: int, group: Group, split_sizes: Sequence[int] | None):
    """Collective: the full tensor from every rank's ``local`` shard."""
    rank, world = _rank_world(group)
    if world == 1:
        return local.detach().clone()
    stacked = all_gather_first_dim(local.detach().unsqueeze(0), group)
    return unshard(stacked.unbind(0), dim, split_sizes)


def tag(obj: nn.Module | torch.Tensor, **tags: object) -> None:
    """Set tags as plain attributes (Megatron's way), read back with ``getattr``."""
    for name, value in tags.items():
        setattr(obj, name, value)


def _sharded_param(master: torch.Tensor, dim: int, group: Group, split_sizes, dtype, device) -> nn.Parameter:
    rank, world = _rank_world(group)
    data = shard(master, dim, rank, world, split_sizes).to(dtype=dtype, device=device)
    param = nn.Parameter(data)
    tag(param, tensor_model_parallel=True, partition_dim=dim)
    return param


def _master_weight(shape, init_method: InitMethod | None, device) -> torch.Tensor:
    """The full fp32 weight, on the host; on ``meta`` (shape only, no init) for a ``meta`` layer."""
    if device is not None and torch.device(device).type == "meta":
        return torch.empty(shape, dtype=torch.float32, device="meta")
    master = torch.empty(shape, dtype=torch.float32, device="cpu")
    (init_method or normal_init())(master)
    return master


class _SequenceParallelLinear(torch.autograd.Function):
    """``F.linear(all_gather_seq(x), w, b)`` saving only ``x``'s shard; backward all-gathers again
    (Megatron's with SP, no async overlap): input memory divided by tp for a second all-gather."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sink):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias, ctx.sink = group, bias is not None, sink
        return F.linear(all_gather_first_dim(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = reduce_scatter_first_dim(grad @ weight, ctx.group) if need_x else None
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_w = None
        if need_w:
            total = all_gather_first_dim(x, ctx.group)
            total = total.reshape(-1, total.shape[-1])
            if ctx.sink is None or not ctx.sink(grad_2d, total):  # the sink: tokenloom.train.parallel.wgrad
                grad_w = grad_2d.T @ total
        grad_b = grad_2d.sum(0) if ctx.has_bias and need_b else None
        return grad_x, grad_w, grad_b, None, None


class ColumnParallelLinear(nn.Module):
    """Linear with the output features split over the tp group. See the module docstring."""

    wgrad_fusion: bool = True
    """Hand the wgrad to the weight's sink: only for a weight used once per backward (not a tied head)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: Group,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        init_method: InitMethod | None = None,
        split_sizes: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        rank, world = _rank_world(group)
        _check_split(out_features, world, split_sizes, "output features")
        if sequence_parallel and gather_output:
            raise TokenloomError(
                "ColumnParallelLinear: gather_output is not supported with sequence_parallel"
            )
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel, self.skip_bias_add = sequence_parallel, skip_bias_add
        self.split_sizes = list(split_sizes) if split_sizes else None
        dtype = dtype or torch.get_default_dtype()
        master = _master_weight((out_features, in_features), init_method, device)
        self.weight = _sharded_param(master, 0, group, self.split_sizes, dtype, device)
        if bias:
            zeros = torch.zeros(out_features, device=master.device)
            self.bias = _sharded_param(zeros, 0, group, self.split_sizes, dtype, device)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: Group, **kwargs) -> ColumnParallelLinear:
        """This rank's shard of an existing full ``nn.Linear`` (weights copied, not shared)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            group=group,
            bias=linear.bias is not None,
            init_method=lambda w: w.copy_(linear.weight.detach()),
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            **kwargs,
        )
        if linear.bias is not None:
            rank, world = _rank_world(group)
            with torch.no_grad():
                layer.bias.copy_(shard(linear.bias.detach(), 0, rank, world, layer.split_sizes))
        return layer

    def forward(
        self, x: torch.Tensor, skip_bias_add: bool | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """x: ``[..., in]`` (``[s/tp, b, in]`` under sp) -> ``[..., out/tp]`` (``[..., out]`` with
        gather_output), plus the bias when ``skip_bias_add`` (argument, else the layer's)."""
        skip = self.skip_bias_add if skip_bias_add is None else skip_bias_add
        bias = None if skip else self.bias
        if self.sequence_parallel and _rank_world(self.group)[1] > 1:
            sink = fusion_sink(x, self.weight) if self.wgrad_fusion else None
            out = _SequenceParallelLinear.apply(x, self.weight, bias, self.group, sink)
        else:
            out = (wgrad_linear if self.wgrad_fusion else F.linear)(copy_to_region(x, self.group), self.weight, bias)
        if self.gather_output:
            out = gather_from_region(out, self.group)
        return (out, self.bias) if skip else out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective over the group: the full ``nn.Linear`` state dict (``weight``, ``bias``)."""
        state = {"weight": _gather_shards(self.weight, 0, self.group, self.split_sizes)}
        if self.bias is not None:
            state["bias"] = _gather_shards(self.bias, 0, self.group, self.split_sizes)
        return state

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """Linear with the input features split over the tp group. See the module docstring."""

    wgrad_fusion: bool = True
    """As :attr:`ColumnParallelLinear.wgrad_fusion`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: Group,
        bias: bool = True,
        input_is_parallel: bool = False,
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        init_method: InitMethod | None = None,
        split_sizes: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        rank, world = _rank_world(group)
        _check_split(in_features, world, split_sizes, "input features")
        if sequence_parallel and not input_is_parallel:
            raise TokenloomError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel, self.skip_bias_add = sequence_parallel, skip_bias_add
        self.split_sizes = list(split_sizes) if split_sizes else None
        dtype = dtype or torch.get_default_dtype()
        master = _master_weight((out_features, in_features), init_method, device)
        self.weight = _sharded_param(master, 1, group, self.split_sizes, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
            tag(self.bias, sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: Group, **kwargs) -> RowParallelLinear:
        """This rank's shard of an existing full ``nn.Linear`` (weights copied, not shared)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            group=group,
            bias=linear.bias is not None,
            init_method=lambda w: w.copy_(linear.weight.detach()),
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            **kwargs,
        )
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias.detach())
        return layer

    def forward(
        self, x: torch.Tensor, skip_bias_add: bool | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """x: ``[..., in/tp]`` or ``[..., in]`` -> ``[..., out]`` (``[s/tp, b, out]`` under sp), plus the
        bias when ``skip_bias_add``."""
        x_parallel = x if self.input_is_parallel else scatter_to_region(x, self.group)
        partial = (wgrad_linear if self.wgrad_fusion else F.linear)(x_parallel, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            out = reduce_from_region(partial, self.group)
        if self.skip_bias_add if skip_bias_add is None else skip_bias_add:
            return out, self.bias
        return out if self.bias is None else out + self.bias

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective over the group: the full ``nn.Linear`` state dict (``weight``, ``bias``)."""
        state = {"weight": _gather_shards(self.weight, 1, self.group, self.split_sizes)}
        if self.bias is not None:
            state["bias"] = self.bias.detach().clone()
        return state

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over the tp group. See the module docstring."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Group,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        rank, world = _rank_world(group)
        if num_embeddings % world:
            raise TokenloomError(
                f"vocabulary of {num_embeddings} rows cannot be split evenly over {world} tensor-parallel "
                f"ranks; pad it to a multiple of {world} (Megatron pads to make_vocab_size_divisible_by * tp)"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.sequence_parallel = group, sequence_parallel
        per_rank = num_embeddings // world
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        master = _master_weight((num_embeddings, embedding_dim), init_method, device)
        self.weight = _sharded_param(master, 0, group, None, dtype or torch.get_default_dtype(), device)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, group: Group, **kwargs) -> VocabParallelEmbedding:
        """This rank's shard of an existing full ``nn.Embedding`` (weights copied, not shared)."""
        return cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            group=group,
            init_method=lambda w: w.copy_(embedding.weight.detach()),
            dtype=embedding.weight.dtype,
            device=embedding.weight.device,
            **kwargs,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (any shape; ``[b, s]`` under sp) -> ``[*ids.shape, h]`` or ``[s/tp, b, h]``."""
        world = _rank_world(self.group)[1]
        if world == 1:
            out = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(), self.group)
        return reduce_from_region(out, self.group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective over the group: the full ``nn.Embedding`` state dict (``weight``)."""
        return {"weight": _gather_shards(self.weight, 0, self.group, None)}

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, ids [{self.vocab_start}, {self.vocab_end}), "
            f"sequence_parallel={self.sequence_parallel}"
        )


def is_sequence_parallel(param: nn.Parameter) -> bool:
    """A replicated parameter tagged ``sequence_parallel``: its grad is partial on each tp rank."""
    return bool(getattr(param, "sequence_parallel", False))


def sync_sequence_parallel_grads(module: nn.Module, group: Group) -> None:
    """Sum over tp the partial grads of ``sequence_parallel`` params (one all-reduce); call after
    backward, before the DP reduction and the optimizer step."""
    all_reduce_in_place([p.grad for p in module.parameters() if is_sequence_parallel(p) and p.grad is not None],
                        group)


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel context a model is built with: its layers and dropout stream. At one
    rank the factories return ``wgrad.Linear`` / ``nn.Embedding`` (a tp-free model's names and
    numerics), else the parallel layers above; all on ``meta``, for the model to initialise."""

    group: Group = None
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (``[s/tp, b, h]`` outside tp regions); needs tp > 1."""

    @property
    def size(self) -> int:
        return _rank_world(self.group)[1]

    @property
    def rank(self) -> int:
        return _rank_world(self.group)[0]

    @property
    def sp(self) -> bool:
        """Whether sequence parallelism is on (asked for, with more than one rank)."""
        return self.sequence_parallel and self.size > 1

    def column(self, in_features: int, out_features: int, *, bias: bool,
               split_sizes: Sequence[int] | None = None) -> Linear | ColumnParallelLinear:
        if self.size == 1:
            return Linear(in_features, out_features, bias=bias, device="meta")
        return ColumnParallelLinear(in_features, out_features, group=self.group, bias=bias, split_sizes=split_sizes,
                                    sequence_parallel=self.sp, device="meta")

    def row(self, in_features: int, out_features: int, *, bias: bool) -> Linear | RowParallelLinear:
        if self.size == 1:
            return Linear(in_features, out_features, bias=bias, device="meta")
        return RowParallelLinear(in_features, out_features, group=self.group, bias=bias, input_is_parallel=True,
                                 sequence_parallel=self.sp, device="meta")

    def embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Embedding | VocabParallelEmbedding:
        if self.size == 1:
            return nn.Embedding(num_embeddings, embedding_dim, device="meta")
        return VocabParallelEmbedding(num_embeddings, embedding_dim, group=self.group, device="meta")

    def fork(self, active: bool, device: torch.device) -> AbstractContextManager:
        """The tp dropout stream (:mod:`.random`, masks differ across tp ranks) when ``active`` at
        tp > 1, else the default generator (masks agree)."""
        if not active or self.size == 1:
            return nullcontext()
        return get_rng_tracker(device).fork()
