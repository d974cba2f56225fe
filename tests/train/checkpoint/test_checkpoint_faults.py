"""Faults while ``cli.py train`` writes a checkpoint (issue 19): a full disk, an I/O error and a
permission error end in one line naming the checkpoint and what to do; the previous complete
checkpoint stays the one ``--resume auto`` takes (a partial one never becomes latest), no
temporary folder is left, and resuming gives the losses of an uninterrupted run.

The faults are raised inside the ``train`` subprocess (and its torchrun ranks) where the kernel
raises them: opening, writing, fsyncing or renaming the checkpoint's files
(``tests/fault_site/sitecustomize.py``).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from tl_testing import fault_env, run_cli

from tokenloom.train.checkpoint import commit as checkpoint

RUN = ["--mock-data", "--seq-length", "16", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
       "--set", "model.vocab_size=64", "--set", "progress=false", "--set", "plot=false", "--eval-interval", "0",
       "--micro-batch-size", "2", "--global-batch-size", "4", "--set", "data.mock.num_sequences=200",
       "--set", "data.mock.max_length=40", "--train-iters", "6", "--save-interval", "3", "--log-interval", "1"]
pytestmark = pytest.mark.slow
ITER3, ITER6 = checkpoint.checkpoint_name(3), checkpoint.checkpoint_name(6)


def _train(out: Path, *extra, env=None):
    return run_cli("train", *RUN, "--output-dir", out, *extra, env=env, timeout=360)


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["iter"]: r["train_loss"] for r in records if "train_loss" in r}


def _one_line_error(done, *needles: str) -> str:
    assert done.returncode != 0, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(("warning: ", "logs: "))
             and not line.lstrip().startswith(("outputs ", "{"))]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    done = _train(out)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def reference(reference_run):
    losses = _losses(reference_run)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    return losses


FAULTS = {  # the fault hits iteration 6's checkpoint; iteration 3's is complete by then
    "disk-full-writing-the-model": ("write", errno.ENOSPC, f"{ITER6}.tmp/tp0_pp0_dp0.pt", 4096,
                                    "no space left on device writing", "free space on that disk"),
    "disk-full-at-fsync": ("fsync", errno.ENOSPC, f"{ITER6}.tmp/tp0_pp0_dp0.pt", 0,
                           "no space left on device writing", "free space on that disk"),
    "io-error-writing-rng": ("write", errno.EIO, f"{ITER6}.tmp/rng_rank0.pt", 0, "I/O error on",
                             "check it (dmesg)"),
    "io-error-publishing": ("rename", errno.EIO, f"{ITER6}", 0, "I/O error on", "check it (dmesg)"),
    "permission-denied": ("open", errno.EACCES, f"{ITER6}.tmp/state.json", 0, "permission denied on",
                          "give this user access"),
    "too-many-open-files": ("open", errno.EMFILE, f"{ITER6}.tmp/tp0_pp0_dp0.pt", 0, "too many open files at",
                            "raise the open-file limit (ulimit -n)"),
}


def test_faults_writing_a_checkpoint_keep_the_last_one_and_resume_gives_the_same_losses(tmp_path, reference):
    """Each fault of FAULTS in turn hits iteration 6's checkpoint of one output directory: the first
    in a fresh run, each next one in the ``--resume auto`` run after the previous fault (so every
    resume starts from what a fault left behind); the last resume, fault-free, completes with the
    losses of an uninterrupted run."""
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    resume: tuple[str, ...] = ()
    for fault, (op, err, pattern, room, what, advice) in FAULTS.items():
        done = _train(out, *resume, env=fault_env(op, err, f"{ckpt}/{pattern}", room))
        assert not resume or f"resumed from {ckpt / ITER3} at iteration 3" in done.stderr, (fault, done.stderr)
        _one_line_error(done, f"{what} {ckpt / ITER6}", advice, f"the last complete one is {ckpt / ITER3}",
                        "--resume auto")
        assert checkpoint.resolve("auto", ckpt) == ckpt / ITER3, f"{fault}: a partial checkpoint became the latest"
        assert (ckpt / checkpoint.LATEST).read_text().strip() == ITER3
        assert sorted(p.name for p in ckpt.iterdir()) == [ITER3, checkpoint.LATEST], f"{fault}: temporary folders"
        assert checkpoint.read_state(ckpt / ITER3)["iteration"] == 3
        resume = ("--resume", "auto")

    again = _train(out, *resume)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {ckpt / ITER3} at iteration 3" in again.stderr
    assert _losses(out) == reference, "resuming continues with the losses of an uninterrupted run"
    assert checkpoint.resolve("auto", ckpt) == ckpt / ITER6


def test_a_fault_before_any_checkpoint_says_the_rerun_starts_over(tmp_path, reference):
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    iter3 = ckpt / ITER3
    done = _train(out, env=fault_env("write", errno.ENOSPC, f"{iter3}.tmp/tp0_pp0_dp0.pt", 1000))
    _one_line_error(done, f"no space left on device writing {iter3}", "there is no complete checkpoint yet",
                    "rerun the same command")
    assert checkpoint.resolve("auto", ckpt) is None and list(ckpt.iterdir()) == []
    again = _train(out, "--resume", "auto")
    assert again.returncode == 0 and "resumed from" not in again.stderr, again.stderr
    assert _losses(out) == reference


def test_a_fault_updating_the_latest_pointer_keeps_the_complete_checkpoint(tmp_path, reference):
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    done = _train(out, env=fault_env("rename", errno.EIO, ckpt / checkpoint.LATEST))
    _one_line_error(done, f"I/O error on {ckpt / checkpoint.LATEST}", f"checkpoint {ckpt / ITER3} is complete",
                    "--resume auto continues from it")
    assert checkpoint.resolve("auto", ckpt) == ckpt / ITER3 and not (ckpt / checkpoint.LATEST).exists()
    assert not list(ckpt.glob(f"{checkpoint.LATEST}.tmp-*")), "the pointer's temporary file is removed"
    again = _train(out, "--resume", "auto")
    assert again.returncode == 0 and f"resumed from {ckpt / ITER3} at iteration 3" in again.stderr, again.stderr
    assert _losses(out) == reference
    assert (ckpt / checkpoint.LATEST).read_text().strip() == ITER6


# (rank that meets the fault, its file) in turn, the second in the resume after the first; extra flags
TWO_RANK_FAULTS = {"plain": ([(1, "rng_rank1.pt"), (0, "tp0_pp0_dp0.pt")], ()),
                   "zero1": ([(1, "tp0_pp0_dp1.pt")], ("--set", "zero1=true"))}


@pytest.mark.parametrize("name", TWO_RANK_FAULTS)
def test_two_ranks_a_disk_full_on_one_rank_ends_in_its_one_line_and_resume_gives_the_same_losses(tmp_path, name):
    """``--nproc-per-node 2``: every rank writes its RNG file and its piece file (its half of the
    replicated state; with ZeRO-1 its own optimizer shard too). The rank that met the fault
    names it in the one error line (the other rank's broken barrier is its symptom); a fault in
    one rank's file, then in another's (in the resumed run), and the final resume gives the
    losses of an uninterrupted 2-rank run (the first run's: it trained all six steps before its
    last save failed)."""
    faults, extra = TWO_RANK_FAULTS[name]
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    resume: tuple[str, ...] = ()
    uninterrupted: dict[int, float] = {}
    for rank, file in faults:
        done = _train(out, "--nproc-per-node", "2", *extra, *resume,
                      env=fault_env("write", errno.ENOSPC, f"{ckpt}/{ITER6}.tmp/{file}", 100))
        line = _one_line_error(done, f"error: rank {rank}: no space left on device writing {ckpt / ITER6}",
                               f"the last complete one is {ckpt / ITER3}", "--resume auto", "full logs: ")
        assert "barrier failed" not in line
        assert checkpoint.resolve("auto", ckpt) == ckpt / ITER3, "a partial checkpoint never becomes the latest"
        assert (ckpt / checkpoint.LATEST).read_text().strip() == ITER3
        # the first run trained every step before its last save failed: the uninterrupted run's losses
        uninterrupted = uninterrupted or _losses(out)
        resume = ("--resume", "auto")
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5, 6]
    again = _train(out, "--nproc-per-node", "2", *extra, *resume)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {ckpt / ITER3} at iteration 3" in again.stderr
    assert _losses(out) == uninterrupted
    assert sorted(p.name for p in ckpt.iterdir()) == [ITER3, ITER6, checkpoint.LATEST], "the next save cleans up"


# --------------------------------------------------------------------------- the run's own files


def test_a_full_disk_appending_metrics_stops_with_one_line_and_resume_completes(tmp_path, reference_run, reference):
    """The disk fills half-way through iteration 5's metrics record (after checkpoint 3): one line
    naming metrics.jsonl and the checkpoint to resume from; the torn record is dropped on resume."""
    lines = (reference_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    room = sum(len(line) for line in lines[:4]) + len(lines[4]) // 2
    out = tmp_path / "run"
    metrics, ckpt = out / "metrics.jsonl", out / "checkpoints"
    done = _train(out, env=fault_env("write", errno.ENOSPC, str(metrics), room))
    _one_line_error(done, f"no space left on device writing {metrics}", f"the last complete one is {ckpt / ITER3}",
                    "--resume auto")
    assert not metrics.read_text().endswith("\n"), "the fault tore a record, as a full disk does"
    again = _train(out, "--resume", "auto")
    assert again.returncode == 0, again.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iter"] for r in records if "train_loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["iter"] for r in records if "checkpoint" in r][-1] == 6  # each save's record (a torn one is dropped)
    assert _losses(out) == reference


def test_too_many_open_files_writing_the_config_stops_before_training(tmp_path):
    out = tmp_path / "run"
    done = _train(out, env=fault_env("open", errno.EMFILE, f"{out}/config.json*"))
    _one_line_error(done, f"too many open files at {out / 'config.json'}", "ulimit -n",
                    "there is no complete checkpoint yet")
    assert list(out.iterdir()) == [], "no config and no temporary file is left"


def test_a_full_disk_drawing_the_loss_plot_is_a_warning_after_a_complete_run(tmp_path, reference):
    out = tmp_path / "run"
    done = _train(out, "--set", "plot=true", env=fault_env("write", errno.ENOSPC, f"{out}/loss.png*"))
    assert done.returncode == 0, done.stderr
    assert f"warning: no loss plot: no space left on device writing {out / 'loss.png'}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not list(out.glob("loss.png*")), "neither a half-written plot nor its temporary file"
    assert _losses(out) == reference and checkpoint.resolve("auto", out / "checkpoints").name == ITER6
