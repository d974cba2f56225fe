"""Worker processes for preprocess: tasks in, results out in submission order.

Why not ``concurrent.futures.ProcessPoolExecutor``: its workers share one result pipe,
read by a thread of the main process. A worker killed (OOM killer, ``kill -9``) part-way
through writing a result, which for a chunk of tokens is megabytes and many writes,
leaves that thread blocked in ``recv`` for bytes that never come: the executor never
notices the death and the run hangs instead of stopping with its resume hint (seen under
load in about one kill in ten). Here each worker owns a pipe whose sending end no other
process holds, so a worker's death is end-of-file on its pipe (and its sentinel) whatever
it was doing, and :meth:`OrderedPool.result` raises :class:`WorkerDied`.

The trade-off: a task is sent to the worker with the fewest tasks not yet finished (the
others in turn on a tie) when it is submitted, not taken by whichever worker is free when
it starts, so a worker that turns slow after that (a core taken by another process) still
holds the tasks it was given. Preprocess consumes results in input order anyway, so a free
worker can only run ahead by the caller's in-flight bound. Each worker's
tasks are sent, and its results read as soon as they are written, by threads of its own, so
neither side ever waits on the other's pipe: results wait in memory
(at most the caller's in-flight bound of them) until :meth:`OrderedPool.result` takes them.

Workers ignore SIGINT (Ctrl-C reaches the whole process group): the main process stops
them, so one Ctrl-C prints one message, not one traceback per worker.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import queue
import signal
import sys
import threading

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]  # the module or None, checked before use


class WorkerDied(Exception):
    """A worker process exited abruptly (killed, out of memory)."""


class RemoteError(Exception):
    """An exception raised in a worker that could not be sent back as itself."""


def _serve(tasks, results, initializer, initargs) -> None:
    """A worker's loop: ``(fn, args)`` in, ``(ok, value)`` out, until ``None`` or end of file."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            task = tasks.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        fn, args = task
        try:
            reply = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - sent to the main process, which raises it
            reply = (False, exc)
        try:
            results.send(reply)  # pickles before writing: a failure here has written nothing
        except (EOFError, OSError):
            return
        except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception
            results.send((False, RemoteError(f"{type(exc).__name__}: {exc} (sending {type(reply[1]).__name__})")))


_DIED = object()
_PIPE_BYTES = 1 << 20


def _pipe(context):
    """A one-way pipe ``(receiving end, sending end)`` with a 1 MB buffer where Linux allows it
    (``F_SETPIPE_SZ`` up to ``/proc/sys/fs/pipe-max-size``, 1 MB by default). Tasks and results
    are ~1 MB: through a socket pair's ~200 KB they took a wake-up of the other side every
    ~200 KB, and the main process spent more CPU moving data than reading the input."""
    receiving, sending = context.Pipe(duplex=False)
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    if set_size is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(sending.fileno(), set_size, _PIPE_BYTES)
    return receiving, sending


def _send(conn, outbox: queue.SimpleQueue) -> None:
    """A sender thread: one worker's tasks, in order, until ``None``. One per worker, because a
    send blocks until that worker has read a task larger than the pipe holds (a chunk of records
    is ~1 MB): with one sender for all, a busy worker held back the tasks of an idle one (the
    workers of a 2-worker run waited a large part of the time for tasks)."""
    while (task := outbox.get()) is not None:
        try:
            conn.send(task)
        except (OSError, ValueError):  # the worker died, or the pool is closing: result() reports it
            return


def _receive(conn, inbox: queue.SimpleQueue) -> None:
    """A receiver thread: every message of one worker into ``inbox`` as it arrives, then ``_DIED``
    at end of file. Reading as soon as a worker writes keeps it from blocking in ``send`` while
    the main process waits on another worker's older result (a result can exceed what the pipe
    holds): without it the workers of a 2-worker run sat a large part of the time in ``send``."""
    while True:
        try:
            reply = conn.recv()  # a message cut short by the worker's death ends in EOF, not a hang
        except (EOFError, OSError):
            inbox.put(_DIED)
            return
        except Exception as exc:  # noqa: BLE001 - a reply that does not unpickle: its task failed
            reply = (False, RemoteError(f"{type(exc).__name__}: {exc} (receiving a result)"))
        inbox.put(reply)


