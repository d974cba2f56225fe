"""Runs that survive failures: what each rank leaves for the launcher, and the restart records.

torchrun's agent (``--max-restarts N``, :mod:`torch.distributed.elastic`) restarts the ranks of a
node when one fails (a kill, an exception, a collective timeout, a hang ended by :class:`Watchdog`);
a restarted rank resumes from the newest complete checkpoint (``resume=auto``, forced by
:func:`tokenloom.train.launch.main` on a restart), so no sample is seen twice or skipped. What
torchrun does not give: the cause and the failing rank in a form the run can record (its error
files hold only exceptions raised through ``@record``; a ``kill -9`` or an ``os._exit`` leaves
none), and a stop when a restart cannot help. So the launcher learns them from the files each rank
writes into the launch's log directory (``LOGS``, :data:`LOG_DIR_ENV`):

* ``rank{R}.log``: its ``error:`` line (:mod:`tokenloom.train.launch` reads it), or none when the
  process vanished (the launcher sees the pid gone: a kill, the OOM killer);
* ``rank{R}.step`` (:class:`Progress`): ``START LAST TIME``, the iteration the attempt began at,
  the last finished one and when; rewritten after every step (a rename, no fsync: it is a hint);
* ``LOGS/restarts.jsonl``: one :func:`restart_record` per restart, appended by the launcher; rank 0
  of the restarted job copies the newest into ``metrics.jsonl`` after its first step (with
  ``restart_s``: from the failure to that step) and all of them into the run's summary.

A restart cannot help when the error repeats: the launcher stops the job with one line when an
attempt fails before finishing a step, or with the error and iteration of an earlier attempt
(:func:`deterministic`). The watchdog is in-process: a thread per rank that, when no step has
finished within the hang timeout, dumps the rank's Python stacks (:mod:`faulthandler`) into its log,
writes ``rank{R}.hang`` and ends the rank so torchrun restarts the job; the launcher names the
ranks that wrote no ``.hang`` (stopped, or stuck outside Python) as the ones that had not reached
the collective. This module imports nothing of the trainer: the loop and the launcher both use it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

LOG_DIR_ENV = "TOKENLOOM_LOG_DIR"
"""Environment variable naming the launch's log directory in a rank (set by ``launch.main``)."""
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of this node's worker-group restarts (0 on the first attempt)."""
RESTARTS = "restarts.jsonl"
HANG_EXIT = 3
"""Exit status of a rank ended by its watchdog."""
HANG_LINGER_S = 3.0
"""How long a rank whose watchdog fired waits before it exits: its peers' watchdogs fire too, and
the launcher has them dump their stacks (:data:`DUMP_SIGNAL`) before a peer's exit breaks their
collective."""
DUMP_SIGNAL = signal.SIGUSR1
"""Each rank dumps every thread's Python stack into its log on this signal (:func:`dump_on_signal`)."""
HANG_MIN_S = 60.0
HANG_STEPS = 10.0


def dump_on_signal() -> None:
    """Dump every thread's Python stack to stderr on :data:`DUMP_SIGNAL` (faulthandler's C handler:
    it works while the main thread is blocked in a collective)."""
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)


def restart_count() -> int:
    return int(os.environ.get(RESTART_ENV, "0") or 0)


def log_dir() -> Path | None:
    value = os.environ.get(LOG_DIR_ENV)
    return Path(value) if value else None


def default_hang_timeout(slowest_step_s: float) -> float:
    """The hang timeout when none is configured: :data:`HANG_STEPS` times the slowest iteration seen
    so far (its step, evaluation and checkpoint copy), at least :data:`HANG_MIN_S`. Before the first
    step finishes there is none (start-up, compilation; the collective timeout covers it)."""
    return max(HANG_MIN_S, HANG_STEPS * slowest_step_s)


@dataclass(frozen=True)
class StepMark:
    start: int
    last: int
    time: float


def read_step(path: Path) -> StepMark | None:
    try:
        start, last, when = path.read_text().split()
        return StepMark(int(start), int(last), float(when))
    except (OSError, ValueError):
        return None


class Progress:
    """A rank's progress for the launcher (``rank{R}.step``) and its :class:`Watchdog`; without a
    launch log directory (a run in-process, under a foreign torchrun) only the watchdog, if asked."""

    def __init__(self, rank: int, start_iteration: int, hang_timeout_s: float | None, enabled: bool = True) -> None:
        self.rank, self.start = rank, start_iteration
        directory = log_dir()
        self.path = directory / f"rank{rank}.step" if directory is not None else None
        self._last = time.monotonic()
        self.watchdog = Watchdog(rank, hang_timeout_s, directory) if enabled else None
        self._write(start_iteration)

    def _write(self, iteration: int) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(f"{self.start} {iteration} {time.time():.3f}")
            os.replace(tmp, self.path)
        except OSError:  # a hint for the launcher: never a reason to stop training
            pass

    def step(self, iteration: int) -> None:
        """After each iteration (its step, evaluation and save)."""
        now = time.monotonic()
        took, self._last = now - self._last, now
        self._write(iteration)
        if self.watchdog is not None:
            self.watchdog.step(iteration, took)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()


