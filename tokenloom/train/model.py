"""A small, readable GPT in one file (in the spirit of nanoGPT).

Two flavours share one code path, picked by :attr:`GPTConfig.arch`:

* ``"gpt2"``: LayerNorm, GELU (tanh approximation) MLP, learned position embeddings.
* ``"llama"``: RMSNorm, SwiGLU MLP, rotary position embeddings (RoPE, "rotate half"
  layout as in GPT-NeoX / Hugging Face), optional grouped-query attention (GQA) via
  ``n_kv_heads``.

Choices and their costs:

* Attention is ``F.scaled_dot_product_attention(is_causal=True)`` so the fused (flash /
  memory-efficient, or the CPU flash) kernel is used; GQA repeats K/V heads with
  ``repeat_interleave`` before the call (costs memory of ``n_heads/n_kv_heads`` copies
  of K and V, but works on every torch >= 2.4 without ``enable_gqa``).
* The vocabulary is padded up to a multiple of ``make_vocab_size_divisible_by`` (as
  Megatron does) so the LM-head GEMM has friendly shapes. Logits are returned for the
  padded vocabulary and the loss is taken over it too (Megatron behaviour): no label
  is ever a padded id, so the loss only pushes those logits down.
  Slice ``logits[..., :vocab_size]`` for sampling.
* Activation recompute is per layer (``Block.recompute``) with non-reentrant
  ``torch.utils.checkpoint``: it saves the layer's activations at the price of one more
  forward of that layer in backward, and keeps the autograd graph visible (needed by
  ``find_unused_parameters`` in :mod:`tokenloom.train.ddp`).
* Initialisation is deterministic from ``seed`` using a private generator (the global
  RNG is untouched): normal(0, ``init_std``) for all weights, and residual output
  projections scaled by ``1/sqrt(2 * n_layers)`` (GPT-2 paper); biases zero, norm
  weights one.

Kernels (:attr:`GPTConfig.kernels`, see :mod:`tokenloom.train.kernels`): the ops are
looked up with :func:`~tokenloom.train.kernels.select_kernels` on the first forward
(the device is known then) and memoised per (mode, device type) in this module, never
stored on the modules: no parameters or buffers are added, so the state dict, pickling
and checkpoints are the same in every mode and load across modes.

* ``reference`` (default) runs the eager code below exactly as before the kernel
  library existed, bit for bit: ``nn.LayerNorm``/``nn.RMSNorm``, ``F.gelu``,
  ``F.silu(gate) * up``, rotate-half RoPE, SDPA, and the loss from full padded-vocab
  logits. It is the numerical baseline every distributed test compares against.
  The price: the loss materialises ``[tokens, padded_vocab]`` fp32 logits (620 MB at
  1024 tokens x 50k vocab).
* ``compiled`` / ``triton`` / ``auto`` route norms, activation, RoPE and attention
  through the :class:`~tokenloom.train.kernels.KernelSet`, and the loss through its
  chunked cross entropy straight from the final hidden states and the LM-head weight
  (O(chunk x vocab) memory, the same three LM-head GEMMs when training; full logits
  below 2^22 of them, where chunking only costs time). The loss keeps the
  reference semantics: softmax over the *padded* vocabulary (Megatron's), per-token
  losses reduced exactly as the reference does (``mean`` over all tokens, or over
  ``loss_mask``). Numerics differ from ``reference`` by float rounding (fp32 norms and
  a different log-sum-exp order), ~1e-6 relative on the loss.
* Logits (``labels=None``) are always the full padded-vocab tensor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tokenloom.errors import TokenloomError
from tokenloom.train.kernels import KernelSet, select_kernels


@dataclass(kw_only=True)
class GPTConfig:
    """Model shape and behaviour. Every field is keyword-only."""

    arch: Literal["gpt2", "llama"] = "gpt2"
    """``gpt2``: LayerNorm + GELU + learned positions; ``llama``: RMSNorm + SwiGLU + RoPE."""
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
    """MLP inner size; None means ``4*d_model`` (gpt2) or ``8/3*d_model`` rounded up to 64 (llama)."""
    bias: bool | None = None
    """Biases in linear layers and LayerNorm; None means True for gpt2, False for llama."""
    tie_embeddings: bool = True
    """Share the token-embedding matrix with the LM head (one tensor, one storage)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency (llama only)."""
    recompute_layers: tuple[int, ...] = field(default_factory=tuple)
    """Indices of blocks whose activations are recomputed in backward (``tuple(range(n_layers))`` = all)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init."""
    seed: int = 0
    """Seed of the private generator used for the weight init."""
    kernels: str = "reference"
    """Op implementations: reference | compiled | triton | auto (see tokenloom.train.kernels);
    ``reference`` is the eager path, bit-identical to the model before kernels existed."""

    def __post_init__(self) -> None:
        kv = self.kv_heads
        if self.d_model % self.n_heads:
            raise TokenloomError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % kv:
            raise TokenloomError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={kv}")
        if self.arch not in ("gpt2", "llama"):
            raise TokenloomError(f"arch must be 'gpt2' or 'llama', got {self.arch!r}")
        if self.bias is None:
            self.bias = self.arch == "gpt2"
        if self.kernels not in ("reference", "compiled", "triton", "auto"):
            raise TokenloomError(f"kernels must be reference, compiled, triton or auto, got {self.kernels!r}")
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
        if self.arch == "gpt2":
            return 4 * self.d_model
        return 64 * math.ceil(8 * self.d_model / 3 / 64)


@functools.cache
def _kernel_set(mode: str, device_type: str) -> KernelSet | None:
    """The kernel set for ``mode`` on ``device_type``, or None when it resolves to ``reference``
    (the model's own eager code runs then). Raises ``ValueError`` when the host cannot run ``mode``."""
    ks = select_kernels(mode, device_type)
    return None if ks.mode == "reference" else ks


def _kernels_for(mode: str, x: torch.Tensor) -> KernelSet | None:
    return None if mode == "reference" else _kernel_set(mode, x.device.type)


def rope_tables(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim] (rotate-half layout)."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [T, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        qkv_out = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, qkv_out, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.residual_scaled_init = True
        self.dropout = cfg.dropout
        self.kernels = cfg.kernels

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = split_qkv(self.qkv(x), self.n_heads, self.n_kv_heads, self.head_dim)
        p = self.dropout if self.training else 0.0
        ks = _kernels_for(self.kernels, x)
        if ks is not None:
            if rope is not None:
                cos, sin = rope[0][:T], rope[1][:T]
                q, k = ks.rope(q, cos, sin), ks.rope(k, cos, sin)
            y = ks.attention(q, k, v, causal=True, dropout_p=p)
            return self.proj(y.transpose(1, 2).reshape(B, T, -1))
        y = attend(q, k, v, rope, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.swiglu = cfg.arch == "llama"
        inner = cfg.ffn_size
        self.fc = nn.Linear(cfg.d_model, 2 * inner if self.swiglu else inner, bias=cfg.bias)
        self.proj = nn.Linear(inner, cfg.d_model, bias=cfg.bias)
        self.proj.residual_scaled_init = True
        self.kernels = cfg.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        ks = _kernels_for(self.kernels, x)
        if ks is not None:
            h = ks.swiglu(*h.chunk(2, dim=-1)) if self.swiglu else ks.bias_gelu(h, None, approximate="tanh")
            return self.proj(h)
        return self.proj(mlp_activation(h, self.swiglu))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Reference causal attention: q [B, h, T, d], k/v [B, h_kv, T, d] -> [B, h, T, d].

    RoPE (if ``rope``) on q and k, k/v heads repeated to h for GQA, then SDPA. Shared by
    the one-process model and its tensor-parallel twin (each rank with its heads).
    """
    if rope is not None:
        T = q.shape[2]
        cos, sin = rope[0][:T], rope[1][:T]
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
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
    """``nn.LayerNorm`` (same parameters and state dict) whose forward honours ``kernels``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.kernels = cfg.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ks = _kernels_for(self.kernels, x)
        if ks is None:
            return super().forward(x)
        return ks.layer_norm(x, self.weight, self.bias, self.eps)


class _RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters and state dict) whose forward honours ``kernels``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.d_model, eps=cfg.norm_eps)
        self.kernels = cfg.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ks = _kernels_for(self.kernels, x)
        if ks is None:
            return super().forward(x)
        return ks.rms_norm(x, self.weight, self.eps)


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.arch == "llama":
        return _RMSNorm(cfg)
    return _LayerNorm(cfg)


