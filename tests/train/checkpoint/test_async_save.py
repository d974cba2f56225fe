"""Checkpoints written in the background (``async_save``): host staging, the one write in flight,
failures raised on the main thread, per-save metrics, and runs identical to synchronous saves."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest
import torch
from test_loop import losses, tiny

from tokenloom.errors import TokenloomError
from tokenloom.train import loop
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.checkpoint.async_save import CheckpointSaver, HostStaging
from tokenloom.train.loop import run
from tokenloom.train.metrics import read_metrics

CKPT_FILES = ("tp0_pp0_dp0.pt", "rng_rank0.pt", "state.json", checkpoint.COMPLETE)


def test_staging_copies_into_buffers_it_reuses_and_keeps_tied_views_shared():
    w = torch.arange(6.0).reshape(2, 3)
    state = {"a": w, "tied": w.detach(), "opt": [{"step": torch.tensor(3.0), "lr": 0.1}], "betas": (0.9, 0.95)}
    staging = HostStaging(pin_memory=False)
    first = staging.stage(state, share_views=True)
    assert torch.equal(first["a"], w) and first["a"].data_ptr() != w.data_ptr()
    assert first["tied"].data_ptr() == first["a"].data_ptr(), "one view of one storage: one copy, written once"
    assert first["opt"][0]["lr"] == 0.1 and first["betas"] == (0.9, 0.95) and isinstance(first["betas"], tuple)
    w.add_(100)  # the next step changes the live state; the staged copy keeps the saved values
    assert torch.equal(first["a"], torch.arange(6.0).reshape(2, 3))
    again = staging.stage(state, share_views=True)
    assert again["a"].data_ptr() == first["a"].data_ptr(), "the second save reuses the first one's buffer"
    assert torch.equal(again["a"], w)
    assert staging.nbytes == w.nbytes + 4
    apart = HostStaging(pin_memory=False).stage(state, share_views=False)
    assert apart["tied"].data_ptr() != apart["a"].data_ptr() and torch.equal(apart["tied"], w), "a copy each"
    grown = staging.stage({**state, "a": torch.zeros(4)}, share_views=True)
    assert grown["a"].shape == (4,), "a buffer whose shape no longer matches is replaced"


def _saver(root: Path, asynchronous: bool = True) -> CheckpointSaver:
    return CheckpointSaver(root, rank=0, world_size=1, keep_last=0, asynchronous=asynchronous, pin_memory=False,
                           timeout_s=60)


def _files(value: float) -> dict:
    return {"model.pt": {"w": torch.full((4,), value)}}


def test_one_write_in_flight_and_the_next_save_waits_for_it(tmp_path, monkeypatch):
    """The write runs on another thread while save() has returned; the next save starts its
    write only after the previous one ended; wait() reports both with their stall and write time."""
    release, spans = threading.Event(), []
    save_files = checkpoint.save_files

    def slow(root, iteration, write, state, **kw):
        began = time.perf_counter()
        if iteration == 1:
            assert release.wait(30)
        path = save_files(root, iteration, write, state, **kw)
        spans.append((iteration, began, time.perf_counter()))
        return path

    monkeypatch.setattr(checkpoint, "save_files", slow)
    saver = _saver(tmp_path)
    path = saver.save(1, lambda: _files(1.0), {}, fresh_copies=False)
    assert path == tmp_path / "iter_0000001" and saver.writing and not path.exists()
    saver.poll()  # still writing: nothing to take, nothing raised
    assert saver.take_reports() == []
    threading.Timer(0.2, release.set).start()
    saver.save(2, lambda: _files(2.0), {}, fresh_copies=False)  # waits for iteration 1's write first
    saver.wait()
    (_, _, end1), (_, begin2, _) = spans
    assert begin2 >= end1
    reports = saver.take_reports()
    assert [r.iteration for r in reports] == [1, 2] and all(r.write_s > 0 and r.stall_s >= 0 for r in reports)
    assert reports[0].record() == {"iter": 1, "checkpoint": str(path), "save_stall_s": reports[0].stall_s,
                                   "save_write_s": reports[0].write_s}
    assert checkpoint.find_latest(tmp_path) == tmp_path / "iter_0000002"
    assert torch.equal(checkpoint.load_tensors(tmp_path / "iter_0000001", "model.pt")["w"], torch.ones(4))


def test_the_copy_runs_after_save_returns_and_the_update_gate_waits_for_it(tmp_path, monkeypatch):
    """save() returns before the state is copied (the containers' plain values are frozen at
    the call); before_update() blocks until the copy is done and that wait is part of the
    save's stall; the checkpoint holds the state as it was at save(), not as updated later."""
    release = threading.Event()
    stage = HostStaging.stage

    def slow_copy(self, obj, **kw):
        assert release.wait(30)
        return stage(self, obj, **kw)

    monkeypatch.setattr(HostStaging, "stage", slow_copy)
    w, group = torch.full((4,), 1.0), {"lr": 0.5}
    saver = _saver(tmp_path)
    saver.save(1, lambda: {"model.pt": {"w": w, "group": group}}, {}, fresh_copies=False)
    group["lr"] = 0.25  # a plain value changed after save(): the checkpoint keeps 0.5
    threading.Timer(0.3, release.set).start()
    saver.before_update()  # blocks until the copy is done
    assert release.is_set()
    w.add_(100)  # the optimizer step, after the gate: the checkpoint keeps the values of save()
    saver.before_update()  # nothing to wait for now
    saver.wait()
    saved = checkpoint.load_tensors(tmp_path / "iter_0000001", "model.pt")
    assert torch.equal(saved["w"], torch.ones(4)) and saved["group"] == {"lr": 0.5}
    (report,) = saver.take_reports()
    assert report.stall_s >= 0.2, "the gate's wait counts in the stall"
    saver.before_update()  # no save in flight: returns at once


