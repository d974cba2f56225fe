"""``tokenloom train`` from the command line: in-process, the summary is the last stdout line,
and the command trains what the library trains for the config it wrote."""

from __future__ import annotations

import json
import math

from tl_testing import run_cli


def test_train_prints_its_summary(tmp_path):
    out = run_cli("train", "--mock-data", "--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "2",
                  "--seq-length", "16", "--output-dir", tmp_path / "run", "--set", "model.n_layers=1",
                  "--set", "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.vocab_size=64",
                  "--set", "data.mock.num_sequences=50", "--set", "data.mock.max_length=40",
                  "--set", "eval_interval=0", "--set", "progress=false", "--set", "plot=false",
                  "--set", "log_interval=1")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert summary["iteration"] == 3 and len(losses) == 3 and summary["train_loss"] == losses[-1]
    # an untrained model is near uniform over the padded vocabulary (64 rounded up to 128, as Megatron)
    assert abs(losses[0] - math.log(128)) < 0.3
    assert summary["tokens_per_s"] > 0 and summary["first_step_s"] > 0

    # the library, given the config the command wrote, trains to the same losses
    from tokenloom.train.config import load_config
    from tokenloom.train.loop import run

    cfg = load_config(tmp_path / "run" / "config.json", [f"output_dir={json.dumps(str(tmp_path / 'lib'))}"])
    assert cfg.train_iters == 3 and cfg.model.n_layers == 1 and cfg.micro_batch_size == 2
    run(cfg)
    lib = [json.loads(line) for line in (tmp_path / "lib" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in lib if "train_loss" in r] == losses
