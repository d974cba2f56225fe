"""Atomic, exactly resumable training checkpoints, loaded with ``torch.load(weights_only=True)`` only.

Layout (one directory per saved iteration)::

    CKPT_DIR/iter_0000100/tp*_pp*_dp*.pt   every rank's pieces of the model and optimizer
                                           (:mod:`tokenloom.train.checkpoint.format`)
                          rng_rank<r>.pt   RNG states of rank r, as tensors
                          state.json       iteration, consumed samples, data fingerprint, config
                          COMPLETE         written last: without it the directory is ignored
    CKPT_DIR/latest                        name of the newest complete checkpoint

Atomicity: ranks write into ``iter_0000100.tmp`` (files fsynced), a barrier, then rank 0 writes
``COMPLETE``, fsyncs, renames and fsyncs the parent, and only then replaces ``latest``. A crash
leaves the previous checkpoints intact or a directory :func:`find_latest` skips; ``resume="auto"``
takes the highest complete iteration, never the pointer, so it cannot go back in time. An OS error
while saving ends in one line naming the checkpoint and the last complete one (:func:`save_files`).
The protocol is the same when :mod:`.async_save` runs it on a background thread.

No arbitrary unpickling: non-tensor state is JSON, RNG states integer tensors. The tensors' layout
is :mod:`.format`'s. All ranks write one directory: multi-node runs need a shared ``CKPT_DIR``.
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
    """An OS failure saving ``final`` as one line naming it and what to do. Previous checkpoints stay
    (a re-saved ``old`` is moved back); ``tmp`` is removed when no other rank may write into it."""
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
"""A local-tier checkpoint's per-rank marker: names and sizes of the files the rank wrote."""


def write_held(write: Callable[[Path], None], names: list[str], rank: int) -> Callable[[Path], None]:
    """``write``, then this rank's :data:`HELD` marker listing ``names`` with their sizes."""
    def run(tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)  # node-local: rank 0 made it on its own node only
        write(tmp)
        sizes = {name: (tmp / name).stat().st_size for name in names}
        write_file(tmp / HELD.format(rank=rank), lambda f: f.write(json.dumps(sizes).encode()))
    return run


def holds(path: str | os.PathLike, rank: int) -> bool:
    """Whether the complete local-tier checkpoint holds every file ``rank`` wrote, at its size."""
    path = Path(path)
    try:
        sizes = json.loads((path / HELD.format(rank=rank)).read_text())
        return is_complete(path) and all((path / n).stat().st_size == size for n, size in sizes.items())
    except (OSError, ValueError):
        return False


def newest_held(durable: int | None, held: list[list[int]]) -> int | None:
    """The newest local iteration every rank holds (``held``), if newer than ``durable``; else None."""
    common = set.intersection(*(set(h) for h in held)) if held else set()
    best = max(common, default=None)
    return best if best is not None and (durable is None or best > durable) else None


def write_torch_files(files: dict[str, Any]) -> Callable[[Path], None]:
    """``write(tmp)`` for :func:`save_files`: ``torch.save`` each file into ``tmp / name``, in order."""

    def write(tmp: Path) -> None:
        for name, obj in files.items():
            write_file(tmp / name, functools.partial(torch.save, obj))

    return write


def save_files(root: str | os.PathLike, iteration: int, write: Callable[[Path], None], state: dict, *, rank: int,
               barrier: Callable[[], None], keep_last: int, world_size: int) -> Path:
    """The module docstring's save protocol (every rank): ``write(tmp)`` writes this rank's files,
    rank 0 adds ``state.json`` and commits. An OS failure raises a one-line error naming the
    checkpoint and the last complete one (untouched, what ``--resume auto`` takes)."""
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
    """``"auto"``: the latest complete checkpoint under ``root`` or None; else a checkpoint or a root
    (its latest). ``flag`` names the option in errors."""
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
