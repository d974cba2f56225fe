"""Single-process checks of the one GPT as pipeline stages and the strategy's pieces (fast)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.errors import TokenloomError
from tokenloom.train.config import TrainConfig
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.flops import flops_per_token
from tokenloom.train.model.gpt import GPT
from tokenloom.train.model.pipeline_split import PipelineSplit, pipeline_stage
from tokenloom.train.optim.adamw import param_groups
from tokenloom.train.strategy import counts_in_grad_norm


def test_param_groups_match_optim():
    cfg = GPTConfig(vocab_size=50, make_vocab_size_divisible_by=64, seq_len=8, n_layers=2, n_heads=4, d_model=16)
    stages = [pipeline_stage(cfg, PipelineSplit(cfg.n_layers, 2), r) for r in (0, 1)]
    ours = [sorted(p.numel() for p in g["params"]) for g in param_groups(stages, 0.1)]
    ref = [sorted(p.numel() for p in g["params"]) for g in param_groups(GPT(cfg), 0.1)]
    # the last stage's tied LM head is one more (undecayed) embedding-sized tensor
    assert ours[0] == ref[0] and ours[1] == sorted(ref[1] + [64 * 16])


def test_pipeline_stages_and_grad_norm_rule():
    cfg = GPTConfig(vocab_size=50, make_vocab_size_divisible_by=64, seq_len=8, n_layers=4, n_heads=4, d_model=16,
                    bias=False)
    first, last = (pipeline_stage(cfg, PipelineSplit(cfg.n_layers, 2), r) for r in (0, 1))
    assert list(first.blocks) == ["0", "1"] and list(last.blocks) == ["2", "3"]
    assert last.lm_head.weight.shared and not counts_in_grad_norm(last.lm_head.weight, 0)
    first.tok_emb.weight.tensor_model_parallel = True  # as a vocab-parallel shard is tagged
    assert counts_in_grad_norm(first.tok_emb.weight, 1)  # a shard counts on every tp rank
    assert not counts_in_grad_norm(last.norm.weight, 1)  # replicated: tp rank 0 only


def test_meta_model_has_shapes_only_and_counts_like_the_real_one():
    cfg = GPTConfig(vocab_size=50, make_vocab_size_divisible_by=64, seq_len=8, n_layers=2, n_heads=4, d_model=16)
    meta, real = GPT(cfg, device="meta"), GPT(cfg)
    assert all(p.is_meta for p in meta.parameters())
    assert meta.lm_head.weight is meta.tok_emb.weight
    assert meta.num_params() == real.num_params() and flops_per_token(meta) == flops_per_token(real)
    assert pipeline_stage(cfg, PipelineSplit(cfg.n_layers, 2), 1).num_params() == real.num_params()  # the whole model's


def test_config_checks():
    with pytest.raises(TokenloomError, match=r"n_layers 3 must be divisible by --pp 2 x --vpp 1"):
        PipelineSplit(3, 2)
    TrainConfig(tp=2, model=GPTConfig(dropout=0.1, n_layers=1, vocab_size=64))  # dropout at tp > 1 is supported
    cfg = TrainConfig()
    assert (cfg.tp, cfg.pp, cfg.vpp, cfg.sp, cfg.zero1) == (1, 1, None, False, False)


def test_stage_runs_on_hidden_states():
    cfg = GPTConfig(vocab_size=50, make_vocab_size_divisible_by=64, seq_len=8, n_layers=2, n_heads=4, d_model=16)
    model = GPT(cfg)
    first, last = (pipeline_stage(cfg, PipelineSplit(cfg.n_layers, 2), r) for r in (0, 1))
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    hidden = first(x[:, :-1])
    torch.testing.assert_close(last(None, x[:, 1:], hidden=hidden), model(x[:, :-1], x[:, 1:]), rtol=0, atol=0)
