"""The array cache: one build among concurrent processes, atomic entries, keys that follow content."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from tokenloom.blending.cache import ArrayCache, content_key, elect_builders
from tokenloom.blending.sources import source_metadata
from tokenloom.errors import TokenloomError
from tokenloom.indexed import IndexedDatasetWriter


def _build_in_process(cache_dir, log_dir, n):
    cache = ArrayCache(cache_dir)

    def build():
        (log_dir / f"built-{n}").write_text("x")
        time.sleep(0.5)  # long enough that every process arrives while the build is running
        rng = np.random.default_rng(123)
        return {"a": rng.integers(0, 1000, size=10_000), "b": np.arange(7, dtype=np.int32)}

    arrays, _ = cache.get_or_build("k" * 64, build, {"what": "test"})
    np.save(log_dir / f"seen-{n}.npy", np.asarray(arrays["a"]))


def test_eight_processes_build_once(tmp_path):
    cache_dir, logs = tmp_path / "cache", tmp_path / "logs"
    logs.mkdir()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_build_in_process, args=(cache_dir, logs, n)) for n in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(list(logs.glob("built-*"))) == 1
    seen = [np.load(f) for f in sorted(logs.glob("seen-*.npy"))]
    assert len(seen) == 8 and all(np.array_equal(s, seen[0]) for s in seen)


def test_hit_maps_files_and_is_fast(tmp_path):
    cache = ArrayCache(tmp_path)
    arrays, built = cache.get_or_build("abc", lambda: {"x": np.arange(1_000_000)})
    assert built
    start = time.perf_counter()
    again, built = cache.get_or_build("abc", lambda: pytest.fail("must not rebuild"))
    assert not built and time.perf_counter() - start < 0.05
    assert isinstance(again["x"].base, np.memmap) and again["x"][-1] == 999_999  # a view of the mapping


def test_incomplete_entry_is_rebuilt(tmp_path):
    cache = ArrayCache(tmp_path)
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "x.npy").write_bytes(b"half-written")  # no meta.json: not complete
    arrays, built = cache.get_or_build("abc", lambda: {"x": np.arange(3)})
    assert built and arrays["x"].tolist() == [0, 1, 2]


def test_key_follows_content_not_path(tmp_path):
    def write(ids):
        with IndexedDatasetWriter(tmp_path / "src", vocab_size=100) as w:
            for doc in ids:
                w.add_document(doc)

    write([[1, 2, 3], [4]])
    first = source_metadata([str(tmp_path / "src")])[str(tmp_path / "src")].digest
    time.sleep(0.01)
    write([[1, 2], [3, 4]])  # "re-tokenized" into the same prefix
    second = source_metadata([str(tmp_path / "src")])[str(tmp_path / "src")].digest
    assert first != second
    assert content_key({"a": 1, "b": [1, 2]}) == content_key({"b": [1, 2], "a": 1})
    assert content_key({"seq": 1024}) != content_key({"seq": 2048})


def test_election_on_shared_dir(tmp_path):
    # Simulated ranks on one filesystem: all nonce files are visible, rank 0 leads.
    for r in range(3):
        (tmp_path / f".nonce-run-{r}").write_text(str(r))
    assert elect_builders(tmp_path, 2, 3, lambda: None, "run") == 0


@pytest.mark.parametrize("damage", ["truncate-large", "truncate-small", "flip-small", "meta"])
def test_damaged_entry_is_rebuilt_with_a_warning(tmp_path, capsys, damage):
    cache = ArrayCache(tmp_path)
    values = {"big": np.arange(300_000, dtype=np.int64), "small": np.arange(10, dtype=np.int32)}
    cache.get_or_build("abc", lambda: values)
    entry = tmp_path / "abc"
    if damage == "truncate-large":
        (entry / "big.npy").write_bytes((entry / "big.npy").read_bytes()[:-1000])
    elif damage == "truncate-small":
        (entry / "small.npy").write_bytes((entry / "small.npy").read_bytes()[:-4])
    elif damage == "flip-small":
        data = bytearray((entry / "small.npy").read_bytes())
        data[-1] ^= 1
        (entry / "small.npy").write_bytes(bytes(data))
    else:
        (entry / "meta.json").write_text("{")
    arrays, built = cache.get_or_build("abc", lambda: values)
    assert built and "damaged" in capsys.readouterr().err
    assert all(np.array_equal(arrays[k], values[k]) for k in values)
    assert not list(tmp_path.glob("abc.tmp-*"))
    with pytest.raises(TokenloomError, match="may not rebuild"):
        (entry / "small.npy").write_bytes(b"")
        cache.get_or_build("abc", lambda: values, may_build=False)


def test_temp_folders_of_dead_builders_are_swept(tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    cache = ArrayCache(tmp_path)
    mine = cache.temp_dir("k").name.rsplit("-", 2)[0]  # <key>.tmp-<host>
    names = [f"{mine}-{dead.pid}-aaaaaaaa", f"{mine}-{os.getpid()}-bbbbbbbb", "k.tmp-00000000-1-cccccccc"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.npy").write_bytes(b"partial")
    assert ArrayCache(tmp_path) is not None  # opening the cache sweeps
    left = sorted(p.name for p in tmp_path.glob("k.tmp-*"))
    assert left == sorted(names[1:])  # the live builder's and the other host's stay
