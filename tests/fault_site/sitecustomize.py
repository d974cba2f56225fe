"""Operating-system faults injected into a ``cli.py`` subprocess and every process it starts.

Tests put this folder on ``PYTHONPATH`` (see ``tl_testing.fault_env``) with
``TOKENLOOM_TEST_FAULT`` holding JSON ``{"op", "errno", "path", "room"}``; Python imports
``sitecustomize`` at start-up, so torchrun's ranks get the fault too. The fault is raised
where the kernel would raise it, on files whose path matches the glob ``path``:

- ``open``: opening the file for writing fails (``EACCES`` on a folder this user may not write),
  through ``open`` or ``os.open``;
- ``write``: the first ``room`` bytes reach the file, then ``write(2)`` fails without a file
  name (a full disk: ``ENOSPC``; a failing device: ``EIO``); the fault sits under a real
  ``BufferedWriter``, so buffered bytes meet it again on flush and close, as on a real disk;
  ``os.write`` to a matching file fails at once;
- ``fsync``: ``fsync(2)`` of the file fails (delayed allocation or write-back finding no room);
- ``rename``: renaming onto a matching name fails (``os.rename``/``os.replace``, pathlib's too);
- ``signal``: the ``count``-th time a process opens a matching file for writing, it sends signal
  ``errno`` to its whole process group, as Ctrl-C does to a terminal's foreground job (start the
  command in a session of its own): a stop that lands at a chosen point of the run, whatever its speed;
- ``exit``: the process dies (``os._exit(errno)``, like a kill) when it opens a matching file for
  writing, only the first time across processes: it first creates the file ``marker``, and a
  process that finds the marker already there goes on (so a retried task succeeds).

Code that writes through anything else (a C library opening files itself) is not reached.
Without the variable nothing is patched.
"""

from __future__ import annotations

import builtins
import fnmatch
import io
import json
import os

_SPEC = os.environ.get("TOKENLOOM_TEST_FAULT")


def _matches(path) -> bool:
    try:
        return fnmatch.fnmatch(os.path.abspath(os.fsdecode(path)), _FAULT["path"])
    except TypeError:  # a file descriptor, not a path
        return False


def _fd_matches(fd: int) -> bool:
    try:
        return _matches(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return False


def _fail(*names):
    return OSError(_FAULT["errno"], os.strerror(_FAULT["errno"]), *names)


class _FailingRaw(io.RawIOBase):
    """A file that takes ``room`` bytes, then fails every write like ``write(2)``."""

    def __init__(self, raw, room: int):
        self._raw, self._room = raw, room

    @property
    def name(self):
        return self._raw.name

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return self._raw.readable()

    def seekable(self) -> bool:
        return self._raw.seekable()

    def readinto(self, b):
        return self._raw.readinto(b)

    def write(self, data) -> int:
        if self._room <= 0:
            raise _fail()
        n = self._raw.write(memoryview(data).cast("B")[: self._room])  # the short write a full disk allows
        self._room -= n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def truncate(self, size=None) -> int:
        return self._raw.truncate(size)

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()
        super().close()


def _install() -> None:
    real_open, real_fsync, real_rename, real_replace = builtins.open, os.fsync, os.rename, os.replace
    real_os_open, real_os_write = os.open, os.write
    op = _FAULT["op"]

    def faulty_open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True,
                    opener=None):
        if not any(c in mode for c in "wax+") or not _matches(file):
            return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
        if op == "open":
            raise _fail(os.fspath(file))
        if op != "write":
            return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
        binary = mode.replace("t", "") if "b" in mode else mode.replace("t", "") + "b"
        raw = _FailingRaw(real_open(file, binary, 0, closefd=closefd, opener=opener), _FAULT.get("room", 0))
        buffered = io.BufferedWriter(raw)
        if "b" in mode:
            return buffered
        return io.TextIOWrapper(buffered, io.text_encoding(encoding), errors, newline)

    def faulty_fsync(fd):
        fd = fd if isinstance(fd, int) else fd.fileno()
        if _fd_matches(fd):
            raise _fail()
        return real_fsync(fd)

    def renaming(real):
        def faulty(src, dst, *a, **k):
            if _matches(dst):
                raise _fail(os.fspath(src), os.fspath(dst))
            return real(src, dst, *a, **k)

        return faulty

    def faulty_os_open(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and _matches(path):
            raise _fail(os.fspath(path))
        return real_os_open(path, flags, *a, **k)

    def dying_open(file, mode="r", *a, **k):
        if any(c in mode for c in "wax+") and _matches(file):
            try:
                os.close(real_os_open(_FAULT["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os._exit(_FAULT["errno"])
        return real_open(file, mode, *a, **k)

    opened = [0]

    def signalling_open(file, mode="r", *a, **k):
        if any(c in mode for c in "wax+") and _matches(file):
            opened[0] += 1
            if opened[0] == _FAULT.get("count", 1):
                os.killpg(0, _FAULT["errno"])
        return real_open(file, mode, *a, **k)

    def faulty_os_write(fd, data):
        if _fd_matches(fd):
            raise _fail()
        return real_os_write(fd, data)

    if op == "open":
        builtins.open = io.open = faulty_open
        os.open = faulty_os_open
    elif op == "write":
        builtins.open = io.open = faulty_open
        os.write = faulty_os_write
    elif op == "fsync":
        os.fsync = faulty_fsync
    elif op == "rename":
        os.rename, os.replace = renaming(real_rename), renaming(real_replace)
    elif op == "exit":
        builtins.open = io.open = dying_open
    elif op == "signal":
        builtins.open = io.open = signalling_open
    else:
        raise ValueError(f"TOKENLOOM_TEST_FAULT: unknown op {op!r}")


if _SPEC:
    _FAULT = json.loads(_SPEC)
    _install()
