"""Checkpoints written in the background: the step loop blocks only until the state it saves is copied.

A save (:meth:`CheckpointSaver.save`, on every rank) has three parts:

1. **capture**, on the main thread: wait for the previous save, run the training-group collectives,
   gather the files' contents (RNG states, views of live parameters and optimizer states) and copy
   their containers, freezing the plain values;
2. **copy**, on one background thread, into reused host buffers (:class:`HostStaging`: pinned, on
   a stream of its own on CUDA). The next forward and backward only read the state; the optimizer
   step first calls :meth:`CheckpointSaver.before_update`, which waits for the copy. That wait plus
   the capture is the save's **stall**;
3. **write**, on that thread: :func:`~tokenloom.train.checkpoint.commit.save_files`, the unchanged
   commit protocol, with barriers on a gloo group only this thread uses.

Invariants: at most one save in flight (its buffers are reused); nothing writes a captured tensor
before its copy ends. A failed copy or write raises its one-line error on the main thread at the
next poll, save or wait; the previous complete checkpoint stays the resume point. A failing run
waits for the write alone, or abandons it with peers, leaving at most a temporary folder the next
save removes. ``async_save=false`` writes on the main thread (the stall is the whole save).

Trade-offs: one more host copy of the state for the whole run (as Megatron's and torchtitan's async
saves); the copy hides behind forward and backward when shorter, for the optimizer-step gate; on CPU
it competes with the step for cores. A rank dying mid-write stalls peers until the collective timeout.
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
    """One finished save: ``stall_s`` the loop was blocked, ``write_s`` of background copy, write and
    commit (synchronous: write and commit, inside the stall)."""

    iteration: int
    path: Path
    stall_s: float
    write_s: float

    def record(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` record of this save."""
        return {"iter": self.iteration, "checkpoint": str(self.path), "save_stall_s": self.stall_s,
                "save_write_s": self.write_s}


class HostStaging:
    """Host copies of nested state, each tensor in a buffer kept under its path and reused while
    shape, dtype and strides match (a run allocates once). ``share_views``: one copy per view of
    a storage (tied weights pickle alike), else one per occurrence. ``pin_memory``: pinned buffers,
    non-blocking copies. Not thread-safe: one staging per writer."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._buffers: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._stream: Any = None

    @staticmethod
    def freeze(obj: Any) -> Any:
        """``obj`` with containers copied, tensors kept (copied later by :meth:`stage`)."""
        return HostStaging(False)._copy(obj, "", None, {}, tensors=False)

    def after_queued_work(self) -> Any:
        """CUDA: an event after the work queued so far on this thread's stream; None on CPU."""
        if not self.pin_memory:
            return None
        if self._stream is None:  # on the current device, as the run's tensors are
            self._stream = torch.cuda.Stream()
        return torch.cuda.current_stream().record_event()

    @torch.no_grad()
    def stage(self, obj: Any, *, share_views: bool, after: Any = None) -> Any:
        """``obj`` with tensors replaced by host copies (dicts keep type and attributes, so they
        pickle alike); pinned: on a stream of its own after event ``after``, done on return."""
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
        """``obj``'s copy; ``seen``: copies by tensor view (None: per occurrence); ``copies``:
        containers by id, so one met twice stays one object, as pickle writes it."""
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
    """One rank's checkpoint writer into ``root``, synchronous or one background write at a time;
    the first asynchronous save creates the thread's gloo group (collective)."""

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
        """Save ``iteration`` (every rank). ``files()`` gives name -> ``torch.save`` object and may
        run training-group collectives (main thread); ``state`` goes to ``state.json``. Returns the
        directory, complete once synchronous or reported. ``fresh_copies``: tensors written as
        copies per occurrence (views of a flat buffer would be written whole). Raises the previous
        write's failure. ``local``: the local tier root (files marked, newest two kept)."""
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
        """Wait until the save in flight holds its copy; call before writing captured state (the
        optimizer step). Counts in the save's stall."""
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
        """Take a finished background write's outcome without waiting (its error raised here)."""
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
        """Forget the write in flight (the run is failing): the daemon thread ends with the process,
        publishing only if complete; :meth:`before_update` no longer guards its state."""
        self._thread, self._outcome, self._copied = None, None, None

    def take_reports(self) -> list[SaveReport]:
        """The saves finished since the last call, oldest first."""
        reports, self._reports = self._reports, []
        return reports
