"""glibc malloc tuning for CPU training: freed activation memory is kept for the next step.

PyTorch's CPU tensors come from plain ``malloc``. glibc serves blocks above its mmap
threshold (dynamic, 128 KiB up to 32 MiB) with a fresh ``mmap`` and gives them back
with ``munmap`` on free, and it trims the top of the heap once more than the trim
threshold is free. A training step frees and re-allocates the same activations and
gradients every step, so every step faults all of them in again and the kernel zeroes
each page: tens of thousands of minor page faults per step for a small GPT, whose steps
are measurably faster once they are gone (``bench/train_bench.py``, whose malloc-default
rows compare; see bench/RESULTS.md). :func:`keep_freed_memory` raises both
thresholds with ``mallopt``, so freed blocks stay in the heap and the next step reuses
them: after the first step the faults drop to about zero.

Trade-off: the process keeps its peak heap instead of handing memory back to the OS
between steps (the next step needs it again anyway), and memory freed after, say, an
evaluation pass is kept as well; reuse also fragments a little (a slightly higher peak
RSS). Blocks of 1 GiB and more are still mmapped. PyTorch's
own CPU launcher (``python -m torch.backends.xeon.run_cpu``) gets the same effect by
preloading jemalloc or tcmalloc; this needs no extra library and no relaunch. Only
glibc is tuned: under another allocator (musl, or jemalloc/tcmalloc in ``LD_PRELOAD``)
nothing is changed. The setting is process-wide and stays for the rest of the process.
Fully sharded runs take the opposite setting (:func:`release_large_blocks`).
"""

from __future__ import annotations

import ctypes
import functools
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
"""Blocks at least this large are still mmapped (and unmapped on free)."""
TRIM_THRESHOLD = (1 << 31) - 1
"""Free heap top kept before glibc trims it (``mallopt`` takes a C int)."""
_FALLBACK_MMAP_THRESHOLD = 32 << 20  # glibc's own upper bound for its dynamic threshold


def _mallopt():
    """glibc's ``mallopt`` (argument and result types set), or None when the C library is not
    glibc or an allocator is preloaded over it."""
    preload = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preload or "tcmalloc" in preload or "mimalloc" in preload:
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError when the C library is not glibc
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no C library handle (Windows) or not glibc
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


@functools.cache
def keep_freed_memory() -> bool:
    """Tune glibc malloc as the module docstring says, once per process. True when applied;
    False when the allocator is not glibc's or refuses the setting."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and not mallopt(_M_MMAP_THRESHOLD, _FALLBACK_MMAP_THRESHOLD):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


RELEASE_MMAP_THRESHOLD = 1 << 20
"""Under :func:`release_large_blocks`, blocks at least this large are mmapped and unmapped on free."""


@functools.cache
def release_large_blocks() -> bool:
    """The opposite tuning, for fully sharded training (``fsdp``) on the CPU, once per process: a
    fixed mmap threshold of :data:`RELEASE_MMAP_THRESHOLD` (glibc's dynamic threshold, which
    climbs to 32 MiB after the first frees, is switched off) and the same trim threshold, so
    every large block is mapped when allocated and unmapped when freed. FSDP gathers each
    block's parameters and frees them again while activations that live until the backward are
    allocated in between; a heap that keeps freed blocks fragments under that pattern and grows
    by most of each gather, so the resident memory would no longer follow the sharded state.
    The cost is the page faults of those blocks in every step (the ones
    :func:`keep_freed_memory` saves). True when applied; False when the allocator is not
    glibc's or refuses the setting."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, RELEASE_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, RELEASE_MMAP_THRESHOLD))
