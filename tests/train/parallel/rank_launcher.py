"""Run named scenarios on N spawned gloo ranks and collect each rank's results (test helper).

A scenario is a function ``f(rank, **kwargs)`` in a module's ``SCENARIOS`` dict; the
module is named, not passed, because the workers must import it. A hang fails the
test at ``deadline_s``; a rank's exception comes back as its traceback.
Ranks start in :func:`tl_testing.rank_context` (forked from a server that imported torch and
the run once) with the launching process's environment.
"""

from __future__ import annotations

import gc
import importlib
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tl_testing import apply_environ, rank_context, timed

from tokenloom.train import staged_gloo


def launch(module: str, scenarios: list[tuple[str, dict]], world_size: int, tmp_path: Path, *,
           deadline_s: float, collective_timeout_s: float, staged: bool = False) -> list[list[Any]]:
    """Per-rank lists of per-scenario results of ``module.SCENARIOS[name](rank, **kwargs)``; with
    ``staged`` the group is :class:`~tokenloom.train.staged_gloo.StagedGloo` staging every call."""
    ctx = rank_context()
    tag = f"{module}_{world_size}{'_staged' if staged else ''}"
    args = (world_size, str(tmp_path / f"pg_init_{tag}"), module, scenarios, str(tmp_path), tag,
            collective_timeout_s, staged, dict(os.environ))
    procs = [ctx.Process(target=_worker, args=(r, *args)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        with timed(f"{module} x{len(scenarios)} at world {world_size}", deadline_s) as limit:
            end = time.monotonic() + limit
            for proc in procs:
                proc.join(timeout=max(1.0, end - time.monotonic()))
        hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
        if hung:
            pytest.fail(f"ranks {hung} still running after {limit:.0f} s (hang?) in {scenarios}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    results = []
    for r in range(world_size):
        path = tmp_path / f"result_{tag}_rank{r}.pt"
        if not path.exists():
            pytest.fail(f"rank {r} wrote no result (exit code {procs[r].exitcode})")
        res = torch.load(path, weights_only=True)
        if "crash" in res:
            pytest.fail(f"rank {r} crashed:\n{res['crash']}")
        results.append(res["results"])
    return results


def _worker(rank: int, world_size: int, init_file: str, module: str, scenarios: list, out_dir: str, tag: str,
            collective_timeout_s: float, staged: bool = False, environ: dict | None = None) -> None:
    if environ is not None:
        apply_environ(environ)
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    try:
        if staged:
            staged_gloo.register(stage_all=True)
        dist.init_process_group(staged_gloo.BACKEND if staged else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        registry = importlib.import_module(module).SCENARIOS
        out["results"] = []
        for name, kw in scenarios:
            if out["results"]:
                # what the scenarios before left alive (dynamo's and inductor's caches, process groups,
                # results) out of this one's collections: each run starts with a full one (ManualGC),
                # which would otherwise visit the survivors of every scenario before it
                gc.collect()
                gc.freeze()
            out["results"].append(registry[name](rank, **kw))
    except Exception:
        out = {"crash": traceback.format_exc()}
    torch.save(out, Path(out_dir) / f"result_{tag}_rank{rank}.pt")
    if "crash" not in out:
        dist.destroy_process_group()
