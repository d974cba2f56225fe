"""Launch helpers for multi-process (gloo, CPU) training tests.

``run_world(scenario, world_size)`` starts ``_dist_worker.py`` once per rank as a plain
subprocess with torchrun-style env vars on 127.0.0.1 and a free port, waits with a hard
deadline (a hang fails the test, processes are killed), and returns each rank's JSON.
``group``: a 1-rank gloo process group for in-process checks (DDP, the wgrad sinks);
``nccl_group``: the same on cuda:0 with NCCL (skipped without CUDA).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tl_testing import timed

WORKER = Path(__file__).with_name("_dist_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(
    scenario: str,
    world_size: int,
    tmp_path: Path,
    deadline_s: float = 240.0,
    collective_timeout_s: float = 60.0,
) -> list[dict | None]:
    for attempt in range(2):  # the free port can be taken before rank 0 binds it: retry once
        out = tmp_path / f"{scenario}_w{world_size}_try{attempt}"
        out.mkdir()
        _launch(scenario, world_size, out, deadline_s, collective_timeout_s)
        if "address already in use" not in (out / "rank0.log").read_text().lower():
            break
    results = []
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
        if results[-1] and "crash" in results[-1]:
            pytest.fail(f"rank {rank} crashed:\n{results[-1]['crash']}")
    return results


def _launch(
    scenario: str, world_size: int, out: Path, deadline_s: float, collective_timeout_s: float
) -> None:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        TL_TEST_TIMEOUT_S=str(collective_timeout_s),
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
    )
    procs = []
    for rank in range(world_size):
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(WORKER), scenario, str(out)]
        procs.append((subprocess.Popen(cmd, env=env_r, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        with timed(f"{scenario} at world {world_size}", deadline_s) as limit:
            end = time.monotonic() + limit
            for proc, _ in procs:
                proc.wait(timeout=max(1.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        logs = "\n".join((out / f"rank{r}.log").read_text()[-2000:] for r in range(world_size))
        pytest.fail(f"{scenario} at world size {world_size} hung for {limit:.0f} s; logs:\n{logs}")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


@pytest.fixture
def group(tmp_path):
    """A 1-rank gloo process group for in-process DDP checks (torn down after the test)."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.fixture
def nccl_group(tmp_path):
    """A one-rank NCCL group on cuda:0: every collective and every bucket on the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60),
                            device_id=torch.device("cuda", 0))
    yield torch.device("cuda", 0)
    dist.destroy_process_group()


@pytest.fixture
def run_world(tmp_path):
    def run(scenario: str, world_size: int, **kw):
        return _run_world(scenario, world_size, tmp_path, **kw)

    return run


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def suite_results(request, tmp_path_factory):
    """The main DDP suite, run once per world size and shared by the asserting tests."""
    return _run_world("suite", request.param, tmp_path_factory.mktemp("suite"))
