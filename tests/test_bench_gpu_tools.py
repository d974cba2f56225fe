"""The tools ``scripts/gpu-check.sh`` runs besides ``train_bench``, on CPU: ``fp8_bench`` says in
its table why it did not run (no float8 GPU, no data) and exits 0, so ``bench/run_all.py`` keeps
going; ``profile_step`` profiles our step and lists the host synchronisations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tl_testing import limit_s

REPO = Path(__file__).resolve().parent.parent


def _bench(script: str, *args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, str]:
    tables = tmp_path / "tables.md"
    env = dict(os.environ, BENCH_RESULTS_MD=str(tables), PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    env.pop("TOKENLOOM_BENCH_DATA", None)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=limit_s(240))
    return proc, tables.read_text() if tables.exists() else ""


def test_fp8_bench_says_why_it_did_not_run(tmp_path):
    proc, table = _bench("fp8_bench.py", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "| not run |" in table and "float8" in table


@pytest.mark.slow
def test_profile_step_lists_kernels_and_host_syncs(tmp_path):
    proc, _ = _bench("profile_step.py", "--d-model", "32", "--seq-len", "32", "--n-layers", "1", "--n-heads", "2",
                     "--vocab", "256", "--steps", "2", "--warmup", "1", "--rows", "5", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "operators and kernels by self_cpu_time_total" in proc.stdout
    assert "host synchronisations in 2 steps" in proc.stdout
