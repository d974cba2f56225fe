"""Atomic, exactly resumable training checkpoints, loaded with ``torch.load(weights_only=True)`` only.

Layout (one directory per saved iteration)::

    CKPT_DIR/iter_0000100/tp*_pp*_dp*.pt   every rank's pieces of the model and optimizer
                                           (:mod:`tokenloom.train.checkpoint.format`)
                          rng_rank<r>.pt   RNG states of rank r, as tensors
                          state.json       iteration, consumed samples, data fingerprint, config
                          COMPLETE         written last: without it the directory is ignored
    CKPT_DIR/latest                        name of the newest complete checkpoint

Atomicity: every rank writes into ``iter_0000100.tmp`` (each file fsynced), a barrier
waits for all ranks, then rank 0 writes ``COMPLETE``, fsyncs the directory, renames it to
``iter_0000100`` and fsyncs the parent; only then is ``latest`` replaced (temp file +
fsync + rename). A crash at any point leaves either the previous checkpoints intact or a
``.tmp`` / marker-less directory that :func:`find_latest` skips. ``resume="auto"`` takes
the highest-iteration *complete* checkpoint (the ``latest`` pointer is for people and
tools; a crash between the rename and the pointer update cannot make auto-resume go
back in time). A disk-full, I/O or permission error while saving ends in one line naming the
checkpoint and the last complete one (:func:`save_files`); the temporary folder is removed
then, or by the next save when other ranks may still be writing into it.

A save's files are named and captured first (:func:`tokenloom.train.checkpoint.reshard.files`) and written
by :func:`save_files`, which may run on a background thread after the state was copied to host
memory (:mod:`tokenloom.train.checkpoint.async_save`): the protocol above is the same either way.

Nothing is unpickled as arbitrary objects: non-tensor state is JSON, RNG states are
stored as integer tensors (python's Mersenne-Twister words, numpy's key array).
Trade-offs: this module owns the directory, its markers and the commit, not the tensors' layout
(one format for every layout, :mod:`tokenloom.train.checkpoint.format`, which also reads the earlier
versions' formats); :mod:`tokenloom.train.checkpoint.reshard` loads any of them into any layout.
All ranks write into one directory, so multi-node runs need ``CKPT_DIR`` on a shared
filesystem.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from tokenloom.errors import TokenloomError
from tokenloom.fsio import atomic_writer, fsync_dir, naming, os_error_message

COMPLETE = "COMPLETE"
LATEST = "latest"
_NAME = re.compile(r"^iter_(\d{7,})$")


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


# --------------------------------------------------------------------------- RNG state


def capture_rng() -> dict[str, Any]:
    """Python, numpy, torch CPU (and CUDA) RNG states as tensors and plain values."""
    version, words, gauss = random.getstate()
    # the legacy MT19937 tuple (numpy's stub types the default call as a dict)
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state: dict[str, Any] = {
        "python_version": version,
        "python_words": torch.tensor(words, dtype=torch.int64, device="cpu"),
        "python_gauss": gauss,
        "numpy_kind": kind,
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_cached_gauss": float(cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(state["python_words"].tolist()), state["python_gauss"]))
    np.random.set_state((state["numpy_kind"], state["numpy_keys"].numpy().astype(np.uint32),
                         state["numpy_pos"], state["numpy_has_gauss"], state["numpy_cached_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- save


def write_file(path: Path, write: Callable[[Any], None]) -> None:
    """``write(f)`` into a new file at ``path``, then fsync it; an OS error names ``path``."""
    with naming(path), open(path, "wb") as f:
        try:
            write(f)
        except RuntimeError as exc:  # torch's zip writer reports a failed write as "unexpected pos" on close
            cause = exc.__context__
            while cause is not None and not isinstance(cause, OSError):
                cause = cause.__context__
            if cause is None:
                raise
            raise cause from None
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _failing_save(root: Path, final: Path, tmp: Path, old: Path, remove_tmp: bool):
    """Turn an operating-system failure while saving ``final`` into one line naming it and what to do.

    The previous checkpoints are left as they were: a re-saved iteration moved aside to
    ``old`` is moved back, and ``tmp`` is removed when no other rank may still write into it
    (``remove_tmp``; otherwise the next save removes it).
    """
    try:
        yield
    except OSError as exc:
        if old.exists() and not final.exists():
            with contextlib.suppress(OSError):
                os.rename(old, final)
        if remove_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise TokenloomError(f"{os_error_message(OSError(exc.errno, exc.strerror), final)}; the checkpoint was not "
                             f"saved and {resume_advice(root)}") from None


def resume_advice(root: str | os.PathLike) -> str:
    """What to do after a failed run whose checkpoints are under ``root`` (the end of an error line)."""
    last = find_latest(root)
    if last is None:
        return "there is no complete checkpoint yet: then rerun the same command"
    return f"the last complete one is {last}: then rerun the same command with --resume auto to continue from it"


def _remove_unfinished(root: Path) -> None:
    """Temporary folders of saves that failed or were killed (one job writes a checkpoint root)."""
    for path in root.glob("iter_*.tmp"):
        shutil.rmtree(path, ignore_errors=True)


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at checkpoint ``name`` (atomically: readers see the old or the new name)."""
    with atomic_writer(root / LATEST, "w") as f:
        f.write(name + "\n")


HELD = "HELD.rank{rank}"
"""A local-tier checkpoint's per-rank marker: the names and sizes of the files that rank wrote,
written by the rank after them (:func:`write_held`); :func:`holds` checks them."""


