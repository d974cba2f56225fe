"""Fully sharded data parallelism (ZeRO-3): parameters, gradients and AdamW state sharded over dp.

Built on torch's ``fully_shard`` (FSDP2), applied per transformer block and then to each model chunk (the
embeddings, final norm and head), over this rank's data-parallel group. Each parameter becomes a ``DTensor``
sharded on dim 0 over dp (``torch.chunk``'s split: the first ranks get ``ceil(rows / dp)`` rows, the last
ones fewer or none); a block's parameters are all-gathered just before its forward and again before its
backward, the next block's gather prefetched (explicit forward and backward prefetch, torchtitan's), freed
after each, and its gradients reduce-scattered (averaged over dp) as its backward ends. Every micro-batch's
backward reduce-scatters into the sharded gradient (no ``no_sync``): accumulating full gradients would hold
what FSDP exists to shard.

Why FSDP2 and not our own buckets (ZeRO-1's flat ranges of :mod:`~tokenloom.train.optim.zero` plus freeing
and per-block gathers): FSDP2's per-parameter sharding shards the *local* tensor a rank holds, so it
composes with our tensor-parallel layers (their weights are plain tp-local tensors and their collectives are
our own: FSDP2 never sees tp) and with our pipeline schedules (each chunk is its own FSDP root; a backward
call per micro-batch finalises its reduce-scatters). It brings the gather/free/prefetch/reduce-scatter
machinery, its streams on CUDA and its ``torch.compile`` support, which a second hand-written ZeRO-3 would
have to re-derive and maintain; the sharded ``DTensor`` parameters work with torch's fused AdamW as they
are. What we keep our own: the clipping norm and the tp/pp gradient sums run on the local shards
(:func:`local`), and checkpoints stay in :mod:`~tokenloom.train.checkpoint.format`: a dim-0 shard of a
contiguous tensor is one contiguous element range of it, so each rank writes its own pieces
(:func:`own_piece`) and any layout loads them, and loading cuts this rank's rows (:func:`cut`).

The chunk's own parameters (the embeddings, the final norm and the LM head, tied to the token embedding by
default) are the FSDP root's: ``fully_shard`` gathers them before the forward and keeps them gathered for
the backward (torch's rule for a root). Left at that, the tied table stays gathered to the end of the
backward, where memory peaks; so the final norm's hook frees them once the backward is back through the norm
(:func:`_reshard_once_back_through`): the norm and the head are the chunk's only own modules whose backward
reads their weights. The trade-off: the hook rests on that layout of :class:`~tokenloom.train.model.gpt.GPT`
(a later-running own module would find them freed and fail loudly), and under a pipeline schedule a
micro-batch may gather them once more at the start of its backward (more traffic, a lower peak).

Mixed precision is the trainer's: fp32 parameters (the master weights), bf16 autocast compute, so gathers
and reduce-scatters run in fp32 (no ``MixedPrecisionPolicy``: twice a bf16 gather's traffic).

Megatron's parameter tags (``tensor_model_parallel``, ``sequence_parallel``, ...) live on the parameters,
which ``fully_shard`` replaces: :func:`shard_fully` copies every tag across.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def shard_fully(chunks: Sequence[nn.Module], blocks: Sequence[Sequence[nn.Module]], group: dist.ProcessGroup,
                device: torch.device) -> None:
    """``fully_shard`` each of ``blocks[i]`` (chunk ``i``'s transformer blocks, in forward
    order), then each chunk, over ``group``; each block prefetches the next one's gather in
    forward and the previous one's in backward. Collective over ``group``. Parameter tags are
    carried over to the sharded parameters."""
    from torch.distributed.device_mesh import DeviceMesh  # lazy: start-up time (see is_sharded)
    from torch.distributed.fsdp import fully_shard  # lazy: start-up time (see is_sharded)

    mesh = DeviceMesh.from_group(group, device.type)
    for chunk, chunk_blocks in zip(chunks, blocks, strict=True):
        tags = {name: dict(vars(p)) for name, p in chunk.named_parameters(remove_duplicate=False)}
        for block in chunk_blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(chunk, mesh=mesh)
        norm = getattr(chunk, "norm", None)  # a chunk with the head: its final norm
        if isinstance(norm, nn.Module):
            norm.register_forward_pre_hook(functools.partial(_reshard_once_back_through, chunk))
        for name, p in chunk.named_parameters(remove_duplicate=False):
            for key, value in tags[name].items():
                setattr(p, key, value)
        for before, after in zip(chunk_blocks, chunk_blocks[1:], strict=False):
            before.set_modules_to_forward_prefetch([after])  # type: ignore[operator]  # fully_shard's mixin
            after.set_modules_to_backward_prefetch([before])  # type: ignore[operator]


def _reshard_once_back_through(chunk: nn.Module, norm: nn.Module, args: tuple) -> None:
    """Forward pre-hook of ``chunk``'s final norm: once the backward has come back through it
    (its input's gradient is computed), free the chunk's own gathered parameters, which
    ``fully_shard`` would keep to the end of the backward. The norm and the LM head are the
    only modules of the chunk's own that read their weights in backward; what is left of it
    (the embeddings) reads only the token ids. A later forward gathers them again."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.requires_grad:
        x.register_hook(lambda grad: chunk.reshard())  # type: ignore[operator]  # fully_shard's mixin


def reshard(chunks: Sequence[nn.Module]) -> None:
    """Free the gathered parameters of every sharded module of ``chunks``, so that each holds its
    sharded ``DTensor`` parameters again: a chunk (the FSDP root) keeps its own gathered after a
    forward, for the backward that follows. Call it before reading or writing the parameters
    outside a forward (saving, loading). Not a collective."""
    from torch.distributed.fsdp import FSDPModule  # lazy: start-up time (see is_sharded)

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def is_sharded(t: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``DTensor``. Read from ``sys.modules``: torch's FSDP and DTensor modules
    take a second or more of CPU to import, which every process of a run without FSDP would pay
    (each rank, each launcher), and no tensor is a ``DTensor`` before :func:`shard_fully` loads them."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a ``DTensor``'s local shard, any other tensor itself."""
    return t.to_local() if is_sharded(t) else t


def _rows(p: torch.Tensor) -> tuple[int, int]:
    """(first row, rows) of ``p``'s dim-0 shard on this rank, as ``fully_shard`` cuts it."""
    if not is_sharded(p) or p.dim() == 0:
        return 0, p.shape[0] if p.dim() else 1
    mesh = p.device_mesh
    size, rank = mesh.size(), mesh.get_local_rank()
    per = -(-p.shape[0] // size)
    first = min(rank * per, p.shape[0])
    rows = min(per, p.shape[0] - first)
    assert local(p).shape[0] == rows, (tuple(local(p).shape), p.shape, rank, size)  # torch.chunk's split
    return first, rows


def own_piece(p: torch.Tensor, t: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(start element in the flattened full tensor, 1-d view of this rank's part) of ``t``, a
    tensor sharded like parameter ``p`` (``p`` itself, or one of its AdamW moments)."""
    first, _ = _rows(p)
    row = math.prod(p.shape[1:])
    return first * row, local(t).reshape(-1)


def cut(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``full`` (a tensor of ``p``'s full shape), as ``p``'s shard holds them."""
    if full.dim() == 0 or not is_sharded(p):
        return full
    first, rows = _rows(p)
    return full[first : first + rows]


def like(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (``p``'s full shape) sharded as ``p`` is, on ``p``'s device: a ``DTensor`` for a
    sharded ``p`` (what AdamW keeps as its moments), a copy otherwise."""
    if not is_sharded(p) or full.dim() == 0:
        return full.to(p.device).clone()
    piece = cut(p, full).to(local(p).device).clone()
    return type(p).from_local(piece, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
