"""Faults end cleanly and resume (issue 19): a full disk and other OS errors, a dead worker, a killed
main process, a kill at each publish step, temporary files of dead runs, and the space estimate.

Operating-system errors are injected where a real one would arise (the ``.bin`` write that runs out
of room, the checkpoint file that cannot be created); kills are real SIGKILLs of subprocesses
wherever the timing allows it, and simulated by an exception nothing catches at the exact publish
steps. Every test then reruns the same command and compares bytes with an uninterrupted run.
"""

from __future__ import annotations

import errno
import gc
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from preprocess_helpers import REPO, preprocess, same_bytes, write_jsonl
from tl_testing import cli_env, fault_env, limit_s, one_line_error, shared_data_dir

from tokenloom.cli import main
from tokenloom.indexed import format as indexed_format
from tokenloom.preprocess import checkpoint, pipeline, space
from tokenloom.preprocess.worker import encode_in_worker


def _corpus(path: Path, n: int, seed: int = 0, words: int = 300) -> Path:
    rng = np.random.default_rng(seed)
    vocab = ["alpha", "beta", "gamma", "δέλτα", "\n", "zeta", "🙂"]
    return write_jsonl(path, [{"text": " ".join(rng.choice(vocab, int(rng.integers(1, words))))} for _ in range(n)])


def _args(path: Path, out: Path, *extra) -> list[str]:
    return ["preprocess", "--input", str(path), "--output-prefix", str(out), "--tokenizer-type", "byte",
            "--append-eod", "--workers", "1", "--no-progress", "--chunk-bytes", "4096", *map(str, extra)]


def _invoke(args):
    return CliRunner().invoke(main, args)