def write_held(write: Callable[[Path], None], names: list[str], rank: int) -> Callable[[Path], None]:
    """``write``, then this rank's :data:`HELD` marker listing ``names`` with their sizes."""
    def run(tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)  # node-local: rank 0 made it on its own node only
        write(tmp)
        sizes = {name: (tmp / name).stat().st_size for name in names}
        write_file(tmp / HELD.format(rank=rank), lambda f: f.write(json.dumps(sizes).encode()))
    return run


def holds(path: str | os.PathLike, rank: int) -> bool:
    """Whether the complete checkpoint at ``path`` holds every file ``rank`` wrote, at its size (a
    local tier's checkpoint; a node may have lost its disk, or a file)."""
    path = Path(path)
    try:
        sizes = json.loads((path / HELD.format(rank=rank)).read_text())
        return is_complete(path) and all((path / n).stat().st_size == size for n, size in sizes.items())
    except (OSError, ValueError):
        return False


def newest_held(durable: int | None, held: list[list[int]]) -> int | None:
    """The local-tier iteration to resume from: the newest that every rank holds (``held``: each
    rank's complete local iterations, :func:`holds`), when it is newer than the newest durable one
    (``durable``, None: none); else None (resume from the durable tier)."""
    common = set.intersection(*(set(h) for h in held)) if held else set()
    best = max(common, default=None)
    return best if best is not None and (durable is None or best > durable) else None


def write_torch_files(files: dict[str, Any]) -> Callable[[Path], None]:
    """``write(tmp)`` for :func:`save_files`: ``torch.save`` each ``files[name]`` into ``tmp / name``
    (:func:`write_file`), in ``files``' order."""

    def write(tmp: Path) -> None:
        for name, obj in files.items():
            write_file(tmp / name, functools.partial(torch.save, obj))

    return write


def save_files(root: str | os.PathLike, iteration: int, write: Callable[[Path], None], state: dict, *, rank: int,
               barrier: Callable[[], None], keep_last: int, world_size: int) -> Path:
    """The save protocol of the module docstring, for any set of files; every rank calls it.

    ``write(tmp)`` writes this rank's files into the temporary folder (with :func:`write_file`);
    rank 0 then adds ``state.json`` (``state`` and the iteration) and commits. An
    operating-system failure (disk full, I/O or permission error) raises a one-line
    :class:`TokenloomError` on the rank that met it, naming the checkpoint and the last
    complete one, which stays untouched and what ``--resume auto`` takes.
    """
    root = Path(root)
    name = checkpoint_name(iteration)
    final, tmp, old = root / name, root / f"{name}.tmp", root / f"{name}.old"

    def failing():
        return _failing_save(root, final, tmp, old, remove_tmp=world_size == 1)

    if rank == 0:
        with failing():
            root.mkdir(parents=True, exist_ok=True)
            _remove_unfinished(root)  # left over by a failed or killed save
            tmp.mkdir()
    barrier()
    with failing():
        write(tmp)
    barrier()
    if rank == 0:
        with failing():
            text = json.dumps({**state, "iteration": iteration}, indent=2, sort_keys=True)
            write_file(tmp / "state.json", lambda f: f.write(text.encode()))
            write_file(tmp / COMPLETE, lambda f: f.write(f"{iteration}\n".encode()))
            fsync_dir(tmp / COMPLETE)  # the directory holding the files, before it is renamed
            if final.exists():  # re-saving the same iteration (a rerun into the same directory)
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(tmp, final)
        fsync_dir(final)
        shutil.rmtree(old, ignore_errors=True)
        try:
            write_latest(root, name)
        except OSError as exc:  # the checkpoint is whole: --resume auto finds it without the pointer
            raise TokenloomError(f"{os_error_message(exc, root / LATEST)}; checkpoint {final} is complete and "
                                 "--resume auto continues from it") from None
        if keep_last > 0:
            for _, path in complete_checkpoints(root)[:-keep_last]:
                shutil.rmtree(path, ignore_errors=True)
    barrier()
    return final


# --------------------------------------------------------------------------- find / load


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / COMPLETE).is_file()


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(iteration, path) of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def find_latest(root: str | os.PathLike) -> Path | None:
    """The highest-iteration complete checkpoint under ``root`` (None if there is none)."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve(resume: str, root: str | os.PathLike, flag: str = "--resume") -> Path | None:
    """``"auto"``: latest complete checkpoint under ``root`` or None; otherwise ``resume`` is a
    checkpoint directory, or a checkpoint root whose latest complete checkpoint is taken.
    ``flag`` names the option the path came from in errors."""
    if resume == "auto":
        return find_latest(root)
    path = Path(resume)
    if is_complete(path):
        return path
    latest = find_latest(path)
    if latest is None:
        why = "is not a complete checkpoint (no COMPLETE marker)" if path.exists() else "does not exist"
        auto = " or 'auto'" if flag == "--resume" else ""
        raise TokenloomError(f"{flag} {path} {why}; pass a checkpoint directory or its parent{auto}")
    return latest


def read_state(path: str | os.PathLike) -> dict:
    """``state.json`` of a complete checkpoint (iteration, consumed samples, fingerprint, config)."""
    path = Path(path)
    if not is_complete(path):
        raise TokenloomError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    return json.loads((path / "state.json").read_text())


def load_tensors(path: str | os.PathLike, name: str, map_location: Any = "cpu") -> Any:
    """One of the checkpoint's ``.pt`` files, with ``weights_only=True``."""
    return torch.load(Path(path) / name, map_location=map_location, weights_only=True)
