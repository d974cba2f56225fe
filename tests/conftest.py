"""Fixtures for every test folder; helpers live in ``tl_testing``.

Under ``CI=true`` a skip is a failure unless the test needs a GPU: a test skips when a
part it needs is missing (megatron-core, the native extension, the shared data, Triton's
interpreter), and CI installs all of them, so a skip there means an install step broke
and a whole capability went untested. Locally such tests still skip, with the reason.
"""

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


IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
GPU_REASON = "needs a CUDA device"
"""The one skip reason CI accepts (no CI machine has a GPU); GPU tests use exactly it."""


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _fail_skip_in_ci(report, needs_gpu: bool) -> None:
    if IN_CI and report.skipped and not needs_gpu and GPU_REASON not in _skip_reason(report):
        report.outcome = "failed"
        report.longrepr = (f"CI=true: this would have been skipped ({_skip_reason(report)}); in CI every "
                           "required part is installed, so a skip means a capability went untested")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result(), item.get_closest_marker("gpu") is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result(), False)  # a module that skips at import (importorskip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not (path / "README.md").exists():
        pytest.skip(f"shared third-party data not found at {path} (set TOKENLOOM_SHARED_DATA)")
    return path


@pytest.fixture(autouse=True)
def _own_user_cache(tmp_path_factory, monkeypatch):
    """Each test its own per-user cache (the tokenizer self-check verdicts): a verdict cached by
    one test (or by the developer's own runs) never decides another test's backend."""
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path_factory.mktemp("user-cache")))


def pytest_collection_modifyitems(config, items):
    """Modules holding a ``slow`` test run first, in their order; the rest keep theirs. Under
    pytest-xdist (``scripts/test.sh`` runs whole modules on two workers) the long multi-process
    modules then start early instead of keeping one worker busy after the other has finished."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free local port for the module (:class:`tl_testing.S3Server`); skips without
    moto[server] (the dev extra) or s3fs (the s3 extra)."""
    pytest.importorskip("moto.moto_server.werkzeug_app", reason="needs moto[server] (the dev extra)")
    pytest.importorskip("s3fs", reason="needs s3fs (the s3 extra)")
    from tl_testing import S3Server

    server = S3Server()
    yield server
    server.close()
