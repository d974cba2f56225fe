"""Checkpoint files: round trip of the earlier one-process format (its reader is kept) with weights_only
loads, RNG states, markers, latest pointer, pruning."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenloom.errors import TokenloomError
from tokenloom.train import checkpoint
from tokenloom.train.model import GPT, GPTConfig
from tokenloom.train.optim import OptimConfig, build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import legacy_ckpt  # noqa: E402  # the one-process format's writer, kept for its reader


def model_and_optimizer(seed: int = 0):
    model = GPT(GPTConfig(vocab_size=64, make_vocab_size_divisible_by=32, seq_len=8, n_layers=1, n_heads=2,
                          d_model=16, seed=seed))
    opt = build_optimizer(model, OptimConfig(lr=1e-2, min_lr=0.0))
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))
    model(x[:, :-1], x[:, 1:]).backward()
    opt.step()
    return model, opt


def test_round_trip_restores_model_optimizer_rng_and_state(tmp_path):
    model, opt = model_and_optimizer()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = legacy_ckpt.save(tmp_path, 7, model=model, optimizer=opt, state={"consumed_samples": 28})
    expected = (random.random(), np.random.rand(), torch.rand(3))
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE", "model.pt", "optimizer.pt", "rng_rank0.pt", "state.json"]
    for name in ("model.pt", "optimizer.pt", "rng_rank0.pt"):  # loadable with weights_only=True
        torch.load(path / name, weights_only=True)

    other, other_opt = model_and_optimizer(seed=5)
    state = checkpoint.load(path, model=other, optimizer=other_opt)
    assert state["iteration"] == 7 and state["consumed_samples"] == 28
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(),
                                                  strict=True))
    s1, s2 = opt.state_dict(), other_opt.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        assert all(torch.equal(s1["state"][k][n], s2["state"][k][n]) for n in s1["state"][k])
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(3), expected[2])


def test_latest_pointer_marker_and_pruning(tmp_path):
    model, opt = model_and_optimizer()
    for it in (1, 2, 3):
        legacy_ckpt.save(tmp_path, it, model=model, optimizer=opt, state={}, keep_last=2)
    assert [i for i, _ in checkpoint.complete_checkpoints(tmp_path)] == [2, 3]
    assert (tmp_path / "latest").read_text() == "iter_0000003\n"
    assert not list(tmp_path.glob("*.tmp"))
    # Saving the same iteration again replaces it whole.
    legacy_ckpt.save(tmp_path, 3, model=model, optimizer=opt, state={"again": True})
    assert json.loads((tmp_path / "iter_0000003" / "state.json").read_text())["again"] is True
    (tmp_path / "iter_0000003" / "COMPLETE").unlink()
    assert checkpoint.find_latest(tmp_path).name == "iter_0000002"
    assert checkpoint.resolve(str(tmp_path), tmp_path).name == "iter_0000002"
    assert checkpoint.resolve("auto", tmp_path / "empty") is None
    with pytest.raises(TokenloomError, match="no COMPLETE marker"):
        checkpoint.resolve(str(tmp_path / "iter_0000003"), tmp_path)


def test_mismatched_model_is_a_clear_error(tmp_path):
    model, opt = model_and_optimizer()
    path = legacy_ckpt.save(tmp_path, 1, model=model, optimizer=opt, state={})
    bigger = GPT(GPTConfig(vocab_size=64, make_vocab_size_divisible_by=32, seq_len=8, n_layers=2, n_heads=2,
                           d_model=16))
    with pytest.raises(TokenloomError, match="does not match the configured model"):
        checkpoint.load(path, model=bigger, optimizer=None)
