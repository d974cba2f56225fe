"""StepTimer: the first step is timed alone, pauses are left out, tokens/s covers the rest; MFU; the
logger (time stamps, TensorBoard, W&B, a missing package) and the loss figure's panels and marks."""

from __future__ import annotations

import sys
import time
import types
import warnings

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
    timer.step(data_wait_s=2.0)  # the loader's start: left out with the first step
    for _ in range(4):
        clock.now += 0.5
        timer.step(data_wait_s=0.1)
    # mean of steps 2-5; the first step is reported once; the data wait is summed over the interval
    assert timer.interval() == pytest.approx({"tokens_per_s": 2000.0, "step_time_s": 0.5, "first_step_s": 7.0,
                                              "data_wait_s": 0.4, "data_wait_share": 0.2})
    for _ in range(2):
        clock.now += 0.25
        timer.step()
    assert timer.interval() == pytest.approx({"tokens_per_s": 4000.0, "step_time_s": 0.25, "data_wait_s": 0.0,
                                              "data_wait_share": 0.0})
    assert timer.first_step_s == 7.0
    assert timer.tokens_per_s == pytest.approx(1000 * 6 / 2.5)
    assert timer.summary() == {"tokens_per_s": pytest.approx(2400.0), "first_step_s": 7.0,
                               "data_wait_share": pytest.approx(0.4 / 2.5)}


def test_interval_of_only_the_first_step_and_pauses(clock):
    timer = StepTimer(tokens_per_step=10, device=torch.device("cpu"))
    timer.start()
    clock.now += 3.0
    timer.step(data_wait_s=1.5)
    # log interval 1: the record still has a step time, and the first step's data wait
    assert timer.interval() == pytest.approx({"tokens_per_s": 10 / 3, "step_time_s": 3.0, "first_step_s": 3.0,
                                              "data_wait_s": 1.5, "data_wait_share": 0.5})
    assert timer.tokens_per_s is None and timer.data_wait_share is None  # nothing but the first step yet
    clock.now += 1.0
    timer.step()
    with timer.paused():  # an evaluation or a checkpoint
        clock.now += 60.0
    clock.now += 1.0
    timer.step()
    assert timer.interval() == pytest.approx({"tokens_per_s": 10.0, "step_time_s": 1.0, "data_wait_s": 0.0,
                                              "data_wait_share": 0.0})
    assert timer.tokens_per_s == pytest.approx(10.0)


def test_mfu_is_model_flops_over_the_total_peak_and_none_without_one():
    assert metrics.mfu(600.0, 1000.0, 1e6) == pytest.approx(0.6)
    assert metrics.mfu(600.0, 1000.0, None) is None


# --------------------------------------------------------------------------- the logger and the figure


def test_every_record_has_a_time_and_tensorboard_gets_an_event_file(tmp_path):
    logger = metrics.MetricsLogger(tmp_path / "m.jsonl", tensorboard_dir=str(tmp_path / "tb"))
    before = time.time()
    logger.log({"iter": 1, "train_loss": 2.5, "lr": 1e-3})
    logger.log({"iter": 1, "checkpoint": "c", "save_stall_s": 0.1, "save_write_s": 0.2})
    logger.close()
    records = metrics.read_metrics(tmp_path / "m.jsonl")
    assert [list(r)[:2] for r in records] == [["iter", "time"]] * 2
    assert all(before - 1 <= r["time"] <= time.time() + 1 for r in records)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_a_missing_logger_package_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no raw UserWarning
        logger = metrics.MetricsLogger(tmp_path / "m.jsonl", tensorboard_dir=str(tmp_path / "tb"),
                                       wandb_project="proj")
    logger.log({"iter": 1, "train_loss": 2.5})
    logger.close()
    assert capsys.readouterr().err.splitlines() == [
        f"warning: tensorboard_dir {tmp_path / 'tb'} is ignored: the tensorboard package is not installed "
        "(pip install 'tokenloom[tensorboard]')",
        "warning: wandb_project proj is ignored: the wandb package is not installed (pip install 'tokenloom[wandb]')"]
    assert not (tmp_path / "tb").exists() and len(metrics.read_metrics(tmp_path / "m.jsonl")) == 1


class FakeWandb(types.ModuleType):
    """The part of the wandb module a run uses, recording the calls (no network)."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.calls: list[tuple] = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def define_metric(self, name, **kwargs):
        self.calls.append(("define_metric", name, kwargs))

    def log(self, data):
        self.calls.append(("log", data))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_gets_the_numeric_fields_against_iter(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = metrics.MetricsLogger(tmp_path / "m.jsonl", wandb_project="proj", wandb_exp_name="exp",
                                   run_config={"train_iters": 3}, wandb_dir=tmp_path)
    logger.log({"iter": 2, "train_loss": 2.5, "mfu": None, "resumed_from": "x", "blend_changed": True})
    logger.log({"iter": 4, "val_loss": 2.0, "val_loss_per_source": {"web": 2.5, "code": None}})
    logger.close()
    assert fake.calls == [
        ("init", {"project": "proj", "name": "exp", "config": {"train_iters": 3}, "dir": str(tmp_path),
                  "resume": "allow"}),
        ("define_metric", "iter", {}), ("define_metric", "*", {"step_metric": "iter"}),
        ("log", {"iter": 2, "train_loss": 2.5}),
        ("log", {"iter": 4, "val_loss": 2.0, "val_loss_per_source/web": 2.5}),  # a mapping: one scalar per key
        ("finish",)]


def test_the_loss_figure_has_a_learning_rate_panel_and_marks_resumes_and_blend_changes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [{"iter": i, "train_loss": 3.0 - 0.1 * i, "lr": 1e-3 * i} for i in range(1, 9)]
    records += [{"iter": 4, "val_loss": 2.7}, {"iter": 3, "resumed_from": "ck/iter_3", "blend_changed": False},
                {"iter": 6, "resumed_from": "ck/iter_6", "blend_changed": True}]
    fig = metrics.loss_figure(records)
    try:
        loss_ax, lr_ax = fig.axes
        assert loss_ax.get_ylabel() == "loss" and lr_ax.get_ylabel() == "learning rate"
        assert list(lr_ax.lines[0].get_ydata()) == [r["lr"] for r in records[:8]]

        def marks(ax):
            return sorted((float(line.get_xdata()[0]), line.get_linestyle()) for line in ax.lines
                          if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2)

        assert marks(loss_ax) == marks(lr_ax) == [(3.0, ":"), (6.0, "--")]
        assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == [
            "train loss", "val loss", "resumed", "blend changed"]
    finally:
        plt.close(fig)
