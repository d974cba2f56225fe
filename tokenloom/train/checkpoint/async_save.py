"""Checkpoints written in the background: the step loop blocks only until the state it saves is copied.

A save (:meth:`CheckpointSaver.save`, called by :meth:`~tokenloom.train.strategy.Strategy.save` on every
rank) has three parts:

1. **the capture**, on the main thread: the previous save's write is waited for; the collectives
   on the training group run; the files' contents are gathered (RNG states, views of the live
   parameters and optimizer states) and their containers copied, freezing every plain value;
2. **the copy**, on one background thread: every tensor is copied into host buffers
   (:class:`HostStaging`: pinned on CUDA, filled on a stream of its own that starts after the
   work queued so far; allocated by the first save and reused by every later one). The step
   loop goes on meanwhile: the next forward and backward only read the state. Whatever
   updates it (the optimizer step) first calls :meth:`CheckpointSaver.before_update`, which
   waits for the copy; that wait and the capture are the save's **stall**;
3. **the write**, on the same thread: :func:`tokenloom.train.checkpoint.commit.save_files`,
   the commit protocol (temp dir, fsync, ``COMPLETE``, rename, ``latest``, ``keep_last``)
   unchanged, so a checkpoint is only ever published whole. Its barriers run on a gloo group of
   its own that only this thread uses, so two threads' collectives never share a group.

Invariants: at most one save is in flight, and the next save waits for it (its host buffers are about to be
overwritten). Nothing writes a tensor a save captured between its capture and the end of its copy: the
optimizer step is the one writer of saved state and it waits in :meth:`CheckpointSaver.before_update`. A
failed copy or write (disk full, I/O error) keeps its one-line :class:`~tokenloom.errors.TokenloomError`
naming the checkpoint, raised on the main thread by the next :meth:`CheckpointSaver.poll` (each step
boundary), save or :meth:`CheckpointSaver.wait` (the run's end, a save-and-exit); the previous complete
checkpoint stays what ``--resume auto`` takes. When the run fails otherwise, the write in flight is waited
for in one process, or abandoned with peers (:meth:`CheckpointSaver.abandon`): at most an unpublished
temporary folder remains, which the next save into that root removes. Each finished save leaves a
:class:`SaveReport` (stall, write time) for the metrics.

``async_save=false`` writes on the main thread with the training group's barriers (the stall is then the
whole save), from the live state (one-process format) or fresh host copies (per shard).

Trade-offs: host memory holds one more copy of the state a rank writes, for the whole run (as in Megatron's
and torchtitan's asynchronous saves). Copying behind the next forward and backward instead of before them
(where they stage) hides the copy when it is shorter than those, at the price of the gate in the optimizer
step; on CPU the copy and the write compete with the step for cores and memory bandwidth. A rank that dies
mid-write leaves peers waiting in a checkpoint barrier until the collective timeout, as a synchronous save
does.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.runtime import collective

Barrier = Callable[[], None]


@dataclass(frozen=True)
class SaveReport:
    """One finished save: ``stall_s`` the loop was blocked (the capture and the optimizer step's
    wait for the copy), ``write_s`` of copying, writing and committing in the background (for a
    synchronous save, the writing and committing, part of the stall)."""

    iteration: int
    path: Path
    stall_s: float
    write_s: float

    def record(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` record of this save."""
        return {"iter": self.iteration, "checkpoint": str(self.path), "save_stall_s": self.stall_s,
                "save_write_s": self.write_s}


