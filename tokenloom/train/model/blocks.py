"""The GPT's layers: attention, MLP, the MoE layer, norms and the transformer :class:`Block`, each
taking the model's ``TensorParallel`` context and kernel set (None: the eager reference code here,
the baseline every distributed test compares against). Dropout inside tp regions draws from the
per-tp-rank stream (:mod:`tokenloom.train.parallel.random`). Trade-offs: GQA repeats K/V heads
before SDPA (copies, no need for ``enable_gqa``); recompute is per block and non-reentrant, so
``find_unused_parameters`` still sees the graph.
"""

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tokenloom.errors import TokenloomError

if TYPE_CHECKING:  # torch >= 2.5; kernels.attention falls back without it
    pass
from tokenloom.train.kernels import (
    KernelSet,
    attention_sdpa,
)
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.moe import (
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
)
from tokenloom.train.parallel.layers import TensorParallel, tag
from tokenloom.train.parallel.random import checkpoint as tp_checkpoint
from tokenloom.train.parallel.random import get_rng_tracker
from tokenloom.train.parallel.wgrad import linear as wgrad_linear


def rope_tables(cfg: GPTConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [seq_len, head_dim] (rotate-half), computed in float64 on the host."""
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
    """(``layer(x)`` without bias, the bias) for a kernel to fuse; the wgrad goes to its sink."""
    if isinstance(layer, nn.Linear):
        fused = getattr(layer, "wgrad_fusion", False)
        return (wgrad_linear if fused else F.linear)(x, layer.weight), layer.bias
    return layer(x, skip_bias_add=True)


class Attention(nn.Module):
    """Causal self-attention; each tp rank holds ``n_heads / tp`` and ``n_kv_heads / tp`` heads."""

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
        """x: [B, T, d] ([T/tp, B, d] under sp); ``documents``: the forward's document mask. Returns
        (projection with bias, None) for reference kernels, else (without bias, the bias)."""
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
    """GELU or SwiGLU MLP (gate/up halves split alike over tp)."""

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
        """As :meth:`Attention.forward`'s return."""
        ks = self.ops
        if ks is None:
            return self.proj(mlp_activation(self.fc(x), self.swiglu)), None
        if self.swiglu:
            h = ks.swiglu(*self.fc(x).chunk(2, dim=-1))
        else:
            h = ks.bias_gelu(*_matmul_and_bias(self.fc, x), approximate="tanh")
        return _matmul_and_bias(self.proj, h)


class Experts(nn.Module):
    """``E`` MLPs stacked (``fc`` [E, d, inner or 2 inner], ``proj`` [E, inner, d]): expert e is the
    :class:`MLP` with ``fc.weight = fc[e].T``. Under ep it holds experts ``first ..`` only."""

    first: int = 0
    """The layer's index of the first expert held (nonzero under ep)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        E, d, inner = cfg.num_experts or 1, cfg.d_model, cfg.moe_ffn_size
        width = 2 * inner if cfg.mlp == "swiglu" else inner
        self.fc = nn.Parameter(torch.empty(E, d, width, device="meta"))
        self.proj = nn.Parameter(torch.empty(E, inner, d, device="meta"))
        self.fc_bias = nn.Parameter(torch.empty(E, width, device="meta")) if cfg.use_bias else None
        self.proj_bias = nn.Parameter(torch.empty(E, d, device="meta")) if cfg.use_bias else None


class MoE(nn.Module):
    """Mixture-of-experts MLP (megatron-core's ``MoELayer``; contracts in :mod:`.moe`). ``stats``
    accumulates on the device in training forwards (no host sync); :meth:`take_stats` pops it."""

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
        """x: [B, T, d] ([T/tp, B, d] under sp) -> (gated expert outputs with biases, None)."""
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
        """Keep this rank's ``E / size`` experts and exchange tokens over ``group``; call before the
        optimizer or DDP see the (replaced, ``expert_parallel``-tagged) parameters."""
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
        """Pop the statistics, [E + 3] float64 (zeros when none): tokens per expert, balance and
        z-loss sums, forwards."""
        stats = self.stats
        self.stats = None
        return stats if stats is not None else torch.zeros(self.num_experts + 3, dtype=torch.float64,
                                                             device=self.router.weight.device)


def rope_at(rope: tuple[torch.Tensor, torch.Tensor], seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for ``seq`` tokens: the table's first rows, or per-sample tables [B, 1, T, d]."""
    return rope if rope[0].dim() == 4 else (rope[0][:seq], rope[1][:seq])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    dropout_p: float = 0.0,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference causal attention (RoPE, GQA repeat, SDPA): q [B, h, T, d], k/v [B, h_kv, T, d]."""
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
        """``x + dropout(out + bias)``; under sp the mask comes from the tp stream."""
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
