"""Content-addressed, concurrency-safe cache of index arrays (``--cache-dir``).

Layout::

    CACHE_DIR/<key>/<name>.npy     one array per file, plain .npy (np.load(allow_pickle=False))
    CACHE_DIR/<key>/meta.json      each array's size and BLAKE3 (written last)
    CACHE_DIR/<key>/description.json   what the key was hashed from, for people
    CACHE_DIR/<key>.lock           flock taken by the one process that builds the entry
    CACHE_DIR/<key>.tmp-<host>-<pid>-<random>/   an entry being written (or left by a killed builder)

``key`` is the SHA-256 of a canonical JSON description of everything that changes
the arrays: the config *and* a digest of every source's ``.idx`` bytes and
manifest. Re-tokenizing into the same prefix therefore changes the key, where
Megatron (keyed by path) silently reuses stale indices.

Safety: an entry is written into a temporary directory, every file fsynced, and
the directory renamed into place, so it appears whole or not at all (a killed
builder leaves only a ``<key>.tmp-*`` directory, which the next process that opens the
cache removes once its owner is dead). Local builders serialise on an exclusive
``flock`` and re-check after taking it, so N processes started together do one build
and N loads. A hit maps large files (``mmap_mode="r"``) and reads small ones; an entry
whose files no longer match the sizes and checksums recorded at publish time (a
truncated ``.npy``, a lost file) is rebuilt with a warning instead of crashing the run.

Distributed runs do not trust ``flock`` (unreliable on some shared filesystems):
:func:`elect_builders` finds out which ranks share a filesystem by having each rank
drop a nonce file and look for the others' (detected, not configured); the
lowest rank of each filesystem builds while the rest poll the cache directory for
its hand-over file (:class:`SharedBuild`), with progress and a timeout of their own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import blake3
import numpy as np
from numpy.lib import format as npy

from tokenloom.errors import TokenloomError
from tokenloom.fsio import fsync_dir, os_error_message, pid_alive

Arrays = dict[str, np.ndarray]


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def content_key(description: dict) -> str:
    return hashlib.sha256(canonical_json(description).encode()).hexdigest()


class DamagedEntry(Exception):
    """A finished entry whose files disagree with the sizes or checksums recorded at publish time."""


def write_error(exc: OSError, path: str | os.PathLike) -> str:
    """One line for an operating-system failure writing ``path`` of the cache, and what to do."""
    return f"{os_error_message(OSError(exc.errno, exc.strerror), path)}; then rerun the same command " \
           "(cache entries already built are kept)"


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


class _HashingWriter:
    """A write-only file wrapper that counts and BLAKE3-hashes what passes through it."""

    def __init__(self, f):
        self.f, self.hash, self.size = f, blake3.blake3(), 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.hash.update(view)
        self.size += view.nbytes
        return self.f.write(view)


def _save_parts(f, parts: list[np.ndarray]) -> None:
    """One ``.npy`` holding ``np.concatenate(parts)`` (as ``np.save`` would write it), streamed."""
    first = parts[0]
    shape = (sum(len(p) for p in parts), *first.shape[1:])
    npy.write_array_header_1_0(f, {"descr": npy.dtype_to_descr(first.dtype), "fortran_order": False, "shape": shape})
    for part in parts:
        assert part.dtype == first.dtype and part.shape[1:] == first.shape[1:], (part.dtype, first.dtype)
        if part.size:
            f.write(np.ascontiguousarray(part).reshape(-1).view(np.uint8).data)


class ArrayCache:
    """Entries of named numpy arrays under ``cache_dir``, keyed by content.

    Reading policy: arrays up to ``map_threshold`` bytes are read into memory and their
    BLAKE3 checked against the one recorded at publish time (free at that size); larger
    ones are memory-mapped and checked by size and ``.npy`` header only, since hashing a
    multi-GB index on every start would cost seconds. Reading small arrays instead of
    mapping them keeps the process's descriptors and mappings bounded however many
    entries a blend of thousands of sources loads (each mapping holds a descriptor in
    Python < 3.13, and the kernel caps mappings at ``vm.max_map_count``).
    """

    map_threshold = 1 << 20

    def __init__(self, cache_dir: str | os.PathLike):
        self.dir = Path(cache_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TokenloomError(f"--cache-dir {self.dir}: cannot create ({exc.strerror})") from None
        self.sweep()

    def entry(self, key: str) -> Path:
        return self.dir / key

    def temp_dir(self, key: str) -> Path:
        """``<key>.tmp-<host>-<pid>-<random>``: the name says who owns it (see :meth:`sweep`)."""
        return self.dir / f"{key}.tmp-{_host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def sweep(self, key: str = "*") -> int:
        """Remove ``<key>.tmp-*`` folders whose builder is dead (same host, pid gone); the number removed.

        Folders of builders on other hosts are left alone: their liveness cannot be seen
        from here, and the next build on their host removes them.
        """
        removed, host = 0, _host_tag()
        for tmp in self.dir.glob(f"{key}.tmp-*"):
            parts = tmp.name.rsplit(".tmp-", 1)[1].split("-")
            if len(parts) != 3 or parts[0] != host or not parts[1].isdigit() or pid_alive(int(parts[1])):
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            removed += 1
        return removed

    def _read_meta(self, key: str) -> dict | None:
        meta_path = self.entry(key) / "meta.json"
        try:
            text = meta_path.read_text()
        except FileNotFoundError:
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise DamagedEntry("meta.json is not valid JSON") from None

    def load(self, key: str) -> Arrays | None:
        """The entry's arrays, or None if absent or incomplete; raises :class:`DamagedEntry`."""
        meta = self._read_meta(key)
        if meta is None:
            return None
        entry = self.entry(key)
        recorded = meta["arrays"]
        if isinstance(recorded, list):  # an entry published before sizes were recorded
            recorded = {name: None for name in recorded}
        out = {}
        for name, record in recorded.items():
            path = entry / f"{name}.npy"
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise DamagedEntry(f"{name}.npy is missing") from None
            if record is not None and size != record["bytes"]:
                raise DamagedEntry(f"{name}.npy has {size} bytes, {record['bytes']} when published")
            try:
                if record is not None and size <= self.map_threshold:
                    data = path.read_bytes()
                    if blake3.blake3(data).hexdigest() != record["blake3"]:
                        raise DamagedEntry(f"{name}.npy does not match its checksum")
                    out[name] = np.load(io.BytesIO(data), allow_pickle=False)
                else:
                    # Plain ndarray views of the mappings (np.asarray drops the memmap subclass, whose
                    # per-access overhead dominates reading single samples); the maps stay alive as .base.
                    out[name] = np.asarray(np.load(path, mmap_mode="r", allow_pickle=False))
            except ValueError as exc:  # a header or length that does not parse
                raise DamagedEntry(f"{name}.npy: {exc}") from None
        return out

    def description(self, key: str) -> dict | None:
        """What the key was hashed from (kept beside the arrays for people; loads never read it)."""
        try:
            return json.loads((self.entry(key) / "description.json").read_text())
        except FileNotFoundError:
            return None

    def store(self, key: str, arrays: Mapping[str, np.ndarray | list[np.ndarray]], description: dict | None = None
              ) -> None:
        """Publish an entry whole: files go to a temporary directory beside it, each is fsynced,
        then the directory is fsynced and renamed into place, and the cache directory fsynced.

        A list of arrays (same dtype and trailing shape) is stored as their concatenation,
        written part by part without building it in memory.
        meta.json records every file's size and BLAKE3 (hashed from the bytes written,
        so a later truncation or overwrite is detected on load). One rename publishes
        every array, so an entry costs one fsync per file plus two directory fsyncs, and
        readers never see an entry with some arrays missing. Callers hold :meth:`lock`.

        An operating-system failure (disk full, I/O or permission error) removes the
        temporary folder and raises a one-line :class:`TokenloomError` naming the entry.
        """
        entry = self.entry(key)
        tmp = self.temp_dir(key)
        try:
            self._write_entry(entry, tmp, arrays, description)
        except OSError as exc:  # named after the entry: the temporary folder is gone
            raise TokenloomError(write_error(exc, entry)) from None

    def _write_entry(self, entry: Path, tmp: Path, arrays: Mapping, description: dict | None) -> None:
        tmp.mkdir(parents=True)
        try:
            records = {}
            for name, arr in arrays.items():
                with open(tmp / f"{name}.npy", "wb") as f:
                    hashing = _HashingWriter(f)
                    _save_parts(hashing, arr if isinstance(arr, list) else [arr])
                    f.flush()
                    os.fsync(f.fileno())
                records[name] = {"bytes": hashing.size, "blake3": hashing.hash.hexdigest()}
            for name, doc in (("description.json", description), ("meta.json", {"arrays": records})):
                with open(tmp / name, "w") as f:
                    f.write(canonical_json(doc))
                    f.flush()
                    os.fsync(f.fileno())
            fsync_dir(tmp / "meta.json")
            if entry.exists():  # an incomplete or damaged entry
                self._discard(entry)
            os.rename(tmp, entry)
            fsync_dir(entry)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _discard(self, entry: Path) -> None:
        """Move a bad entry out of the way in one rename (readers never see it half-deleted), then delete it."""
        doomed = self.temp_dir(entry.name)
        os.rename(entry, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    @contextlib.contextmanager
    def lock(self, key: str):
        path = self.dir / f"{key}.lock"
        try:
            handle = open(path, "a+")
        except OSError as exc:
            raise TokenloomError(write_error(exc, path)) from None
        with handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def get_or_build(
        self, key: str, build: Callable[[], Arrays], description: dict | None = None, may_build: bool = True
    ) -> tuple[Arrays, bool]:
        """(arrays, built_here). Exactly one local process builds a missing entry; the rest wait and load.

        A damaged entry (sizes or checksums that differ from those recorded at publish
        time) is rebuilt under the lock, with a warning on stderr.
        """
        try:
            found = self.load(key)
        except DamagedEntry as exc:
            if not may_build:
                raise TokenloomError(f"cache entry {self.entry(key)} is damaged ({exc}) and this rank may not "
                                     "rebuild it; rerun `build` with this --cache-dir") from None
            found = None
        if found is not None:
            return found, False
        if not may_build:
            raise TokenloomError(f"cache entry {self.entry(key)} is missing and this rank may not build it")
        with self.lock(key):
            found = None
            try:
                found = self.load(key)
            except DamagedEntry as exc:
                print(f"warning: cache entry {self.entry(key)} is damaged ({exc}); rebuilding it", file=sys.stderr)
                try:
                    self._discard(self.entry(key))
                except OSError as err:
                    raise TokenloomError(write_error(err, self.entry(key))) from None
            if found is not None:
                return found, False
            self.store(key, build(), description)
        stored = self.load(key)
        if stored is None:  # just published under the lock: only a concurrent rm gets here
            raise TokenloomError(f"{self.entry(key)}: cache entry vanished after it was stored; rerun")
        return stored, True


# --------------------------------------------------------------------------- distributed


def elect_builders(
    cache_dir: str | os.PathLike, rank: int, world_size: int, barrier: Callable[[], None], run_id: str
) -> int:
    """The lowest rank that shares this rank's cache filesystem (this rank builds iff it is the answer).

    Every rank writes ``.nonce-<run_id>-<rank>`` into ``cache_dir``; after a barrier
    each rank looks for the others' files. Ranks on one shared filesystem all see
    each other; ranks on node-local disks see only their node. ``run_id`` must be
    the same on every rank (e.g. broadcast from rank 0).
    """
    directory = Path(cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    mine = directory / f".nonce-{run_id}-{rank}"
    mine.write_text(str(rank))
    barrier()
    leader = min(r for r in range(world_size) if (directory / f".nonce-{run_id}-{r}").exists())
    barrier()
    mine.unlink(missing_ok=True)
    return leader


class SharedBuild:
    """One build per filesystem in a distributed run; the other ranks wait on the cache, not a collective.

    Every rank calls :meth:`run` once: the lowest rank of each filesystem (see
    :func:`elect_builders`) builds, writing its progress to
    ``CACHE_DIR/.runs/<run_id>.progress`` and, when done, ``<run_id>.done`` holding a
    JSON payload for the others (or ``<run_id>.failed`` with its error). The others
    poll those files -- printing what the builder has done every ``report_every``
    seconds -- for up to ``timeout`` seconds, then run the follower function on the
    payload. A build of hours therefore never meets the process group's collective
    timeout (30 minutes by default), and node-local cache directories work: each
    node's lowest rank builds into its own. A follower stops early if the builder died
    on this host. ``run_id`` must be equal on all ranks and unique to this run.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        barrier: Callable[[], None],
        run_id: str,
        timeout: float = 6 * 3600,
        report_every: float = 30.0,
        echo: Callable[[str], None] | None = None,
    ):
        self.rank, self.world_size, self.barrier, self.run_id = rank, world_size, barrier, run_id
        self.timeout, self.report_every = timeout, report_every
        self.echo = echo or (lambda line: print(line, flush=True))

    def run(self, cache_dir: str | os.PathLike, lead: Callable, follow: Callable):
        """``lead(progress) -> (result, payload)`` on the elected rank; ``follow(payload) -> result`` on the rest.

        ``progress(done, total)`` may be called by ``lead`` as often as it likes (written at
        most once a second); ``payload`` must be JSON-serialisable.
        """
        leader = elect_builders(cache_dir, self.rank, self.world_size, self.barrier, self.run_id)
        runs = Path(cache_dir) / ".runs"
        runs.mkdir(parents=True, exist_ok=True)
        base = runs / self.run_id
        if self.rank != leader:
            return follow(self._wait(base, leader, Path(cache_dir)))
        _forget_old_runs(runs)
        last = [0.0]

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 1.0 or done == total:
                last[0] = now
                _write_json(base.with_suffix(".progress"), {"done": done, "total": total})

        _write_json(base.with_suffix(".owner"), {"host": _host_tag(), "pid": os.getpid()})
        try:
            result, payload = lead(progress)
        except BaseException as exc:
            _write_json(base.with_suffix(".failed"), {"error": str(exc) or type(exc).__name__})
            raise
        _write_json(base.with_suffix(".done"), payload)
        return result

    def _wait(self, base: Path, leader: int, cache_dir: Path):
        start = time.monotonic()
        next_report, delay = start + self.report_every, 0.05
        while True:
            try:
                return json.loads(base.with_suffix(".done").read_text())
            except (FileNotFoundError, ValueError):
                pass
            failed = _read_json(base.with_suffix(".failed"))
            if failed is not None:
                raise TokenloomError(f"rank {leader} failed to build the index cache in {cache_dir}: {failed['error']}")
            owner = _read_json(base.with_suffix(".owner"))
            if owner and owner["host"] == _host_tag() and not pid_alive(owner["pid"]):
                raise TokenloomError(f"rank {leader} (pid {owner['pid']}) died while building the index cache in "
                                     f"{cache_dir}; rerun the job (finished entries are kept)")
            now = time.monotonic()
            if now - start > self.timeout:
                raise TokenloomError(
                    f"rank {self.rank} waited {now - start:.0f} s for rank {leader} to build the index cache in "
                    f"{cache_dir}; raise data.blend.build_timeout (now {self.timeout:g} s) or run `build` with "
                    "this --cache-dir before the job")
            if now >= next_report:
                state = _read_json(base.with_suffix(".progress")) or {}
                done = f"{state['done']}/{state['total']} blend members built" if state else "starting"
                self.echo(f"rank {self.rank}: waiting for rank {leader} to build the index cache in {cache_dir}: "
                          f"{done}, {now - start:.0f} s elapsed (timeout {self.timeout:g} s)")
                next_report = now + self.report_every
            time.sleep(delay)
            delay = min(1.0, delay * 1.5)


def _write_json(path: Path, doc) -> None:
    """Written whole (temp name, rename), so a poller sees all of it or nothing."""
    tmp = path.with_name(f"{path.name}.tmp-{_host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _forget_old_runs(runs: Path, age: float = 7 * 86400) -> None:
    """Hand-over files of runs older than a week (every follower has long read them)."""
    cutoff = time.time() - age
    for path in runs.iterdir():
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mtime < cutoff:
                path.unlink()
