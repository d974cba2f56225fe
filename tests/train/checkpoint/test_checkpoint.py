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
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.loop import start_run
from tokenloom.train.model.config import GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import legacy_ckpt  # noqa: E402  # the one-process format's writer, kept for its reader
from test_loop import tiny  # noqa: E402


def trained(tmp: Path, **overrides):
    """A one-process run (test_loop's tiny GPT) after two optimizer steps."""
    r = start_run(tiny(tmp, train_iters=4, eval_interval=0, **overrides))
    steps = r.steps()
    next(steps), next(steps)
    return r


def test_an_earlier_one_process_checkpoint_resumes_model_optimizer_and_rng(tmp_path):
    """The one-process ``model.pt`` + ``optimizer.pt`` of earlier versions loads into a run
    (:meth:`Strategy.load`, as ``--resume`` calls it) with its parameters, AdamW state and this
    rank's RNG streams; every file of it loads with ``weights_only=True``."""
    saving = trained(tmp_path / "a")
    model, opt = saving.strategy.chunks[0], saving.strategy.optimizer
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = legacy_ckpt.save(tmp_path / "ckpt", 7, model=model, optimizer=opt, state={"consumed_samples": 28})
    expected = (random.random(), np.random.rand(), torch.rand(3))
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE", "model.pt", "optimizer.pt", "rng_rank0.pt", "state.json"]
    for name in ("model.pt", "optimizer.pt", "rng_rank0.pt"):  # loadable with weights_only=True
        torch.load(path / name, weights_only=True)

    loading = start_run(tiny(tmp_path / "b", train_iters=4, eval_interval=0, seed=5))
    state = checkpoint.read_state(path)
    loading.strategy.load(path, state)
    assert state["iteration"] == 7 and state["consumed_samples"] == 28
    other = loading.strategy.chunks[0]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(),
                                                  strict=True))
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        mine, theirs = opt.state[p], loading.strategy.optimizer.state[q]
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(3), expected[2])


def test_latest_pointer_marker_and_pruning(tmp_path):
    r = trained(tmp_path / "run")
    model, opt = r.strategy.chunks[0], r.strategy.optimizer
    tmp_path = tmp_path / "ckpt"
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
    saving = trained(tmp_path / "a")
    path = legacy_ckpt.save(tmp_path / "ckpt", 1, model=saving.strategy.chunks[0],
                            optimizer=saving.strategy.optimizer, state={})
    deeper = start_run(tiny(tmp_path / "b", model=GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32,
                                                            seq_len=32, n_layers=3, n_heads=2, d_model=32)))
    with pytest.raises(TokenloomError, match=r"optimizer state has 28 parameters, the configured model 40; was it trained with another model"):
        deeper.strategy.load(path, checkpoint.read_state(path))
    wider = start_run(tiny(tmp_path / "c", model=GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32,
                                                           seq_len=32, n_layers=2, n_heads=2, d_model=64)))
    with pytest.raises(TokenloomError, match=r"of shape \[.*\] where this rank's model has \[.*another model"):
        wider.strategy.load(path, checkpoint.read_state(path))


def test_a_local_checkpoint_is_held_only_with_every_file_its_rank_wrote(tmp_path):
    files = {"tp0_pp0_dp0.pt": {"w": torch.arange(4.0)}, "rng_rank0.pt": {"seed": torch.tensor([1])}}
    write = checkpoint.write_held(checkpoint.write_torch_files(files), list(files), rank=0)
    path = checkpoint.save_files(tmp_path, 5, write, {}, rank=0, barrier=lambda: None, keep_last=0, world_size=1)
    assert checkpoint.holds(path, 0) and not checkpoint.holds(path, 1)  # rank 1 wrote nothing here
    with open(path / "rng_rank0.pt", "ab") as f:  # a file of another size than the rank wrote
        f.write(b"x")
    assert not checkpoint.holds(path, 0)
    (path / "rng_rank0.pt").unlink()
    assert not checkpoint.holds(path, 0)


def test_the_local_tier_is_taken_only_where_every_rank_holds_it_and_it_is_newer():
    assert checkpoint.newest_held(4, [[3, 5, 6], [5, 6], [5]]) == 5  # rank 2 misses 6
    assert checkpoint.newest_held(6, [[5, 6], [5, 6]]) is None  # the durable one is as new
    assert checkpoint.newest_held(None, [[2], [3]]) is None  # no step every rank holds
    assert checkpoint.newest_held(None, [[2, 3], [3]]) == 3
