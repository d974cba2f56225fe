"""``torch.compile`` wrappers, created once per function (at first use: inductor is slow to import).

Shapes: torch's "automatic dynamic" (``dynamic=None``): one compile per op for the first shape, one
recompile with symbolic sizes for the next, serving all later shapes. Not ``dynamic=False``
(recompiles per shape) nor ``fullgraph=True`` (raises past the recompile limit): a graph break
falls back to eager with a warning instead of failing the step.

Small CPU tensors run eager (:func:`compiled_above`): a compiled call's fixed cost exceeds what
fusing saves below each op's :data:`CPU_MIN_NUMEL`, set at or above its measured crossover
(bench/RESULTS.md, notes). Like Megatron's fused softmax fallback, the switch depends only on size
and device, so runs stay deterministic; CUDA always compiles. :func:`force_compiled` turns it off.
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
"""Smallest first-argument ``numel`` for which a CPU call compiles; None: never on CPU."""

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
    """``fn`` compiled from ``CPU_MIN_NUMEL[op]`` elements on CPU (always elsewhere), eager below;
    compiled at the first call that needs it."""

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
    """Whether inductor can build kernels here (CPU: a C++ compiler; CUDA: Triton). Compiles
    nothing, so a broken toolchain surfaces at the first call."""
    if not torch._dynamo.is_dynamo_supported():
        return False
    if device_type == "cuda":
        return triton_available("cuda")
    if device_type == "cpu":
        return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)
    return False
