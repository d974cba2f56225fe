"""Tiny helpers shared by the benches: timing and a ratio table printed to stdout.

``print_table`` also appends the table as markdown to the file named by the
``BENCH_RESULTS_MD`` environment variable when it is set (``bench/run_all.py`` uses it
to collect every table without parsing stdout). Its printed output is the same either
way; the file gets a ``### title`` heading, a blank line and the same pipe rows.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable

RESULTS_ENV = "BENCH_RESULTS_MD"


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    """Best wall time of ``repeat`` runs (the least disturbed by other load)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def best_interleaved(fns: list[Callable[[], float]], repeat: int = 3) -> list[float]:
    """Best of ``repeat`` rounds for each timed callable, the callables alternating within a round.

    Each ``fn`` times itself and returns seconds (so it can exclude its own set-up and
    clean-up). Alternating A, B, A, B, ... lets slow drift of the machine (other load, page
    cache growth, thermal state) reach both sides alike instead of whichever runs last.
    """
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], fn())
    return best


def timed(fn: Callable[..., object], *args) -> Callable[[], float]:
    """A self-timing callable for :func:`best_interleaved`: ``fn(*args)``, its wall time in seconds."""
    def run() -> float:
        start = time.perf_counter()
        fn(*args)
        return time.perf_counter() - start
    return run


def timed_in_fresh_dir(fn: Callable[[str], object], parent: str | os.PathLike,
                       before: Callable[[], object] | None = None) -> Callable[[], float]:
    """A self-timing callable for :func:`best_interleaved`: ``before()``, then ``fn(new directory
    under parent)`` timed, then the directory removed (untimed: a growing page cache would slow
    whichever side runs later)."""
    def timed() -> float:
        directory = tempfile.mkdtemp(dir=parent)
        if before is not None:
            before()
        start = time.perf_counter()
        fn(directory)
        elapsed = time.perf_counter() - start
        shutil.rmtree(directory)
        return elapsed
    return timed


def print_table(title: str, rows: list[tuple[str, str, str, str]]) -> None:
    """rows: (metric, tokenloom, baseline, ratio) as strings."""
    header = ("metric", "tokenloom", "baseline", "ratio")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in [header, tuple("-" * w for w in widths), *rows]]
    print(f"\n{title}")
    for line in lines:
        print(line)
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"### {title}\n\n" + "\n".join(lines) + "\n\n")
