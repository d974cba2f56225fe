"""Acceptance (issue 56, dedup): ``preprocess --dedup exact|minhash`` on real paragraphs with planted
duplicates; agreement with datatrove's MinHash pipeline; the same bytes and removed list for any
worker count, for shards + merge and after a kill in the bucket pass; the filter wiring.

One corpus (1725 paragraphs of the shared novels, 225 planted duplicates) serves the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from dedup_corpus import Corpus, jaccard, planted_corpus
from preprocess_helpers import preprocess, same_bytes
from tl_testing import REPO, cli_env, one_line_error, patch_datatrove_xxhash

import tokenloom.clean
from tokenloom.errors import TokenloomError
from tokenloom.indexed import manifest
from tokenloom.preprocess import PreprocessConfig
from tokenloom.preprocess.config import check_options
from tokenloom.preprocess.merge import merge

# Sized on this machine (2 cores, shared): the module's runs take ~15 s, the datatrove oracle ~5 s.
pytestmark = pytest.mark.timeout(200)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return planted_corpus()


@pytest.fixture(scope="module")
def work(tmp_path_factory, corpus):
    """(folder, the corpus as 3 jsonl files, the reference: one in-process run with --dedup minhash)."""
    folder = tmp_path_factory.mktemp("dedup")
    paths = corpus.write(folder, parts=3)
    reference = preprocess(folder, paths, name="reference", dedup="minhash", append_eod=True)
    return folder, paths, reference


def removed(prefix: Path) -> list[dict]:
    return [json.loads(line) for line in Path(f"{prefix}.removed.jsonl").read_text(encoding="utf-8").splitlines()]


def test_minhash_removes_the_planted_duplicates_and_little_else(work, corpus):
    folder, paths, reference = work
    listed = removed(reference)
    gone = {corpus.index(paths, r["input"], r["record"]): r for r in listed}
    planted = set(corpus.exact) | set(corpus.near)
    print(f"recall {len(set(gone) & planted) / len(planted):.3f}, removed {len(gone)}, planted {len(planted)}")
    assert len(set(gone) & planted) >= 0.95 * len(planted)
    twins = {i: corpus.index(paths, r["kept"]["input"], r["kept"]["record"]) for i, r in gone.items()}
    not_duplicates = [i for i in set(gone) - planted if jaccard(corpus.texts[i], corpus.texts[twins[i]]) < 0.5]
    assert len(not_duplicates) <= 0.01 * len(gone), not_duplicates
    assert all(twins[i] < i for i in gone)  # the first in input order is kept
    assert {r["reason"] for r in listed} == {"minhash"}
    m = manifest.read(reference)
    assert m["options"]["clean"]["minhash"] == {"ngrams": 5, "bands": 14, "rows": 8, "seed": 1}
    assert m["counts"]["removed"] == {"minhash": len(listed)}
    assert m["counts"]["documents"] == len(corpus.texts) - len(listed) == m["counts"]["records"] - len(listed)


def test_exact_removes_exactly_the_exact_copies(work, corpus):
    folder, paths, _ = work
    out = preprocess(folder, paths, name="exact", dedup="exact", append_eod=True)
    gone = {corpus.index(paths, r["input"], r["record"]): corpus.index(paths, r["kept"]["input"], r["kept"]["record"])
            for r in removed(out)}
    assert gone == corpus.exact


def test_removed_sets_agree_with_datatrove(work, corpus, tmp_path, monkeypatch):
    data = pytest.importorskip("datatrove.data")
    dedup = pytest.importorskip("datatrove.pipeline.dedup.minhash")
    patch_datatrove_xxhash(monkeypatch)
    config = dedup.MinhashConfig()  # the defaults: 5-grams, 14 x 8, seed 1, 64-bit xxhash
    documents = [data.Document(text=t, id=str(i)) for i, t in enumerate(corpus.texts)]
    dedup.MinhashDedupSignature(output_folder=str(tmp_path / "sigs"), config=config).run(documents)
    buckets = dedup.MinhashDedupBuckets(input_folder=str(tmp_path / "sigs"), output_folder=str(tmp_path / "buckets"),
                                        config=config)
    for bucket in range(config.num_buckets):
        buckets.run(rank=bucket, world_size=config.num_buckets)
    dedup.MinhashDedupCluster(input_folder=str(tmp_path / "buckets"), output_folder=str(tmp_path / "remove"),
                              config=config).run()
    theirs = set(np.frombuffer((tmp_path / "remove" / "000000.remove").read_bytes(), "<u4").tolist())
    folder, paths, reference = work
    ours = {corpus.index(paths, r["input"], r["record"]) for r in removed(reference)}
    agreement = len(ours & theirs) / len(ours | theirs)
    print(f"agreement with datatrove: {agreement:.4f} ({len(ours)} ours, {len(theirs)} theirs)")
    assert agreement >= 0.98, (agreement, sorted(ours - theirs)[:10], sorted(theirs - ours)[:10])


def test_workers_and_shards_give_the_same_bytes_and_list(work):
    folder, paths, reference = work
    two = preprocess(folder, paths, name="two", dedup="minhash", append_eod=True, workers=2, chunk_bytes=1 << 16)
    shards = [preprocess(folder, paths, name="sh", dedup="minhash", append_eod=True, num_shards=2, shard_index=i)
              for i in range(2)]
    parts = [f"{shards[0]}-shard{i:05d}-of-00002" for i in range(2)]
    assert Path(f"{parts[1]}.clean").is_dir()  # the side files the merge decides from
    merge(str(folder / "merged"), parts)
    expected = Path(f"{reference}.removed.jsonl").read_bytes()
    for out in (two, folder / "merged"):
        assert same_bytes(out, reference)
        assert Path(f"{out}.removed.jsonl").read_bytes() == expected
        assert manifest.read(out)["counts"] == manifest.read(reference)["counts"]


def _fault_env(work: Path, path: str) -> dict:
    env = cli_env()
    env["PYTHONPATH"] += os.pathsep + str(REPO / "tests" / "fault_site")
    env["TOKENLOOM_TEST_FAULT"] = json.dumps({"op": "exit", "errno": 137, "path": path,
                                              "marker": str(work / "killed.marker")})
    return env


def test_a_run_killed_in_the_bucket_pass_resumes_there_with_the_same_bytes(work):
    """The process dies (as under ``kill -9``) when the bucket pass opens the output it copies the kept
    documents into; the rerun resumes from the checkpoint saved when reading ended."""
    folder, paths, reference = work
    out = folder / "killed"
    args = [sys.executable, str(REPO / "cli.py"), "preprocess", "--input", *map(str, paths), "--output-prefix",
            str(out), "--tokenizer-type", "byte", "--append-eod", "--dedup", "minhash", "--workers", "1",
            "--no-progress"]
    env = _fault_env(folder, str(folder / "killed.partial" / "0.bin"))
    first = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert first.returncode == 137 and (folder / "killed.marker").exists(), first.stderr
    assert "dedup minhash: about" in first.stdout and "of run files" in first.stdout  # the plan, before the run
    assert not Path(f"{out}.bin").exists() and (folder / "killed.partial" / "clean" / "meta.json").exists()
    again = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "resuming from" in again.stdout
    assert same_bytes(out, reference)
    assert Path(f"{out}.removed.jsonl").read_bytes() == Path(f"{reference}.removed.jsonl").read_bytes()
    assert not (folder / "killed.partial").exists()


class _Short:
    """A filter of this test: keep documents of at least ``min_words`` words."""

    def __init__(self, min_words: int):
        self.name, self.min_words = "short", min_words

    def keep(self, text: str) -> bool:
        return len(text.split()) >= self.min_words


def _build_filters(names, overrides=None):
    overrides = overrides or {}
    unknown = [n for n in names if n != "short"]
    if unknown:
        raise ValueError(f"unknown filter {unknown[0]!r} (known: short)")
    fields = {k.split(".", 1)[1]: v for k, v in overrides.items()}
    if set(fields) - {"min_words"}:
        raise ValueError(f"short has no field {sorted(set(fields) - {'min_words'})[0]!r}")
    return [_Short(int(fields.get("min_words", 3)))]


@pytest.fixture
def short_filter(monkeypatch):
    """``tokenloom.clean.filters`` replaced by one filter (forked workers inherit the replacement)."""
    fake = types.ModuleType("tokenloom.clean.filters")
    fake.FILTER_NAMES = ("short",)
    fake.build_filters = _build_filters
    monkeypatch.setitem(sys.modules, "tokenloom.clean.filters", fake)
    monkeypatch.setattr(tokenloom.clean, "filters", fake, raising=False)


def test_filters_run_before_dedup_and_are_listed(tmp_path, short_filter):
    texts = ["one two three", "a b", "one two three", "x y", "four five six seven", "a b", "four five six seven"]
    path = tmp_path / "f.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    runs = [preprocess(tmp_path, [path], name=f"w{w}", dedup="exact", filters=["short"], workers=w, chunk_bytes=30,
                       filter_params=["short.min_words=3"]) for w in (1, 2)]
    listed = removed(runs[0])
    assert [(r["record"], r["reason"], r.get("kept", {}).get("record")) for r in listed] == [
        (2, "short", None), (3, "exact", 1), (4, "short", None), (6, "short", None), (7, "exact", 5)]
    m = manifest.read(runs[0])
    assert m["counts"]["removed"] == {"exact": 2, "short": 3} and m["counts"]["documents"] == 2
    assert m["options"]["clean"]["filter_params"] == {"short.min_words": "3"}
    assert same_bytes(runs[0], runs[1]) and Path(f"{runs[1]}.removed.jsonl").read_text() == \
        Path(f"{runs[0]}.removed.jsonl").read_text()


@pytest.mark.parametrize(("options", "fragment"), [
    ({"filters": ["nope"]}, "unknown filter 'nope'"),
    ({"filters": ["short"], "filter_params": ["short.colour=red"]}, "no field 'colour'"),
    ({"filters": ["short"], "filter_params": ["short.min_words"]}, "NAME.FIELD=VALUE"),
    ({"filter_params": ["short.min_words=3"]}, "not in --filters"),
    ({"dedup": "fuzzy"}, "--dedup 'fuzzy'"),
    ({"dedup": "minhash", "minhash_bands": 0}, "--minhash-bands must be >= 1"),
])
def test_bad_cleaning_options_are_refused_in_one_line(short_filter, options, fragment):
    cfg = PreprocessConfig(inputs=["x.jsonl"], output_prefix="out", **options)
    with pytest.raises(TokenloomError, match=fragment.replace("(", r"\(")):
        check_options(cfg)


def test_merge_refuses_part_of_a_pending_dedup(work):
    folder, paths, _ = work
    shard = f"{folder}/sh-shard00001-of-00002"
    if not Path(f"{shard}.bin").exists():
        pytest.skip("needs test_workers_and_shards_give_the_same_bytes_and_list's shards")  # same module, runs first
    plain = preprocess(folder, paths[:1], name="plain")
    with pytest.raises(TokenloomError, match="dedup is pending"):
        merge(str(folder / "mixed"), [str(plain), shard])
    done = subprocess.run([sys.executable, str(REPO / "cli.py"), "merge", "--output-prefix", str(folder / "one"),
                           shard, f"{folder}/sh-shard00000-of-00002"], capture_output=True, text=True,
                          env=cli_env(), timeout=60)
    one_line_error(done, "in index order")
