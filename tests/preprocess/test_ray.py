"""Acceptance (issue 21): ``preprocess --executor ray`` on a local 2-CPU Ray cluster gives the
single-process run's bytes, also when a task's worker process is killed and Ray retries it.

One cluster serves the module (starting Ray takes ~10 s). It runs in a helper process whose
environment carries the fault site (``tests/fault_site``): a Ray worker that opens shard 3's
staged ``.bin`` of the ``killed`` job for writing dies the first time, so only that job meets
the fault, and its retry finds the marker and goes on.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from dedup_corpus import planted_corpus
from preprocess_helpers import preprocess, same_bytes
from tl_testing import REPO, cli_env, limit_s, one_line_error, run_cli

from tokenloom.errors import TokenloomError
from tokenloom.indexed import manifest
from tokenloom.preprocess import PreprocessConfig, run

pytest.importorskip("ray", reason="Ray not installed (pip install -e '.[ray]')")

FILES = 8
CLUSTER = """
import sys, ray
ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes it
ray.shutdown()
"""


def _corpus(directory) -> list[str]:
    """Eight jsonl files of equal size (so each is its own shard), different documents."""
    words = ["alpha", "beta", "gamma", "zeta", "eta"]
    lengths = [0, 1, 5, 40, 120, 300, 800, 17] * 4
    paths = []
    for k in range(FILES):
        rng = np.random.default_rng(k)
        docs = [{"text": "".join(rng.choice(list("abcdefgh \n"), n)) + " δέλτα 🙂 " + rng.choice(words)[:2]}
                for n in rng.permutation(lengths)]
        path = directory / f"part{k}.jsonl"
        path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(GCS address, work folder) of a local Ray cluster with 2 CPUs, shut down after the module."""
    work = tmp_path_factory.mktemp("ray")
    env = cli_env()
    env["PYTHONPATH"] += os.pathsep + str(REPO / "tests" / "fault_site")
    env["TOKENLOOM_TEST_FAULT"] = json.dumps({"op": "exit", "errno": 137, "marker": str(work / "killed.marker"),
                                              "path": str(work / "killed.shards" / "*-shard00003-of-*.partial"
                                                          / "0.bin")})
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    address = proc.stdout.readline().strip()
    assert address, "the Ray cluster did not start"
    yield address, work
    proc.stdin.close()
    proc.wait(timeout=limit_s(60))


@pytest.fixture(scope="module")
def single(cluster):
    _, work = cluster
    inputs = _corpus(work)
    return inputs, preprocess(work, inputs, name="single", append_eod=True)


def _ray_run(address, inputs, out, *options):
    # Ray joins a cluster at an explicit address with its token (~/.ray/auth_token, written by
    # the cluster) only when told to.
    return run_cli("preprocess", "--input", *inputs, "--output-prefix", out, "--tokenizer-type", "byte",
                   "--append-eod", "--no-progress", "--executor", "ray", "--ray-address", address, *options, timeout=240,
                   env=dict(cli_env(), RAY_AUTH_MODE="token"))


def test_ray_output_equals_single_process_run(cluster, single):
    address, work = cluster
    inputs, reference = single
    done = _ray_run(address, inputs, work / "ray")
    assert done.returncode == 0, done.stderr
    assert f"ray: {FILES} tasks on 2 CPUs" in done.stdout
    assert same_bytes(work / "ray", reference)
    m = manifest.read(work / "ray")
    assert [i["path"] for i in m["inputs"]] == inputs
    assert m["counts"] == manifest.read(reference)["counts"]
    assert [s["index"] for s in m["shards"]] == list(range(FILES))
    assert not (work / "ray.shards").exists()  # the staging folder goes once the merge is published
    assert not (work / "killed.marker").exists()  # the fault is only for the killed job
    done = _ray_run(address, inputs, work / "ray3", "--num-shards", "3")  # tasks of several inputs
    assert done.returncode == 0, done.stderr
    assert "ray: 3 tasks" in done.stdout and same_bytes(work / "ray3", reference)


