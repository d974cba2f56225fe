"""Tensor-parallel GPT pipeline stages, built from the one-process GPT's weights.

:func:`build_tp_gpt_stage` is :func:`tokenloom.train.parallel.schedules.build_gpt_stage`
with Megatron's tensor-parallel layers inside every block (training-stack.md §c):

* attention ``qkv`` -> :class:`ColumnParallelLinear` with ``split_sizes = [q, k, v]``, so
  each rank holds ``n_heads / tp`` query heads and ``n_kv_heads / tp`` key/value heads;
  ``proj`` -> :class:`RowParallelLinear` (``input_is_parallel``), one all-reduce;
* MLP ``fc`` -> column parallel (``split_sizes = [gate, up]`` for SwiGLU so each rank
  keeps matching gate/up halves), ``proj`` -> row parallel, one all-reduce;
* token embedding -> :class:`VocabParallelEmbedding`; LM head -> column parallel
  without gather, and the loss is :func:`vocab_parallel_cross_entropy` on the
  ``[b, s, V/tp]`` logits (full logits never exist on one rank);
* norms, learned positions and RoPE tables are replicated; the forward is the
  reference path of :mod:`tokenloom.train.model` (same norms, residuals, RoPE / learned
  positions, ``scaled_dot_product_attention(is_causal=True)``), so it equals the
  one-process model up to the summation order of the tp all-reduces.

Parameter names equal the one-process model's (``blocks.3.attn.qkv.weight``) and
:meth:`TPGPTStage.full_state_dict` (collective over tp) gathers full tensors under those
names: that is what checkpoints are resharded through (:mod:`.reshard`).

With tied embeddings the LM head shard *is* the embedding shard (both split the
``[V, h]`` matrix by rows), so on a one-stage pipeline they stay one tensor; across
stages the last stage keeps a copy tagged ``shared_embedding`` (and ``shared``), kept
in sync by :func:`~tokenloom.train.parallel.schedules.allreduce_tied_embedding_grads`,
as Megatron does.

Grad-norm bookkeeping (Megatron's ``param_is_not_tensor_parallel_duplicate`` and
``shared``): sharded parameters carry ``tensor_model_parallel``; replicated ones are
counted only on tp rank 0 (:func:`counts_in_grad_norm`), the tied duplicate never.

Limits, on purpose for now: no sequence parallelism (activations stay ``[b, s, h]``;
the layers support it but the stage does not wire it), no dropout under tp > 1 (the
model-parallel RNG tracker of :mod:`.random` is not wired in; a config with dropout and
tp > 1 is refused), and every rank builds the full one-process model once to slice its
part (host memory of the full model; fine up to models that fit in one host).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tokenloom.errors import TokenloomError
from tokenloom.train.model import GPT, GPTConfig, attend, make_norm, mlp_activation, split_qkv
from tokenloom.train.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tokenloom.train.parallel.mappings import Group
from tokenloom.train.parallel.schedules import stage_forward, stage_layer_ids, tag_embeddings_and_rope
from tokenloom.train.parallel.tp_cross_entropy import vocab_parallel_cross_entropy


def _tp_size(group: Group) -> int:
    import torch.distributed as dist

    return 1 if group is None else dist.get_world_size(group)


def check_tp_config(cfg: GPTConfig, tp: int) -> None:
    """Refuse shapes that cannot be split over ``tp`` ranks, with the fix in the message."""
    problems = []
    if cfg.n_heads % tp or cfg.kv_heads % tp:
        problems.append(f"n_heads={cfg.n_heads} and n_kv_heads={cfg.kv_heads} must be divisible by tp={tp}")
    if cfg.ffn_size % tp:
        problems.append(f"ffn size {cfg.ffn_size} must be divisible by tp={tp}")
    if cfg.padded_vocab_size % tp:
        problems.append(f"padded vocab {cfg.padded_vocab_size} must be divisible by tp={tp} "
                        "(raise make_vocab_size_divisible_by)")
    if tp > 1 and cfg.dropout > 0:
        problems.append("dropout > 0 with tp > 1 is not supported yet (no model-parallel RNG tracker wired)")
    if problems:
        raise TokenloomError("tensor parallelism: " + "; ".join(problems))


class TPAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, ref: nn.Module, group: Group) -> None:
        super().__init__()
        tp = _tp_size(group)
        hd = cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads // tp, cfg.kv_heads // tp, hd
        sizes = [cfg.n_heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd]
        self.qkv = ColumnParallelLinear.from_linear(ref.qkv, group=group, split_sizes=sizes)
        self.proj = RowParallelLinear.from_linear(ref.proj, group=group, input_is_parallel=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = split_qkv(self.qkv(x), self.n_heads, self.n_kv_heads, self.head_dim)
        y = attend(q, k, v, rope)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class TPMLP(nn.Module):
    def __init__(self, cfg: GPTConfig, ref: nn.Module, group: Group) -> None:
        super().__init__()
        self.swiglu = cfg.arch == "llama"
        inner = cfg.ffn_size
        sizes = [inner, inner] if self.swiglu else None
        self.fc = ColumnParallelLinear.from_linear(ref.fc, group=group, split_sizes=sizes)
        self.proj = RowParallelLinear.from_linear(ref.proj, group=group, input_is_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(mlp_activation(self.fc(x), self.swiglu))


class TPBlock(nn.Module):
    """Pre-norm block as :class:`tokenloom.train.model.Block`, with tp attention and MLP."""

    def __init__(self, cfg: GPTConfig, ref: nn.Module, group: Group) -> None:
        super().__init__()
        self.norm1, self.norm2 = make_norm(cfg), make_norm(cfg)
        self.norm1.load_state_dict(ref.norm1.state_dict())
        self.norm2.load_state_dict(ref.norm2.state_dict())
        self.attn, self.mlp = TPAttention(cfg, ref.attn, group), TPMLP(cfg, ref.mlp, group)
        self.recompute = ref.recompute

    def _forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, rope, use_reentrant=False)
        return self._forward(x, rope)


_TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


class TPGPTStage(nn.Module):
    """One pipeline stage (or model chunk) of a GPT with tensor-parallel layers.

    ``forward(hidden, batch)`` as :class:`~tokenloom.train.parallel.schedules.GPTStage`:
    ``batch`` is a dict with ``tokens`` (first stage) and ``labels`` / ``loss_mask``
    (last stage, read by :func:`tp_gpt_loss`); the last stage returns the
    vocab-parallel logits ``[b, s, V/tp]``.
    """

    def __init__(self, model: GPT, layer_ids: Sequence[int], first: bool, last: bool, group: Group) -> None:
        super().__init__()
        cfg = model.cfg
        check_tp_config(cfg, _tp_size(group))
        self.cfg, self.first, self.last, self.tp_group = cfg, first, last, group
        with torch.no_grad():
            if first:
                self.tok_emb = VocabParallelEmbedding.from_embedding(model.tok_emb, group=group)
                self.tok_emb.weight.is_embedding = True
                self.pos_emb = None
                if model.pos_emb is not None:
                    self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
                    self.pos_emb.weight.copy_(model.pos_emb.weight)
                    self.pos_emb.weight.is_embedding = True
            self.blocks = nn.ModuleDict({str(i): TPBlock(cfg, model.blocks[i], group) for i in layer_ids})
            if last:
                self.norm = make_norm(cfg)
                self.norm.load_state_dict(model.norm.state_dict())
                self.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group=group)
                if cfg.tie_embeddings and first:
                    self.lm_head.weight = self.tok_emb.weight
        tag_embeddings_and_rope(self, cfg, first, last)
        if cfg.tie_embeddings and last:
            self.lm_head.weight.is_embedding = True  # a tied head decays like the table it is

    def forward(self, hidden: torch.Tensor | None, batch: Any) -> torch.Tensor:
        return stage_forward(self, hidden, batch["tokens"] if self.first else None)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective over the tp group: this stage's full tensors under one-process names
        (the tied duplicate ``lm_head.weight`` of a last stage included)."""
        out: dict[str, torch.Tensor] = {}
        tp_modules = {name: m for name, m in self.named_modules() if isinstance(m, _TP_LAYERS)}
        for name, module in tp_modules.items():
            for key, t in module.full_state_dict().items():
                out[f"{name}.{key}"] = t
        for name, t in self.state_dict().items():
            owner = name.rsplit(".", 1)[0]
            if owner not in tp_modules:
                out[name] = t.detach().clone()
        return out


