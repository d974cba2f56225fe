"""Helpers shared by every test folder (``tests/`` is on pytest's ``pythonpath``).

Test folders have no ``__init__.py`` and several have a ``conftest.py``, so
``from conftest import ...`` would be ambiguous; shared code lives here instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """``$TOKENLOOM_SHARED_DATA`` or ``../shared/data`` beside the repository."""
    return Path(os.environ.get("TOKENLOOM_SHARED_DATA", REPO.parent / "shared" / "data"))


def run_cli(*args, cwd: Path | None = None, timeout: float = 300, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    """Run ``python cli.py ARGS`` in a subprocess, exactly as a user would; this checkout comes
    first on ``PYTHONPATH``, so processes it starts (torchrun's ranks) import it too."""
    return subprocess.run([sys.executable, str(REPO / "cli.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout, env=env or cli_env())


def one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """The command failed with exactly one stderr line holding every fragment, no traceback."""
    assert done.returncode != 0, done.stdout
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def cli_env() -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(REPO) + (os.pathsep + path if path else ""))


def fault_env(op: str, err: int, path: str | Path, room: int = 0, count: int = 1) -> dict[str, str]:
    """:func:`cli_env` plus an operating-system fault (``tests/fault_site/sitecustomize.py``):
    ``op`` (open, write, fsync, rename) on files matching the glob ``path`` fails with ``err``;
    ``signal`` sends signal ``err`` to the process group at the ``count``-th open of such a file."""
    env = cli_env()
    env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + str(REPO / "tests" / "fault_site")
    env["TOKENLOOM_TEST_FAULT"] = json.dumps({"op": op, "errno": err, "path": str(path), "room": room,
                                              "count": count})
    return env


def import_megatron(module: str):
    """Import a megatron.core module quietly, or skip the test when megatron-core is missing or
    fails to import (the ``[interop]`` extra; under ``CI=true`` the skip fails the run)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(module, reason="megatron-core not installed or not importable "
                                   "(pip install -e '.[interop]')", exc_type=ImportError)
