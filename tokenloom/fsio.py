"""Durable file publication and hashing, shared by every stage.

Every final file goes through :func:`atomic_writer`: a temporary name beside the target,
fsynced, renamed over it, directory fsynced. Readers see the old file or the whole new one; a
killed writer leaves only a ``*.tmp-*`` file, whose pid lets the next run remove those of dead
processes (:func:`remove_dead_temps`). OS failures while writing become one line naming the path
and what to do (:func:`os_error_message`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import os
import shutil
import uuid


def temp_name(final: str | os.PathLike) -> str:
    """A unique temporary name beside ``final`` (same directory, so the rename is atomic)."""
    return f"{os.fspath(final)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` of this machine alive (whoever owns it)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_dead_temps(final: str | os.PathLike) -> list[str]:
    """Remove ``final``'s temporary files and folders whose writer process is dead; return them.
    Names carry pids but no host: only for outputs with one writer host (preprocess, merge)."""
    removed = []
    for path in glob.glob(glob.escape(os.fspath(final)) + ".tmp-*"):
        pid = path.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
    return removed


_ADVICE = {
    errno.ENOSPC: "no space left on device writing {path}: free space on that disk",
    errno.EDQUOT: "disk quota exceeded writing {path}: free space on that disk or raise the quota",
    errno.EMFILE: "too many open files at {path}: raise the open-file limit (ulimit -n)",
    errno.ENFILE: "the system's open-file table is full at {path}: close other programs' files",
    errno.EIO: "I/O error on {path}: the disk or network filesystem failed; check it (dmesg)",
    errno.EACCES: "permission denied on {path}: give this user access to it and to {dir}, or choose another location",
    errno.EPERM: "operation not permitted on {path}: give this user access to it and to {dir}, or choose another "
                 "location",
    errno.EROFS: "read-only file system at {path}: choose a writable location",
}


def os_error_message(exc: OSError, path: str | os.PathLike | None = None) -> str:
    """One line for an operating-system failure: what happened, on which path, what to do."""
    where = os.fspath(exc.filename if exc.filename is not None else path if path is not None else "?")
    if exc.errno not in _ADVICE:
        return f"{exc.strerror or exc} on {where}"
    return _ADVICE[exc.errno].format(path=where, dir=os.path.dirname(os.path.abspath(where)) or ".")


@contextlib.contextmanager
def naming(path: str | os.PathLike):
    """Give an :class:`OSError` raised inside the block ``path`` when it names no file (``write``)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, os.fspath(path)) from exc  # the errno picks the subclass


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
        with naming(path), open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def hash_file(h, path: str | os.PathLike, block: int = 1 << 22):
    """Feed the file at ``path`` to ``h`` (a ``hashlib`` or ``blake3`` hasher) and return ``h``; read
    into one buffer, not mapped (a mapping makes the whole input resident)."""
    with open(path, "rb", buffering=0) as f:
        buffer = memoryview(bytearray(max(1, min(block, os.fstat(f.fileno()).st_size))))
        while n := f.readinto(buffer):
            h.update(buffer[:n])
    return h


def sha256_file(path: str | os.PathLike) -> str:
    return hash_file(hashlib.sha256(), path).hexdigest()
