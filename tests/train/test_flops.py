"""FLOPs per token: the 6N + 12LHQT formula on a small model."""

from __future__ import annotations

from tokenloom.train.flops import flops_per_token
from tokenloom.train.model import GPT, GPTConfig


def test_flops_per_token_formula():
    model = GPT(GPTConfig(vocab_size=100, seq_len=16, n_layers=2, n_heads=4, d_model=32, tie_embeddings=True))
    n = model.num_params() - 16 * 32  # minus position table
    assert flops_per_token(model, 16) == 6 * n + 12 * 2 * 4 * 8 * 16
    assert flops_per_token(model) == flops_per_token(model, 16)  # the model's seq_len by default
