"""Fixtures for every test folder; helpers live in ``tl_testing``."""

from __future__ import annotations

from pathlib import Path

import pytest
from tl_testing import shared_data_dir


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not (path / "README.md").exists():
        pytest.skip(f"shared third-party data not found at {path} (set TOKENLOOM_SHARED_DATA)")
    return path
