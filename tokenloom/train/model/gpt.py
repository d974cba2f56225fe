"""The GPT (nanoGPT's readability, megatron-core ``GPTModel``'s layouts): :class:`GPT` assembles the
blocks of :mod:`.blocks` described by a :class:`~.config.GPTConfig`, in every layout with the
one-process model's names (checkpoints reshard by name) and, at tp = 1, its numerics and state dict.

* **Tensor parallelism**: vocab-parallel embedding and head, loss on ``[.., V/tp]`` logits; sequence
  parallelism keeps ``[s/tp, b, h]`` between tp regions. **Pipeline**: a stage is a block range
  (:mod:`.pipeline_split`) plus embeddings (``pre``) and/or head and loss (``post``).
* **Initialisation** is layout-free (:meth:`GPT.init_weights`): every layout starts equal.
* Logits cover the padded vocabulary (no label is a padded id); slice ``[..., :vocab_size]``.

Kernels are chosen once for the build device (:func:`build_ops`, megatron-core's ModuleSpec idea)
and held as a plain attribute: one ``forward`` path, nothing for dynamo to look up, no parameters
added, so checkpoints load across modes. ``reference`` materialises fp32 logits; kernel modes take
the loss chunked from hidden states and head weight (``bench/kernels_bench.py`` compares them).
"""
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tokenloom.errors import TokenloomError

if TYPE_CHECKING:  # torch >= 2.5; kernels.attention falls back without it
    from torch.nn.attention.flex_attention import BlockMask
from tokenloom.train.kernels import (
    KernelSet,
    document_attention_mask,
    flex_usable,
    select_kernels,
)
from tokenloom.train.kernels.compiled import compiled
from tokenloom.train.model.blocks import (
    Attention,
    Block,
    Experts,
    MoE,
    make_norm,
    rope_tables,
)
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.parallel.context import (
    CausalChunks,
    local_index,
)
from tokenloom.train.parallel.layers import TensorParallel, shard, tag
from tokenloom.train.parallel.mappings import gather_from_region, scatter_to_sequence_parallel_region
from tokenloom.train.parallel.tp_cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_lm_head_cross_entropy,
)


def build_ops(mode: str, device: torch.device | str) -> KernelSet | None:
    """The :class:`KernelSet` for ``mode`` on ``device``, or None for ``reference`` (the modules'
    eager code) and ``meta``. Raises ``ValueError`` when the host cannot run ``mode``."""
    device_type = torch.device(device).type
    if mode == "reference" or device_type == "meta":
        return None
    ks = select_kernels(mode, device_type)
    return None if ks.mode == "reference" else ks



def _given(t: torch.Tensor | None, name: str) -> torch.Tensor:
    if t is None:
        raise TokenloomError(f"this stage's forward needs {name}")
    return t


