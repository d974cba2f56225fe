"""``torch.compile`` wrappers, created once per function and shared by every caller.

Shapes: torch's default "automatic dynamic" (``dynamic=None``): the first call compiles a
graph for its shapes, the first call with another shape recompiles once with symbolic sizes,
and that graph serves every later shape. A training run thus pays one compile per op (two
for the chunked cross entropy: full chunk and tail) and evaluation at other lengths one
more. ``dynamic=False`` would recompile for every new shape, and a ``fullgraph=True``
function raises past ``torch._dynamo.config.recompile_limit``, so neither is used: a graph
break or the limit falls back to eager with a warning instead of failing the step.

Cost: compiling is slow the first time in a process (inductor start-up) and importing
inductor is too, so wrappers are made at their first use.

Small CPU tensors run the eager reference (:func:`compiled_above`): a compiled call has a
fixed cost (guards, the AOTAutograd and autograd.Function wrappers) that on CPU exceeds what
fusing saves until a tensor is large. Each op's switch (:data:`CPU_MIN_NUMEL`) sits at or
above its measured crossover (the per-op table is in bench/RESULTS.md's notes;
``bench/kernels_bench.py`` measures the model they add up to); the chunked cross entropy's
"stats" and "grad" math share one switch above both. Like Megatron's fused softmax, which
falls back to torch for shapes its kernel does not handle, the switch is a pure function of
the input's size and device, so a run is deterministic. CUDA inputs always take the
compiled path (no crossover has been measured on a GPU). :func:`force_compiled` turns the
switch off (tests, benches).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from collections.abc import Callable, Iterator

import torch

from .triton_ops import triton_available

_CACHE: dict[Callable, Callable] = {}

CPU_MIN_NUMEL: dict[str, int | None] = {
    "rms_norm": 1 << 16,
    "layer_norm": 1 << 14,  # the bf16/fp16 path (fp32 takes ATen's kernel)
    "swiglu": 1 << 20,
    "rope": 1 << 20,
    "bias_dropout_add": None,  # compiled never won on CPU up to 2^22 elements: always eager there
    "bias_gelu": None,  # likewise
    "cross_entropy_chunk": 1 << 18,
}
"""Smallest first-argument ``numel`` for which a CPU call takes the compiled kernel;
None: never on CPU. From the crossover table in the module docstring."""

_forced = False


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)`` (automatic dynamic shapes), memoised on ``fn``."""
    if fn not in _CACHE:
        _CACHE[fn] = torch.compile(fn)
    return _CACHE[fn]


@contextlib.contextmanager
def force_compiled() -> Iterator[None]:
    """Within the block, :func:`compiled_above` wrappers always take the compiled kernel."""
    global _forced
    saved, _forced = _forced, True
    try:
        yield
    finally:
        _forced = saved


def compiled_above(fn: Callable, op: str) -> Callable:
    """``fn`` compiled for inputs whose first argument has at least ``CPU_MIN_NUMEL[op]``
    elements (always on non-CPU devices), the eager ``fn`` itself below that.

    The compiled wrapper is created at the first call that needs it, so a run whose tensors
    all stay below the thresholds never imports inductor.
    """

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args, **kwargs):
        if x.device.type == "cpu" and not _forced:
            threshold = CPU_MIN_NUMEL[op]
            if threshold is None or x.numel() < threshold:
                return fn(x, *args, **kwargs)
        return compiled(fn)(x, *args, **kwargs)

    return dispatch


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
