"""``tokenloom train`` from the command line: in-process, the summary is the last stdout line."""

from __future__ import annotations

import json

from tl_testing import run_cli


def test_train_prints_its_summary(tmp_path):
    out = run_cli("train", "--mock-data", "--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "2",
                  "--seq-length", "16", "--output-dir", tmp_path / "run", "--set", "model.n_layers=1",
                  "--set", "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.vocab_size=64",
                  "--set", "data.mock.num_sequences=50", "--set", "data.mock.max_length=40",
                  "--set", "eval_interval=0", "--set", "progress=false", "--set", "plot=false")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["iteration"] == 3 and summary["train_loss"] > 0
    assert summary["tokens_per_s"] > 0 and summary["first_step_s"] > 0
    assert (tmp_path / "run" / "metrics.jsonl").exists()
