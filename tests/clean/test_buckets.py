"""The dedup decision from run files on disk equals union-find in memory, across runs, blocks and logs."""

from __future__ import annotations

import numpy as np
import pytest

from tokenloom.clean import buckets
from tokenloom.clean.buckets import CleanLog, decide, removals


def _roots_in_memory(keys: np.ndarray, has: np.ndarray) -> np.ndarray:
    """Documents sharing any band key, joined; each cluster's root is its first document."""
    n = len(keys)
    parent = list(range(n))

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    first: dict = {}
    for d in range(n):
        if not has[d]:
            continue
        for band in keys[d]:
            key = (int(band[0]), int(band[1]))
            if key in first:
                a, b = find(first[key]), find(d)
                parent[max(a, b)] = min(a, b)
            else:
                first[key] = d
    return np.array([find(d) for d in range(n)])


def _random_keys(rng, n, bands):
    """Band keys drawn from a small pool, so that many documents share some band (chains of clusters)."""
    pool = rng.integers(0, 2**63, size=(n // 2, 2), dtype=np.uint64)
    pool[:, 0] &= np.uint64(0xFF)  # equal first words: the merge's bound must compare the second word too
    keys = pool[rng.integers(0, len(pool), size=(n, bands))]
    keys[rng.random((n, bands)) < 0.6] = rng.integers(0, 2**63, size=2, dtype=np.uint64)  # unique noise
    return keys, rng.random(n) < 0.9


@pytest.mark.parametrize("logs", [1, 3])
def test_decision_from_disk_equals_union_find_in_memory(tmp_path, monkeypatch, logs):
    monkeypatch.setattr(buckets, "RUN_RECORDS", 50)  # many runs
    monkeypatch.setattr(buckets, "MERGE_RECORDS", 200)  # blocks smaller than a run: key groups straddle them
    monkeypatch.setattr(buckets, "MIN_BLOCK", 4)
    rng = np.random.default_rng(logs)
    n, bands = 600, 3
    keys, has = _random_keys(rng, n, bands)
    keys[:, 1][has.nonzero()[0][:5]] = keys[:, 1][has.nonzero()[0][0]]  # one large cluster
    dirs, cut = [], np.linspace(0, n, logs + 1).astype(int)
    for k in range(logs):
        log = CleanLog(tmp_path / f"log{k}", ["short"])
        for start in range(cut[k], cut[k + 1], 37):  # chunks
            stop = min(start + 37, cut[k + 1])
            numbers = np.arange(start, stop) * 2 + 1  # every other line is a record a filter removed
            log.add(0, numbers, np.stack([numbers + 1, np.zeros_like(numbers)], 1), keys[start:stop], has[start:stop])
        log.finish({"dedup": "minhash"})
        dirs.append(tmp_path / f"log{k}")
    decision = decide(dirs)
    expected = _roots_in_memory(keys, has)
    assert np.array_equal(decision.roots, expected)
    assert decision.duplicates == int((expected != np.arange(n)).sum()) > 50
    listed = list(removals(dirs, decision, "minhash"))
    assert [(r.log, r.record) for r in listed] == sorted((r.log, r.record) for r in listed)  # input order
    dups = [r for r in listed if r.reason == "minhash"]
    assert len(dups) == decision.duplicates and len(listed) - len(dups) == n  # and one filtered record per document
    for r in dups:
        doc = cut[r.log] + (r.record - 1 - 2 * cut[r.log]) // 2
        root = expected[doc]
        log_of_root = int(np.searchsorted(cut, root, "right") - 1)
        assert r.kept == (log_of_root, 0, 2 * root + 1)


def test_a_resumed_log_decides_as_an_uninterrupted_one(tmp_path, monkeypatch):
    monkeypatch.setattr(buckets, "RUN_RECORDS", 40)
    rng = np.random.default_rng(5)
    keys, has = _random_keys(rng, 300, 2)
    numbers = np.arange(1, 301)
    straight = CleanLog(tmp_path / "straight", [])
    straight.add(0, numbers, np.empty((0, 2), np.int64), keys, has)
    straight.finish({})
    log = CleanLog(tmp_path / "resumed", [])
    log.add(0, numbers[:120], np.empty((0, 2), np.int64), keys[:120], has[:120])
    state = log.checkpoint()
    log.add(0, numbers[120:200], np.empty((0, 2), np.int64), keys[120:200], has[120:200])  # lost in a crash
    log.checkpoint()
    log.close()
    log = CleanLog(tmp_path / "resumed", [], resume=state)
    log.add(0, numbers[120:], np.empty((0, 2), np.int64), keys[120:], has[120:])
    log.finish({})
    a, b = decide([tmp_path / "straight"]), decide([tmp_path / "resumed"])
    assert np.array_equal(a.roots, b.roots) and a.duplicates > 0
    assert (tmp_path / "resumed" / "docs.u64").read_bytes() == (tmp_path / "straight" / "docs.u64").read_bytes()
