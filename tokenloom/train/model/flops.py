"""Model FLOPs per token, the numerator of MFU (:func:`tokenloom.train.metrics.mfu`)."""

from __future__ import annotations

from tokenloom.train.model.gpt import GPT


def flops_per_token(model: GPT, seq_len: int | None = None) -> int:
    """Training FLOPs per token, ``6*N + 12*L*H*Q*T`` (nanoGPT / PaLM; N active non-embedding
    parameters), ignoring causal sparsity, GQA and recompute (MFU convention)."""
    cfg = model.cfg
    T = cfg.seq_len if seq_len is None else seq_len
    return 6 * model.num_active_params(exclude_embeddings=True) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * T
