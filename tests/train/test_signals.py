"""SIGTERM to a 2-rank ``cli.py train`` job: every process of the job ends, with a checkpoint of
the step it stopped at, and ``--resume auto`` continues with the losses of an uninterrupted run,
whether the launcher, torchrun or one rank was signalled."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tl_testing import REPO, cli_env, limit_s, reaped, run_cli

from tokenloom.train.launch import process_alive

ITERS = 60  # the signal lands after 3 logged steps: dozens of steps of margin on a fast machine
TINY = ["--mock-data", "--set", "data.mock.num_sequences=400", "--set", "data.mock.max_length=100",
        "--seq-length", "16", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--set", "model.vocab_size=64", "--set", "model.make_vocab_size_divisible_by=32", "--set", "progress=false",
        "--set", "plot=false", "--eval-interval", "0", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--log-interval", "1", "--save-interval", "1000", "--train-iters", str(ITERS), "--nproc-per-node", "2"]


def train(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "cli.py"), "train", *TINY, "--output-dir", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(cli_env(), OMP_NUM_THREADS="1"))


def losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in records if "train_loss" in r]


def finished(proc: subprocess.Popen) -> tuple[str, str]:
    with reaped(proc):
        return proc.communicate(timeout=limit_s(240))


def job_pids(launcher: int, out: Path) -> list[int]:
    """The launcher, torchrun (its child) and the ranks, once both ranks have logged 3 steps."""
    deadline = time.monotonic() + limit_s(120)
    while not (out / "metrics.jsonl").exists() or len(losses(out)) < 3:
        assert process_alive(launcher) and time.monotonic() < deadline
        time.sleep(0.02)
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    ranks = [int(p.read_text()) for p in sorted((out / "logs").glob("*/rank*.pid"))]
    assert len(ranks) == 2 and len(children) == 1
    return [launcher, int(children[0]), *ranks]


LAUNCH_BUDGET_S = 120.0
"""One 2-rank torchrun launch of ``TINY`` (start-up, 60 steps, exit) takes about ten seconds on the developers'
machine: the test's timeout is this per launch it makes (the reference, then a run and its resume per target)."""


@pytest.mark.timeout(7 * LAUNCH_BUDGET_S)
def test_sigterm_to_the_launcher_or_one_rank_saves_the_step_and_resume_continues_exactly(tmp_path):
    reference = train(tmp_path / "reference")
    assert reference.wait(timeout=limit_s(240)) == 0, finished(reference)
    expected = losses(tmp_path / "reference")
    assert len(expected) == ITERS

    for target, at in (("launcher", 0), ("torchrun", 1), ("rank 1", 3)):
        out = tmp_path / target.replace(" ", "")
        proc = train(out)
        try:
            pids = job_pids(proc.pid, out)
            seen = len(losses(out))
            os.kill(pids[at], signal.SIGTERM)
            deadline = time.monotonic() + limit_s(60)
            while any(process_alive(p) for p in pids):
                assert time.monotonic() < deadline, f"{target}: still running: {[p for p in pids if process_alive(p)]}"
                time.sleep(0.1)
        finally:
            stdout, stderr = finished(proc)
        assert proc.returncode == (128 + signal.SIGTERM if target == "launcher" else 0), stderr
        assert "Traceback" not in stdout + stderr, stderr
        stops = [line for line in stderr.splitlines() if line.startswith("stopped by SIGTERM")]
        assert len(stops) == 1, stderr
        it, ckpt, command = re.fullmatch(r"stopped by SIGTERM after iteration (\d+): checkpoint (\S+); resume with: "
                                         r"(python cli.py train --config \S+ --nproc-per-node 2 --resume auto)",
                                         stops[0]).groups()
        assert seen <= int(it) < ITERS and Path(ckpt).name == f"iter_{int(it):07d}" and (Path(ckpt) / "COMPLETE").exists()
        assert len(losses(out)) == int(it)

        resumed = run_cli(*command.split()[2:], timeout=240)
        assert resumed.returncode == 0, resumed.stderr
        assert losses(out) == expected, target
