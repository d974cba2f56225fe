"""Durable file publication and hashing, shared by every stage.

Every final file tokenloom writes goes through :func:`atomic_writer`: data goes to a
unique temporary name beside the target, is flushed and fsynced, then renamed over
the target, and the directory is fsynced. Readers see the old file or the whole
new one, and a killed writer leaves only a ``*.tmp-*`` file, never a half-written
file under the final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path


def temp_name(final: str | os.PathLike) -> str:
    """A unique temporary name beside ``final`` (same directory, so the rename is atomic)."""
    return f"{os.fspath(final)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync the directory holding ``path`` so a rename into it is durable (best effort)."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename a complete, fsynced temporary file onto its final name."""
    os.replace(tmp, final)
    fsync_dir(final)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None):
    """``with atomic_writer(p) as f: f.write(...)``: published on success, discarded on error."""
    tmp = temp_name(path)
    try:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def sha256_tree(path: str | os.PathLike) -> str:
    """sha256 of a file, or of a directory as (relative name, file sha256) pairs in name order."""
    root = Path(path)
    if not root.is_dir():
        return sha256_file(root)
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + bytes.fromhex(sha256_file(p)))
    return h.hexdigest()
