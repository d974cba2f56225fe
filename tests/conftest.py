"""Fixtures for every test folder; helpers live in ``tl_testing``.

Under ``CI=true`` a skip is a failure unless the test needs a GPU: a test skips when a
part it needs is missing (megatron-core, the native extension, the shared data, Triton's
interpreter), and CI installs all of them, so a skip there means an install step broke
and a whole capability went untested. Locally such tests still skip, with the reason.

The timing check: every test's time (setup, call and teardown, which pytest-timeout bounds
together) is recorded against its timeout, every module- or session-scoped fixture's setup
against the timeout of the test whose setup ran it, and every timed wait inside a test
(``tl_testing.timed``: ``run_cli``, the rank launchers) against its own limit. The end of the
run prints the tightest ratios; above ``$TL_TIMING_LIMIT`` (0.33 under ``CI=true``, else
report only) the run fails, so a machine three times slower than the one that ran it still
passes. ``$TL_TIMEOUT_SCALE`` scales every timeout (``tl_testing.TIMEOUT_SCALE``); the ratios
are taken against the unscaled timeouts.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path

# One thread per process, for the pytest workers and every process a test starts (cli.py runs,
# torchrun's ranks, which torchrun already gives one): CI runs three xdist workers on two cores, and
# torch's default of a thread per core then oversubscribes them, where the tiny models' small ops
# wait on each other's threads (a one-process cli.py run took twice as long). Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles in the process that compiles: its default on two cores is a pool of two compile
# workers, fresh interpreters that import torch (about 10 s of CPU on a slow 2-core machine) in every
# process whose blocks compile (every rank of a compile: true launch), for kernels that take a
# second of g++ each. Same generated code either way.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The processes tests start get Ctrl-C as from a terminal: a shell without job control starts a
# background job (``cmd &``, ``nohup``) with SIGINT ignored, every process below it inherits that, and
# the tests that interrupt a run with SIGINT (test_faults' Ctrl-C, test_stop) would see it survive.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402
import tl_testing  # noqa: E402
import torch  # noqa: E402
from tl_testing import TIMEOUT_SCALE, shared_data_dir  # noqa: E402

# Triton reads TRITON_INTERPRET when its @jit functions are decorated, including its own
# standard library (tl.sum, ...) at import; any test module may import Triton first (torch
# inductor, megatron-core), so without a GPU the interpreter is switched on here, before
# any test module is collected. It only affects Triton kernels, which need it on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
TIMING_LIMIT = float(os.environ.get("TL_TIMING_LIMIT", "0.33" if IN_CI else "inf"))
"""The largest time / timeout ratio the run accepts (module docstring)."""
TIMING_SHOWN = 12
"""How many of the tightest ratios the end of the run prints."""
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
    # timed waits of this phase (run_cli, rank launchers) travel on the report (xdist included)
    item.user_properties.extend(("tl_wait", what, took, limit / TIMEOUT_SCALE)
                                for what, took, limit in tl_testing.DEADLINES)
    tl_testing.DEADLINES.clear()
    outcome = yield
    _fail_skip_in_ci(outcome.get_result(), item.get_closest_marker("gpu") is not None)


def _base_timeout(item) -> float:
    """The item's timeout before :data:`TIMEOUT_SCALE`: its ``timeout`` marker's or the ini's."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        return float(marker.args[0] if marker.args else marker.kwargs["timeout"])
    return float(item.config.getini("timeout") or 0)


_running: list = []  # the item whose protocol runs now (its setup runs the module fixtures)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    start = time.monotonic()
    yield
    if fixturedef.scope != "function" and _running:
        item = _running[-1]
        item.user_properties.append(("tl_fixture", f"{fixturedef.argname} ({fixturedef.scope})",
                                     time.monotonic() - start, item.stash.get(_TIMEOUT, 0.0)))


_TIMEOUT = pytest.StashKey[float]()
_times: dict[str, list] = {}  # nodeid -> [seconds, timeout, waits and fixtures]


def pytest_runtest_logreport(report):
    """Collects the timing records (on the xdist controller, from every worker's reports)."""
    entry = _times.setdefault(report.nodeid, [0.0, 0.0, []])
    entry[0] += report.duration
    for prop in report.user_properties:
        if prop[0] == "tl_timeout":
            entry[1] = prop[1]
        elif prop[0] in ("tl_wait", "tl_fixture") and prop not in entry[2]:
            entry[2].append(prop)


def timing_ratios() -> list[tuple[float, str, float, float]]:
    """``(ratio, what, seconds, timeout)`` of every test, module fixture and timed wait, tightest first."""
    rows = []
    for nodeid, (took, limit, extra) in _times.items():
        if limit > 0:
            rows.append((took / limit, f"test {nodeid}", took, limit))
        for kind, what, secs, lim in extra:
            if lim > 0:
                rows.append((secs / lim, f"{'wait' if kind == 'tl_wait' else 'fixture'} {what} in {nodeid}",
                             secs, lim))
    return sorted(rows, reverse=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller prints it
    rows = timing_ratios()
    if not rows:
        return
    terminalreporter.section("time over timeout (tightest first)")
    for ratio, what, took, limit in rows[:TIMING_SHOWN]:
        terminalreporter.write_line(f"{ratio:6.3f}  {took:7.1f} s of {limit:6.0f} s  {what}")
    over = [r for r in rows if r[0] > TIMING_LIMIT]
    if over:
        terminalreporter.write_line(f"timing check: {len(over)} above the limit {TIMING_LIMIT} "
                                    "(TL_TIMING_LIMIT): size their timeouts by their work", red=True)
        config.stash[_TIMING_FAILED] = True
    else:
        terminalreporter.write_line(f"timing check: tightest {rows[0][0]:.3f} <= {TIMING_LIMIT}")


_TIMING_FAILED = pytest.StashKey[bool]()


def pytest_sessionfinish(session, exitstatus):
    if session.config.stash.get(_TIMING_FAILED, False) and session.exitstatus == 0:
        session.exitstatus = 1


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
    one test (or by the developer's own runs) never decides another test's backend. (Except on
    purpose: tests/tokenizers' ``load_shared`` and its tests whose subject is not the check read
    one session cache, each verdict computed there by this run.)"""
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path_factory.mktemp("user-cache")))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """The heap collection made (every test module and what it imports: torch, transformers, megatron-core,
    datatrove), frozen out of the garbage collector's later passes (:func:`gc.freeze`): each run a test
    makes in this process starts with a full collection (``ManualGC``), which would visit all of it again,
    about a quarter of a second of CPU each on a slow 2-core machine. Only what is alive now is frozen:
    what the tests make is collected as before."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Modules holding a ``slow`` test run first, in their order; the rest keep theirs. Under
    pytest-xdist (``scripts/test.sh`` runs whole modules on two workers) the long multi-process
    modules then start early instead of keeping one worker busy after the other has finished.
    Each item's timeout is recorded for the timing check, and scaled by :data:`TIMEOUT_SCALE`."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)
    for item in items:
        base = _base_timeout(item)
        item.stash[_TIMEOUT] = base
        item.user_properties.append(("tl_timeout", base))
        if TIMEOUT_SCALE != 1 and base > 0:
            item.add_marker(pytest.mark.timeout(base * TIMEOUT_SCALE))


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
