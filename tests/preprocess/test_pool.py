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


def _big(n: int) -> bytes:
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


def test_a_worker_killed_while_sending_a_large_result_is_reported_not_waited_for():
    """A message cut short by a death ends in EOF: ProcessPoolExecutor's reader thread waits forever on it."""
    pool = OrderedPool(2, fork_or_spawn())
    try:
        pool.submit(os.getpid)
        pool.submit(os.getpid)
        victim, _ = pool.result(), pool.result()
        pool.submit(_big, 256 << 20)  # to the victim: far beyond a pipe's buffer, so it blocks part-way
        pool.submit(_slow_square, 2, 0.0)
        time.sleep(1.0)  # this process reads nothing yet: the victim is stuck inside its send
        os.kill(victim, signal.SIGKILL)
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
    finally:
        pool.close()
