"""What a training process sets up around the model, the same in every layout: its place in the
job (:func:`join_world` decides the run's device once; every tensor the trainer makes names it),
seeds, autocast, host memory and garbage collection. :func:`collective` turns a dead or stalled
peer into a one-line :class:`~tokenloom.errors.TokenloomError`, not a backend traceback.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tokenloom.errors import TokenloomError
from tokenloom.train.dist import init_from_env, launch_env, resolve_backend
from tokenloom.train.host_alloc import keep_freed_memory, release_large_blocks


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    size: int
    device: torch.device
    owns_group: bool
    """We created the default process group (and destroy it at the end)."""


def join_world(dist_timeout_s: float, backend: str | None = None) -> World:
    """Join the launch the environment describes over ``backend``, or run alone on ``cuda:0`` or the CPU."""
    resolve_backend(backend)  # its one-line refusals hold for one rank too
    if int(launch_env()["WORLD_SIZE"]) > 1 or dist.is_initialized():
        owns = not dist.is_initialized()
        info = init_from_env(backend, timeout_s=dist_timeout_s)
        return World(info.rank, info.world_size, info.device, owns)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return World(0, 1, device, False)


def collective(what: str, fn: Callable, *args, **kwargs):
    """Run a collective, turning a peer failure into a one-line TokenloomError."""
    try:
        return fn(*args, **kwargs)
    except TokenloomError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise TokenloomError(f"rank {dist.get_rank()}: {what} failed ({type(e).__name__}: {first}); another "
                             "rank has probably died or stalled past the collective timeout") from e


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global RNGs (dropout, shuffles)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """bf16 for ``bf16``, or ``auto`` on a GPU that supports it; fp32 otherwise."""
    bf16 = precision == "bf16" or (
        precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
    )
    return torch.bfloat16 if bf16 else torch.float32


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16, AMX); else torch emulates it, slower than fp32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def bf16_over_fp32_speed(size: int = 256, reps: int = 3) -> float:
    """bf16 matmul throughput over fp32's on this CPU (best of ``reps``), for explaining an emulated bf16 run."""
    def best(dtype: torch.dtype) -> float:
        a = torch.randn(size, size, dtype=dtype)
        times = []
        for _ in range(reps + 1):  # the first warms the kernel up
            start = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - start)
        return min(times[1:])
    return best(torch.float32) / max(best(torch.bfloat16), 1e-9)


def autocast_for(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """A factory of the forward's autocast context in :func:`compute_dtype` (none for fp32)."""
    if compute_dtype(precision, device) == torch.bfloat16:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext


def tune_host_memory(keep_freed: bool, device: torch.device, *, fully_sharded: bool = False) -> None:
    """On CPU only: release large blocks for a ``fully_sharded`` run, else keep freed memory when asked."""
    if device.type != "cpu":
        return
    if fully_sharded:
        release_large_blocks()
    elif keep_freed:
        keep_freed_memory()


class ManualGC:
    """``with ManualGC(n) as g: ... g.step(iteration)``: automatic GC (costly, bench/RESULTS.md) off inside,
    a young-generation collection every ``n`` steps (0: automatic), so no rank stalls others at random."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def __enter__(self) -> ManualGC:
        self._was_enabled = gc.isenabled()
        if self.interval:
            gc.collect()
            gc.disable()
        return self

    def step(self, iteration: int) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self.interval and self._was_enabled:
            gc.enable()
