"""glibc malloc tuning for CPU training: freed activation memory is kept for the next step.

glibc mmaps blocks above its (dynamic) mmap threshold and unmaps them on free, and trims the
heap top past the trim threshold; a step frees and re-allocates the same activations, so every
step faults them in again, zeroed (``bench/train_bench.py`` compares). :func:`keep_freed_memory`
raises both thresholds so the next step reuses freed blocks.

Trade-off: the process keeps its peak heap (a slightly higher peak RSS); blocks of 1 GiB and
more are still mmapped. Like torch's CPU launcher preloading jemalloc, but with no library or
relaunch. Only glibc is tuned (nothing under another allocator); the setting is process-wide.
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
    """glibc's ``mallopt``, or None when the C library is not glibc or an allocator is preloaded."""
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
    """Tune glibc malloc to keep freed blocks, once per process; True when applied."""
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
    """The opposite, for ``fsdp`` on CPU, once per process: fixed mmap and trim thresholds of
    :data:`RELEASE_MMAP_THRESHOLD`, so large blocks are unmapped on free. FSDP's gathers freed
    between long-lived activations fragment a keeping heap, which then grows by most of each
    gather; the cost is those blocks' page faults every step. True when applied."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, RELEASE_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, RELEASE_MMAP_THRESHOLD))
