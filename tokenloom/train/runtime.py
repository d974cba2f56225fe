"""What a training process sets up around the model: its place in the job, seeds,
autocast, host memory and garbage collection. Every layout uses the same pieces.

* :func:`join_world`: join the launcher's process group (torchrun or Slurm variables,
  :mod:`tokenloom.train.dist`) or run alone; the run's device is decided here once and
  every tensor the trainer makes names it.
* :func:`collective`: a peer that died or stalled surfaces as one-line
  :class:`~tokenloom.errors.TokenloomError` at the next collective (after at most the
  process group's timeout), not a backend traceback.
* :class:`ManualGC`: automatic GC off, a young-generation collection every N steps on
  every rank at the same step (torchtitan's ``gc_freq``, Megatron's ``--manual-gc``).
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
from tokenloom.train.dist import init_from_env, launch_env
from tokenloom.train.host_alloc import keep_freed_memory, release_large_blocks


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    size: int
    device: torch.device
    owns_group: bool
    """We created the default process group (and destroy it at the end)."""


def join_world(dist_timeout_s: float) -> World:
    """Join the launch described by the environment (torchrun / Slurm), or run alone on
    ``cuda:0`` when CUDA is available, else the CPU."""
    if int(launch_env()["WORLD_SIZE"]) > 1 or dist.is_initialized():
        owns = not dist.is_initialized()
        info = init_from_env(timeout_s=dist_timeout_s)
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
    """bf16 when ``precision`` is ``bf16``, or ``auto`` on a GPU that supports it; fp32
    otherwise (always on CPU under ``auto``)."""
    bf16 = precision == "bf16" or (
        precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
    )
    return torch.bfloat16 if bf16 else torch.float32


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX tiles), as oneDNN
    does; without either, torch emulates bf16 matmuls through fp32 conversions, several times slower
    than plain fp32. Read from torch's own CPU-capability probes (``torch.cpu``)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def bf16_over_fp32_speed(size: int = 256, reps: int = 3) -> float:
    """bf16 matmul throughput over fp32's on this CPU (a ``size`` cube, best of ``reps``): a few
    milliseconds, measured only when the summary has to explain an emulated bf16 run."""
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
    """When the run computes on the CPU (on a GPU, host allocations are few and small):
    :func:`~tokenloom.train.host_alloc.release_large_blocks` for a ``fully_sharded`` run,
    else :func:`~tokenloom.train.host_alloc.keep_freed_memory` when asked."""
    if device.type != "cpu":
        return
    if fully_sharded:
        release_large_blocks()
    elif keep_freed:
        keep_freed_memory()


class ManualGC:
    """``with ManualGC(n) as g: ... g.step(iteration)``: Python's automatic garbage collection
    off inside, a young-generation collection every ``n`` steps (n = 0: left automatic).

    Automatic GC walks every tracked object whenever allocations pile up, and the data
    pipeline allocates many small objects per step: a measurable part of a CPU training
    step (see bench/RESULTS.md, notes). Collecting at fixed steps costs less and happens on every rank at the same step,
    so no rank stalls the others at random (torchtitan's gc_freq, Megatron's --manual-gc).
    """

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
