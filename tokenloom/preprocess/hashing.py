"""The inputs' BLAKE3 digests for the manifest, computed by a child process while the run goes on.

The child is started before the tokenizer loads: start-up (imports, the tokenizer, forking
the workers) runs on one core, so the child hashes on cores that would otherwise sit idle, and
never takes CPU from the workers while they tokenize.

BLAKE3, not sha256: faster per core (bench/RESULTS.md's notes), and a tree hash, so one large
file is hashed by several threads (:data:`THREADS`) where sha256 reads it start to end on one
core and, with many workers on one huge file, would be the slowest stage. The digest is ``b3sum``'s for a file;
a datasets directory's is the BLAKE3 of its (relative name, file digest) pairs in name order;
an object's is streamed from the store. The index caches of ``build`` use BLAKE3 too.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3

from tokenloom import objstore
from tokenloom.errors import TokenloomError
from tokenloom.fsio import hash_file
from tokenloom.preprocess.pool import fork_or_spawn
from tokenloom.preprocess.worker import die_with_parent

FILES_AT_ONCE = 4
"""Input files hashed at once by the child."""
THREADS = max(1, (os.cpu_count() or 1) // 8)
"""Threads hashing one file (an eighth of the cores: on 2 cores one, beside the start-up's core)."""


def digest(path: str) -> str:
    """The BLAKE3 (hex) that the manifest records for one input."""
    if objstore.is_url(path):
        h = blake3.blake3()
        with objstore.reading(path), objstore.open_input(path) as f:
            for block in iter(lambda: f.read(objstore.READ_BLOCK), b""):
                h.update(block)
        return h.hexdigest()
    root = Path(path)
    if not root.is_dir():
        return _file_digest(root)
    h = blake3.blake3()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + bytes.fromhex(_file_digest(p)))
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    # 16 MB blocks: large enough for several threads per update
    return hash_file(blake3.blake3(max_threads=THREADS), path, block=16 << 20).hexdigest()


def _hash_all(paths: list[str], conn, parent_pid: int) -> None:
    """Child process: send ``{path: blake3}``, or the error that stopped it."""
    die_with_parent(parent_pid)
    try:
        with ThreadPoolExecutor(min(FILES_AT_ONCE, max(1, len(paths)))) as pool:
            result: dict | BaseException = dict(zip(paths, pool.map(digest, paths), strict=True))
    except (OSError, TokenloomError) as exc:
        result = exc
    conn.send(result)
    conn.close()


class InputHasher:
    """Hashes ``paths`` in a child process from construction on; :meth:`result` waits for it."""

    def __init__(self, paths: list[str]):
        context = fork_or_spawn()
        self._conn, child_end = context.Pipe(duplex=False)
        self._process = context.Process(target=_hash_all, args=(list(paths), child_end, os.getpid()),
                                        name="tokenloom-hasher", daemon=True)
        self._process.start()
        child_end.close()  # so that a child that dies leaves EOF here, not a wait forever

    def result(self) -> dict[str, str]:
        """``{path: blake3}``; raises what stopped the child (an ``OSError`` or a ``TokenloomError``)."""
        try:
            result = self._conn.recv()
        except EOFError:
            raise TokenloomError(f"the input hasher process died (exit code {self._wait()})") from None
        self._wait()
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        """Stop the child if it still runs (a run that ended early or failed)."""
        if self._process.is_alive():
            self._process.kill()
        self._wait()
        self._conn.close()

    def _wait(self) -> int | None:
        self._process.join()
        return self._process.exitcode
