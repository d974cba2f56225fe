"""Tiny helpers shared by the benches: timing and a ratio table printed to stdout."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    """Best wall time of ``repeat`` runs (the least disturbed by other load)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def print_table(title: str, rows: list[tuple[str, str, str, str]]) -> None:
    """rows: (metric, tokenloom, baseline, ratio) as strings."""
    header = ("metric", "tokenloom", "baseline", "ratio")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    print(f"\n{title}")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
