"""Shared fixtures: where the third-party data lives, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """``$TOKENLOOM_SHARED_DATA`` or ``../shared/data`` beside the repository."""
    return Path(os.environ.get("TOKENLOOM_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not (path / "README.md").exists():
        pytest.skip(f"shared third-party data not found at {path} (set TOKENLOOM_SHARED_DATA)")
    return path


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python cli.py ARGS`` in a subprocess (exactly as a user would)."""
    return subprocess.run([sys.executable, str(REPO / "cli.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)
