"""Object storage: ``s3://`` inputs and output prefixes against a real S3 server on 127.0.0.1.

The server is moto's (the ``s3`` fixture: one per module, on a free port), wrapped in a small WSGI
layer that answers ``403 AccessDenied`` to the requests a test names: a bucket policy that denies
writes or reads, seen by the client exactly as from a real store. ``cli.py preprocess``
runs in a subprocess with the endpoint and credentials in the standard AWS variables.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from preprocess_helpers import preprocess
from tl_testing import closed_port, one_line_error, run_cli

pytest.importorskip("moto.moto_server.werkzeug_app", reason="needs moto[server] (the dev extra)")
pytest.importorskip("s3fs", reason="needs s3fs (the s3 extra)")


@pytest.fixture(scope="module")
def corpus(s3, shared_data, tmp_path_factory):
    """tinyshakespeare as two .jsonl.zst parts and a parquet part, locally and under s3://corpus/in/;
    the local run's output."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    local = tmp_path_factory.mktemp("corpus")
    lines = (shared_data / "tinyshakespeare" / "tinyshakespeare.jsonl").read_bytes().splitlines(keepends=True)
    lines = lines[:2400]  # ~400 kB: enough for several chunks, quick to tokenize
    fs = s3.fs()
    fs.mkdir("corpus")
    fs.mkdir("out")
    for n, part in enumerate((lines[:1000], lines[1000:2000])):
        path = local / f"part{n}.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor(level=3).compress(b"".join(part)))
        fs.put_file(str(path), f"corpus/in/{path.name}")
    texts = [json.loads(line)["text"] for line in lines[2000:]]
    pq.write_table(pa.table({"text": texts}), local / "part2.parquet", row_group_size=100)
    fs.put_file(str(local / "part2.parquet"), "corpus/in/part2.parquet")
    # The byte tokenizer: these tests are about reading and writing, and it loads at once.
    args = ["--tokenizer-type", "byte", "--workers", "2", "--no-progress", "--append-eod", "--chunk-bytes", "65536"]
    ref = preprocess(local, [*sorted(local.glob("*.jsonl.zst")), local / "part2.parquet"], name="ref",
                     append_eod=True, chunk_bytes=65536)
    return {"args": args, "ref": ref, "inputs": ["s3://corpus/in/*.jsonl.zst", "s3://corpus/in/part2.parquet"]}


def _run_s3(s3, corpus, prefix: str, staging: Path, env=None, inputs=None):
    return run_cli("preprocess", "--input", *(inputs or corpus["inputs"]), "--output-prefix", prefix,
                   "--staging-dir", staging, *corpus["args"], env=env or s3.env())


def _same_as_reference(s3, prefix: str, ref: Path) -> None:
    fs = s3.fs()
    for ext in (".bin", ".idx"):
        assert fs.cat_file(prefix.removeprefix("s3://") + ext) == Path(f"{ref}{ext}").read_bytes(), ext
    assert fs.exists(prefix.removeprefix("s3://") + ".manifest.json")


def test_s3_inputs_and_output_equal_the_local_run(s3, corpus, tmp_path):
    rule = ({"HEAD"}, "/out", "/out")  # credentials that may write to the bucket but not look at it
    s3.deny.append(rule)
    try:
        done = _run_s3(s3, corpus, "s3://out/run/ds", tmp_path / "staging")
    finally:
        s3.deny.remove(rule)
    assert done.returncode == 0, done.stderr
    _same_as_reference(s3, "s3://out/run/ds", corpus["ref"])
    assert sorted(s3.fs().ls("out/run")) == ["out/run/ds.bin", "out/run/ds.idx", "out/run/ds.manifest.json"]
    assert not any((tmp_path / "staging").iterdir())  # staging removed once uploaded


@pytest.mark.parametrize("denied", [".bin", ".idx"])
def test_failed_upload_leaves_no_object_and_a_rerun_publishes(s3, corpus, tmp_path, denied):
    """The bucket refuses the upload of one file: no object under its key, nor a manifest; a rerun
    (the store fixed) uploads what was staged without tokenizing again."""
    prefix = f"s3://out/fail{denied}/ds"
    rule = ({"PUT", "POST"}, f"/out/fail{denied}/", denied)
    s3.deny.append(rule)
    try:
        done = _run_s3(s3, corpus, prefix, tmp_path / "staging")
    finally:
        s3.deny.remove(rule)
    one_line_error(done, f"{prefix}{denied}: upload failed: access denied", "rerun the same command")
    keys = s3.fs().ls(f"out/fail{denied}") if s3.fs().exists(f"out/fail{denied}") else []
    assert f"out/fail{denied}/ds{denied}" not in keys and "out/fail{denied}/ds.manifest.json" not in keys, keys
    if denied == ".idx":
        assert keys == [f"out/fail{denied}/ds.bin"], keys  # complete, but without its index: unfinished
        return
    assert keys == [], keys  # the first upload failed: nothing at all under the final keys
    done = _run_s3(s3, corpus, prefix, tmp_path / "staging")
    assert done.returncode == 0, done.stderr
    assert "every output is complete; publishing it" in done.stdout
    _same_as_reference(s3, prefix, corpus["ref"])