class HostStaging:
    """Copies of nested state (dicts, lists, tuples of tensors and plain values) in host memory.

    Each tensor is copied into a buffer of the same shape, dtype and strides, kept under its
    path in the structure and reused by the next :meth:`stage` when that still matches (so a
    run's saves allocate once). ``share_views``: tensors that are the same view of the same
    storage (tied weights in a state dict) get one shared copy, so ``torch.save`` writes the
    same bytes as for originals that fill their storages; otherwise each occurrence gets its
    own (as ``.clone()`` would). ``pin_memory`` (CUDA state): pinned
    buffers filled by non-blocking copies, waited for before :meth:`stage` returns. Not
    thread-safe: one staging per writer, refilled only once its previous write is done.
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._buffers: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._stream: Any = None

    @staticmethod
    def freeze(obj: Any) -> Any:
        """``obj`` with its containers copied and its tensors kept (the same objects): the plain
        values are fixed as they are now, the tensors' contents are copied later by :meth:`stage`."""
        return HostStaging(False)._copy(obj, "", None, {}, tensors=False)

    def after_queued_work(self) -> Any:
        """CUDA: an event on the current stream, for :meth:`stage` to start after the work queued
        so far (call on the thread that queued it); None on CPU."""
        if not self.pin_memory:
            return None
        if self._stream is None:  # on the current device, as the run's tensors are
            self._stream = torch.cuda.Stream()
        return torch.cuda.current_stream().record_event()

    @torch.no_grad()
    def stage(self, obj: Any, *, share_views: bool, after: Any = None) -> Any:
        """``obj`` with every tensor replaced by its host copy; containers are copied (dicts keep
        their type and attributes, so ``torch.save`` pickles them alike), other values kept.
        Pinned: the copies run on a stream of their own, after ``after`` (an event of
        :meth:`after_queued_work`; any thread may call this), and are waited for before return."""
        if not self.pin_memory:
            return self._copy(obj, "", {} if share_views else None, {})
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        with torch.cuda.stream(self._stream):  # also makes the stream's device current on this thread
            if after is not None:
                self._stream.wait_event(after)
            out = self._copy(obj, "", {} if share_views else None, {})
        self._stream.synchronize()  # the non-blocking device-to-host copies
        return out

    def _copy(self, obj: Any, path: str, seen: dict[tuple, torch.Tensor] | None, copies: dict[int, Any], *,
              tensors: bool = True) -> Any:
        """``obj``'s copy; ``seen``: copies by tensor view (None: a copy per occurrence);
        ``copies``: containers already copied, by id, so a container met twice (the betas tuple
        of every param group) is one object in the copy too, as pickle writes it; ``tensors``:
        False keeps tensors as they are (only the containers are copied)."""
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, seen) if tensors else obj
        if not isinstance(obj, (dict, list, tuple)):
            return obj
        if id(obj) in copies:
            return copies[id(obj)]
        out: Any
        if isinstance(obj, dict):  # a shallow copy keeps the type and attributes (a state dict's _metadata)
            out = copy.copy(obj)
            for k, v in obj.items():
                out[k] = self._copy(v, f"{path}/{k}", seen, copies, tensors=tensors)
        else:
            items = [self._copy(v, f"{path}/{i}", seen, copies, tensors=tensors) for i, v in enumerate(obj)]
            if isinstance(obj, list):
                out = items
            else:  # a tuple of plain values is immutable: kept as it is
                out = obj if all(a is b for a, b in zip(items, obj, strict=True)) else tuple(items)
        copies[id(obj)] = out
        return out

    def _tensor(self, obj: torch.Tensor, path: str, seen: dict[tuple, torch.Tensor] | None) -> torch.Tensor:
        key = (obj.device, obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), obj.stride(),
               obj.dtype)
        if seen is not None and key in seen:
            return seen[key].detach()  # another tensor on the same copy, as the original is (pickled alike)
        kept = self._buffers.get(path)
        if kept is not None and kept[0] == obj.stride() and kept[1].shape == obj.shape and kept[1].dtype == obj.dtype:
            buf = kept[1]
        else:
            buf = torch.empty_like(obj, device="cpu", pin_memory=self.pin_memory)
            self._buffers[path] = (obj.stride(), buf)
        buf.copy_(obj.detach(), non_blocking=self.pin_memory)
        if seen is not None:
            seen[key] = buf
        return buf

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(buf.untyped_storage().nbytes() for _, buf in self._buffers.values())


