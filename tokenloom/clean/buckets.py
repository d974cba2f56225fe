"""A run's cleaning side files, and the dedup decision made from them on disk.

A :class:`CleanLog` is written in input order by the process writing the tokens; its folder
(``PREFIX.partial/clean/`` while running, ``PREFIX.clean/`` beside a shard) holds little-endian
``uint64`` files: ``docs.u64`` (``(input, record)`` per kept document, in output order),
``filtered.u64`` (``(input, record, reason)`` per filter removal), ``run-NNNNN.u64`` (runs of
``(key0, key1, doc)`` per band key, each sorted by key then document, cut every ``RUN_RECORDS``
and at each checkpoint), and ``meta.json`` once complete. :meth:`CleanLog.checkpoint` returns the
counts a resume truncates back to.

:func:`decide` merges all logs' runs from disk a block per run at a time (no key group straddles
two rounds), joins equal keys by union-find rooted at the smaller document, and keeps each
cluster's first document in input order. Memory: ``MERGE_RECORDS`` records and 8 bytes per
document; the Python union-find runs once per distinct duplicate pair.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenloom.errors import TokenloomError
from tokenloom.fsio import atomic_writer, naming

META_FORMAT = "tokenloom.clean-log/1"
RECORD = np.dtype([("k0", "<u8"), ("k1", "<u8"), ("doc", "<u8")])
RUN_RECORDS = 1 << 17  # keys buffered before a run is written: 3 MiB (sorting it takes a few copies)
MERGE_RECORDS = 1 << 17  # records held by the merge at once, over all runs
MIN_BLOCK = 1 << 10  # records read from a run at a time, at least
BLOCK_DOCS = 1 << 12  # documents per block when listing removed documents (a Python object per removal)
UNION_SLICE = 1 << 12  # duplicate pairs turned into Python ints at a time
_RECORD_SHIFT = 40  # (input << 40) | record orders removals; records below 2^40, inputs below 2^24


class CleanLog:
    """Append-only side files of one run (see the module); ``resume`` is a :meth:`checkpoint`."""

    def __init__(self, directory: Path, reasons: list[str], resume: dict | None = None):
        self.dir = Path(directory)
        self.reasons = list(reasons)
        self.dir.mkdir(parents=True, exist_ok=True)
        state = resume or {"docs": 0, "filtered": 0, "runs": 0}
        self.docs, self.filtered, self.runs = int(state["docs"]), int(state["filtered"]), int(state["runs"])
        for path in self.dir.glob("run-*.u64"):
            if int(path.stem.split("-")[1]) >= self.runs:
                path.unlink()
        self._docs = self._open("docs.u64", 16 * self.docs, resume is not None)
        self._filtered = self._open("filtered.u64", 24 * self.filtered, resume is not None)
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self.removed_by_filter = np.zeros(len(self.reasons), np.int64)
        if resume is not None:
            self.removed_by_filter[:] = state.get("removed_by_filter", [0] * len(self.reasons))

    def _open(self, name: str, size: int, resume: bool):
        path = self.dir / name
        if not resume:
            return open(path, "wb")
        f = open(path, "r+b")
        if os.fstat(f.fileno()).st_size < size:
            f.close()
            raise TokenloomError(f"{path}: shorter than its checkpoint ({size} bytes); cannot resume")
        f.truncate(size)
        f.seek(size)
        return f

    def add(self, input_index: int, numbers: np.ndarray, removed: np.ndarray, keys: np.ndarray,
            has_keys: np.ndarray) -> None:
        """One chunk's :class:`~tokenloom.clean.stage.CleanResult` fields."""
        n = len(numbers)
        with naming(self.dir / "docs.u64"):
            pairs = np.empty((n, 2), "<u8")
            pairs[:, 0], pairs[:, 1] = input_index, numbers
            self._docs.write(pairs.tobytes())
        if len(removed):
            rows = np.empty((len(removed), 3), "<u8")
            rows[:, 0], rows[:, 1:] = input_index, removed
            with naming(self.dir / "filtered.u64"):
                self._filtered.write(rows.tobytes())
            np.add.at(self.removed_by_filter, removed[:, 1].astype(np.int64), 1)
            self.filtered += len(removed)
        if has_keys.any():
            docs = np.flatnonzero(has_keys) + self.docs
            k = keys[has_keys]
            records = np.empty(k.shape[:2], RECORD)
            records["k0"], records["k1"] = k[:, :, 0], k[:, :, 1]
            records["doc"] = docs[:, None]
            self._buffer.append(records.reshape(-1))
            self._buffered += records.size
            if self._buffered >= RUN_RECORDS:
                self._write_run()
        self.docs += n

    def _write_run(self) -> None:
        if not self._buffered:
            return
        records = np.concatenate(self._buffer)
        records = records[np.lexsort((records["doc"], records["k1"], records["k0"]))]
        path = self.dir / f"run-{self.runs:05d}.u64"
        with naming(path), open(path, "wb") as f:
            f.write(records.tobytes())
            f.flush()
            os.fsync(f.fileno())
        self.runs += 1
        self._buffer, self._buffered = [], 0

    def checkpoint(self) -> dict:
        """Write the buffered keys as a run, make every file durable, return the resume state."""
        self._write_run()
        for f, name in ((self._docs, "docs.u64"), (self._filtered, "filtered.u64")):
            with naming(self.dir / name):
                f.flush()
                os.fsync(f.fileno())
        return {"docs": self.docs, "filtered": self.filtered, "runs": self.runs,
                "removed_by_filter": self.removed_by_filter.tolist()}

    def finish(self, meta: dict) -> dict:
        """Complete the log: checkpoint, close, write ``meta.json`` (``meta`` plus the counts)."""
        state = self.checkpoint()
        self.close()
        full = {"format": META_FORMAT, **meta, **state, "reasons": self.reasons}
        with atomic_writer(self.dir / "meta.json", "w", encoding="utf-8") as f:
            json.dump(full, f)
        return full

    def close(self) -> None:
        for f in (self._docs, self._filtered):
            if not f.closed:
                try:
                    f.close()
                except OSError:
                    pass


