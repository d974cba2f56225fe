"""The preprocess worker pool: order, errors, and a worker killed in the middle of a result."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from tokenloom.preprocess.pool import OrderedPool, RemoteError, WorkerDied, fork_or_spawn


def _slow_square(x: int, delay: float) -> int:
    time.sleep(delay)
    return x * x


def _fail(message: str) -> None:
    raise ValueError(message)


def _unpicklable():
    return threading.Lock()


def _big_after_pid(path: str, n: int) -> bytes:
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    return b"x" * n


@pytest.fixture(params=["default", "spawn"])
def context(request):
    return fork_or_spawn() if request.param == "default" else multiprocessing.get_context("spawn")


def test_results_come_back_in_submission_order(context):
    pool = OrderedPool(3, context)
    try:
        delays = [0.05, 0.0, 0.02, 0.0, 0.04, 0.01, 0.0, 0.03]
        for i, d in enumerate(delays):
            pool.submit(_slow_square, i, d)
        assert [pool.result() for _ in delays] == [i * i for i in range(len(delays))]
        assert pool.pending() == 0
    finally:
        pool.close()


def test_a_task_error_is_raised_here_and_the_pool_goes_on():
    pool = OrderedPool(2, fork_or_spawn())
    try:
        pool.submit(_fail, "bad record")
        pool.submit(_unpicklable)
        pool.submit(_slow_square, 3, 0.0)
        with pytest.raises(ValueError, match="bad record"):
            pool.result()
        with pytest.raises(RemoteError, match="lock"):
            pool.result()
        assert pool.result() == 9
    finally:
        pool.close()


def test_close_lets_idle_workers_exit_and_kills_busy_ones():
    pool = OrderedPool(2, fork_or_spawn())
    pids = []
    for _ in range(2):
        pool.submit(os.getpid)
    pids = [pool.result(), pool.result()]
    assert len(set(pids)) == 2
    pool.close()
    busy = OrderedPool(1, fork_or_spawn())
    busy.submit(time.sleep, 60)
    start = time.monotonic()
    busy.close()
    assert time.monotonic() - start < 10


def test_a_worker_killed_while_sending_a_large_result_is_reported_not_waited_for(monkeypatch, tmp_path):
    """A message cut short by a death ends in EOF: ProcessPoolExecutor's reader thread waits forever on it.
    The pool's receiver threads are held back until the victim is dead, so it dies blocked in its send."""
    from tokenloom.preprocess import pool as pool_module

    gate, real_receive = threading.Event(), pool_module._receive
    monkeypatch.setattr(pool_module, "_receive", lambda conn, inbox: gate.wait() and real_receive(conn, inbox))
    pid_file = tmp_path / "victim"
    pool = OrderedPool(2, fork_or_spawn())
    try:
        pool.submit(_big_after_pid, str(pid_file), 256 << 20)  # far beyond a pipe's buffer: blocks part-way
        pool.submit(_slow_square, 2, 0.0)
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        victim = int(pid_file.read_text())
        time.sleep(1.0)  # nothing reads yet: the victim is stuck inside its send
        os.kill(victim, signal.SIGKILL)
        gate.set()
        outcome = []

        def take():
            try:
                outcome.append(pool.result())
            except WorkerDied as exc:
                outcome.append(exc)

        reader = threading.Thread(target=take, daemon=True)
        reader.start()
        reader.join(30)
        assert not reader.is_alive(), "result() hung on a dead worker"
        assert isinstance(outcome[0], WorkerDied) and str(victim) in str(outcome[0])
        assert pool.result() == 4  # the other worker's result is still delivered
    finally:
        pool.close()


def test_close_drops_outstanding_tasks_and_result_after_it_says_the_pool_is_closed():
    pool = OrderedPool(2, fork_or_spawn())
    pool.submit(time.sleep, 60)
    pool.submit(_slow_square, 2, 0.0)
    pool.close()
    assert pool.pending() == 0
    with pytest.raises(ValueError, match="closed"):
        pool.result()
