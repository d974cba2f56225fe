"""Acceptance: same bytes for any worker count, for sharded+merged runs, and after SIGKILL + resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from preprocess_helpers import REPO, preprocess, same_bytes, write_jsonl
from tl_testing import limit_s

from tokenloom.indexed import manifest
from tokenloom.preprocess.merge import merge


def _corpus(path, n, seed=0, size=400):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "δέλτα", "эпсилон", "\n", "zeta", "", "🙂"]
    docs = [{"text": " ".join(rng.choice(words, size=int(rng.integers(0, size))))} for _ in range(n)]
    return write_jsonl(path, docs)


def test_worker_count_does_not_change_bytes(tmp_path):
    path = _corpus(tmp_path / "c.jsonl", 600)
    outs = [preprocess(tmp_path, [path], name=f"w{w}", workers=w, append_eod=True, chunk_bytes=4096)
            for w in (1, 2, 4)]
    assert same_bytes(outs[0], outs[1]) and same_bytes(outs[0], outs[2])


def test_sharded_then_merged_equals_single_run(tmp_path, monkeypatch):
    files = [_corpus(tmp_path / f"part{i}.jsonl", 50 + 30 * i, seed=i) for i in range(5)]
    single = preprocess(tmp_path, files, name="single", append_eod=True)
    shards = [preprocess(tmp_path, files, name="sh", append_eod=True, num_shards=3, shard_index=i)
              for i in range(3)]
    shard_prefixes = [f"{tmp_path}/sh-shard{i:05d}-of-00003" for i in range(3)]
    assert all(s == shards[0] for s in shards)  # preprocess returns the base path it was given
    merge(str(tmp_path / "merged"), shard_prefixes)
    assert same_bytes(tmp_path / "merged", single)
    m = manifest.read(tmp_path / "merged")
    assert [i["path"] for i in m["inputs"]] == [str(f) for f in files]
    assert m["counts"]["tokens"] == manifest.read(single)["counts"]["tokens"]
    # The shard comes from the launcher's environment when not given.
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    preprocess(tmp_path, files, name="env", append_eod=True)
    assert same_bytes(tmp_path / "env-shard00001-of-00003", shard_prefixes[1])


def _cli(args):
    return [sys.executable, str(REPO / "cli.py"), "preprocess", *map(str, args)]


def test_sigkill_then_resume_gives_identical_bytes(tmp_path):
    path = _corpus(tmp_path / "c.jsonl", 4000, size=600)
    common = ["--input", path, "--tokenizer-type", "byte", "--append-eod", "--workers", "1", "--no-progress",
              "--chunk-bytes", "2048", "--checkpoint-interval", "0.05"]  # a checkpoint copies the index: not every chunk
    preprocess(tmp_path, [path], name="straight", append_eod=True)
    out = tmp_path / "resumed"
    proc = subprocess.Popen(_cli([*common, "--output-prefix", out]), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ckpt = tmp_path / "resumed.partial" / "checkpoint.npz"
    deadline = time.monotonic() + 60
    total = (tmp_path / "straight.bin").stat().st_size
    while time.monotonic() < deadline:
        part = tmp_path / "resumed.partial" / "0.bin"
        if ckpt.exists() and part.exists() and part.stat().st_size > total // 3:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "resumed.bin").exists() and not (tmp_path / "resumed.idx").exists(), \
        "the run finished before it could be killed; make the corpus larger"
    again = subprocess.run(_cli([*common, "--output-prefix", out]), capture_output=True, text=True, timeout=limit_s(300))
    assert again.returncode == 0, again.stderr
    assert "resuming from" in again.stdout
    assert same_bytes(out, tmp_path / "straight")
    assert not (tmp_path / "resumed.partial").exists()
    counts = json.loads((tmp_path / "resumed.manifest.json").read_text())["counts"]
    assert counts == json.loads((tmp_path / "straight.manifest.json").read_text())["counts"]


def test_changed_command_does_not_resume(tmp_path):
    path = _corpus(tmp_path / "c.jsonl", 50)
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "checkpoint.npz").write_bytes(b"garbage")
    out = preprocess(tmp_path, [path], append_eod=True)
    assert same_bytes(out, preprocess(tmp_path, [path], name="ref", append_eod=True))


@pytest.mark.parametrize("bad", [-1, 2])
def test_bad_shard_index(tmp_path, bad):
    from tokenloom.errors import TokenloomError

    path = _corpus(tmp_path / "c.jsonl", 5)
    with pytest.raises(TokenloomError, match="--shard-index"):
        preprocess(tmp_path, [path], num_shards=2, shard_index=bad)


def test_an_encoder_rebuilt_for_memory_does_not_change_bytes(tmp_path, shared_data):
    """--encoder-memory-mb 1 rebuilds gigatoken's encoder after nearly every chunk of this text of
    distinct words (in the workers and in-process); the bytes are those of a never-rebuilt one."""
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), int(rng.integers(3, 12)))) for _ in range(20000)]
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": " ".join(words[i:i + 400])} for i in range(0, 20000, 400)] * 4)
    gpt2 = str(shared_data / "tokenizers" / "gpt2" / "gpt2.tiktoken")
    kw = dict(tokenizer=gpt2, tokenizer_type=None, append_eod=True, chunk_bytes=64 << 10)
    never = preprocess(tmp_path, [path], name="never", encoder_memory_mb=0, **kw)
    assert json.loads((tmp_path / "never.manifest.json").read_text())["tokenizer"]["backend"] == "gigatoken"
    for workers in (1, 2):
        assert same_bytes(preprocess(tmp_path, [path], name=f"w{workers}", workers=workers, encoder_memory_mb=1, **kw),
                          never)