def read_meta(directory: Path) -> dict:
    """A complete log's ``meta.json`` (one-line error when it is missing or foreign)."""
    path = Path(directory) / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenloomError(f"{path}: the dedup side files of this output are missing or unreadable ({exc}); "
                             "rerun the preprocess that made it") from None
    if meta.get("format") != META_FORMAT:
        raise TokenloomError(f"{path}: unknown format {meta.get('format')!r} (expected {META_FORMAT})")
    return meta


def run_files_bytes(documents: float, bands: int) -> int:
    """The run files' size for ``documents`` documents with keys (the plan's estimate)."""
    return int(documents * bands * RECORD.itemsize)


# --------------------------------------------------------------------------- the decision


class _RunReader:
    def __init__(self, path: Path, offset: int, block: int):
        self.f = open(path, "rb")
        self.left = os.fstat(self.f.fileno()).st_size // RECORD.itemsize
        self.offset, self.block = np.uint64(offset), block
        self.buf = np.empty(0, RECORD)

    def fill(self, extend: bool = False) -> None:
        """Read the next block when the buffer is empty (``extend``: append it to the buffer)."""
        if (extend or not len(self.buf)) and self.left:
            n = min(self.block, self.left)
            block = np.fromfile(self.f, RECORD, n)
            if len(block) != n:
                raise TokenloomError(f"{self.f.name}: shorter than it was written; rerun the preprocess")
            block["doc"] += self.offset
            self.buf = np.concatenate([self.buf, block]) if len(self.buf) else block
            self.left -= n

    def last(self) -> tuple[int, int]:
        return int(self.buf["k0"][-1]), int(self.buf["k1"][-1])

    def take(self, bound: tuple[int, int] | None) -> np.ndarray:
        """The buffered records whose key is below ``bound`` (None: all of them)."""
        if bound is None:
            out, self.buf = self.buf, np.empty(0, RECORD)
            return out
        k0 = self.buf["k0"]
        lo, hi = np.searchsorted(k0, bound[0], "left"), np.searchsorted(k0, bound[0], "right")
        n = int(lo + np.searchsorted(self.buf["k1"][lo:hi], bound[1], "left"))
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


