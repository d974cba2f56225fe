"""launch(): in-process from a config file, torchrun command line, failing ranks -> one error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tokenloom.errors import TokenloomError
from tokenloom.train.launch import launch, torchrun_command
from tokenloom.train.metrics import read_metrics
from tokenloom.train.model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[2]
MODEL = dict(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2, n_heads=2, d_model=32)


def write_config(path: Path, out: Path, **overrides) -> Path:
    cfg = {"model": MODEL, "data": {"mock": {"num_sequences": 200, "max_length": 100}},
           "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 4, "eval_interval": 0,
           "log_interval": 2, "output_dir": str(out), "progress": False, "plot": False, **overrides}
    path.write_text(json.dumps(cfg))
    return path


def test_in_process_from_a_config_file_with_known_peak(tmp_path):
    path = write_config(tmp_path / "c.json", tmp_path / "run", peak_flops=1e12)
    summary = launch(path)
    assert summary["iteration"] == 4 and summary["checkpoint"].endswith("iter_0000004")
    record = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    fpt = GPT(GPTConfig(**MODEL)).flops_per_token()
    assert record["mfu"] == pytest.approx(fpt * record["tokens_per_s"] / 1e12)


def test_torchrun_command_line():
    cmd = torchrun_command("cfg.json", 4)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == ["--standalone", "--nproc-per-node", "4", "-m", "tokenloom.train.loop", "--config",
                       "cfg.json"]


def test_failing_ranks_raise_one_error(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    # 4 is not a multiple of micro-batch 4 x 2 ranks: every rank fails before training.
    path = write_config(tmp_path / "c.json", tmp_path / "run", micro_batch_size=4)
    with pytest.raises(TokenloomError, match="torchrun exit status"):
        launch(path, nproc_per_node=2)
    assert "not a multiple of micro_batch_size x data-parallel ranks = 4 x 2" in capfd.readouterr().err
    with pytest.raises(TokenloomError, match="nproc_per_node"):
        launch(path, nproc_per_node=0)