def test_dedup_is_decided_over_every_shard(cluster):
    """``--dedup minhash`` as Ray tasks (one per file, duplicates across files): the merge's final pass
    removes what one process removes, the same bytes and the same removed list."""
    address, work = cluster
    paths = planted_corpus(n=300, exact=15, near=30, seed=1).write(work, parts=3)
    reference = preprocess(work, paths, name="dedup-single", append_eod=True, dedup="minhash")
    done = _ray_run(address, [str(p) for p in paths], work / "dedup-ray", "--dedup", "minhash")
    assert done.returncode == 0, done.stderr
    assert "ray: 3 tasks" in done.stdout and "removed" in done.stdout
    assert same_bytes(work / "dedup-ray", reference)
    listed = (work / "dedup-ray.removed.jsonl").read_bytes()
    assert listed == (work / "dedup-single.removed.jsonl").read_bytes() and listed.count(b"\n") >= 40
    assert manifest.read(work / "dedup-ray")["counts"]["removed"] == manifest.read(reference)["counts"]["removed"]
    assert not (work / "dedup-ray.shards").exists()


def test_killed_task_is_retried_and_bytes_match(cluster, single):
    address, work = cluster
    inputs, reference = single
    done = _ray_run(address, inputs, work / "killed")
    assert (work / "killed.marker").exists(), "the fault did not fire: no task was killed"
    assert done.returncode == 0, done.stderr
    assert same_bytes(work / "killed", reference)
    assert not (work / "killed.shards").exists()


def test_unreachable_ray_address_is_one_line(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "hello"}\n')
    done = run_cli("preprocess", "--input", path, "--output-prefix", tmp_path / "out", "--tokenizer-type", "byte",
                   "--executor", "ray", "--ray-address", f"127.0.0.1:{port}", timeout=60)
    one_line_error(done, "--ray-address", f"127.0.0.1:{port}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing written


def test_missing_ray_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    cfg = PreprocessConfig(inputs=[str(tmp_path)], output_prefix=str(tmp_path / "out"), executor="ray")
    with pytest.raises(TokenloomError, match=r"pip install 'tokenloom\[ray\]'"):
        run(cfg)


def test_bad_records_are_judged_over_the_job(cluster, single):
    address, work = cluster
    inputs, _ = single
    bad = work / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n{"text": "also fine"}\n{"no_text": 1}\n', encoding="utf-8")
    files = [inputs[0], str(bad), inputs[1]]
    reference = preprocess(work, files, name="tolerant-single", append_eod=True, max_bad_fraction=0.05)
    done = _ray_run(address, files, work / "tolerant", "--max-bad-fraction", "0.05")
    # 2 bad of 68 records: 2.9% of the job, though 50% of the bad file's shard
    assert done.returncode == 0, done.stderr
    assert same_bytes(work / "tolerant", reference)
    assert (work / "tolerant.rejects.jsonl").read_bytes() == (work / "tolerant-single.rejects.jsonl").read_bytes()
    single_options = {k: v for k, v in manifest.read(reference)["options"].items() if k != "shard"}
    assert manifest.read(work / "tolerant")["options"] == single_options  # merged outputs list "shards" instead


def test_an_object_store_output_is_refused_in_one_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "hello"}\n')
    done = run_cli("preprocess", "--input", path, "--output-prefix", "s3://bucket/out", "--tokenizer-type", "byte",
                   "--executor", "ray", timeout=60)
    one_line_error(done, "--output-prefix s3://bucket/out", "shared filesystem")


def test_a_rerun_keeps_the_shards_a_failed_job_finished(cluster, single):
    """The merge fails (a directory where the output goes): one line; the rerun does not tokenize the
    finished shards again (same staged files, same inodes) and, once the way is clear, publishes the
    single run's bytes."""
    address, work = cluster
    inputs, _ = single
    (work / "again.bin").mkdir()
    failed = _ray_run(address, inputs[:3], work / "again", "--num-shards", "3")
    one_line_error(failed, "again.bin", "rerun the same command")
    staged = sorted((work / "again.shards").glob("*.bin"))
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in staged]
    assert len(staged) == 3 and len(list((work / "again.shards").glob("*.done.json"))) == 3
    failed = _ray_run(address, inputs[:3], work / "again", "--num-shards", "3")
    one_line_error(failed, "again.bin", "rerun the same command")
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in staged] == before
    (work / "again.bin").rmdir()
    done = _ray_run(address, inputs[:3], work / "again", "--num-shards", "3")
    assert done.returncode == 0, done.stderr
    three = preprocess(work, inputs[:3], name="three", append_eod=True)
    assert same_bytes(work / "again", three) and not (work / "again.shards").exists()