class Watchdog:
    """A daemon thread that ends this rank when no step finished within the hang timeout: the
    configured one, else :func:`default_hang_timeout` of the slowest iteration so far. It dumps
    every thread's Python stack to stderr (the rank's log; :func:`faulthandler.dump_traceback`),
    writes ``LOGS/rank{R}.hang`` (the last finished iteration), prints one ``error:`` line and exits
    with :data:`HANG_EXIT` at once (``os._exit``: the main thread is blocked in a collective). It
    only runs between the first and the last step: start-up and the final save are not watched."""

    def __init__(self, rank: int, timeout_s: float | None, directory: Path | None) -> None:
        self.rank, self.timeout_s, self.dir = rank, timeout_s, directory
        self._slowest = 0.0
        self._iteration: int | None = None
        self._last = time.monotonic()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def limit(self) -> float:
        return self.timeout_s if self.timeout_s is not None else default_hang_timeout(self._slowest)

    def step(self, iteration: int, took_s: float) -> None:
        with self._cond:
            if self._iteration is not None:  # the first iteration's time includes start-up
                self._slowest = max(self._slowest, took_s)
            self._iteration, self._last = iteration, time.monotonic()
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="tokenloom-watchdog", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                waited = time.monotonic() - self._last
                if waited >= self.limit():
                    self._fire(waited)
                self._cond.wait(timeout=min(1.0, max(0.05, self.limit() - waited)))

    def _fire(self, waited: float) -> None:
        print(f"hang: rank {self.rank}: no step finished within {waited:.0f} s (hang timeout "
              f"{self.limit():g} s) after iteration {self._iteration}; its Python stacks:", file=sys.stderr,
              flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.dir is not None:
            tmp = self.dir / f".rank{self.rank}.hang.tmp"
            try:
                tmp.write_text(json.dumps({"rank": self.rank, "iteration": self._iteration, "time": time.time()}))
                os.replace(tmp, self.dir / f"rank{self.rank}.hang")
            except OSError:
                pass
        print(f"error: rank {self.rank}: no step finished within {self.limit():g} s after iteration "
              f"{self._iteration} (hang timeout; stacks above)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        time.sleep(HANG_LINGER_S)
        os._exit(HANG_EXIT)


def restart_record(*, restart: int, rank: int | None, why: str, failed_at: float, failed_iteration: int,
                   resumes_from: int, node: int = 0, world_size: int | None = None,
                   new_world_size: int | None = None) -> dict:
    """One restart: when (``failed_at``, unix seconds), which rank, why, the iteration the job had
    reached, the checkpoint iteration it resumes from and the steps lost between them; with the world
    sizes before and after the restart where known (they differ when an elastic job lost or gained
    a node: ``world_size`` then ``new_world_size``)."""
    record = {"restart": restart, "node": node, "failed_at": round(failed_at, 3), "rank": rank, "why": why,
              "failed_iteration": failed_iteration, "resumes_from": resumes_from,
              "steps_lost": max(0, failed_iteration - resumes_from)}
    if world_size is not None:
        record["world_size"] = world_size
    if new_world_size is not None:
        record["new_world_size"] = new_world_size
    return record


def append_record(directory: Path, record: dict) -> None:
    with open(directory / RESTARTS, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(directory: Path | None) -> list[dict]:
    if directory is None:
        return []
    try:
        text = (directory / RESTARTS).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being appended
            continue
    return out


def wait_for_records(directory: Path | None, count: int, timeout_s: float = 10.0) -> list[dict]:
    """The restart records once ``count`` are there (the launcher appends one as torchrun restarts
    the ranks), or what there is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    records = read_records(directory)
    while len(records) < count and time.monotonic() < deadline:
        time.sleep(0.1)
        records = read_records(directory)
    return records


def deterministic(history: list[dict], record: dict, attempt_start: int | None) -> str | None:
    """Why restarting after ``record`` would loop (None: restart): the attempt failed before
    finishing a step (``attempt_start`` is where it began), or an earlier attempt failed with the
    same error at the same iteration. A death without an error message (a kill) always restarts."""
    if record["rank"] is None or "died without an error message" in record["why"]:
        return None
    if attempt_start is not None and record["failed_iteration"] <= attempt_start:
        return "it failed before finishing a step, so a restart would repeat it"
    for earlier in history:
        if earlier["why"] == record["why"] and earlier["failed_iteration"] == record["failed_iteration"]:
            return f"restart {earlier['restart']} failed the same way at the same iteration"
    return None
