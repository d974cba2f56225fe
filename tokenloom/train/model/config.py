"""The GPT model's description, :class:`GPTConfig`: features (``norm``, ``mlp``, ``positions``, ``bias``,
GQA via ``n_kv_heads``) that ``arch`` presets when left None, so an old config builds the same model;
every combination builds in every layout and kernels mode (each feature is its own kernel op). MoE
uses Megatron's flags; the vocabulary is padded to ``make_vocab_size_divisible_by``.
"""

import math
from dataclasses import dataclass, field
from typing import Literal

from tokenloom.errors import TokenloomError


@dataclass(kw_only=True)
class GPTConfig:
    """Model shape and behaviour (keyword-only). After construction the feature fields hold resolved
    values, so a saved config names the built model whatever the presets later mean."""

    arch: Literal["gpt2", "llama"] = "gpt2"
    """Preset of the features left None: gpt2 (LayerNorm, GELU, learned positions, biases) or llama
    (RMSNorm, SwiGLU, RoPE, no biases)."""
    norm: Literal["layernorm", "rmsnorm"] | None = None
    """Normalisation of every block and the final norm; None: the arch's (gpt2 layernorm, llama rmsnorm)."""
    mlp: Literal["gelu", "swiglu"] | None = None
    """MLP activation: tanh GELU, or SwiGLU (gate and up projections); None: the arch's."""
    positions: Literal["learned", "rope"] | None = None
    """Position encoding: a learned seq_len-row table, or RoPE (base rope_theta); None: the arch's."""
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
    """Biases in linear layers (and LayerNorm unless norm_bias says otherwise); None: the arch's."""
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
    """How tokens reach the experts at ep > 1 (same result): alltoall moves only the routed rows, with a
    host sync per layer and pass; allgather gathers the ep group's tokens and reduce-scatters the
    outputs: fixed-size collectives, no host sync with grouped GEMM, more bytes at large ep."""
    kernels: str = "reference"
    """Op implementations, chosen once at build: reference (eager) | compiled | triton | auto (reference
    on CUDA, where inductor fuses it under compile; compiled on CPU). See tokenloom.train.kernels."""

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
