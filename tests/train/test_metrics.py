"""StepTimer: the first step is timed alone, pauses are left out, tokens/s covers the rest; MFU."""

from __future__ import annotations

import pytest
import torch

from tokenloom.train import metrics
from tokenloom.train.metrics import StepTimer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", c)
    return c


def test_first_step_alone_then_interval_means(clock):
    timer = StepTimer(tokens_per_step=1000, device=torch.device("cpu"))
    timer.start()
    clock.now += 7.0  # the first step: compile and warm-up
    timer.step()
    for _ in range(4):
        clock.now += 0.5
        timer.step()
    # mean of steps 2-5; the first step is reported once
    assert timer.interval() == pytest.approx({"tokens_per_s": 2000.0, "step_time_s": 0.5, "first_step_s": 7.0})
    for _ in range(2):
        clock.now += 0.25
        timer.step()
    assert timer.interval() == pytest.approx({"tokens_per_s": 4000.0, "step_time_s": 0.25})
    assert timer.first_step_s == 7.0
    assert timer.tokens_per_s == pytest.approx(1000 * 6 / 2.5)
    assert timer.summary() == {"tokens_per_s": pytest.approx(2400.0), "first_step_s": 7.0}


def test_interval_of_only_the_first_step_and_pauses(clock):
    timer = StepTimer(tokens_per_step=10, device=torch.device("cpu"))
    timer.start()
    clock.now += 3.0
    timer.step()
    # log interval 1: the record still has a step time
    assert timer.interval() == pytest.approx({"tokens_per_s": 10 / 3, "step_time_s": 3.0, "first_step_s": 3.0})
    assert timer.tokens_per_s is None  # nothing but the first step yet
    clock.now += 1.0
    timer.step()
    with timer.paused():  # an evaluation or a checkpoint
        clock.now += 60.0
    clock.now += 1.0
    timer.step()
    assert timer.interval() == pytest.approx({"tokens_per_s": 10.0, "step_time_s": 1.0})
    assert timer.tokens_per_s == pytest.approx(10.0)


def test_mfu_is_model_flops_over_the_total_peak_and_none_without_one():
    assert metrics.mfu(600.0, 1000.0, 1e6) == pytest.approx(0.6)
    assert metrics.mfu(600.0, 1000.0, None) is None
