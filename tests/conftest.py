"""Fixtures for every test folder; helpers live in ``tl_testing``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tl_testing import shared_data_dir

# Triton reads TRITON_INTERPRET when its @jit functions are decorated, including its own
# standard library (tl.sum, ...) at import; any test module may import Triton first (torch
# inductor, megatron-core), so without a GPU the interpreter is switched on here, before
# any test module is collected. It only affects Triton kernels, which need it on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not (path / "README.md").exists():
        pytest.skip(f"shared third-party data not found at {path} (set TOKENLOOM_SHARED_DATA)")
    return path