class Block(nn.Module):
    """Pre-norm transformer block; ``recompute=True`` checkpoints it (non-reentrant)."""

    def __init__(self, cfg: GPTConfig, recompute: bool = False) -> None:
        super().__init__()
        self.norm1, self.attn = make_norm(cfg), Attention(cfg)
        self.norm2, self.mlp = make_norm(cfg), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.recompute = recompute

    def _forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), rope))
        return x + self.drop(self.mlp(self.norm2(x)))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, rope, use_reentrant=False)
        return self._forward(x, rope)


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(tokens)`` gives logits, with ``labels`` the mean loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        V = cfg.padded_vocab_size
        self.tok_emb = nn.Embedding(V, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.arch == "gpt2" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i in cfg.recompute_layers) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, V, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if cfg.arch == "llama":
            cos, sin = rope_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init from ``cfg.seed`` (independent of the global RNG)."""
        gen = torch.Generator().manual_seed(self.cfg.seed)
        std, resid_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.lm_head and self.cfg.tie_embeddings:
                    continue  # shares tok_emb.weight, already initialised
                s = resid_std if getattr(module, "residual_scaled_init", False) else std
                w = torch.empty(module.weight.shape, dtype=torch.float32).normal_(0.0, s, generator=gen)
                module.weight.copy_(w)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                if module.weight is not None:
                    module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens/labels/loss_mask: [batch, seq]. Returns logits [batch, seq, padded_vocab]
        when ``labels`` is None, else the scalar cross-entropy averaged over tokens whose
        ``loss_mask`` is nonzero (all tokens when ``loss_mask`` is None)."""
        B, T = tokens.shape
        if T > self.cfg.seq_len:
            raise TokenloomError(f"sequence length {T} exceeds the model's seq_len={self.cfg.seq_len}")
        x = self.tok_emb(tokens)
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=tokens.device))
        else:
            rope = (self.rope_cos, self.rope_sin)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope)
        h = self.norm(x)
        ks = _kernels_for(self.cfg.kernels, h)
        if labels is None:
            return self.lm_head(h)
        if ks is not None:  # chunked: never holds [B*T, vocab] logits; same reduction as below
            return ks.cross_entropy(h, self.lm_head.weight, labels, loss_mask, reduction="mean")
        logits = self.lm_head(h)
        losses = F.cross_entropy(logits.float().view(B * T, -1), labels.reshape(-1), reduction="none")
        if loss_mask is None:
            return losses.mean()
        mask = loss_mask.reshape(-1).to(losses.dtype)
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)

    def kernel_set(self, device: torch.device | str | None = None) -> KernelSet:
        """The :class:`KernelSet` ``cfg.kernels`` resolves to on ``device`` (default: the parameters')."""
        device = self.tok_emb.weight.device if device is None else device
        return select_kernels(self.cfg.kernels, device)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied embedding counts once). ``exclude_embeddings`` drops
        the position table and, when untied, the input token table (lookups, not matmuls)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.tok_emb.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token, ``6*N + 12*L*H*Q*T`` (nanoGPT / PaLM formula).

        N = parameters used in matmuls (:meth:`num_params` with ``exclude_embeddings``),
        L layers, H heads, Q head dim, T sequence length. Ignores causal sparsity, GQA
        savings in the attention term and recompute (MFU convention)."""
        T = self.cfg.seq_len if seq_len is None else seq_len
        cfg = self.cfg
        return (
            6 * self.num_params(exclude_embeddings=True) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * T
        )

    def mfu(self, tokens_per_second: float, peak_flops: float, seq_len: int | None = None) -> float:
        """Model FLOPs utilisation: ``flops_per_token * tokens_per_second / peak_flops``
        (peak of all devices together, e.g. 989e12 per H100 SXM for dense bf16)."""
        return self.flops_per_token(seq_len) * tokens_per_second / peak_flops
