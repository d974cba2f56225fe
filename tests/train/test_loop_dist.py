"""The loop with 2 gloo ranks: equals 1-process training, and a dead rank fails fast with one line.

Run as a script (``python test_loop_dist.py die CONFIG``) it is one rank whose rank 1
``os._exit``s in its third step; the test starts the ranks itself so it can read each
rank's stderr and enforce a deadline (a hang fails the test and the ranks are killed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: also when run as a rank's script
from tl_testing import limit_s  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def tiny(tmp: Path, **overrides):
    from tokenloom.train.config import TrainConfig
    from tokenloom.train.data import DataConfig, MockDataConfig
    from tokenloom.train.model.config import GPTConfig
    from tokenloom.train.optim.adamw import OptimConfig

    kw = dict(
        model=GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2, n_heads=2,
                        d_model=32),
        data=DataConfig(mock=MockDataConfig(num_sequences=300, max_length=200)),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=3),
        micro_batch_size=2, global_batch_size=4, train_iters=8, eval_interval=4, eval_iters=2,
        log_interval=1, save_interval=None, output_dir=str(tmp), progress=False, plot=False,
    )
    kw.update(overrides)
    return TrainConfig(**kw)


def records(out: Path, key: str) -> list[tuple[int, float]]:
    from tokenloom.train.metrics import read_metrics

    return [(r["iter"], r[key]) for r in read_metrics(out / "metrics.jsonl") if key in r]


def test_two_ranks_under_torchrun_equal_one_process(tmp_path, monkeypatch):
    from tokenloom.train.checkpoint import commit as checkpoint
    from tokenloom.train.checkpoint import format as ckpt_format
    from tokenloom.train.launch import launch

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launch(tiny(tmp_path / "ddp"), nproc_per_node=2)  # micro 2 x 2 ranks, no accumulation
    launch(tiny(tmp_path / "single"))  # in-process: micro 2, accumulation 2
    for key in ("train_loss", "val_loss"):
        ddp, single = records(tmp_path / "ddp", key), records(tmp_path / "single", key)
        assert [i for i, _ in ddp] == [i for i, _ in single] and ddp
        for (_, a), (_, b) in zip(ddp, single, strict=True):
            assert abs(a - b) < 1e-5, (key, ddp, single)
    pa, pb = (ckpt_format.read(checkpoint.find_latest(tmp_path / d / "checkpoints"))[0] for d in ("ddp", "single"))
    assert max((pa[k] - pb[k]).abs().max().item() for k in pa) < 1e-5
    state = checkpoint.read_state(checkpoint.find_latest(tmp_path / "ddp" / "checkpoints"))
    assert state["world_size"] == 2 and state["consumed_samples"] == 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_rank_stops_the_others_with_one_line_error(tmp_path):
    from tokenloom.train.config import config_to_dict

    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(config_to_dict(tiny(tmp_path / "run", train_iters=20, dist_timeout_s=30))))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, __file__, "die", str(config)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    start = time.monotonic()
    try:
        outputs = [p.communicate(timeout=limit_s(120)) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("a rank hung after its peer died")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.monotonic() - start
    assert procs[1].returncode == 3, outputs[1]
    assert procs[0].returncode == 1, outputs[0]
    # rank 0's stderr: the run's own "iteration N: ..." lines (validation, saves), then one error line, no traceback
    lines = [line for line in outputs[0][1].strip().splitlines() if not line.startswith("iteration ")]
    assert len(lines) == 1, outputs[0][1]
    assert lines[0].startswith("error: rank 0:") and "died" in lines[0], lines[0]
    assert elapsed < 60, elapsed  # well within the 30 s collective timeout plus start-up


def _die_in_third_step(config: str) -> None:
    """One rank of the dead-rank test: rank 1 exits abruptly in its third training step."""
    from tokenloom.train import loop
    from tokenloom.train.strategy import Strategy

    real_step, calls = Strategy.train_step, []

    def step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3 and os.environ["RANK"] == "1":
            os._exit(3)
        return real_step(self, *args, **kwargs)

    Strategy.train_step = step
    torch.set_num_threads(1)
    sys.exit(loop.main(["--config", config]))


if __name__ == "__main__":
    if sys.argv[1] == "die":
        _die_in_third_step(sys.argv[2])