def build_tp_gpt_stage(
    model: GPT, tp_group: Group, pp_size: int = 1, pp_rank: int = 0, num_chunks: int = 1, chunk: int = 0
) -> TPGPTStage:
    """Chunk ``chunk`` of pipeline rank ``pp_rank``, tensor-split over ``tp_group``
    (None: tp = 1), with exact copies (shards) of ``model``'s weights. Layers are
    assigned by :func:`~tokenloom.train.parallel.schedules.stage_layer_ids` (Megatron's
    offsets, interleaved chunks included)."""
    ids = stage_layer_ids(model.cfg.n_layers, pp_size, pp_rank, num_chunks, chunk)
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == pp_size - 1 and chunk == num_chunks - 1
    return TPGPTStage(model, ids, first, last, tp_group)


def tp_gpt_loss(logits: torch.Tensor, batch: Any, group: Group) -> torch.Tensor:
    """Masked mean cross-entropy of one micro-batch from vocab-parallel logits, as
    ``GPT.forward(tokens, labels, loss_mask)`` computes it."""
    labels = batch["labels"]
    losses = vocab_parallel_cross_entropy(logits.float(), labels, group).reshape(-1)
    mask = batch.get("loss_mask")
    if mask is None:
        return losses.mean()
    mask = mask.reshape(-1).to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def counts_in_grad_norm(param: nn.Parameter, tp_rank: int) -> bool:
    """Megatron's rule: count a parameter once per model replica. Shards count on every
    tp rank, replicated tensors on tp rank 0 only, the tied duplicate never."""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0