def masked_mean(losses: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of per-token ``losses`` over the tokens whose ``loss_mask`` is nonzero (all when None)."""
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.reshape(-1).to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean fp32 next-token cross entropy over the tokens ``loss_mask`` keeps (reference, tp = 1)."""
    return masked_mean(token_losses(logits, labels), loss_mask)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Unmasked per-token fp32 cross entropy [labels.numel()]: what :func:`lm_loss` averages."""
    return F.cross_entropy(logits.float().view(labels.numel(), -1), labels.reshape(-1), reduction="none")


class GPT(nn.Module):
    """Decoder-only transformer, or a pipeline stage of one (``layers``, ``pre``, ``post``), at any
    tp size. A tied head's stage without the embedding keeps its own copy (Megatron's), tagged
    ``shared_embedding`` and ``shared``. ``device="meta"`` keeps shapes only."""

    rope_cos: torch.Tensor  # buffers (positions rope), [seq_len, head_dim]
    rope_sin: torch.Tensor

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        tp: TensorParallel | None = None,
        layers: Sequence[int] | None = None,
        pre: bool = True,
        post: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp or TensorParallel()
        self.pre, self.post = pre, post
        self.cp: tuple[dist.ProcessGroup, int, int] | None = None  # context_parallel()
        if cfg.n_heads % self.tp.size or cfg.kv_heads % self.tp.size:  # the layers check the other splits
            raise TokenloomError(f"n_heads={cfg.n_heads} and n_kv_heads={cfg.kv_heads} must be divisible by "
                                 f"tp={self.tp.size}")
        layers = range(cfg.n_layers) if layers is None else layers
        device = torch.device("cpu" if device is None else device)
        self.ops = ops = build_ops(cfg.kernels, device)  # chosen once, for every module below
        self._lm_loss, self._token_losses = lm_loss, token_losses  # compile_blocks swaps in compiled forms
        if pre:
            self.tok_emb = self.tp.embedding(cfg.padded_vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model, device="meta") if cfg.positions == "learned" else None
            self.drop = nn.Dropout(cfg.dropout)
        if cfg.num_experts is not None and self.tp.size > 1 and not self.tp.sp:
            raise TokenloomError(f"mixture-of-experts layers at tp={self.tp.size} need sequence parallelism (sp=true), "
                                 "as in Megatron")
        self.blocks = nn.ModuleDict({str(i): Block(cfg, self.tp, i in cfg.recompute_layers, ops, cfg.is_moe_layer(i))
                                     for i in layers})
        if post:
            self.norm = make_norm(cfg, ops)
            self.lm_head = self.tp.column(cfg.d_model, cfg.padded_vocab_size, bias=False)
            self.lm_head.wgrad_fusion = False  # maybe tied: a second consumer of its weight (tokenloom.train.parallel.wgrad)
        if cfg.positions == "rope":
            self.register_buffer("rope_cos", torch.empty(cfg.seq_len, cfg.head_dim, device="meta"), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.seq_len, cfg.head_dim, device="meta"), persistent=False)
        if device.type != "meta":
            self._materialise(device)
        self._tie_and_tag()
        if device.type != "meta":
            self.init_weights()

    def _materialise(self, device: torch.device) -> None:
        """Uninitialised storage on ``device``, carrying the parallel tags over (``to_empty`` makes
        new parameter objects)."""
        tags = {name: dict(vars(p)) for name, p in self.named_parameters(remove_duplicate=False)}
        self.to_empty(device=device)
        for name, p in self.named_parameters(remove_duplicate=False):
            vars(p).update(tags[name])

    def _tie_and_tag(self) -> None:
        """Tie the head to the embedding (a stage holding both); tag parameters for optimizer,
        grad norm and gradient reductions."""
        cfg, tp = self.cfg, self.tp
        if self.pre:
            tag(self.tok_emb.weight, is_embedding=True, shared_embedding=cfg.tie_embeddings)
        if self.post and cfg.tie_embeddings:
            if self.pre:
                self.lm_head.weight = self.tok_emb.weight
            # a tied head decays like the table it is; the last stage's copy is out of the grad norm
            tag(self.lm_head.weight, is_embedding=True, shared_embedding=True, shared=not self.pre)
        if tp.sp:  # norms see this rank's tokens only: grads summed over tp after backward
            for module in self.modules():
                if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                    for p in module.parameters():
                        tag(p, sequence_parallel=True)

    @torch.no_grad()
    def init_weights(self) -> None:
        """normal(0, ``init_std``) from ``cfg.seed`` in one-process order, residual projections by
        ``1/sqrt(2 n_layers)`` (GPT-2), biases zero, norms one. Each rank draws every full weight and
        keeps its shard: the whole model's draws buy equal starts, one full weight held at a time."""
        cfg, tp = self.cfg, self.tp
        mine = dict(self.named_parameters(remove_duplicate=False))
        split_sizes = {f"{name}.weight": getattr(m, "split_sizes", None) for name, m in self.named_modules()}
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        std, resid_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for name, module in GPT(cfg, device="meta").named_modules():  # the one-process order
            if isinstance(module, Experts):  # every expert's weights, drawn as one stacked tensor
                for pname, s in (("fc", std), ("proj", resid_std)):
                    full = torch.empty(getattr(module, pname).shape, dtype=torch.float32, device="cpu")
                    full.normal_(0.0, s, generator=gen)
                    if f"{name}.{pname}" in mine:  # the experts this rank holds (all but under ep)
                        held = mine[f"{name}.{pname}"]
                        experts = self.get_submodule(name)
                        assert isinstance(experts, Experts)  # the same module as the meta model's
                        first = experts.first
                        held.copy_(full[first:first + held.shape[0]])
                for pname in ("fc_bias", "proj_bias"):
                    if f"{name}.{pname}" in mine:
                        mine[f"{name}.{pname}"].zero_()
                continue
            if not isinstance(module, (nn.Linear, nn.Embedding)) or (name == "lm_head" and cfg.tie_embeddings):
                continue
            s = resid_std if getattr(module, "residual_scaled_init", False) else std
            # drawn on every rank, held or not: the generator must advance as in one process
            full = torch.empty(module.weight.shape, dtype=torch.float32, device="cpu").normal_(0.0, s, generator=gen)
            targets = [f"{name}.weight"] + (["lm_head.weight"] if name == "tok_emb" and cfg.tie_embeddings else [])
            for target in filter(mine.__contains__, targets):
                p = mine[target]
                if getattr(p, "tensor_model_parallel", False):
                    p.copy_(shard(full, p.partition_dim, tp.rank, tp.size, split_sizes[target]))  # type: ignore[attr-defined]  # a tag
                else:
                    p.copy_(full)
        for module in self.modules():
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.weight is not None:
                module.weight.fill_(1.0)
            bias = getattr(module, "bias", None)
            if bias is not None:
                bias.zero_()
        if cfg.positions == "rope":
            cos, sin = rope_tables(cfg, self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(
        self,
        tokens: torch.Tensor | None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        *,
        hidden: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        token_losses: bool = False,
    ) -> torch.Tensor:
        """tokens/labels/loss_mask: [batch, seq] -> logits without ``labels``, else the mean loss over
        kept tokens, or with ``token_losses`` unmasked per-token losses (no fused grads-in-forward).
        No ``pre``: input ``hidden``; no ``post``: returns the activation. ``documents``:
        ``cu_seqlens`` with per-document ``positions``, the mask built once per forward."""
        if self.cp is not None and positions is None:  # the global positions of this rank's tokens
            where = _given(tokens if self.pre else hidden, "tokens" if self.pre else "hidden").device
            positions = local_index(self.cfg.seq_len, self.cp[1], self.cp[2], where).unsqueeze(0)
        x = self.embed(_given(tokens, "tokens"), positions) if self.pre else _given(hidden, "hidden")
        per_token = positions if positions is not None else tokens  # [batch, seq]
        mask: torch.Tensor | BlockMask | CausalChunks | None = documents
        if self.cp is not None:  # each query chunk against the keys up to it, by global position (and document)
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            mask = CausalChunks.of(self.cfg.seq_len, self.cp[1], self.cp[2], x.device, dtype, documents)
        elif documents is not None and per_token is not None:  # one mask for every block of this forward
            dropout = self.cfg.dropout if self.training else 0.0
            flex = flex_usable(x.device, dropout, self.cfg.head_dim)
            mask = document_attention_mask(documents, per_token.shape[-1], flex=flex)
        rope = (self.rope_cos, self.rope_sin) if self.cfg.positions == "rope" else None
        if rope is not None and positions is not None:
            rope = (rope[0][positions].unsqueeze(1), rope[1][positions].unsqueeze(1))
        for block in self.blocks.values():
            x = block(x, rope, mask)
        if not self.post:
            return x
        if token_losses:
            return self.token_head(self.norm(x), _given(labels, "labels"))
        return self.head(self.norm(x), labels, loss_mask)

    def context_parallel(self, group: dist.ProcessGroup, size: int, rank: int) -> None:
        """Run as ``rank`` of a context-parallel group (:mod:`~tokenloom.train.parallel.context`):
        :meth:`forward` takes this rank's tokens of each sequence, attention gathers all K/V."""
        self.cp = (group, size, rank)
        for module in self.modules():
            if isinstance(module, Attention):
                module.cp_group = group

    def expert_parallel(self, group: dist.ProcessGroup, size: int, rank: int) -> None:
        """Run as ``rank`` of an expert-parallel group (:meth:`MoE.expert_parallel`). Layers are
        initialised whole first (one-process values), so a rank briefly holds every expert."""
        for layer in self.moe_layers().values():
            layer.expert_parallel(group, size, rank)

    def compile_blocks(self) -> None:
        """``torch.compile`` each block (torchtitan's choice: a backward node per block keeps DDP
        overlapping; identical blocks share a graph) and the reference loss (no fp32 logit copies).
        The cost: no fusion across blocks; embedding and head matmul stay eager."""
        for block in self.blocks.values():
            block.compile()
        if self.post:
            self._lm_loss, self._token_losses = compiled(lm_loss), compiled(token_losses)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        B, T = tokens.shape
        if T > self.cfg.seq_len:
            raise TokenloomError(f"sequence length {T} exceeds the model's seq_len={self.cfg.seq_len}")
        x = self.tok_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=tokens.device) if positions is None else positions)
        if self.tp.sp:  # [T/tp, B, d] from here on: each rank keeps its slice of the sequence
            x = scatter_to_sequence_parallel_region(x.transpose(0, 1).contiguous(), self.tp.group)
        with self.tp.fork(self.tp.sp and self.training and self.drop.p > 0, x.device):
            return self.drop(x)

    def head(self, h: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None) -> torch.Tensor:
        """LM head and loss on the final hidden states (see :meth:`forward`)."""
        tp = self.tp
        ks = self.ops
        if labels is None:
            logits = self.lm_head(h)
            if tp.size > 1:
                logits = gather_from_region(logits, tp.group)
            return logits.transpose(0, 1) if tp.sp else logits
        if tp.size == 1:
            if ks is not None:  # chunked: never holds [B*T, vocab] logits; same reduction as below
                return ks.cross_entropy(h, self.lm_head.weight, labels, loss_mask, reduction="mean")
            return self._lm_loss(self.lm_head(h), labels, loss_mask)
        else:
            if tp.sp:  # the sequence-first layout of the activations
                labels = labels.transpose(0, 1)
                loss_mask = None if loss_mask is None else loss_mask.transpose(0, 1)
            if ks is not None:  # fused LM head + vocab-parallel loss, O(chunk x vocab / tp) memory
                return vocab_parallel_lm_head_cross_entropy(h, self.lm_head.weight, labels, tp.group, loss_mask,
                                                            reduction="mean", sequence_parallel=tp.sp)
            losses = vocab_parallel_cross_entropy(self.lm_head(h).float(), labels, tp.group).reshape(-1)
        return masked_mean(losses, loss_mask)

    def token_head(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token losses [batch, seq] (``token_losses`` of :meth:`forward`), kernels as :meth:`head`."""
        tp, ks = self.tp, self.ops
        if tp.size == 1:
            if ks is not None:
                losses = ks.cross_entropy(h, self.lm_head.weight, labels, None, reduction="none")
            else:
                losses = self._token_losses(self.lm_head(h), labels)
            return losses.view(labels.shape)
        if tp.sp:  # the sequence-first layout of the activations: losses come out [seq, batch]
            labels = labels.transpose(0, 1)
        if ks is not None:
            losses = vocab_parallel_lm_head_cross_entropy(h, self.lm_head.weight, labels, tp.group, None,
                                                          reduction="none", sequence_parallel=tp.sp)
        else:
            losses = vocab_parallel_cross_entropy(self.lm_head(h).float(), labels, tp.group)
        losses = losses.reshape(labels.shape)
        return losses.transpose(0, 1) if tp.sp else losses

    def param_split(self) -> dict[str, int]:
        """Unique parameters by part (``embedding``, ``blocks``, ``head``: final norm and an untied
        head), summing to :meth:`num_params`."""
        model = GPT(self.cfg, device="meta")
        embedding = sum(p.numel() for p in (*model.tok_emb.parameters(),
                                            *(model.pos_emb.parameters() if model.pos_emb is not None else ())))
        blocks = sum(p.numel() for p in model.blocks.parameters())
        return {"embedding": embedding, "blocks": blocks, "head": model.num_params() - embedding - blocks}

    def moe_layers(self) -> dict[int, MoE]:
        """This stage's mixture-of-experts MLPs by global block index."""
        return {int(i): b.mlp for i, b in self.blocks.items() if isinstance(b.mlp, MoE)}

    def set_aux_loss_scale(self, scale: float) -> None:
        """The trainer's loss factor (1 / micro-batches), applied to every MoE auxiliary loss too."""
        for layer in self.moe_layers().values():
            layer.aux_loss_scale = scale

    def num_active_params(self, exclude_embeddings: bool = False) -> int:
        """:meth:`num_params` less the ``E - k`` experts per MoE layer a token does not reach."""
        inactive = 0
        for module in GPT(self.cfg, device="meta").modules():
            if isinstance(module, Experts):
                E, k = self.cfg.num_experts or 1, self.cfg.moe_router_topk
                inactive += sum(p.numel() for p in module.parameters()) // E * (E - k)
        return self.num_params(exclude_embeddings) - inactive

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters of the whole model (a stage or shard counts a ``meta`` copy);
        ``exclude_embeddings`` drops the position table and an untied token table."""
        whole = self.tp.size == 1 and self.pre and self.post and len(self.blocks) == self.cfg.n_layers \
            and all(layer.ep is None for layer in self.moe_layers().values())
        model = self if whole else GPT(self.cfg, device="meta")
        n = sum(p.numel() for p in model.parameters())
        if exclude_embeddings:
            if model.pos_emb is not None:
                n -= model.pos_emb.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= model.tok_emb.weight.numel()
        return n