class CheckpointSaver:
    """One rank's checkpoint writer into ``root``: synchronous, or one background write at a time
    (module docstring). ``rank``, ``world_size`` and ``keep_last`` are those of
    :func:`tokenloom.train.checkpoint.commit.save_files`. ``world_size > 1``: the background thread's
    barriers use a gloo group of its own (``timeout_s``), created by the first asynchronous save
    (collective: every rank saves at the same iteration).
    """

    def __init__(self, root: str | Path, *, rank: int, world_size: int, keep_last: int, asynchronous: bool,
                 pin_memory: bool, timeout_s: float) -> None:
        self.root, self.rank, self.world_size, self.keep_last = Path(root), rank, world_size, keep_last
        self.asynchronous = asynchronous
        self.staging = HostStaging(pin_memory)
        self.timeout_s = timeout_s
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._outcome: SaveReport | BaseException | None = None
        self._copied: threading.Event | None = None  # set once the save in flight holds its copy
        self._gate_s = 0.0  # how long before_update waited for that copy
        self._reports: list[SaveReport] = []

    def _barrier(self, background: bool) -> Barrier:
        if self.world_size == 1:
            return lambda: None
        if not background:
            return lambda: collective("checkpoint barrier", dist.barrier)
        if self._group is None:
            self._group = collective("checkpoint group setup", dist.new_group, backend="gloo",
                                     timeout=timedelta(seconds=self.timeout_s))
        group = self._group
        return lambda: collective("checkpoint barrier", dist.barrier, group=group)

    def _commit(self, iteration: int, files: dict[str, Any], state: dict, barrier: Barrier, local: Path | None) -> Path:
        write = checkpoint.write_torch_files(files)
        if local is not None:  # the local tier: each rank marks what it wrote, the newest two are kept
            write = checkpoint.write_held(write, list(files), self.rank)
        return checkpoint.save_files(local or self.root, iteration, write, state, rank=self.rank, barrier=barrier,
                                     keep_last=self.keep_last if local is None else 2, world_size=self.world_size)

    def save(self, iteration: int, files: Callable[[], dict[str, Any]], state: dict, *, fresh_copies: bool,
             local: Path | None = None) -> Path:
        """Save ``iteration``; every rank calls it. ``files()`` gives this rank's files (name ->
        what ``torch.save`` writes; it may run collectives on the training group: it runs here,
        on the main thread); ``state`` goes into ``state.json``. Returns the checkpoint's
        directory: complete on return when synchronous, otherwise once :meth:`wait` or
        :meth:`poll` reports it. ``fresh_copies``: the files' tensors are written as copies, one
        per occurrence (views into a flat buffer, which ``torch.save`` would write whole), also
        by a synchronous save; otherwise as they are, views of one storage shared (a synchronous
        save then copies nothing). Raises the previous write's failure, and this one's when
        synchronous. ``local``: into that root instead, the local tier (each rank's files marked,
        :func:`~tokenloom.train.checkpoint.commit.write_held`; the newest two kept)."""
        self.wait()
        start = time.perf_counter()
        captured = files()
        if not self.asynchronous:
            if fresh_copies:
                captured = HostStaging(False).stage(captured, share_views=False)
            began = time.perf_counter()
            path = self._commit(iteration, captured, state, self._barrier(False), local)
            now = time.perf_counter()
            self._reports.append(SaveReport(iteration, path, now - start, now - began))
            return path
        frozen = HostStaging.freeze(captured)
        after = self.staging.after_queued_work()
        barrier = self._barrier(True)
        copied = self._copied = threading.Event()
        self._gate_s = 0.0
        capture = time.perf_counter() - start

        def run() -> None:
            began = time.perf_counter()
            try:
                try:
                    staged = self.staging.stage(frozen, share_views=not fresh_copies, after=after)
                finally:
                    copied.set()
                path = self._commit(iteration, staged, state, barrier, local)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread by wait()
                self._outcome = exc
            else:  # the stall is completed by wait(), which adds the gate's wait
                self._outcome = SaveReport(iteration, path, capture, time.perf_counter() - began)

        self._thread = threading.Thread(target=run, name=f"checkpoint-write-{iteration}", daemon=True)
        self._thread.start()
        return (local or self.root) / checkpoint.checkpoint_name(iteration)

    def before_update(self) -> None:
        """Wait until the save in flight holds its copy of the state (no wait when none is in
        flight, or its copy is done): call before anything writes a tensor a save captures (the
        optimizer step). The wait counts in that save's stall."""
        copied = self._copied
        if copied is None or copied.is_set():
            return
        start = time.perf_counter()
        copied.wait()
        self._gate_s += time.perf_counter() - start

    @property
    def writing(self) -> bool:
        """Whether a background write is in flight (started and not yet waited for)."""
        return self._thread is not None

    def poll(self) -> None:
        """Take the background write's outcome if it has finished (no wait): its report, or its
        error raised here."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Wait for the write in flight, if any; raise its error, or keep its report."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join()
        outcome, self._outcome, self._copied = self._outcome, None, None
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is not None:
            self._reports.append(dataclasses.replace(outcome, stall_s=outcome.stall_s + self._gate_s))

    def abandon(self) -> None:
        """Forget the write in flight (the run is failing): a daemon thread, it ends with the
        process; its checkpoint is published only if it completes, and an unfinished temporary
        folder is removed by the next save into that root. The state it may still be copying is
        no longer guarded by :meth:`before_update`: the run is not stepping again."""
        self._thread, self._outcome, self._copied = None, None, None

    def take_reports(self) -> list[SaveReport]:
        """The saves finished since the last call, oldest first."""
        reports, self._reports = self._reports, []
        return reports
