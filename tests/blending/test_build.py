"""The build stage: cache keys follow content, one build among concurrent processes, token mode, plan."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import numpy as np
import pytest
from tl_testing import limit_s, run_cli

from tokenloom.blending.args import load_blend_file, parse_data_args
from tokenloom.blending.build import BuildConfig, build
from tokenloom.errors import TokenloomError
from tokenloom.indexed import IndexedDatasetWriter, manifest


def make_source(path, n_docs=300, seed=0, vocab=1000, tokenizer_digest="t" * 64, tokenizer=None):
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(path, vocab_size=vocab) as w:
        for _ in range(n_docs):
            w.add_document(rng.integers(0, vocab, size=int(rng.integers(5, 200))))
    tok = tokenizer or {"digest": tokenizer_digest, "kind": "test"}
    m = manifest.build(str(path), "text", "uint16", [], tok, {}, {})
    manifest.write(path, m)
    return str(path)


@pytest.fixture
def sources(tmp_path):
    return [make_source(tmp_path / "a", seed=1), make_source(tmp_path / "b", n_docs=500, seed=2)]


def cfg_for(sources, tmp_path, **kw):
    kw.setdefault("seq_length", 64)
    kw.setdefault("num_samples", (1000, 50, 10))
    kw.setdefault("split", "90,8,2")  # small sources: every split must hold documents
    return BuildConfig(data=[(0.4, sources[0]), (0.6, sources[1])], cache_dir=str(tmp_path / "cache"), **kw)


def test_warm_cache_only_loads(sources, tmp_path):
    first = build(cfg_for(sources, tmp_path))
    assert first.builds == 3 and first.hits == 0  # one bundle entry per split
    start = time.perf_counter()
    again = build(cfg_for(sources, tmp_path))
    assert again.builds == 0 and again.hits == 3
    assert time.perf_counter() - start < 1.0
    assert again.fingerprint == first.fingerprint
    assert np.array_equal(np.asarray(again.train.dataset_index), np.asarray(first.train.dataset_index))
    assert all(np.array_equal(again.train[i], first.train[i]) for i in range(0, 1000, 97))


def test_key_changes_with_content_and_config(sources, tmp_path):
    base = build(cfg_for(sources, tmp_path)).keys
    assert build(cfg_for(sources, tmp_path, seq_length=32)).keys["train"] != base["train"]
    assert build(cfg_for(sources, tmp_path, seed=7)).keys["train"] != base["train"]
    time.sleep(0.01)
    make_source(tmp_path / "a", seed=99)  # re-tokenized into the same prefix
    after = build(cfg_for(sources, tmp_path))
    assert after.keys["train"] != base["train"] and after.builds > 0


def _build_in_child(sources, tmp_path, out):
    result = build(cfg_for(sources, tmp_path))
    digest = [
        np.asarray(result.train.dataset_sample_index).sum(),
        np.asarray(result.valid.dataset_index).sum(),
    ]
    out.put((result.builds, result.fingerprint, [int(x) for x in digest]))


def test_eight_concurrent_builders_build_once(sources, tmp_path):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(sources, tmp_path, out)) for _ in range(8)]
    for p in procs:
        p.start()
    results = [out.get(timeout=limit_s(120)) for _ in procs]
    for p in procs:
        p.join(60)
    assert sum(r[0] for r in results) == 3  # every entry built exactly once across the 8 processes
    assert len({(r[1], tuple(r[2])) for r in results}) == 1


def test_token_mode_refuses_an_impossible_mix_with_numbers(sources, tmp_path):
    cfg = cfg_for(
        sources, tmp_path, mode="tokens", num_samples=(None, 0, 0), train_tokens=400_000, max_repeat=1.0
    )
    with pytest.raises(
        TokenloomError,
        match=r"impossible mix: .*a: share 0\.4 of 400000 train tokens = 160000 "
        r"tokens, but its train split holds \d+ \([\d.]+ passes > max_repeat "
        r"1\.0\); largest share that fits: [\d.]+",
    ) as info:
        build(cfg)
    assert "b:" not in str(info.value) or "b: share" in str(info.value)
    ok = build(
        cfg_for(
            sources, tmp_path, mode="tokens", num_samples=(None, 0, 0), train_tokens=20_000, max_repeat=1.0
        )
    )
    wanted = -(-20_000 // 64)  # ceil: 313 samples
    assert wanted <= len(ok.train) <= wanted + 1  # Megatron sizes a blend as the sum of per-source ceilings


def test_refuses_sources_from_different_tokenizers(tmp_path):
    a = make_source(tmp_path / "a", tokenizer_digest="a" * 64)
    b = make_source(tmp_path / "b", tokenizer_digest="b" * 64)
    with pytest.raises(TokenloomError, match="different tokenizers"):
        build(cfg_for([a, b], tmp_path))


def _gpt2_fingerprint(files: dict[str, str], digest: str) -> dict:
    return {"kind": "gpt2-bpe", "files": files, "vocab_size": 50257, "eod": 50256, "bos": None, "pad": None,
            "options": {}, "digest": digest, "engine": "tiktoken"}


def test_same_tokenizer_files_under_other_names_blend(tmp_path):
    """Megatron's gpt2-vocab.json / gpt2-merges.txt and HF's vocab.json / merges.txt with the
    same contents give the same ids: the sources blend; other contents are refused."""
    megatron = _gpt2_fingerprint({"gpt2-merges.txt": "m" * 64, "gpt2-vocab.json": "v" * 64}, "1" * 64)
    hf = _gpt2_fingerprint({"merges.txt": "m" * 64, "vocab.json": "v" * 64}, "2" * 64)
    other = _gpt2_fingerprint({"merges.txt": "x" * 64, "vocab.json": "v" * 64}, "3" * 64)
    a = make_source(tmp_path / "a", tokenizer=megatron)
    b = make_source(tmp_path / "b", seed=1, tokenizer=hf)
    c = make_source(tmp_path / "c", seed=2, tokenizer=other)
    assert len(build(cfg_for([a, b], tmp_path)).train) > 0
    with pytest.raises(TokenloomError, match="different tokenizers") as refused:
        build(cfg_for([a, c], tmp_path))
    # each side named as people know it (issue 20: fingerprints alone named neither tokenizer)
    assert "gpt2-bpe (gpt2-merges.txt, gpt2-vocab.json; vocabulary 50257)" in str(refused.value)
    assert "gpt2-bpe (merges.txt, vocab.json; vocabulary 50257)" in str(refused.value)


def test_plan_reports_shares_and_epochs(sources, tmp_path):
    result = build(cfg_for(sources, tmp_path, num_samples=(5000, 0, 0)))
    train = [r for r in result.plan if r.split == "train"]
    assert [round(r.requested, 4) for r in train] == [0.4, 0.6]
    assert all(abs(r.realised - r.requested) < 1e-3 for r in train)
    assert max(r.epochs for r in train) > 1  # 5000 samples of 64 tokens repeat these small sources
    assert result.valid is None and result.test is None  # 0 samples: skipped


def test_data_args_and_blend_files(tmp_path):
    assert parse_data_args(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert parse_data_args(["a", "b"]) == [(1.0, "a"), (1.0, "b")]
    with pytest.raises(TokenloomError, match="odd number"):
        parse_data_args(["0.3", "a", "0.7"])
    f = tmp_path / "blend.yaml"
    f.write_text("train:\n  - [0.5, a]\n  - {weight: 0.5, prefix: b}\nvalid:\n  - [1, c]\n")
    assert load_blend_file(str(f)) == {
        "data_per_split": {"train": [(0.5, "a"), (0.5, "b")], "valid": [(1.0, "c")]}
    }


def test_cli_build_and_errors(sources, tmp_path):
    out = run_cli(
        "build",
        "--data",
        "0.4",
        sources[0],
        "0.6",
        sources[1],
        "--seq-length",
        64,
        "--split",
        "90,8,2",
        "--num-samples",
        "500,20,5",
        "--cache-dir",
        tmp_path / "c",
        "--json",
        "--plot",
        tmp_path / "p.png",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["builds"] == 3 and os.path.getsize(tmp_path / "p.png") > 1000
    bad = run_cli("build", "--data", "0.4", sources[0], "0.6", "--seq-length", 64, "--num-samples", "10")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr


def _rank_main(rank, world, store_dir, cache_dirs, sources, tmp_path, out):
    import torch.distributed as dist

    from tokenloom.blending.cache import SharedBuild

    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world)
    shared = SharedBuild(rank, world, dist.barrier, run_id="test-run")
    cfg = BuildConfig(
        data=[(0.4, sources[0]), (0.6, sources[1])],
        cache_dir=str(cache_dirs[rank]),
        seq_length=64,
        num_samples=(1000, 50, 10),
        split="90,8,2",
    )
    result = build(cfg, shared=shared)
    out.put((rank, result.builds, result.fingerprint))
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["shared", "node-local"])
def test_distributed_build_once_per_filesystem(sources, tmp_path, layout):
    world = 2
    cache_dirs = (
        [tmp_path / "cache"] * world if layout == "shared" else [tmp_path / f"node{r}" for r in range(world)]
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, tmp_path, cache_dirs, sources, tmp_path, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=limit_s(180)) for _ in procs)
    for p in procs:
        p.join(60)
    builds = [r[1] for r in results]
    assert len({r[2] for r in results}) == 1
    assert builds == ([3, 0] if layout == "shared" else [3, 3])


def _slow_open(prefix):
    from tokenloom.blending.sources import LazySource

    time.sleep(3.0)  # two sources: the build outlasts the process group's 3 s timeout
    return LazySource(prefix)


def _node_rank_main(rank, world, store_dir, cache_dirs, sources, out):
    from datetime import timedelta

    import torch.distributed as dist

    from tokenloom.blending.cache import SharedBuild

    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=3))
    lines = []
    shared = SharedBuild(rank, world, dist.barrier, run_id="node-run", timeout=120, report_every=1.0,
                         echo=lines.append)
    cfg = BuildConfig(data=[(0.4, sources[0]), (0.6, sources[1])], cache_dir=str(cache_dirs[rank]), seq_length=64,
                      num_samples=(1000, 50, 10), split="90,8,2")
    result = build(cfg, open_source=_slow_open if rank % 2 == 0 else None, shared=shared)
    dist.barrier()  # the process group is still healthy after the long wait
    arrays = [np.asarray(result.train.dataset_index), np.asarray(result.train.datasets[1].indices.shuffle_index)]
    out.put((rank, result.builds, result.fingerprint, [a.tobytes().hex()[:4096] for a in arrays], len(lines)))
    dist.destroy_process_group()


@pytest.mark.slow
def test_node_local_caches_build_once_per_node_and_waiters_outlive_the_collective_timeout(sources, tmp_path):
    world = 4  # two "nodes" of two ranks, each node with its own cache directory (no shared filesystem)
    cache_dirs = [tmp_path / f"node{r // 2}" for r in range(world)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_node_rank_main, args=(r, world, tmp_path, cache_dirs, sources, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=limit_s(300)) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [r[1] for r in results] == [3, 0, 3, 0]  # one build per node
    assert len({(r[2], tuple(r[3])) for r in results}) == 1  # every rank reads identical arrays
    assert results[1][4] >= 2 and results[3][4] >= 2  # the waiting ranks reported progress
    assert all((tmp_path / f"node{n}" / ".runs" / "node-run.done").exists() for n in range(2))


def test_cli_rebuilds_a_truncated_cache_entry_with_the_same_arrays(sources, tmp_path):
    args = ["build", "--data", "0.4", sources[0], "0.6", sources[1], "--seq-length", 64, "--split", "90,8,2",
            "--num-samples", "20000,20,5", "--cache-dir", tmp_path / "c", "--json"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    key = json.loads(first.stdout)["keys"]["train"]
    npy = tmp_path / "c" / key / "shuffle_index.npy"
    reference = np.load(npy)
    npy.write_bytes(npy.read_bytes()[: npy.stat().st_size // 2])  # a damaged, finished entry
    (tmp_path / "c" / f"{key}.tmp-00000000-1-deadbeef").mkdir()  # another host's leftovers stay
    again = run_cli(*args)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert "damaged" in again.stderr and json.loads(again.stdout)["builds"] == 1
    assert np.array_equal(np.load(npy), reference)
    assert (tmp_path / "c" / f"{key}.tmp-00000000-1-deadbeef").is_dir()
