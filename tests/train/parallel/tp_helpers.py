"""Run a function on N spawned gloo ranks with a hard deadline (tensor-parallel tests).

``run_ranks(fn, world_size, tmp_path, *args)`` spawns ``world_size`` processes, each
joining a gloo group through a ``file://`` store in ``tmp_path`` (no ports, so no
clashes with other test runs), and calls ``fn(rank, world_size, *args)``. An exception
on any rank fails the test with that rank's traceback; a hang past ``deadline_s``
kills the processes and fails. ``fn`` must be a module-level function (spawn pickles
it by name).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tl_testing import apply_environ, rank_context, timed


def run_ranks(fn, world_size: int, tmp_path: Path, *args, deadline_s: float = 120.0) -> None:
    init_file = tmp_path / f"store_{fn.__name__}_{world_size}"
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, str(init_file), args, dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method=rank_context().get_start_method(),  # forked from a warm server (tl_testing)
    )
    try:
        with timed(f"{fn.__name__} at world {world_size}", deadline_s) as limit:
            end = time.monotonic() + limit
            while not ctx.join(timeout=max(0.1, min(5.0, end - time.monotonic()))):
                if time.monotonic() > end:
                    pytest.fail(f"{fn.__name__} at world size {world_size} hung for {limit:.0f} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()


def _entry(rank: int, fn, world_size: int, init_file: str, args: tuple, environ: dict) -> None:
    apply_environ(environ)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    fn(rank, world_size, *args)
    # every rank is done with the group before any rank tears it down: a rank destroying it while
    # a peer still waits on a last collective aborted once with gloo (4 ranks on 2 cores); after a
    # failure the process just exits (the parent reports it), since a barrier could hang there
    dist.barrier()
    dist.destroy_process_group()


def det_randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Deterministic fp32 normal tensor, the same in every process for the same seed."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "", atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=atol, msg=lambda m: f"{what}: {m}")