def _merged(runs: list[tuple[Path, int]]) -> Iterator[np.ndarray]:
    """Blocks of all runs' records in (key, doc) order, no key split across two blocks: a round takes
    every record below the smallest last buffered key of unfinished runs (else those runs read one
    more block), so memory grows with the largest equal-key group."""
    block = max(MIN_BLOCK, MERGE_RECORDS // max(len(runs), 1))
    readers = [_RunReader(path, offset, block) for path, offset in runs]
    try:
        while True:
            for r in readers:
                r.fill()
            live = [r for r in readers if len(r.buf)]
            if not live:
                return
            more = [r for r in live if r.left]
            bound = min((r.last() for r in more), default=None)
            parts = [r.take(bound) for r in live]
            records = np.concatenate(parts)
            if not len(records):
                for r in more:
                    if r.last() == bound:
                        r.fill(extend=True)
                continue
            yield records[np.lexsort((records["doc"], records["k1"], records["k0"]))]
    finally:
        for r in readers:
            r.f.close()


def _find(parent: np.ndarray, x: int) -> int:
    root = x
    while parent[root] != root:
        root = int(parent[root])
    while parent[x] != root:
        parent[x], x = root, int(parent[x])
    return root


@dataclass
class Decision:
    """Per document of the logs in order, its cluster's first document (itself: kept)."""

    roots: np.ndarray
    offsets: np.ndarray  # first document of each log, and the total last
    metas: list[dict]

    def kept(self, log: int) -> np.ndarray:
        """The keep mask of log ``log``'s documents."""
        a, b = int(self.offsets[log]), int(self.offsets[log + 1])
        return self.roots[a:b] == np.arange(a, b)

    @property
    def duplicates(self) -> int:
        return int((self.roots != np.arange(len(self.roots))).sum())


def decide(directories: list[Path]) -> Decision:
    """Cluster the documents of complete logs in order (see the module)."""
    metas = [read_meta(d) for d in directories]
    offsets = np.zeros(len(metas) + 1, np.int64)
    np.cumsum([m["docs"] for m in metas], out=offsets[1:])
    parent = np.arange(int(offsets[-1]), dtype=np.int64)
    runs = [(Path(d) / f"run-{k:05d}.u64", int(offsets[i])) for i, (d, m) in enumerate(zip(directories, metas, strict=True))
            for k in range(m["runs"])]
    for records in _merged(runs):
        if len(records) < 2:
            continue
        k0, k1, doc = records["k0"], records["k1"], records["doc"].astype(np.int64)
        new = np.r_[True, (k0[1:] != k0[:-1]) | (k1[1:] != k1[:-1])]
        if new.all():
            continue
        first = np.maximum.accumulate(np.where(new, np.arange(len(new)), 0))
        a, b = doc[first][~new], doc[~new]
        pairs = np.unique(np.stack([a, b], axis=1), axis=0)
        for at in range(0, len(pairs), UNION_SLICE):
            for x, y in pairs[at:at + UNION_SLICE].tolist():
                rx, ry = _find(parent, x), _find(parent, y)
                if rx != ry:
                    parent[max(rx, ry)] = min(rx, ry)
    while True:  # every parent is a smaller document: pointer jumping reaches the roots
        up = parent[parent]
        if np.array_equal(up, parent):
            break
        parent = up
    return Decision(parent, offsets, metas)


@dataclass(frozen=True)
class Removal:
    """One removed record: ``(log, input, record)``, why, and for a duplicate the kept one's ``(log, input, record)``."""

    log: int
    input: int
    record: int
    reason: str
    kept: tuple[int, int, int] | None = None


def removals(directories: list[Path], decision: Decision, method: str) -> Iterator[Removal]:
    """Every removed record of the logs, in input order (filter removals and duplicates interleaved)."""
    docs = [np.memmap(Path(d) / "docs.u64", "<u8", "r", shape=(m["docs"], 2)) if m["docs"] else
            np.empty((0, 2), "<u8") for d, m in zip(directories, decision.metas, strict=True)]

    def where(doc: int) -> tuple[int, int, int]:
        log = int(np.searchsorted(decision.offsets, doc, "right") - 1)
        row = docs[log][doc - int(decision.offsets[log])]
        return log, int(row[0]), int(row[1])

    for log, (d, meta) in enumerate(zip(directories, decision.metas, strict=True)):
        reasons, n = meta["reasons"], meta["docs"]
        nf = int(meta["filtered"])
        filtered = np.memmap(Path(d) / "filtered.u64", "<u8", "r", shape=(nf, 3)) if nf else np.empty((0, 3), "<u8")

        def fkey(lo: int, hi: int, filtered=filtered) -> np.ndarray:
            rows = filtered[lo:hi]
            return (rows[:, 0] << np.uint64(_RECORD_SHIFT)) | rows[:, 1]

        at = 0
        for start in range(0, max(n, 1), BLOCK_DOCS):
            stop = min(start + BLOCK_DOCS, n)
            rows = docs[log][start:stop]
            bound = (int(docs[log][stop][0]) << _RECORD_SHIFT | int(docs[log][stop][1])) if stop < n else None
            upto = at  # the filter removals before the next block's first document
            while upto < nf:
                keys = fkey(upto, min(upto + BLOCK_DOCS, nf))
                below = len(keys) if bound is None else int(np.searchsorted(keys, np.uint64(bound), "left"))
                upto += below
                if below < len(keys):
                    break
            fkeys = fkey(at, upto)
            roots = decision.roots[start + decision.offsets[log]: stop + decision.offsets[log]]
            ids = np.arange(start, stop) + decision.offsets[log]
            dup = np.flatnonzero(roots != ids)
            events = [(int(fkeys[j - at]), 0, j) for j in range(at, upto)]
            events += [(int(rows[j][0]) << _RECORD_SHIFT | int(rows[j][1]), 1, j) for j in dup.tolist()]
            events.sort()
            for _, kind, j in events:
                if kind == 0:
                    f = filtered[j]
                    yield Removal(log, int(f[0]), int(f[1]), reasons[int(f[2])])
                else:
                    yield Removal(log, int(rows[j][0]), int(rows[j][1]), method, where(int(roots[j])))
            at = upto
