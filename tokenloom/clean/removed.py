"""``PREFIX.removed.jsonl``: every document a run removed, one JSON object a line, in input order.

    {"input": PATH, "record": N, "reason": "exact" | "minhash" | FILTER, "kept": {"input": PATH, "record": M}}

``record`` is 1-based as errors name it (a line counting blanks, or a row). ``kept``, for a
duplicate only, is the first of its cluster in input order. A run without removals writes an
empty file, so absence never means "nothing removed"; written atomically.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable
from pathlib import Path

from tokenloom.clean.buckets import Removal
from tokenloom.fsio import atomic_writer

SUFFIX = ".removed.jsonl"


def removed_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}{SUFFIX}")


def write(path: str | os.PathLike, removals: Iterable[Removal], inputs: list[list[str]]) -> dict[str, int]:
    """Write the list (``inputs[log][input]``: each log's input paths) atomically; return counts per reason."""
    counts: collections.Counter = collections.Counter()
    with atomic_writer(path, "w", encoding="utf-8") as f:
        for r in removals:
            entry: dict = {"input": inputs[r.log][r.input], "record": r.record, "reason": r.reason}
            if r.kept is not None:
                entry["kept"] = {"input": inputs[r.kept[0]][r.kept[1]], "record": r.kept[2]}
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
            counts[r.reason] += 1
    return dict(sorted(counts.items()))