def _left_behind(directory: Path, name: str = "out") -> list[str]:
    """Files under final names or temporary names of ``name`` (the partial folder is listed apart)."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(name) and not p.name.endswith(".partial"))


def _assert_one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


class _SmallDisk(io.RawIOBase):
    """A file on a filesystem with ``room`` bytes left: writes what fits, then fails like the kernel.

    It sits under a real ``BufferedWriter``, so buffered bytes meet the full disk again when
    the file is flushed or closed, as they do on a real filesystem.
    """

    def __init__(self, raw, room: int, err: int):
        self._raw, self._room, self._err = raw, room, err

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self._room == 0:
            raise OSError(self._err, os.strerror(self._err))  # no file name, as from write(2)
        n = self._raw.write(memoryview(data).cast("B")[: self._room])  # the short write a full disk allows
        self._room -= n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def truncate(self, size=None) -> int:
        return self._raw.truncate(size)

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()
        super().close()


@pytest.fixture
def small_disk(monkeypatch):
    """``small_disk(room, err)``: every ``IndexedDatasetWriter`` opened afterwards fails after ``room`` bytes."""

    def install(room: int, err: int = errno.ENOSPC):
        original = indexed_format.IndexedDatasetWriter.__init__

        def init(self, *a, **kw):
            original(self, *a, **kw)
            self._bin = io.BufferedWriter(_SmallDisk(self._bin.detach(), room, err))

        monkeypatch.setattr(indexed_format.IndexedDatasetWriter, "__init__", init)
        return monkeypatch

    return install


# --------------------------------------------------------------------------- disk full and other OS errors


def test_disk_full_mid_run_ends_in_one_line_keeps_the_checkpoint_and_resumes(tmp_path, small_disk):
    path = _corpus(tmp_path / "c.jsonl", 400)
    reference = preprocess(tmp_path, [path], name="ref", append_eod=True)
    full = (tmp_path / "ref.bin").stat().st_size
    out = tmp_path / "out"
    patch = small_disk(full // 2)
    result = _invoke(_args(path, out, "--checkpoint-interval", "0"))
    line = _assert_one_line_error(result, f"no space left on device writing {out}.partial/0.bin",
                                  "free space on that disk", f"resume from the checkpoint in {out}.partial")
    assert _left_behind(tmp_path) == [], "nothing under final or temporary names"
    state, arrays = checkpoint.Checkpoint(Path(f"{out}.partial")).load()
    kept = (tmp_path / "out.partial" / "0.bin").stat().st_size
    assert kept == int(arrays[0]["bin_bytes"]) < full // 2, "bytes after the checkpoint are cut away"
    assert f"({state['counts']['records']} records done, " in line and state["counts"]["records"] > 0
    patch.undo()
    again = _invoke(_args(path, out, "--checkpoint-interval", "0"))
    assert again.exit_code == 0, again.output
    assert f"resuming from {out}.partial" in again.output
    assert same_bytes(out, reference)
    assert _left_behind(tmp_path) == ["out.bin", "out.idx", "out.manifest.json"]
    assert not Path(f"{out}.partial").exists()


def test_disk_full_before_any_checkpoint_removes_everything_and_says_it_starts_over(tmp_path, small_disk):
    path = _corpus(tmp_path / "c.jsonl", 200)
    out = tmp_path / "out"
    patch = small_disk(1000)
    result = _invoke(_args(path, out, "--checkpoint-interval", "1e9"))
    _assert_one_line_error(result, f"{out}.partial/0.bin", "no checkpoint was saved yet, so it starts over")
    assert _left_behind(tmp_path) == [] and not Path(f"{out}.partial").exists()
    patch.undo()
    assert _invoke(_args(path, out)).exit_code == 0
    assert same_bytes(out, preprocess(tmp_path, [path], name="ref", append_eod=True))


@pytest.mark.parametrize("err, phrase", [(errno.EMFILE, "too many open files at"), (errno.EIO, "I/O error on"),
                                         (errno.EACCES, "permission denied on")])
def test_other_write_errors_name_the_path_and_what_to_do(tmp_path, small_disk, err, phrase):
    path = _corpus(tmp_path / "c.jsonl", 200)
    out = tmp_path / "out"
    small_disk(5000, err)
    result = _invoke(_args(path, out, "--checkpoint-interval", "0"))
    _assert_one_line_error(result, f"{phrase} {out}.partial/0.bin", "rerun the same command")
    assert _left_behind(tmp_path) == []


def test_an_unwritable_checkpoint_names_its_file(tmp_path, monkeypatch):
    path = _corpus(tmp_path / "c.jsonl", 100)
    out = tmp_path / "out"

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(checkpoint.np, "savez", denied)
    result = _invoke(_args(path, out, "--checkpoint-interval", "0"))
    _assert_one_line_error(result, f"permission denied on {out}.partial/checkpoint.npz", "give this user access")
    assert _left_behind(tmp_path) == [] and not Path(f"{out}.partial").exists()


def test_too_many_open_files_while_starting_workers_stops_the_started_ones(tmp_path, monkeypatch):
    import multiprocessing

    path = _corpus(tmp_path / "c.jsonl", 50)
    pipe, started = os.pipe, []

    def pipe_until_two_workers_run():  # each forked worker takes two pipes; the pool's queues take some first
        if len(multiprocessing.active_children()) >= 2:
            started.append(len(multiprocessing.active_children()))
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return pipe()

    monkeypatch.setattr(os, "pipe", pipe_until_two_workers_run)
    args = _args(path, tmp_path / "out")
    args[args.index("--workers") + 1] = "8"
    result = _invoke(args)
    monkeypatch.undo()
    _assert_one_line_error(result, f"too many open files at {tmp_path}/out.partial", "ulimit -n",
                           "no checkpoint was saved yet, so it starts over")
    assert started, "the failure came before any worker started"
    assert multiprocessing.active_children() == [], "started workers would keep the process from exiting"
    assert _left_behind(tmp_path) == [] and not (tmp_path / "out.partial").exists()


def test_space_check_refuses_in_one_line(tmp_path, monkeypatch):
    path = _corpus(tmp_path / "c.jsonl", 100)
    monkeypatch.setattr(space.shutil, "disk_usage", lambda d: type("U", (), {"free": 1000})())
    result = _invoke(_args(path, tmp_path / "out"))
    _assert_one_line_error(result, f"not enough disk space in {tmp_path}", "--no-space-check")
    assert _left_behind(tmp_path) == [] and not (tmp_path / "out.partial").exists()
    assert _invoke(_args(path, tmp_path / "out", "--no-space-check")).exit_code == 0


def _estimate_and_real(tmp_path, inputs, **kw) -> tuple[int, int]:
    cfg = pipeline.PreprocessConfig(inputs=[str(i) for i in inputs], output_prefix=str(tmp_path / "est"),
                                    progress=False, workers=1, **kw)
    r = pipeline._Run(cfg, lambda *a: None)
    samples = space.sample_chunks(r.inputs, cfg.json_keys, cfg.txt_unit)
    estimate = r.estimate(samples, list(pipeline._results(r, iter([c for _, c in samples]), None))).output
    r.hasher.close()
    out = preprocess(tmp_path, inputs, name="real", **kw)
    return estimate, sum(Path(f"{out}{ext}").stat().st_size for ext in (".bin", ".idx"))


@pytest.mark.parametrize("compress", [None, "gz", "zst"])
def test_space_estimate_is_within_1_2x_of_the_output(tmp_path, compress):
    files = []
    for i in range(3):
        plain = _corpus(tmp_path / f"c{i}.jsonl", 300 + 200 * i, seed=i)
        docs = [json.loads(line) for line in plain.read_text().splitlines()]
        files.append(write_jsonl(tmp_path / f"c{i}.jsonl{'.' + compress if compress else ''}", docs, compress))
    estimate, real = _estimate_and_real(tmp_path, files, tokenizer_type="byte", append_eod=True)
    assert real / 1.2 <= estimate <= real * 1.2, (estimate, real)


def test_space_estimate_of_a_compressed_file_larger_than_the_decompressors_read(tmp_path):
    plain = _corpus(tmp_path / "big.jsonl", 12000, words=400)  # ~14 MB of text, > 1 MiB compressed
    docs = [json.loads(line) for line in plain.read_text().splitlines()]
    big = write_jsonl(tmp_path / "big.jsonl.zst", docs, "zst")
    assert big.stat().st_size > 2 << 20
    estimate, real = _estimate_and_real(tmp_path, [big], tokenizer_type="byte")
    assert real / 1.2 <= estimate <= real * 1.2, (estimate, real)


def test_space_estimate_of_parquet_whose_first_batch_is_larger_than_the_sample(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    plain = _corpus(tmp_path / "c.jsonl", 1000, words=1000)  # one 1024-row batch, ~3 MB of text
    texts = [json.loads(line)["text"] for line in plain.read_text().splitlines()]
    pq.write_table(pa.table({"text": texts}), tmp_path / "c.parquet")
    estimate, real = _estimate_and_real(tmp_path, [tmp_path / "c.parquet"], tokenizer_type="byte")
    assert real / 1.2 <= estimate <= real * 1.2, (estimate, real)


def test_space_estimate_with_gpt2_on_shared_corpora(tmp_path):
    data = shared_data_dir()
    corpora = [data / "wikitext-2" / "wikitext-2.jsonl", data / "tinyshakespeare" / "tinyshakespeare.jsonl"]
    if not all(c.exists() for c in corpora):
        pytest.skip(f"shared data not found under {data}")
    gpt2 = data / "tokenizers" / "gpt2" / "gpt2.tiktoken"
    estimate, real = _estimate_and_real(tmp_path, corpora, tokenizer=str(gpt2), tokenizer_type=None, append_eod=True)
    assert real / 1.2 <= estimate <= real * 1.2, (estimate, real)


# --------------------------------------------------------------------------- dead workers, killed main


def _cli(args) -> list[str]:
    return [sys.executable, str(REPO / "cli.py"), *args]


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for c in map(int, children):
                if c not in found:
                    found.add(c)
                    todo.append(c)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _wait_for(condition, timeout=60.0, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _start_two_worker_run(tmp_path, out: Path):
    path = _corpus(tmp_path / "c.jsonl", 6000, words=400)
    args = _args(path, out, "--checkpoint-interval", "0")
    args[args.index("--workers") + 1] = "2"
    args[args.index("--chunk-bytes") + 1] = "65536"  # a checkpoint per chunk copies the index: keep chunks few
    proc = subprocess.Popen(_cli(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    part = Path(f"{out}.partial")
    _wait_for(lambda: (part / "checkpoint.npz").exists() and _size(part / "0.bin") > 1 << 20, what="a checkpoint")
    # the two live children: the input hasher, a child too, has hashed the corpus and exited by now
    workers = _wait_for(lambda: len(live := {p for p in _descendants(proc.pid) if _alive(p)}) == 2 and live,
                        what="workers")
    return path, args, proc, workers


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def _checkpoint_kept_and_rerun_resumes(tmp_path: Path, out: Path, path: Path, args: list[str]) -> None:
    """After a stop: nothing left behind but the checkpoint, and the same command resumes from it
    to the bytes of an uninterrupted run."""
    assert _left_behind(tmp_path) == [] and (tmp_path / "out.partial" / "checkpoint.npz").exists()
    again = subprocess.run(_cli(args), capture_output=True, text=True, timeout=limit_s(300))
    assert again.returncode == 0, again.stderr
    assert f"resuming from {out}.partial" in again.stdout
    assert same_bytes(out, preprocess(tmp_path, [path], name="ref", append_eod=True))


def test_a_killed_worker_keeps_the_checkpoint_and_the_rerun_resumes(tmp_path):
    out = tmp_path / "out"
    path, args, proc, workers = _start_two_worker_run(tmp_path, out)
    os.kill(min(workers), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=limit_s(120))
    one_line_error(subprocess.CompletedProcess(args, proc.returncode, "", stderr),
                   "error: a tokenizer worker process died",
                   f"rerun the same command to resume from the checkpoint in {out}.partial")
    _checkpoint_kept_and_rerun_resumes(tmp_path, out, path, args)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_saves_a_checkpoint_names_it_and_the_rerun_resumes(tmp_path):
    """A cluster's SIGTERM mid-run (issue 39): one line naming the checkpoint, exit 130, same bytes on rerun."""
    out = tmp_path / "out"
    path, args, proc, workers = _start_two_worker_run(tmp_path, out)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=limit_s(120))
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted; rerun the same command to resume from the "
                                                   f"checkpoint in {out}.partial"), stderr
    _checkpoint_kept_and_rerun_resumes(tmp_path, out, path, args)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_killed_main_process(tmp_path):
    _, _, proc, workers = _start_two_worker_run(tmp_path, tmp_path / "out")
    assert all(_alive(w) for w in workers)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.05)
    assert not [w for w in workers if _alive(w)], "workers outlived their parent by 5 s"