def test_store_failure_mid_run_keeps_the_staged_checkpoint_and_the_rerun_resumes(s3, corpus, tmp_path):
    """The second input cannot be read: one line, the checkpoint in the staging dir is kept, and the
    same command (the store fixed) resumes from it and uploads the same bytes as the local run."""
    prefix, staging = "s3://out/resume/ds", tmp_path / "staging"
    # Small chunks: part0 is consumed (and checkpointed) while the reader is still ahead, in part1;
    # no space check, which would sample part1 first.
    args = [*corpus["args"], "--checkpoint-interval", "0", "--no-space-check", "--chunk-bytes", "16384"]
    command = ("preprocess", "--input", *corpus["inputs"], "--output-prefix", prefix, "--staging-dir", staging, *args)
    rule = ({"GET"}, "/corpus/in/part1", "")
    s3.deny.append(rule)
    try:
        done = run_cli(*command, env=s3.env())
    finally:
        s3.deny.remove(rule)
    one_line_error(done, "s3://corpus/in/part1.jsonl.zst", "access denied", "rerun the same command to resume "
                   f"from the checkpoint in {staging}")
    assert not s3.fs().exists("out/resume")
    again = run_cli(*command, env=s3.env())
    assert again.returncode == 0, again.stderr
    assert "resuming from" in again.stdout and "records done" in again.stdout
    _same_as_reference(s3, prefix, corpus["ref"])


@pytest.mark.parametrize("case", ["unreachable", "no bucket", "denied read", "denied output"])
def test_bad_object_store_paths_are_one_line(s3, corpus, tmp_path, case):
    url, inputs, env, prefix = corpus["inputs"][0], None, s3.env(), "s3://out/bad/ds"
    if case == "unreachable":
        env = dict(s3.env(f"http://127.0.0.1:{closed_port()}"), AWS_MAX_ATTEMPTS="1")  # botocore: no retries
        prefix = str(tmp_path / "out")  # a local output: the input is what cannot be reached
        fragment = "cannot reach the object store"
    elif case == "no bucket":
        url = "s3://no-such-bucket/part0.jsonl.zst"
        inputs = [url]
        fragment = "no such object or bucket"
    elif case == "denied read":
        url = "s3://corpus/in/part0.jsonl.zst"
        inputs = [url]
        fragment = "access denied"
    else:
        url = prefix = "s3://no-such-bucket/ds"  # found before tokenizing
        fragment = "checking the output bucket failed: no such object or bucket"
    rule = ({"GET", "HEAD"}, "/corpus/in/part0", "") if case == "denied read" else None
    if rule:
        s3.deny.append(rule)
    try:
        done = _run_s3(s3, corpus, prefix, tmp_path / "staging", env=env, inputs=inputs)
    finally:
        if rule:
            s3.deny.remove(rule)
    one_line_error(done, url, fragment)


def test_a_staging_disk_too_small_is_refused_before_work(s3, tmp_path, monkeypatch):
    """The local staging folder of an object-store output must hold the whole output: checked up
    front like a local output's disk, and the message names the staging folder and --staging-dir."""
    import shutil

    from tokenloom.errors import TokenloomError
    from tokenloom.preprocess import PreprocessConfig, run

    for key, value in s3.env().items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    if not s3.fs().exists("out"):  # the bucket, made by the corpus fixture when another test ran first
        s3.fs().mkdir("out")
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * 1000}) + "\n" for _ in range(20)))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=100))
    cfg = PreprocessConfig(inputs=[str(path)], output_prefix="s3://out/small/ds", tokenizer_type="byte",
                           staging_dir=str(tmp_path / "staging"), workers=1, progress=False)
    with pytest.raises(TokenloomError, match=r"staging folder of the object-store output .*--staging-dir"):
        run(cfg)
    assert not s3.fs().exists("out/small/ds.bin") and not s3.fs().exists("out/small/ds.manifest.json")
