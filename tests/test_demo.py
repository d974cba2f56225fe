"""The main job as the README runs it: ``bash scripts/demo.sh``, at a reduced size so CI can
afford it (~1.5 min on 2 cores). Set-up is skipped (``TOKENLOOM_SKIP_SETUP``): the test
command has just run it, and a reinstall would rebuild the native library that this
process has loaded. Every stage must run for real:
tokenizer training, preprocess, blend build, a 2-rank torchrun training run whose
validation loss falls, a generated sample and the loss plot."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from tl_testing import REPO, limit_s

pytestmark = pytest.mark.slow


def test_the_main_job_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh"), "--max-documents", "120", "--vocab-size", "512",
                           "--train-iters", "30", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=limit_s(900), cwd=REPO,
                          env=dict(os.environ, TOKENLOOM_SKIP_SETUP="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = re.search(r"^validation loss: (.*)$", done.stdout, re.M)
    assert losses, done.stdout[-3000:]
    values = [float(v) for v in re.findall(r"\d+: ([\d.]+)", losses.group(1))]
    assert len(values) >= 3 and values[-1] < values[0] - 0.3
    assert "== sample (prompt 'The '):\nThe " in done.stdout
    assert (out / "run" / "loss.png").stat().st_size > 0
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("iter", 0) for r in records) == 30
    assert "2 rank(s)" in done.stdout  # trained under torchrun with 2 ranks
