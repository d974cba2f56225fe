"""The inputs' sha256 digests for the manifest, computed by a child process while the run goes on.

The child is started before the tokenizer loads. Start-up (imports, the tokenizer, forking
the workers) runs on one core, so the child hashes on a core that would otherwise sit idle:
on 2 cores it had hashed ~400 MB by the time the workers started. Before, a thread in the
main process hashed during tokenizing; that took ~0.26 s of CPU per 530 MB from the workers,
and ~0.06 s more to read the file a second time.

The digest is a plain sha256 of each file's bytes (``sha256sum`` checks it); a datasets
directory's is :func:`tokenloom.fsio.sha256_tree`; an object's is streamed from the store.
The trade-off of a plain digest is that one file is hashed sequentially, at ~2 GB/s on one
core. Files are hashed by up to :data:`THREADS` threads at once (``hashlib`` releases the
GIL), so many input files are hashed in parallel. A single file larger than the tokenizers
can read in the time is the case this cannot speed up.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from tokenloom import objstore
from tokenloom.errors import TokenloomError
from tokenloom.fsio import sha256_tree
from tokenloom.preprocess.pool import fork_or_spawn
from tokenloom.preprocess.worker import die_with_parent

THREADS = 4
"""Input files hashed at once by the child."""


def digest(path: str) -> str:
    """The sha256 that the manifest records for one input."""
    return objstore.sha256(path) if objstore.is_url(path) else sha256_tree(path)


def _hash_all(paths: list[str], conn, parent_pid: int) -> None:
    """Child process: send ``{path: sha256}``, or the error that stopped it."""
    die_with_parent(parent_pid)
    try:
        with ThreadPoolExecutor(min(THREADS, max(1, len(paths)))) as pool:
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
        """``{path: sha256}``; raises what stopped the child (an ``OSError`` or a ``TokenloomError``)."""
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