class OrderedPool:
    """``n`` worker processes; :meth:`submit` tasks, :meth:`result` returns their results in order.

    ``context`` is a multiprocessing context (fork or spawn); ``initializer(*initargs)``
    runs once in each worker before its first task. Every process is started by the
    constructor, so with ``fork`` nothing forks after the caller starts threads; a start
    that fails part-way (too many open files) kills the workers it started and raises.
    """

    def __init__(self, n: int, context, initializer=None, initargs=()):
        self._conns: list = []  # (task sender, result receiver) per worker
        self._procs: list = []
        self._submitted = 0
        self._outstanding: collections.deque = collections.deque()  # the worker of each task not yet taken
        self._given: list[int] = [0] * n  # tasks not yet taken, per worker
        self._outboxes: list[queue.SimpleQueue] = []  # each worker's tasks, sent by a thread of its own
        self._senders: list[threading.Thread] = []  # started after the last fork
        self._inboxes: list[queue.SimpleQueue] = []
        self._receivers: list[threading.Thread] = []
        try:
            for _ in range(n):
                task_in, task_out = _pipe(context)
                result_in, result_out = _pipe(context)
                self._conns.append((task_out, result_in))
                proc = context.Process(target=_serve, args=(task_in, result_out, initializer, initargs), daemon=True)
                proc.start()
                self._procs.append(proc)
                task_in.close()
                result_out.close()  # the child's end lives only in the child, so its death is EOF here
        except BaseException:
            self.close(kill=True)
            raise
        for k, (task_out, result_in) in enumerate(self._conns):
            outbox: queue.SimpleQueue = queue.SimpleQueue()
            sender = threading.Thread(target=_send, args=(task_out, outbox), name=f"pool-sender-{k}", daemon=True)
            sender.start()
            self._outboxes.append(outbox)
            self._senders.append(sender)
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            receiver = threading.Thread(target=_receive, args=(result_in, inbox), name=f"pool-receiver-{k}",
                                        daemon=True)
            receiver.start()
            self._inboxes.append(inbox)
            self._receivers.append(receiver)

    def submit(self, fn, *args) -> None:
        """Queue ``fn(*args)`` on the worker with the fewest unfinished tasks (the next in turn on a tie:
        round robin while they keep pace); never blocks."""
        n = len(self._conns)
        # unfinished: given and not taken, less those whose reply (or death) has arrived
        worker = min(((self._submitted + k) % n for k in range(n)),
                     key=lambda w: self._given[w] - self._inboxes[w].qsize())
        self._outboxes[worker].put((fn, args))
        self._outstanding.append(worker)
        self._given[worker] += 1
        self._submitted += 1

    def pending(self) -> int:
        """Tasks submitted whose result has not been taken."""
        return len(self._outstanding)

    def result(self):
        """The oldest outstanding task's result; its exception if it raised; WorkerDied if its worker died.

        After :meth:`close` there is none (closing drops the outstanding tasks): ValueError, as for a
        closed file."""
        if not self._procs:
            raise ValueError("result() of a closed OrderedPool")
        worker = self._outstanding.popleft()
        self._given[worker] -= 1
        reply = self._inboxes[worker].get()
        if reply is _DIED:
            self._inboxes[worker].put(_DIED)  # and for every later task of this worker
            proc = self._procs[worker]
            proc.join(1)
            raise WorkerDied(f"worker process {proc.pid} exited with code {proc.exitcode}")
        ok, value = reply
        if not ok:
            raise value
        return value

    def close(self, kill: bool = False) -> None:
        """Stop the workers: at once if ``kill`` or tasks are outstanding, else after their last task."""
        kill = kill or self.pending() > 0
        for outbox, sender in zip(self._outboxes, self._senders, strict=True):
            outbox.put(None)
            sender.join(5)
        for (task_out, _), proc in zip(self._conns, self._procs, strict=False):
            if kill:
                proc.kill()
            else:
                try:
                    task_out.send(None)
                except (OSError, ValueError):
                    proc.kill()
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for receiver in self._receivers:  # each sees end of file now that its worker is gone
            receiver.join(5)
        for ends in self._conns:
            for end in ends:
                end.close()
        self._procs, self._conns, self._receivers = [], [], []
        self._outstanding.clear()
        self._given = [0] * len(self._given)


def fork_or_spawn():
    """``fork`` on Linux (no re-import of torch and the tokenizer per worker), else ``spawn``."""
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