def test_a_failed_background_write_is_raised_by_the_next_poll_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    saver = _saver(tmp_path)
    saver.save(1, lambda: _files(1.0), {}, fresh_copies=False)
    saver.wait()
    write_file = checkpoint.write_file

    def full_disk(path, write):
        if "iter_0000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        write_file(path, write)

    monkeypatch.setattr(checkpoint, "write_file", full_disk)
    saver.save(2, lambda: _files(2.0), {}, fresh_copies=False)
    deadline = time.monotonic() + 30
    with pytest.raises(TokenloomError) as raised:
        while time.monotonic() < deadline:  # a step boundary, again and again
            saver.poll()
            time.sleep(0.01)
    message = str(raised.value)
    assert f"no space left on device writing {tmp_path / 'iter_0000002'}" in message
    assert f"the last complete one is {tmp_path / 'iter_0000001'}" in message
    assert checkpoint.find_latest(tmp_path) == tmp_path / "iter_0000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", checkpoint.LATEST]
    assert not saver.writing and [r.iteration for r in saver.take_reports()] == [1]


def _run_both(tmp_path: Path, **overrides) -> tuple[dict, dict]:
    summaries = {}
    for name, asynchronous in (("sync", False), ("async", True)):
        summaries[name] = run(tiny(tmp_path / name, train_iters=6, save_interval=2, eval_interval=0,
                                   async_save=asynchronous, **overrides))
    return summaries["sync"], summaries["async"]


@pytest.mark.parametrize("layout", [{}, {"zero1": True}], ids=["one-process", "zero1"])
def test_async_and_sync_saves_give_the_same_run_and_the_same_bytes(tmp_path, layout):
    """Losses, parameters and every checkpoint file but state.json (which holds the output
    directory) are byte-identical with async and sync saves, with plain AdamW and with ZeRO-1 (here
    on one rank)."""
    sync, asynchronous = _run_both(tmp_path, **layout)
    assert losses(tmp_path / "sync") == losses(tmp_path / "async")
    for it in (2, 4, 6):
        a, b = (tmp_path / side / "checkpoints" / checkpoint.checkpoint_name(it) for side in ("sync", "async"))
        names = sorted(p.name for p in a.iterdir())
        assert names == sorted(p.name for p in b.iterdir())
        assert "tp0_pp0_dp0.pt" in names and "model.pt" not in names  # one format for both
        for name in names:
            if name != "state.json":
                assert (a / name).read_bytes() == (b / name).read_bytes(), (it, name)
    assert [s["iter"] for s in sync["saves"]] == [s["iter"] for s in asynchronous["saves"]] == [2, 4, 6]


def test_each_save_reports_its_stall_and_write_time_and_a_resume_cuts_them_back(tmp_path):
    cfg = tiny(tmp_path, train_iters=6, save_interval=2, eval_interval=0)
    summary = run(cfg)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "checkpoint" in r]
    assert [r["iter"] for r in records] == [2, 4, 6]
    for r in records:
        assert r["checkpoint"] == str(tmp_path / "checkpoints" / checkpoint.checkpoint_name(r["iter"]))
        assert r["save_stall_s"] >= 0 and r["save_write_s"] > 0
    assert summary["saves"] == [{k: r[k] for k in ("iter", "save_stall_s", "save_write_s")} for r in records]
    assert summary["checkpoint"] == records[-1]["checkpoint"]

    again = tiny(tmp_path, train_iters=8, save_interval=2, eval_interval=0, override_opt_param_scheduler=True,
                 resume=str(tmp_path / "checkpoints" / "iter_0000004"))
    run(again)
    iters = [r["iter"] for r in read_metrics(tmp_path / "metrics.jsonl") if "checkpoint" in r]
    assert iters == [2, 4, 6, 8], "the records after the resumed checkpoint are cut, then written again"


def test_a_failure_in_the_loop_completes_the_write_in_flight(tmp_path, monkeypatch):
    """An error raised while a background write is in flight (here: a non-finite loss at the step
    after a slow save) leaves that checkpoint complete (a single process waits for the write), so
    ``--resume auto`` continues from it."""
    save_files = checkpoint.save_files

    def slow(root, iteration, *args, **kw):
        time.sleep(0.5)
        return save_files(root, iteration, *args, **kw)

    monkeypatch.setattr(checkpoint, "save_files", slow)
    original = loop.Trainer._log_train

    def nan_at_3(self, mean_loss, *args):
        return original(self, mean_loss * float("nan") if self.iteration == 3 else mean_loss, *args)

    monkeypatch.setattr(loop.Trainer, "_log_train", nan_at_3)
    with pytest.raises(TokenloomError, match="training loss is nan at iteration 3"):
        run(tiny(tmp_path, train_iters=6, save_interval=2, eval_interval=0))
    assert checkpoint.find_latest(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "iter_0000002"
    for name in CKPT_FILES:
        assert (tmp_path / "checkpoints" / "iter_0000002" / name).is_file()
