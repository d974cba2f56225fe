"""Single-process checks of the tp GPT stage and the parallel trainer's pieces (fast)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.errors import TokenloomError
from tokenloom.train.config import TrainConfig
from tokenloom.train.model import GPT, GPTConfig
from tokenloom.train.optim import param_groups
from tokenloom.train.parallel.gpt import build_tp_gpt_stage, check_tp_config, counts_in_grad_norm, tp_gpt_loss


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("tie", [True, False])
def test_stage_at_tp1_equals_model(arch, tie):
    cfg = GPTConfig(arch=arch, vocab_size=50, make_vocab_size_divisible_by=64, seq_len=8, n_layers=2, n_heads=4,
                    n_kv_heads=2, d_model=16, tie_embeddings=tie)
    model = GPT(cfg)
    stage = build_tp_gpt_stage(model, None)
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": None}
    torch.testing.assert_close(stage(None, batch), model(batch["tokens"]), rtol=0, atol=0)
    assert tp_gpt_loss(stage(None, batch), batch, None).item() == pytest.approx(
        model(batch["tokens"], batch["labels"]).item(), abs=1e-6)
    assert sorted(stage.full_state_dict()) == sorted(model.state_dict())
    assert (stage.lm_head.weight is stage.tok_emb.weight) == tie


def test_param_groups_match_optim():
    model = GPT(GPTConfig(vocab_size=50, make_vocab_size_divisible_by=64, seq_len=8, n_layers=2, n_heads=4,
                          d_model=16))
    stage = build_tp_gpt_stage(model, None)
    ours = [sorted(p.numel() for p in g["params"]) for g in param_groups([stage], 0.1)]
    ref = [sorted(p.numel() for p in g["params"]) for g in param_groups(model, 0.1)]
    assert ours == ref


def test_pipeline_stages_and_grad_norm_rule():
    model = GPT(GPTConfig(vocab_size=50, make_vocab_size_divisible_by=64, seq_len=8, n_layers=4, n_heads=4,
                          d_model=16, bias=False))
    first, last = (build_tp_gpt_stage(model, None, 2, r) for r in (0, 1))
    assert list(first.blocks) == ["0", "1"] and list(last.blocks) == ["2", "3"]
    assert last.lm_head.weight.shared and not counts_in_grad_norm(last.lm_head.weight, 0)
    assert counts_in_grad_norm(first.tok_emb.weight, 1)  # a shard counts on every tp rank
    assert not counts_in_grad_norm(last.norm.weight, 1)  # replicated: tp rank 0 only


def test_config_checks():
    with pytest.raises(TokenloomError, match="divisible by tp"):
        check_tp_config(GPTConfig(n_heads=6, d_model=48, n_layers=1, vocab_size=64), 4)
    with pytest.raises(TokenloomError, match="dropout"):
        check_tp_config(GPTConfig(dropout=0.1, n_layers=1, vocab_size=64), 2)
    cfg = TrainConfig()
    assert (cfg.tp, cfg.pp, cfg.vpp, cfg.zero1) == (1, 1, None, False)
