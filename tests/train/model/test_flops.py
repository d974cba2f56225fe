"""FLOPs per token: the 6N + 12LHQT formula on a small model."""

from __future__ import annotations

from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.flops import flops_per_token
from tokenloom.train.model.gpt import GPT


def test_flops_per_token_formula():
    model = GPT(GPTConfig(vocab_size=100, seq_len=16, n_layers=2, n_heads=4, d_model=32, tie_embeddings=True))
    n = model.num_params() - 16 * 32  # minus position table
    assert flops_per_token(model, 16) == 6 * n + 12 * 2 * 4 * 8 * 16
    assert flops_per_token(model) == flops_per_token(model, 16)  # the model's seq_len by default


def test_moe_flops_count_the_experts_a_token_reaches():
    from tokenloom.train.model.config import GPTConfig
    from tokenloom.train.model.flops import flops_per_token
    from tokenloom.train.model.gpt import GPT

    dense = GPTConfig(vocab_size=64, seq_len=8, n_layers=2, n_heads=2, d_model=16, ffn_hidden_size=32)
    moe = GPTConfig(**{**vars(dense), "num_experts": 4, "moe_router_topk": 1})
    router = 2 * 16 * 4
    assert flops_per_token(GPT(moe, device="meta")) == flops_per_token(GPT(dense, device="meta")) + 6 * router
