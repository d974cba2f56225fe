"""``kill -9`` of a ``cli.py train`` job while it writes checkpoints in the background (issue 38,
acceptance 2): each ``--resume auto`` continues from the newest complete checkpoint, and the run
ends with the losses and parameters of an uninterrupted one (fp32, CPU).

The kills land at seeded random moments of the background writes: SIGKILL to the job's process
group at the ``count``-th time the job opens one of a checkpoint's files for writing
(``tests/fault_site/sitecustomize.py``), the file and count drawn per kill. The job saves every
step, so the write of checkpoint ``r + count`` (``r``: where the job resumed) is in flight then, and
the one before it is complete, as the next save waits for the previous write.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tl_testing import REPO, cli_env, fault_env, limit_s

from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.checkpoint import format as ckpt_format

ITERS, KILLS = 24, 10
RUN = ["--mock-data", "--seq-length", "16", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
       "--set", "model.vocab_size=64", "--set", "progress=false", "--set", "plot=false", "--eval-interval", "0",
       "--micro-batch-size", "2", "--global-batch-size", "4", "--set", "data.mock.num_sequences=200",
       "--set", "data.mock.max_length=40", "--train-iters", str(ITERS), "--save-interval", "1", "--log-interval", "1"]
# what the background write opens, in order: its files in the temporary folder, then the pointer's temp file
FILES = ["rng_rank0.pt", "tp0_pp0_dp0.pt", "state.json", checkpoint.COMPLETE, "latest"]
pytestmark = pytest.mark.slow


def _train(out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "cli.py"), "train", *RUN, "--output-dir", str(out), *extra],
                          capture_output=True, text=True, timeout=limit_s(240), env=env or cli_env(),
                          start_new_session=True)  # the kill reaches the job's process group, not pytest


def _losses(out: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r["iter"], r["train_loss"]) for r in records if "train_loss" in r)


def _final(out: Path) -> dict[str, torch.Tensor]:
    path = out / "checkpoints" / checkpoint.checkpoint_name(ITERS)
    params, optim = ckpt_format.read(path)
    return {**params, **{f"optim.{n}.{k}": v for n, state in optim.items() for k, v in state.items()}}


def _newest(ckpt: Path) -> int:
    latest = checkpoint.find_latest(ckpt)
    return 0 if latest is None else checkpoint.read_state(latest)["iteration"]


def test_kill_9_during_async_saves_then_resume_auto_equals_an_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    done = _train(reference)
    assert done.returncode == 0, done.stderr

    out, draw = tmp_path / "run", random.Random(38)
    ckpt = out / "checkpoints"
    resumed = 0
    for kill in range(KILLS):
        name, count = draw.choice(FILES), draw.randint(1, 2)
        pattern = f"{ckpt}/latest.tmp-*" if name == "latest" else f"{ckpt}/iter_*.tmp/{name}"
        done = _train(out, "--resume", "auto", env=fault_env("signal", signal.SIGKILL, pattern, count=count))
        assert done.returncode == -signal.SIGKILL, (kill, name, count, done.stderr)
        if resumed:
            assert f"resumed from {ckpt / checkpoint.checkpoint_name(resumed)} at iteration {resumed}" in done.stderr
        else:
            assert "resumed from" not in done.stderr, done.stderr
        # killed while writing checkpoint resumed + count: the one before it is the newest complete one
        # (or that one itself, when only its pointer was left to write)
        expected = resumed + count - (0 if name == "latest" else 1)
        assert _newest(ckpt) == expected, (kill, name, count, sorted(p.name for p in ckpt.iterdir()))
        resumed = expected

    done = _train(out, "--resume", "auto")
    assert done.returncode == 0, done.stderr
    assert f"resumed from {ckpt / checkpoint.checkpoint_name(resumed)} at iteration {resumed}" in done.stderr
    assert _losses(out) == _losses(reference) and len(_losses(out)) == ITERS
    final, expected_final = _final(out), _final(reference)
    assert final.keys() == expected_final.keys()
    for key, tensor in expected_final.items():
        if isinstance(tensor, dict):
            assert all(torch.equal(tensor[k], final[key][k]) for k in tensor), key
        else:
            assert torch.equal(tensor, final[key]), key
    assert not list(ckpt.glob("*.tmp")), "the last run's saves removed the killed runs' temporary folders"
