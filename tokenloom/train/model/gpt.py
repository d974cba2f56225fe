"""A small, readable GPT in one file (in the spirit of nanoGPT) that serves every parallel
layout (in the spirit of megatron-core's ``GPTModel``).

The model is described by its features (:class:`GPTConfig`): ``norm`` (LayerNorm or RMSNorm),
``mlp`` (tanh-GELU or SwiGLU), ``positions`` (a learned table or rotate-half RoPE as in GPT-NeoX /
Hugging Face, base ``rope_theta``), ``bias``, ``tie_embeddings``, and grouped-query attention via
``n_kv_heads``. :attr:`GPTConfig.arch` is a preset: a feature left None takes the arch's value
(``"gpt2"``: LayerNorm, GELU, learned positions, biases; ``"llama"``: RMSNorm, SwiGLU, RoPE, no
biases; both tied unless ``tie_embeddings`` says otherwise), so a config written before the
features existed builds the same model. Any combination builds, in every layout and every kernels
mode: each feature is its own op in every :class:`~tokenloom.train.kernels.KernelSet` (norm,
activation, RoPE), so no combination falls back or is refused.

Mixture of experts (``num_experts``, Megatron's MoE flags): blocks chosen by ``moe_layer_freq``
hold a :class:`MoE` instead of the :class:`MLP` (:mod:`tokenloom.train.moe`: fp32 top-k router, no
token dropped, experts as one grouped GEMM, balance and z losses joined to backward); expert weights
are stacked on a leading expert dimension and drawn from the same generator in module order. Every
rank holds every expert unless :meth:`GPT.expert_parallel` splits them over an ep group; at tp > 1
sequence parallelism is required (the experts are replicated over tp).

Layouts and their invariants:

* **Tensor parallelism**: linears and the token embedding come from a
  :class:`~tokenloom.train.parallel.layers.TensorParallel` context. At tp = 1 they are
  ``nn.Linear`` (:class:`tokenloom.train.wgrad.Linear`) / ``nn.Embedding``, with the numerics,
  names and state dict of a model that knows nothing of tp; above, ``qkv`` and ``fc`` are
  column-parallel, the output projections row-parallel, embedding and LM head
  vocab-parallel, and the loss is taken on ``[.., V/tp]`` logits (full logits never exist).
  Sequence parallelism keeps ``[s/tp, b, h]`` activations between the tp regions.
* **Pipeline parallelism**: a stage is a range of blocks (``layers``) plus the embeddings
  (``pre``) and/or head and loss (``post``); :mod:`tokenloom.train.pipeline_split` picks
  Megatron's ranges. Parameter names stay global (``blocks.7.mlp.fc.weight``), so
  checkpoints reshard by name.
* **Initialisation** is rank-local and layout-free: parameters are created on ``meta`` and
  :meth:`GPT.init_weights` fills each rank's shards with the one-process model's values
  (every full weight drawn in turn from a private generator seeded by ``seed``, then
  sliced): normal(0, ``init_std``), residual projections scaled by ``1/sqrt(2 * n_layers)``
  (GPT-2), biases zero, norm weights one. The price of equal starts in every layout: every
  rank draws the whole model's numbers.
* **Dropout** at tp > 1 draws inside tensor-parallel regions from the per-tp-rank stream of
  :mod:`tokenloom.train.parallel.random`, elsewhere from the default generator.

Trade-offs:

* GQA repeats K/V heads before ``F.scaled_dot_product_attention(is_causal=True)``: memory
  for ``n_heads/n_kv_heads`` copies of K and V, but no dependence on ``enable_gqa``.
* The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by`` (Megatron's)
  for the LM-head GEMM's shapes; logits and the softmax cover the padded vocabulary. No
  label is a padded id. Slice ``logits[..., :vocab_size]`` for sampling.
* Activation recompute is per layer (``Block.recompute``), non-reentrant, so the autograd
  graph stays visible to ``find_unused_parameters`` (:mod:`tokenloom.train.ddp`).

Kernels (:attr:`GPTConfig.kernels`, :mod:`tokenloom.train.kernels`) are chosen once, when
the model is built, for the device it is built on (:func:`build_ops`, megatron-core's ModuleSpec
idea): every block, norm and the head hold the same :class:`~tokenloom.train.kernels.KernelSet`
(or None, the eager reference code) as a plain attribute, so ``forward`` has one path and no
lookup for dynamo to trace. No parameters or buffers are added, so state dicts and checkpoints
are the same in every mode and load across modes. ``reference`` is the eager code below and the
numerical baseline every distributed test compares against; its loss materialises
``[tokens, padded_vocab]`` fp32 logits. ``compiled`` / ``triton`` (and ``auto`` where it
resolves to one) route norms, activations, RoPE and attention through the kernel set and take
the loss chunked from the final hidden states and the LM-head weight (O(chunk x vocab) memory;
full logits when small), with the reference's semantics (padded-vocab softmax, ``mean`` over
tokens or ``loss_mask``) and its numerics up to float rounding; biases go into ``bias_gelu`` and
``bias_dropout_add`` at every tp size. Logits (``labels=None``) are always the full padded
tensor. ``bench/kernels_bench.py`` measures the modes' throughput and the chunked loss's memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tokenloom.errors import TokenloomError

if TYPE_CHECKING:  # torch >= 2.5; kernels.attention falls back without it
    from torch.nn.attention.flex_attention import BlockMask
from tokenloom.train.kernels import (
    KernelSet,
    attention_sdpa,
    document_attention_mask,
    flex_usable,
    select_kernels,
)
from tokenloom.train.kernels.compiled import compiled
from tokenloom.train.moe import (
    AttachAuxLoss,
    combine,
    dispatch,
    gather_combine,
    gather_dispatch,
    grouped_mm,
    load_balancing_loss,
    permute,
    route,
    unpermute,
    z_loss,
)
from tokenloom.train.parallel.context import (
    CausalChunks,
    causal_chunks_attention,
    gather_sequence,
    local_index,
)
from tokenloom.train.parallel.layers import TensorParallel, shard, tag
from tokenloom.train.parallel.mappings import gather_from_region, scatter_to_sequence_parallel_region
from tokenloom.train.parallel.random import checkpoint as tp_checkpoint
from tokenloom.train.parallel.random import get_rng_tracker
from tokenloom.train.parallel.tp_cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_lm_head_cross_entropy,
)
from tokenloom.train.wgrad import linear as wgrad_linear


@dataclass(kw_only=True)
class GPTConfig:
    """Model shape and behaviour. Every field is keyword-only.

    After construction every feature field (norm, mlp, positions, bias) holds its resolved value, so
    what is saved (``config.json``, a checkpoint's ``state.json``) names the model that was built
    whatever the arch preset later means; a saved config without them (written before they existed)
    resolves them from its arch, as the model was built then."""

    arch: Literal["gpt2", "llama"] = "gpt2"
    """Preset for the features left unset (norm, mlp, positions, bias): ``gpt2``: LayerNorm + GELU +
    learned positions + biases; ``llama``: RMSNorm + SwiGLU + RoPE, no biases."""
    norm: Literal["layernorm", "rmsnorm"] | None = None
    """Normalisation of every block and the final norm; None: the arch's (gpt2 layernorm, llama rmsnorm)."""
    mlp: Literal["gelu", "swiglu"] | None = None
    """MLP activation (tanh GELU, or SwiGLU with a gate and an up projection); None: the arch's
    (gpt2 gelu, llama swiglu)."""
    positions: Literal["learned", "rope"] | None = None
    """Position encoding: a learned table of seq_len rows, or rotary (RoPE, base rope_theta) on queries
    and keys; None: the arch's (gpt2 learned, llama rope)."""
    vocab_size: int = 50257
    """Number of real token ids (the tokenizer's vocabulary size)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding / LM-head rows up to a multiple of this (Megatron's flag)."""
    seq_len: int = 1024
    """Maximum sequence length (size of the position table / RoPE cache)."""
    n_layers: int = 12
    """Number of transformer blocks."""
    n_heads: int = 12
    """Number of query heads; ``d_model`` must be divisible by it."""
    n_kv_heads: int | None = None
    """Number of key/value heads (GQA); None means ``n_heads`` (plain multi-head attention)."""
    d_model: int = 768
    """Hidden size."""
    ffn_hidden_size: int | None = None
    """MLP inner size; None means ``4*d_model`` (gelu) or ``8/3*d_model`` rounded up to 64 (swiglu)."""
    bias: bool | None = None
    """Biases in linear layers (and LayerNorm unless norm_bias says otherwise); None means True for
    gpt2, False for llama."""
    norm_bias: bool | None = None
    """Biases in LayerNorm (RMSNorm has none); None means the same as bias. Megatron's
    --disable-bias-linear sets bias false and keeps these."""
    tie_embeddings: bool = True
    """Share the token-embedding matrix with the LM head (one tensor, one storage)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency (positions rope only)."""
    recompute_layers: tuple[int, ...] = field(default_factory=tuple)
    """Indices of blocks whose activations are recomputed in backward (``tuple(range(n_layers))`` = all)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init."""
    seed: int = 0
    """Seed of the private generator used for the weight init."""
    num_experts: int | None = None
    """Experts of each mixture-of-experts MLP (Megatron's --num-experts); None: dense MLPs everywhere."""
    moe_router_topk: int = 2
    """Experts each token is routed to (its k largest router logits, gates a softmax over them)."""
    moe_ffn_hidden_size: int | None = None
    """Inner size of each expert; None means the dense MLP's (ffn_size)."""
    moe_layer_freq: int = 1
    """Block i has a mixture-of-experts MLP when i % moe_layer_freq == 0 (1: every block)."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    """Balance loss over each micro-batch's tokens (aux_loss), per sequence averaged (seq_aux_loss), or none."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss in the objective (Megatron's default 0: off)."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss (mean squared logsumexp of the router logits); 0: off."""
    moe_grouped_gemm: bool = True
    """Run all experts as one torch._grouped_mm where the device supports it (else a loop over experts)."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach the experts at ep > 1 (at ep 1 both are the same computation, no collective).
    alltoall: only the routed rows move, but the split sizes need a host sync each layer and pass;
    allgather: every ep rank receives all tokens of the ep group and their routing, computes its
    experts on the rows routed to them and returns the outputs by reduce-scatter: fixed-size
    collectives, no host sync where the experts run as one grouped GEMM, more bytes at large ep."""
    kernels: str = "reference"
    """Op implementations: reference | compiled | triton | auto (see tokenloom.train.kernels), chosen
    once when the model is built; ``reference`` is the eager path, bit-identical to the model before
    kernels existed; auto: reference on CUDA (inductor fuses it under compile), compiled on CPU."""

    def __post_init__(self) -> None:
        kv = self.kv_heads
        if self.d_model % self.n_heads:
            raise TokenloomError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % kv:
            raise TokenloomError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={kv}")
        preset = ARCH_FEATURES.get(self.arch)
        if preset is None:
            raise TokenloomError(f"arch must be 'gpt2' or 'llama', got {self.arch!r}")
        for name, value in preset.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.norm_bias is None:
            self.norm_bias = self.bias
        for name, allowed in FEATURE_VALUES.items():
            if getattr(self, name) not in allowed:
                raise TokenloomError(f"model.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.positions == "rope" and self.head_dim % 2:
            raise TokenloomError(f"RoPE needs an even head dimension; d_model={self.d_model} / "
                                 f"n_heads={self.n_heads} = {self.head_dim}")
        if self.kernels not in ("reference", "compiled", "triton", "auto"):
            raise TokenloomError(f"kernels must be reference, compiled, triton or auto, got {self.kernels!r}")
        if self.num_experts is not None:
            if self.num_experts < 1 or not 1 <= self.moe_router_topk <= self.num_experts:
                raise TokenloomError(f"model.num_experts={self.num_experts} must be >= 1 and model.moe_router_topk="
                                     f"{self.moe_router_topk} between 1 and it")
            if self.moe_layer_freq < 1:
                raise TokenloomError(f"model.moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
            if self.moe_token_dispatcher_type not in ("alltoall", "allgather"):
                raise TokenloomError("model.moe_token_dispatcher_type must be alltoall or allgather, "
                                     f"got {self.moe_token_dispatcher_type!r}")
            if self.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
                raise TokenloomError("model.moe_router_load_balancing_type must be aux_loss, seq_aux_loss or none, "
                                     f"got {self.moe_router_load_balancing_type!r}")
        bad = [i for i in self.recompute_layers if not 0 <= i < self.n_layers]
        if bad:
            raise TokenloomError(f"recompute_layers {bad} out of range for n_layers={self.n_layers}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return math.ceil(self.vocab_size / m) * m

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.mlp == "gelu":
            return 4 * self.d_model
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    @property
    def moe_ffn_size(self) -> int:
        """Inner size of each expert (``moe_ffn_hidden_size``, else the dense MLP's)."""
        return self.ffn_size if self.moe_ffn_hidden_size is None else self.moe_ffn_hidden_size

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` has a mixture-of-experts MLP."""
        return self.num_experts is not None and index % self.moe_layer_freq == 0

    @property
    def use_bias(self) -> bool:
        """``bias`` resolved (``__post_init__`` replaces None by the arch's default)."""
        return bool(self.bias)


ARCH_FEATURES: dict[str, dict[str, str | bool]] = {
    "gpt2": {"norm": "layernorm", "mlp": "gelu", "positions": "learned", "bias": True},
    "llama": {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": False},
}
"""Each :attr:`GPTConfig.arch` preset: the value of every feature field left None."""

FEATURE_VALUES = {"norm": ("layernorm", "rmsnorm"), "mlp": ("gelu", "swiglu"), "positions": ("learned", "rope")}
"""The values each feature field takes."""


def build_ops(mode: str, device: torch.device | str) -> KernelSet | None:
    """The op implementations of a model built on ``device`` for kernel mode ``mode``: the
    :class:`~tokenloom.train.kernels.KernelSet`, or None when it resolves to ``reference``
    (the modules' own eager code, the test oracle, runs then). A ``meta`` model (shapes only,
    never run) takes None. Raises ``ValueError`` when the host cannot run ``mode``."""
    device_type = torch.device(device).type
    if mode == "reference" or device_type == "meta":
        return None
    ks = select_kernels(mode, device_type)
    return None if ks.mode == "reference" else ks


def rope_tables(cfg: GPTConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim] (rotate-half layout), computed in float64
    on the host and moved to ``device``."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device="cpu") / hd))
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64, device="cpu"), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [T, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def _matmul_and_bias(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``layer(x)`` without its bias, and the bias, so that a kernel can fuse the bias into
    the op that follows (``bias_gelu``, ``bias_dropout_add``); the weight gradient goes to its
    sink as in the layer's own forward (:mod:`tokenloom.train.wgrad`)."""
    if isinstance(layer, nn.Linear):
        fused = getattr(layer, "wgrad_fusion", False)
        return (wgrad_linear if fused else F.linear)(x, layer.weight), layer.bias
    return layer(x, skip_bias_add=True)


class Attention(nn.Module):
    """Causal self-attention; ``qkv`` column-parallel and ``proj`` row-parallel at tp > 1
    (each rank holds ``n_heads / tp`` query and ``n_kv_heads / tp`` key/value heads)."""

    def __init__(self, cfg: GPTConfig, tp: TensorParallel, ops: KernelSet | None = None) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads // tp.size, cfg.kv_heads // tp.size, hd
        sizes = [cfg.n_heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd]
        self.qkv = tp.column(cfg.d_model, sum(sizes), bias=cfg.use_bias, split_sizes=sizes)
        self.proj = tp.row(cfg.d_model, cfg.d_model, bias=cfg.use_bias)
        tag(self.proj, residual_scaled_init=True)
        self.dropout, self.ops, self.tp = cfg.dropout, ops, tp
        self.cp_group: dist.ProcessGroup | None = None  # context parallelism: GPT.context_parallel sets it

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [B, T, d] (or [T/tp, B, d] under sequence parallelism); ``documents``: the
        forward's document mask, or the batch's ``cu_seqlens`` (attention stays within each
        document; see ``kernels.document_attention_mask``). Returns the output
        projection with its bias added (reference kernels), or without it and the bias."""
        qkv = self.qkv(x)
        if self.tp.sp:  # [T, B, ...] after the sequence all-gather
            qkv = qkv.transpose(0, 1)
        B, T, _ = qkv.shape
        q, k, v = split_qkv(qkv, self.n_heads, self.n_kv_heads, self.head_dim)
        p = self.dropout if self.training else 0.0
        ks = self.ops
        if self.cp_group is not None:  # rotate at each token's own position, then every cp rank's keys/values
            if rope is not None:
                cos, sin = rope_at(rope, T)
                q, k, rope = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), None
            k, v = gather_sequence(k, 2, self.cp_group), gather_sequence(v, 2, self.cp_group)
        with self.tp.fork(p > 0, x.device):  # heads are split over tp: per-rank masks
            if isinstance(documents, CausalChunks):  # cp, causal: SDPA per query chunk, no mask
                y = causal_chunks_attention(q, k, v, documents, dropout_p=p)
            elif ks is not None:
                if rope is not None:
                    cos, sin = rope_at(rope, T)
                    per_sample = cos.dim() == 4  # positions restart per document: the elementwise form
                    rotate = _apply_rope if per_sample else ks.rope
                    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
                if documents is None:
                    y = ks.attention(q, k, v, causal=True, dropout_p=p)
                else:
                    y = ks.attention(q, k, v, causal=True, dropout_p=p, documents=documents)
            else:
                y = attend(q, k, v, rope, dropout_p=p, documents=documents)
        y = y.transpose(1, 2).reshape(B, T, -1)
        if self.tp.sp:
            y = y.transpose(0, 1)
        return (self.proj(y), None) if ks is None else _matmul_and_bias(self.proj, y)


class MLP(nn.Module):
    """GELU or SwiGLU MLP; ``fc`` column-parallel (gate/up halves split alike) and ``proj``
    row-parallel at tp > 1."""

    def __init__(self, cfg: GPTConfig, tp: TensorParallel, ops: KernelSet | None = None) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        inner = cfg.ffn_size
        self.fc = tp.column(cfg.d_model, 2 * inner if self.swiglu else inner, bias=cfg.use_bias,
                            split_sizes=[inner, inner] if self.swiglu else None)
        self.proj = tp.row(inner, cfg.d_model, bias=cfg.use_bias)
        tag(self.proj, residual_scaled_init=True)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output projection with its bias (reference kernels), or without it and the bias."""
        ks = self.ops
        if ks is None:
            return self.proj(mlp_activation(self.fc(x), self.swiglu)), None
        if self.swiglu:
            h = ks.swiglu(*self.fc(x).chunk(2, dim=-1))
        else:
            h = ks.bias_gelu(*_matmul_and_bias(self.fc, x), approximate="tanh")
        return _matmul_and_bias(self.proj, h)


class Experts(nn.Module):
    """The weights of ``E`` MLPs stacked on a leading expert dimension: ``fc`` [E, d, inner] (or
    [E, d, 2 inner], gate then up, for SwiGLU) and ``proj`` [E, inner, d], with biases ``fc_bias``
    [E, ...] and ``proj_bias`` [E, d] when the model has biases. Expert e alone is the dense
    :class:`MLP` whose ``fc.weight`` is ``fc[e].T`` and ``proj.weight`` is ``proj[e].T``. Under expert
    parallelism (:meth:`MoE.expert_parallel`) the module holds experts ``first ..`` of the layer's,
    as many as its leading dimension says."""

    first: int = 0
    """The layer's index of this module's first expert (nonzero on an expert-parallel rank)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        E, d, inner = cfg.num_experts or 1, cfg.d_model, cfg.moe_ffn_size
        width = 2 * inner if cfg.mlp == "swiglu" else inner
        self.fc = nn.Parameter(torch.empty(E, d, width, device="meta"))
        self.proj = nn.Parameter(torch.empty(E, inner, d, device="meta"))
        self.fc_bias = nn.Parameter(torch.empty(E, width, device="meta")) if cfg.use_bias else None
        self.proj_bias = nn.Parameter(torch.empty(E, d, device="meta")) if cfg.use_bias else None


class MoE(nn.Module):
    """Mixture-of-experts MLP (megatron-core's ``MoELayer`` on one rank): fp32 top-k router,
    tokens sorted by expert, experts as grouped GEMMs, gate-weighted sum back per token; no token
    dropped (:mod:`tokenloom.train.moe`). The balance and z losses (``cfg.moe_*_coeff``) join
    backward through :class:`~tokenloom.train.moe.AttachAuxLoss` scaled by ``aux_loss_scale``
    (1 / micro-batches, set by the trainer; 1 for a single forward and backward).

    Tensor parallelism needs sequence parallelism (Megatron's rule): each tp rank routes its own
    slice of the tokens through full (replicated) experts, whose grads are summed over tp like the
    norms' (tag ``sequence_parallel``). Under expert parallelism the tokens reach the ranks holding
    their experts by all-to-all or all-gather (``cfg.moe_token_dispatcher_type``), with equal results.
    ``stats`` accumulates, on the device and only in training
    forwards, the tokens per expert, the balance and z losses and the number of forwards
    (:meth:`take_stats` reads and clears it): no host sync per step."""

    def __init__(self, cfg: GPTConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.num_experts, self.topk = cfg.num_experts or 1, cfg.moe_router_topk
        self.swiglu, self.grouped = cfg.mlp == "swiglu", cfg.moe_grouped_gemm
        self.dispatcher = cfg.moe_token_dispatcher_type
        self.balancing, self.aux_coeff, self.z_coeff = (cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff,
                                                        cfg.moe_z_loss_coeff)
        self.router = nn.Linear(cfg.d_model, self.num_experts, bias=False, device="meta")
        self.experts = Experts(cfg)
        if tp.sp:
            for p in self.parameters():
                tag(p, sequence_parallel=True)
        self.tp = tp
        self.ep: tuple[dist.ProcessGroup, int] | None = None  # expert_parallel(): (group, size)
        self.aux_loss_scale = 1.0
        self.stats: torch.Tensor | None = None  # [E + 3]: tokens per expert, balance, z, forwards
        self.pending: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """x: [B, T, d] (or [T/tp, B, d] under sequence parallelism) -> (output, None): the gated
        experts' outputs with their biases in, the shape of ``x``."""
        shape, ex = x.shape, self.experts
        flat = x.reshape(-1, shape[-1])
        logits, chosen, gates = route(flat, self.router.weight, self.topk)
        valid, plan, gathered = None, None, None
        if self.ep is not None and self.dispatcher == "allgather":  # every token of the ep group here
            rows, expert_of_row, counts, valid, gathered = gather_dispatch(flat, chosen, gates, self.ep[0], ex.first,
                                                                           ex.fc.shape[0])
            routed = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
        else:
            rows, order, expert_of_row, counts = permute(flat, chosen, self.num_experts)
            routed = counts
            if self.ep is not None:  # to the ranks holding the experts, sorted by local expert
                rows, expert_of_row, counts, plan = dispatch(rows, counts, *self.ep)
        h = grouped_mm(rows, ex.fc, counts, self.grouped, valid)
        if ex.fc_bias is not None:
            h = h + ex.fc_bias[expert_of_row].to(h.dtype)
        out = grouped_mm(mlp_activation(h, self.swiglu), ex.proj, counts, self.grouped, valid)
        if ex.proj_bias is not None:
            out = out + ex.proj_bias[expert_of_row].to(out.dtype)
        if gathered is not None:
            y = gather_combine(out, gathered)
        else:
            if plan is not None:
                out = combine(out, plan)
            y = unpermute(out, order, gates, flat.shape[0])
        y = y.view(*shape[:-1], out.shape[-1])
        group = self.tp.group if self.tp.sp else None
        zero = logits.new_zeros(())
        balance = zero if self.balancing == "none" else load_balancing_loss(
            logits, chosen, shape[1] if self.tp.sp else shape[0], self.balancing, group)
        z = z_loss(logits, group) if self.z_coeff else zero
        aux = self.aux_coeff * balance + self.z_coeff * z
        if torch.is_grad_enabled() and aux.requires_grad:
            y = AttachAuxLoss.apply(y, aux, self.aux_loss_scale)
        if self.training:  # committed by the block, so a recomputed forward is not counted twice
            self.pending = torch.cat([routed.to(torch.float64), torch.stack([balance, z]).detach().to(torch.float64),
                                      torch.ones(1, dtype=torch.float64, device=x.device)])
        return y, None

    @torch.no_grad()
    def expert_parallel(self, group: dist.ProcessGroup, size: int, rank: int) -> None:
        """Keep experts ``rank * E / size`` to ``(rank + 1) * E / size`` of the initialised layer (the
        one-process values) and exchange tokens with the other ranks of ``group`` in every forward
        (:func:`~tokenloom.train.moe.dispatch` or, with the allgather dispatcher,
        :func:`~tokenloom.train.moe.gather_dispatch`). Call before the optimizer or DDP sees the
        parameters (they are replaced). The expert parameters are tagged ``expert_parallel``:
        reduced over the expert-data-parallel group, not with the dense ones; under sequence
        parallelism also ``sequence_parallel`` (summed over tp first, like the router's)."""
        if self.num_experts % size:
            raise TokenloomError(f"num_experts={self.num_experts} is not divisible by ep={size}")
        local = self.num_experts // size
        ex = self.experts
        ex.first = rank * local
        for name in ("fc", "proj", "fc_bias", "proj_bias"):
            p = getattr(ex, name)
            if p is not None:
                setattr(ex, name, nn.Parameter(p[ex.first:ex.first + local].clone()))
                # keeps the tp tag: under sequence parallelism the share's grad is partial per tp rank too
                tag(getattr(ex, name), expert_parallel=True, sequence_parallel=self.tp.sp)
        self.ep = (group, size)

    def commit_stats(self) -> None:
        """Add the last training forward's statistics to ``stats``."""
        if self.pending is not None:
            self.stats = self.pending if self.stats is None else self.stats + self.pending
            self.pending = None

    def take_stats(self) -> torch.Tensor:
        """The statistics since the last call, [E + 3] float64 on the device (zeros when none), and
        clear them: tokens per expert, then the sums of the balance loss, the z-loss and the count
        of forwards they were taken over."""
        stats = self.stats
        self.stats = None
        return stats if stats is not None else torch.zeros(self.num_experts + 3, dtype=torch.float64,
                                                             device=self.router.weight.device)


def rope_at(rope: tuple[torch.Tensor, torch.Tensor], seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin for a sequence of ``seq``: the table's first rows, or the per-sample
    tables ([B, 1, T, d]) that positions restarting at each document gave."""
    return rope if rope[0].dim() == 4 else (rope[0][:seq], rope[1][:seq])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    dropout_p: float = 0.0,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference causal attention: q [B, h, T, d], k/v [B, h_kv, T, d] -> [B, h, T, d].

    RoPE (if ``rope``) on q and k, k/v heads repeated to h for GQA, then SDPA (within each
    document of ``documents``, a ``cu_seqlens`` batch, when given).
    """
    if rope is not None:
        cos, sin = rope_at(rope, q.shape[2])
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    if documents is not None:
        return attention_sdpa(q, k, v, dropout_p=dropout_p, documents=documents)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def split_qkv(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int):
    """[B, T, (H + 2 KV) * D] -> q [B, H, T, D], k and v [B, KV, T, D] (head counts of this rank)."""
    B, T, _ = qkv.shape
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    return (q.view(B, T, n_heads, head_dim).transpose(1, 2), k.view(B, T, n_kv_heads, head_dim).transpose(1, 2),
            v.view(B, T, n_kv_heads, head_dim).transpose(1, 2))


def mlp_activation(h: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """The reference MLP activation: SwiGLU over the [gate, up] halves (Llama), else tanh GELU (GPT-2)."""
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


class _LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state dict) that runs ``ops``' kernel when given."""

    def __init__(self, cfg: GPTConfig, ops: KernelSet | None = None) -> None:
        super().__init__(cfg.d_model, eps=cfg.norm_eps, bias=bool(cfg.norm_bias), device="meta")
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ks = self.ops
        if ks is None:
            return super().forward(x)
        return ks.layer_norm(x, self.weight, self.bias, self.eps)


class _RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters and state dict) that runs ``ops``' kernel when given."""

    def __init__(self, cfg: GPTConfig, ops: KernelSet | None = None) -> None:
        super().__init__(cfg.d_model, eps=cfg.norm_eps, device="meta")
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ks = self.ops
        if ks is None:
            return super().forward(x)
        return ks.rms_norm(x, self.weight, self.eps)


def make_norm(cfg: GPTConfig, ops: KernelSet | None = None) -> nn.Module:
    """The configured norm (LayerNorm or RMSNorm), on ``meta`` until the model materialises it."""
    if cfg.norm == "rmsnorm":
        return _RMSNorm(cfg, ops)
    return _LayerNorm(cfg, ops)


class Block(nn.Module):
    """Pre-norm transformer block; ``recompute=True`` checkpoints it (non-reentrant, replaying
    the tensor-parallel dropout stream too)."""

    def __init__(self, cfg: GPTConfig, tp: TensorParallel, recompute: bool = False,
                 ops: KernelSet | None = None, moe: bool = False) -> None:
        super().__init__()
        self.norm1, self.attn = make_norm(cfg, ops), Attention(cfg, tp, ops)
        self.norm2 = make_norm(cfg, ops)
        self.mlp: MLP | MoE = MoE(cfg, tp) if moe else MLP(cfg, tp, ops)
        self.drop = nn.Dropout(cfg.dropout)
        self.recompute, self.ops, self.tp = recompute, ops, tp

    def _residual(self, x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """``x + dropout(out + bias)``; under sequence parallelism the activation is split over
        tp, so its mask comes from the tensor-parallel stream."""
        y, bias = out
        p = self.drop.p if self.training else 0.0
        with self.tp.fork(self.tp.sp and p > 0, x.device):
            ks = self.ops
            if ks is None:
                return x + self.drop(y)  # the reference: y has its bias already
            return ks.bias_dropout_add(y, bias, x, p, self.training)

    def _forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
        x = self._residual(x, self.attn(self.norm1(x), rope, documents))
        return self._residual(x, self.mlp(self.norm2(x)))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            if self.tp.size > 1:
                y = tp_checkpoint(self._forward, x, rope, documents, tracker=get_rng_tracker(x.device))
            else:
                y = checkpoint(self._forward, x, rope, documents, use_reentrant=False)
        else:
            y = self._forward(x, rope, documents)
        if isinstance(self.mlp, MoE):
            self.mlp.commit_stats()
        return y


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
    """Mean next-token cross entropy of ``logits`` [..., vocab] (any float dtype, computed in
    fp32) against ``labels``, over the tokens ``loss_mask`` keeps: the reference loss at tp = 1."""
    return masked_mean(token_losses(logits, labels), loss_mask)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token next-token cross entropy [labels.numel()] of ``logits`` [..., vocab] (computed
    in fp32) against ``labels``, unmasked: what :func:`lm_loss` averages."""
    return F.cross_entropy(logits.float().view(labels.numel(), -1), labels.reshape(-1), reduction="none")


class GPT(nn.Module):
    """Decoder-only transformer, or a pipeline stage of one, at any tensor-parallel size.

    ``GPT(cfg)`` is the whole model on one process. ``tp`` (a
    :class:`~tokenloom.train.parallel.layers.TensorParallel`) splits its matmuls and
    vocabulary over a tensor-parallel group; ``layers`` (global block indices), ``pre``
    (embeddings) and ``post`` (final norm, LM head, loss) make it a pipeline stage. Names
    are the one-process model's everywhere (``blocks.3.attn.qkv.weight``), so checkpoints
    reshard by name. With tied embeddings a stage that has the LM head but not the
    embedding holds its own copy (Megatron's), tagged ``shared_embedding`` and ``shared``.

    Parameters are created on ``meta`` and materialised on ``device`` (the host by
    default; ``"meta"`` keeps a shape-only model), then :meth:`init_weights` fills this
    rank's shards with exactly the values the one-process model gets.
    """

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
            self.lm_head.wgrad_fusion = False  # maybe tied: a second consumer of its weight (tokenloom.train.wgrad)
        if cfg.positions == "rope":
            self.register_buffer("rope_cos", torch.empty(cfg.seq_len, cfg.head_dim, device="meta"), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.seq_len, cfg.head_dim, device="meta"), persistent=False)
        if device.type != "meta":
            self._materialise(device)
        self._tie_and_tag()
        if device.type != "meta":
            self.init_weights()

    def _materialise(self, device: torch.device) -> None:
        """Uninitialised storage on ``device`` for every parameter and buffer. ``to_empty``
        makes new parameter objects, so the tags the parallel layers put on them
        (``tensor_model_parallel``, ``partition_dim``, ``sequence_parallel``) are carried over."""
        tags = {name: dict(vars(p)) for name, p in self.named_parameters(remove_duplicate=False)}
        self.to_empty(device=device)
        for name, p in self.named_parameters(remove_duplicate=False):
            vars(p).update(tags[name])

    def _tie_and_tag(self) -> None:
        """Tie the LM head to the embedding (one stage holding both) and tag parameters for
        the optimizer, the grad norm and the gradient reductions."""
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
        """Deterministic init from ``cfg.seed`` (independent of the global RNG): normal(0,
        ``init_std``) for matmul weights and embeddings (residual projections scaled by
        ``1/sqrt(2 n_layers)``), drawn from one private generator in the one-process model's
        module order, biases zero, norm weights one.

        Every rank draws every full weight in turn (one host tensor at a time) and keeps
        the shard it holds: the price is the draws of the whole model on every rank
        (about a second at 124 M parameters), the gain is that every layout starts from
        the one-process values and no rank holds more than one full weight.
        """
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
        """tokens/labels/loss_mask: [batch, seq]. Returns logits [batch, seq, padded_vocab]
        when ``labels`` is None, else the scalar cross-entropy averaged over tokens whose
        ``loss_mask`` is nonzero (all tokens when ``loss_mask`` is None); with ``token_losses``,
        the unmasked per-token losses [batch, seq] instead (``loss_mask`` unused), whose
        :func:`masked_mean` is that scalar up to float rounding. In training ``token_losses``
        gives up the fused kernels' gradients-in-forward (the LM head's backward recomputes
        its logits).

        A stage without ``pre`` takes the previous stage's activation as ``hidden``
        (``tokens`` unused); a stage without ``post`` returns its activation ([batch, seq,
        d], or [seq/tp, batch, d] under sequence parallelism).

        Document-isolated attention (``data.inter_document_masking``): ``documents`` is the
        batch's ``cu_seqlens`` [batch, seq + 1] and ``positions`` its position ids [batch,
        seq], restarting at each document (learned position embeddings and RoPE use them).
        The attention mask is built from them once per forward, before the (possibly
        compiled) blocks, which all take it.
        """
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
        """Run as rank ``rank`` of a context-parallel group of ``size``
        (:mod:`tokenloom.train.parallel.context`): :meth:`forward` then takes this rank's
        tokens of each ``seq_len`` sequence (``positions``: theirs, within their documents
        under inter-document masking; by default their global positions), and attention
        gathers every rank's keys and values."""
        self.cp = (group, size, rank)
        for module in self.modules():
            if isinstance(module, Attention):
                module.cp_group = group

    def expert_parallel(self, group: dist.ProcessGroup, size: int, rank: int) -> None:
        """Run as rank ``rank`` of an expert-parallel group of ``size``: every MoE layer keeps its
        share of the experts and exchanges tokens over ``group``
        (:meth:`MoE.expert_parallel`). The trade-off: the layers are initialised whole first
        (one-process values by construction), so a rank briefly holds every expert."""
        for layer in self.moe_layers().values():
            layer.expert_parallel(group, size, rank)

    def compile_blocks(self) -> None:
        """``torch.compile`` each transformer block in place (``compile: true``), torchtitan's
        choice over compiling the whole model: the backward keeps one autograd node per block,
        so data-parallel gradient buckets are reduced while earlier blocks are still in
        backward (a whole-model graph has one backward node and every bucket would wait for
        its end); identical blocks share one compiled graph, so compile time is one block's.
        The reference loss (:func:`lm_loss`, tp = 1) is compiled too, as torchtitan compiles
        its loss: the fp32 cast, log-softmax and gather fuse into one pass over the bf16 logits,
        and the backward recomputes the softmax from them instead of keeping fp32 copies
        ([tokens, vocab] fp32, twice). The cost: no fusion across block boundaries, and the
        embedding and the LM head matmul run eagerly (their kernels are the ``kernels``
        setting's)."""
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
        """LM head and per-token losses [batch, seq] on the final hidden states (``token_losses``
        of :meth:`forward`), by the same kernels as :meth:`head`."""
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
        """Unique parameters of the whole model by part: ``embedding`` (token table, and position table
        if learned), ``blocks`` (the transformer blocks), ``head`` (final norm, and the LM head when
        untied; a tied head is the embedding's table). Counted like :meth:`num_params`, whose total
        they sum to."""
        model = GPT(self.cfg, device="meta")
        embedding = sum(p.numel() for p in (*model.tok_emb.parameters(),
                                            *(model.pos_emb.parameters() if model.pos_emb is not None else ())))
        blocks = sum(p.numel() for p in model.blocks.parameters())
        return {"embedding": embedding, "blocks": blocks, "head": model.num_params() - embedding - blocks}

    def moe_layers(self) -> dict[int, MoE]:
        """This stage's mixture-of-experts MLPs by global block index."""
        return {int(i): b.mlp for i, b in self.blocks.items() if isinstance(b.mlp, MoE)}

    def set_aux_loss_scale(self, scale: float) -> None:
        """The factor the trainer applies to the loss before backward (1 / micro-batches), given to
        every MoE layer's auxiliary losses so they weigh as they would in one process."""
        for layer in self.moe_layers().values():
            layer.aux_loss_scale = scale

    def num_active_params(self, exclude_embeddings: bool = False) -> int:
        """:meth:`num_params` less the experts a token does not reach: per MoE layer, ``E - k`` of its
        ``E`` experts' weights (the router counts as active)."""
        inactive = 0
        for module in GPT(self.cfg, device="meta").modules():
            if isinstance(module, Experts):
                E, k = self.cfg.num_experts or 1, self.cfg.moe_router_topk
                inactive += sum(p.numel() for p in module.parameters()) // E * (E - k)
        return self.num_params(exclude_embeddings) - inactive

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied embedding counts once) of the whole model, counted on
        a ``meta`` copy for a stage or a tensor-parallel shard. ``exclude_embeddings`` drops
        the position table and, when untied, the input token table (lookups, not matmuls)."""
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