# --------------------------------------------------------------------------- the fault matrix of a 2-worker run
#
# Each fault lands mid-run whatever the machine's speed: a byte count for the full disk, a checkpoint
# count for Ctrl-C (``tests/fault_site``). The corpus only needs more chunks than the workers hold in
# flight when the fault lands (issue 39's check of the same matrix on >= 500 MB is run by hand).


@pytest.fixture(scope="module")
def two_worker_corpus(tmp_path_factory):
    """A ~11 MB corpus (~170 chunks of 64 KB) and its reference output from an uninterrupted run."""
    folder = tmp_path_factory.mktemp("matrix")
    path = _corpus(folder / "c.jsonl", 6000, words=400)
    return path, preprocess(folder, [path], name="ref", append_eod=True)


def _two_worker_run(path: Path, out: Path, env=None, close_stdout=False) -> subprocess.CompletedProcess:
    """``cli.py preprocess`` with 2 workers in a session of its own (a signal to its group reaches no test)."""
    args = _args(path, out, "--checkpoint-interval", "0")
    args[args.index("--workers") + 1] = "2"
    args[args.index("--chunk-bytes") + 1] = "65536"
    proc = subprocess.Popen(_cli(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or cli_env(), start_new_session=True)
    if close_stdout:  # every write to stdout now fails with EPIPE, as under ``| head -0``
        proc.stdout.close()
        stderr, stdout = proc.stderr.read(), ""
        proc.wait(timeout=limit_s(300))
    else:
        stdout, stderr = proc.communicate(timeout=limit_s(300))
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


FAULTS = {
    "disk full": (lambda out: fault_env("write", errno.ENOSPC, f"{out}.partial/0.bin", room=8 << 20), 1,
                  "no space left on device writing"),
    "Ctrl-C": (lambda out: fault_env("signal", signal.SIGINT, f"{out}.partial/checkpoint.npz*", count=40), 130,
               "error: interrupted; rerun the same command to resume from the checkpoint in"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_mid_run_ends_in_one_line_and_the_rerun_gives_the_same_bytes(tmp_path, two_worker_corpus, fault):
    path, reference = two_worker_corpus
    env, code, needle = FAULTS[fault]
    out = tmp_path / "out"
    stopped = _two_worker_run(path, out, env(out))
    assert stopped.returncode == code, stopped.stderr
    one_line_error(stopped, needle, f"{out}.partial")
    assert "Exception ignored" not in stopped.stderr
    assert _left_behind(tmp_path) == [] and (tmp_path / "out.partial" / "checkpoint.npz").exists()
    again = _two_worker_run(path, out)
    assert again.returncode == 0, again.stderr
    assert f"resuming from {out}.partial" in again.stdout
    assert same_bytes(out, reference)


def _slow_after_the_first(chunk, opts):
    if chunk.seq > 0:  # still being encoded when the first chunk's write fails
        time.sleep(2)
    return encode_in_worker(chunk, opts)


def test_a_stop_with_chunks_in_flight_leaves_no_error_behind(tmp_path, monkeypatch):
    """The stop's clean-up closes the result generator before the pool: closed after it (when the
    traceback let go of the frame) the generator asked the gone pool for results and printed
    "Exception ignored in: <generator object _results>" with an IndexError after the error line."""
    path = _corpus(tmp_path / "c.jsonl", 400)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(pipeline, "encode_in_worker", _slow_after_the_first)

    def full(run, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pipeline._Run, "consume", full)
    args = _args(path, tmp_path / "out")
    args[args.index("--workers") + 1] = "2"
    _assert_one_line_error(_invoke(args), "no space left on device")
    gc.collect()
    assert [u.exc_value for u in unraisable] == []


def test_closed_stdout_ends_in_one_line_keeps_the_checkpoint_and_the_rerun_gives_the_same_bytes(
        tmp_path, two_worker_corpus):
    """Preprocess writes to stdout only before tokenizing (resuming) and after publishing (the summary):
    a rerun whose stdout is closed stops at its first line, keeping the checkpoint of the stopped run."""
    path, reference = two_worker_corpus
    out = tmp_path / "out"
    env, code, _ = FAULTS["Ctrl-C"]
    assert _two_worker_run(path, out, env(out)).returncode == code
    closed = _two_worker_run(path, out, close_stdout=True)
    assert closed.returncode == 1
    one_line_error(closed, "standard output was closed", "broken pipe", "rerun the same command")
    assert _left_behind(tmp_path) == [] and (tmp_path / "out.partial" / "checkpoint.npz").exists()
    again = _two_worker_run(path, out)
    assert again.returncode == 0 and f"resuming from {out}.partial" in again.stdout, again.stderr
    assert same_bytes(out, reference)
    finished = _two_worker_run(path, out, close_stdout=True)  # the summary, printed after publishing, fails
    one_line_error(finished, "standard output was closed")
    assert same_bytes(out, reference)


# --------------------------------------------------------------------------- publishing


class _Killed(BaseException):
    """Stands for SIGKILL at an exact step: nothing catches it, so no clean-up runs."""


PUBLISH_STEPS = ["staging", "before-bin", "old-manifest-removed", "bin", "idx", "manifest", "clean-up"]


def _kill_at(monkeypatch, step: str, out: Path):
    """Make the run die at ``step`` of publishing ``out`` (renames are matched by their destination)."""
    if step == "staging":  # the manifests are being written: the data is complete, nothing is published
        monkeypatch.setattr(pipeline.manifest, "write", _raise)
    elif step == "clean-up":  # everything is published, the partial folder is being removed
        monkeypatch.setattr(pipeline.shutil, "rmtree", _raise)
    elif step == "old-manifest-removed":
        unlink = os.unlink

        def unlink_then_die(path, *a, **k):
            unlink(path, *a, **k)
            if os.fspath(path) == f"{out}.manifest.json":
                raise _Killed()

        monkeypatch.setattr(os, "unlink", unlink_then_die)
    else:
        replace, before = os.replace, step.startswith("before-")
        final = f"{out}.{step.removeprefix('before-')}".replace(".manifest", ".manifest.json")

        def replace_and_die(src, dst, *a, **k):
            if os.fspath(dst) == final and before:
                raise _Killed()
            replace(src, dst, *a, **k)
            if os.fspath(dst) == final:
                raise _Killed()

        monkeypatch.setattr(os, "replace", replace_and_die)


def _raise(*a, **k):
    raise _Killed()


@pytest.mark.parametrize("step", PUBLISH_STEPS)
def test_kill_at_each_publish_step_then_the_rerun_publishes_the_right_bytes(tmp_path, monkeypatch, step):
    old = _corpus(tmp_path / "old.jsonl", 30, seed=1)
    new = _corpus(tmp_path / "new.jsonl", 60, seed=2)
    old_ref = preprocess(tmp_path, [old], name="old_ref", append_eod=True)
    new_ref = preprocess(tmp_path, [new], name="new_ref", append_eod=True)
    assert _invoke(_args(old, tmp_path / "out")).exit_code == 0  # a finished dataset is being replaced
    with monkeypatch.context() as m:
        _kill_at(m, step, tmp_path / "out")
        with pytest.raises(_Killed):
            pipeline.run(pipeline.PreprocessConfig(
                inputs=[str(new)], output_prefix=str(tmp_path / "out"), tokenizer_type="byte", append_eod=True,
                workers=1, progress=False, chunk_bytes=4096, checkpoint_interval=0), echo=lambda *a: None)
    manifest_file = tmp_path / "out.manifest.json"
    if manifest_file.exists():  # the commit point: a manifest always describes the files beside it
        inputs = manifest_file.read_text()
        assert same_bytes(tmp_path / "out", new_ref if str(new) in inputs else old_ref)
    again = _invoke(_args(new, tmp_path / "out"))
    assert again.exit_code == 0, again.output
    assert same_bytes(tmp_path / "out", new_ref)
    assert str(new) in manifest_file.read_text()
    assert _left_behind(tmp_path) == ["out.bin", "out.idx", "out.manifest.json"]
    assert not (tmp_path / "out.partial").exists()


def test_temporary_files_of_dead_runs_are_removed_by_the_next_run(tmp_path):
    path = _corpus(tmp_path / "c.jsonl", 20)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = [f"out.bin.tmp-{dead}-0a1b2c3d", f"out.idx.tmp-{dead}-0a1b2c3d", f"out.manifest.json.tmp-{dead}-ffff0000"]
    live = f"out.bin.tmp-{os.getpid()}-12345678"  # a live writer's file is never touched
    for name in [*stale, live]:
        (tmp_path / name).write_bytes(b"junk")
    result = _invoke(_args(path, tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert _left_behind(tmp_path) == sorted(["out.bin", "out.idx", "out.manifest.json", live])
    assert all(f"removed {tmp_path / name}" in result.output for name in stale)


def test_merge_uncommits_the_old_output_first_and_cleans_dead_temps(tmp_path, monkeypatch):
    from tokenloom.preprocess.merge import merge

    a = preprocess(tmp_path, [_corpus(tmp_path / "a.jsonl", 20, seed=3)], name="a", append_eod=True)
    b = preprocess(tmp_path, [_corpus(tmp_path / "b.jsonl", 20, seed=4)], name="b", append_eod=True)
    merge(str(tmp_path / "out"), [str(a)])
    (tmp_path / "out.idx.tmp-999999999-0a1b2c3d").write_bytes(b"junk")  # pid beyond pid_max: dead
    original = indexed_format.publish

    def die_after_bin(tmp, final):
        original(tmp, final)
        raise _Killed()

    monkeypatch.setattr(indexed_format, "publish", die_after_bin)
    with pytest.raises(_Killed):
        merge(str(tmp_path / "out"), [str(a), str(b)])
    assert not (tmp_path / "out.manifest.json").exists(), "the old manifest must not describe the new .bin"
    assert not (tmp_path / "out.idx.tmp-999999999-0a1b2c3d").exists()


def test_merge_on_a_full_disk_ends_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    a = preprocess(tmp_path, [_corpus(tmp_path / "a.jsonl", 40, seed=5)], name="a", append_eod=True)
    b = preprocess(tmp_path, [_corpus(tmp_path / "b.jsonl", 40, seed=6)], name="b", append_eod=True)

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "copy_file_range", full)  # merge copies in-kernel, falling back to pwrite
    monkeypatch.setattr(os, "pwrite", full)
    result = _invoke(["merge", "--output-prefix", str(tmp_path / "out"), str(a), str(b)])
    _assert_one_line_error(result, f"no space left on device writing {tmp_path}/out", "rerun the merge")
    assert _left_behind(tmp_path) == []


@pytest.mark.parametrize("change", ["append", "rewrite"])
def test_an_input_changed_during_the_run_is_refused_naming_it(tmp_path, monkeypatch, change):
    """Ranges are cut by the main process and read by the workers: a file written to meanwhile
    (a larger file, or the same size rewritten) must not give a dataset mixing both versions."""
    path = _corpus(tmp_path / "c.jsonl", 200)
    consume = pipeline._Run.consume

    def change_then_consume(run, *args):  # after the first chunk was read
        if not run.counts.records:
            data = path.read_bytes()
            path.write_bytes(data + data[:100] if change == "append" else data)
            os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
        consume(run, *args)

    monkeypatch.setattr(pipeline._Run, "consume", change_then_consume)
    result = _invoke(_args(path, tmp_path / "out"))
    _assert_one_line_error(result, f"{path}: changed while being read", "rerun")
    assert _left_behind(tmp_path) == []
