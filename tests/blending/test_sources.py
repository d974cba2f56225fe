"""Sources of a blend: metadata remembered per file version, files opened only when read,
descriptors bounded however many sources a blend has."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import numpy as np
import pytest
from tl_testing import REPO, limit_s

from tokenloom.blending.blend import Blend, BlendBuilder, BlendConfig
from tokenloom.blending.build import BuildConfig, build
from tokenloom.blending.gpt import GPTDatasetConfig
from tokenloom.blending.sources import LazySource, clear_memo, source_metadata
from tokenloom.indexed.format import write_index


def tiny_sources(directory, count, docs=10, max_length=50, seed=0):
    """``count`` sources with a real .idx and a sparse .bin (no tokens written)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    prefixes = []
    for i in range(count):
        lengths = rng.integers(1, max_length, size=docs, dtype=np.int32)
        prefix = directory / f"s{i:05d}"
        with open(f"{prefix}.bin", "wb") as f:
            f.truncate(int(lengths.sum(dtype=np.int64)) * 2)
        write_index(f"{prefix}.idx", np.uint16, lengths, np.arange(docs + 1, dtype=np.int64))
        prefixes.append(str(prefix))
    return prefixes


def test_metadata_is_remembered_per_file_version(tmp_path):
    (prefix,) = tiny_sources(tmp_path / "src", 1)
    meta = source_metadata([prefix], tmp_path / "cache")[prefix]
    assert (meta.sequences, meta.documents, meta.tokenizer) == (10, 10, None)
    clear_memo()
    memo = tmp_path / "cache" / "sources.jsonl"
    assert len(memo.read_text().splitlines()) == 1
    with open(memo, "a") as f:
        f.write('{"stamp": "torn')  # a torn append is ignored, never trusted
    assert source_metadata([prefix], tmp_path / "cache")[prefix] == meta  # from the memo file
    assert len(memo.read_text().splitlines()) == 2  # nothing recomputed
    tiny_sources(tmp_path / "src", 1, seed=5)  # rewritten: a new inode, a new version
    assert source_metadata([prefix], tmp_path / "cache")[prefix].digest != meta.digest


def test_lazy_source_opens_nothing_until_read(tmp_path):
    (prefix,) = tiny_sources(tmp_path / "src", 1)
    before = len(os.listdir("/proc/self/fd"))
    source = LazySource(prefix)
    assert len(source) == 10 and len(os.listdir("/proc/self/fd")) == before
    assert source.get(3).shape == (int(source.sequence_lengths[3]),)


def _plain_arrays(ds):
    out = [np.asarray(ds.dataset_index), np.asarray(ds.dataset_sample_index)]
    for m in ds.datasets:
        out += [np.asarray(m.indices.document_index), np.asarray(m.indices.sample_index),
                np.asarray(m.indices.shuffle_index)]
    return out


def test_cached_blend_equals_the_plain_builder(tmp_path):
    prefixes = tiny_sources(tmp_path / "src", 40, docs=60)
    weights = np.random.default_rng(1).uniform(0.5, 2.0, size=40).tolist()
    cfg = BuildConfig(data=list(zip(weights, prefixes, strict=True)), seq_length=32, num_samples=(3000, 300, 30),
                      split="80,15,5", cache_dir=str(tmp_path / "cache"))
    gpt = GPTDatasetConfig(seq_length=32, split="80,15,5")
    plain = BlendBuilder(BlendConfig(gpt=gpt, blend=Blend(tuple(prefixes), tuple(weights)))).build([3000, 300, 30])
    cold, warm = build(cfg), build(cfg)
    assert (cold.builds, warm.hits) == (3, 3)
    for split in range(3):
        expected = _plain_arrays(plain[split])
        for result in (cold, warm):
            got = _plain_arrays(result.datasets[split])
            assert len(got) == len(expected) and all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert all(np.array_equal(warm.train[k], plain[0][k]) for k in range(0, 3000, 111))


@pytest.mark.slow
def test_ten_thousand_sources_build_under_a_low_descriptor_limit(tmp_path):
    prefixes = tiny_sources(tmp_path / "src", 10_000)
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps({"data": [[1.0, p] for p in prefixes]}))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def cli(*args):
        return subprocess.run(
            [sys.executable, str(REPO / "cli.py"), "build", "--blend-file", blend, "--seq-length", "16",
             "--num-samples", "20000", "--cache-dir", tmp_path / "cache", "--json", *args],
            capture_output=True, text=True, timeout=limit_s(600),
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))

    cold = cli()
    assert cold.returncode == 0, cold.stderr[-2000:]
    report = json.loads(cold.stdout)
    assert report["builds"] >= 1 and len({r["prefix"] for r in report["plan"]}) == 10_000
    warm = json.loads(cli().stdout)
    assert warm["builds"] == 0 and warm["fingerprint"] == report["fingerprint"]


def test_max_id_is_computed_once_per_file_version_and_only_when_asked(tmp_path, monkeypatch):
    from tokenloom.blending import sources

    (prefix,) = tiny_sources(tmp_path / "src", 1, docs=4, max_length=2000)
    count = os.path.getsize(f"{prefix}.bin") // 2
    tokens = np.arange(count, dtype=np.uint16) % 1000
    tokens[count - 3] = 60000  # in the last of several chunks
    tokens.tofile(f"{prefix}.bin")
    monkeypatch.setattr(sources, "MAX_ID_CHUNK", count // 3)
    cache = tmp_path / "cache"
    assert source_metadata([prefix], cache)[prefix].max_id is None  # a build does not read the .bin
    assert source_metadata([prefix], cache, max_ids=True)[prefix].max_id == 60000
    clear_memo()

    def unread(prefix):
        raise AssertionError(f"{prefix}.bin read again")

    monkeypatch.setattr(sources, "max_token_id", unread)
    assert source_metadata([prefix], cache, max_ids=True)[prefix].max_id == 60000  # the later line wins
    monkeypatch.undo()
    tokens[count - 3] = 7
    tokens.tofile(f"{prefix}.bin.tmp")
    os.replace(f"{prefix}.bin.tmp", f"{prefix}.bin")  # a new .bin version, same .idx
    assert source_metadata([prefix], cache, max_ids=True)[prefix].max_id == 999
