"""``torch.compile`` wrappers, created once per function and shared by every caller.

Shapes: torch's default "automatic dynamic" (``dynamic=None``). The first call compiles
a graph specialised to its shapes; the first call with a different shape recompiles
once with symbolic sizes, and that graph then serves every later shape. So a training
run pays one compile per op (two for the chunked cross entropy: full chunk and tail),
and evaluation at other lengths costs one more, never one per length. ``dynamic=False``
would give slightly tighter kernels but recompile for every new shape, and past
``torch._dynamo.config.recompile_limit`` (8) a ``fullgraph=True`` function raises
(measured), so we keep neither. Without ``fullgraph``, a graph break or the limit
falls back to eager with a warning instead of failing the step.

Cost: the first compile in a process takes 10-30 s on the 2-core dev box (inductor
start-up), later graphs 1-3 s each, a warm on-disk cache < 2 s.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable

import torch

from .triton_ops import triton_available

_CACHE: dict[Callable, Callable] = {}


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)`` (automatic dynamic shapes), memoised on ``fn``."""
    if fn not in _CACHE:
        _CACHE[fn] = torch.compile(fn)
    return _CACHE[fn]


@functools.cache
def compile_available(device_type: str) -> bool:
    """Cheap check that inductor can build kernels for ``device_type`` ("cpu" or "cuda").

    CPU needs a C++ compiler (inductor's OpenMP backend); CUDA needs Triton. This does
    not compile anything, so a broken toolchain still surfaces at the first call.
    """
    if not torch._dynamo.is_dynamo_supported():
        return False
    if device_type == "cuda":
        return triton_available("cuda")
    if device_type == "cpu":
        return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)
    return False
