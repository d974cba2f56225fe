"""``tokenloom.objstore``'s readers of datasets in place: the node cache of small objects
(:func:`local_copy`) and the block-cache reader of a ``.bin`` (:class:`RangedReader`), against moto's
S3 server behind a counting proxy (:class:`tl_testing.FaultProxy`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tl_testing import FaultProxy, limit_s

from tokenloom import objstore

pytest.importorskip("moto.moto_server.werkzeug_app", reason="needs moto[server] (the dev extra)")
s3fs = pytest.importorskip("s3fs", reason="needs s3fs (the s3 extra)")

BLOCK = 1 << 16
DATA = np.random.default_rng(0).integers(0, 256, 10 * BLOCK + 123, dtype=np.uint8).tobytes()


@pytest.fixture
def store(s3, monkeypatch, tmp_path):
    """``(proxy, url)``: an object of 10 blocks and a bit, reached through a proxy; drop via ``proxy``."""
    fs = s3.fs()
    if not fs.exists("objects"):
        fs.mkdir("objects")
    fs.pipe_file("objects/blob.bin", DATA)
    proxy = FaultProxy(s3.endpoint)
    for key, value in s3.env(proxy.endpoint).items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv(objstore.CACHE_ENV, str(tmp_path / "cache"))
    s3fs.S3FileSystem.clear_instance_cache()  # the endpoint differs per test
    yield proxy, "s3://objects/blob.bin"
    proxy.close()
    s3fs.S3FileSystem.clear_instance_cache()


def _gets(proxy) -> list[str]:
    return [rng for method, path, rng in proxy.log if method == "GET" and path.endswith("blob.bin")]


def test_ranged_reads_are_served_from_a_bounded_cache_of_blocks(store):
    proxy, url = store
    reader = objstore.RangedReader(url, len(DATA), block=BLOCK, cache_bytes=4 * BLOCK, read_ahead=0)
    assert reader.read(BLOCK - 10, 20) == DATA[BLOCK - 10: BLOCK + 10]  # two blocks
    assert reader.read(5, 100) == DATA[5:105]  # cached
    assert len(_gets(proxy)) == 2
    for b in range(2, 6):  # four more blocks evict blocks 0 and 1 (4 fit)
        reader.read(b * BLOCK, 1)
    reader.read(0, 1)
    assert len(_gets(proxy)) == 7 and _gets(proxy)[-1] == f"bytes=0-{BLOCK - 1}"
    assert reader.read(10 * BLOCK, 123) == DATA[10 * BLOCK:], "the last, short block"
    with pytest.raises(ValueError):
        reader.read(len(DATA) - 1, 2)


def test_read_ahead_fetches_the_next_blocks_while_the_reader_works(store):
    proxy, url = store
    reader = objstore.RangedReader(url, len(DATA), block=BLOCK, cache_bytes=4 * BLOCK, read_ahead=2)
    got = b"".join(reader.read(pos, min(BLOCK, len(DATA) - pos)) for pos in range(0, len(DATA), BLOCK))
    assert got == DATA
    assert len(_gets(proxy)) == 11, "each block once, most of them ahead of the read"


def test_transient_failures_are_retried_and_the_bytes_are_exact(store, monkeypatch):
    proxy, url = store
    monkeypatch.setattr(objstore, "RETRY_BACKOFF", 0.001)
    faulty = FaultProxy(proxy.endpoint, drop=0.3, seed=1)
    monkeypatch.setenv("AWS_ENDPOINT_URL", faulty.endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        reader = objstore.RangedReader(url, len(DATA), block=BLOCK, cache_bytes=2 * BLOCK, read_ahead=1)
        assert b"".join(reader.read(p, min(BLOCK, len(DATA) - p)) for p in range(0, len(DATA), BLOCK)) == DATA
    finally:
        faulty.close()
    assert faulty.dropped, "nothing was dropped: the test tested nothing"


def test_local_copy_is_fetched_once_by_concurrent_fetchers_and_keyed_by_content(store, s3):
    proxy, url = store
    paths: list = []
    threads = [threading.Thread(target=lambda: paths.append(objstore.local_copy(url))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and len(paths) == 4 and len(_gets(proxy)) == 1
    assert open(paths[0], "rb").read() == DATA and paths[0].endswith("/blob.bin")
    s3.fs().pipe_file("objects/blob.bin", DATA[:-1])  # new content under the same name: a new entry
    fresh = objstore.local_copy(url)
    assert fresh != paths[0] and open(fresh, "rb").read() == DATA[:-1]
    assert objstore.local_copy("s3://objects/none.json", missing_ok=True) is None
    with pytest.raises(objstore.StoreError, match=r"s3://objects/none.json: lookup failed: no such object"):
        objstore.local_copy("s3://objects/none.json")


def _read_in_child(reader, queue) -> None:
    queue.put(reader.read(3 * BLOCK, 10))


def test_a_forked_worker_reads_with_its_own_cache_and_connections(store):
    """A DataLoader worker is forked from a process whose reader is warm: the worker starts over."""
    import multiprocessing

    _, url = store
    reader = objstore.RangedReader(url, len(DATA), block=BLOCK, cache_bytes=4 * BLOCK, read_ahead=2)
    assert reader.read(0, 10) == DATA[:10]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(reader, queue))
    child.start()
    got = queue.get(timeout=limit_s(60))
    child.join(timeout=limit_s(60))
    assert child.exitcode == 0 and got == DATA[3 * BLOCK: 3 * BLOCK + 10]
    assert reader.read(BLOCK, 10) == DATA[BLOCK: BLOCK + 10], "the parent reads on"


def test_the_block_cache_holds_its_byte_budget_across_objects():
    """One LRU for every object a process reads: a blend of many sources stays within the budget."""
    cache = objstore.BlockCache(capacity=10)
    for i in range(5):
        cache.put((f"s3://b/source{i}.bin", 0), bytes(4))
    assert cache.used <= 10 and ("s3://b/source4.bin", 0) in cache and ("s3://b/source0.bin", 0) not in cache
    assert cache.get(("s3://b/source3.bin", 0)) == bytes(4)
    cache.put(("s3://b/source5.bin", 0), bytes(4))  # evicts the least recently used: source4, not source3
    assert ("s3://b/source3.bin", 0) in cache and ("s3://b/source4.bin", 0) not in cache
    assert objstore.block_cache() is objstore.block_cache(), "one per process"


def test_stat_many_lists_a_folder_once_instead_of_a_head_per_object(store, s3):
    proxy, _ = store
    fs = s3.fs()
    urls = [f"s3://objects/many/part{i}.idx" for i in range(objstore.LIST_AT)]
    for i, url in enumerate(urls):
        fs.pipe_file(url[5:], bytes(i + 1))
    before = len(proxy.log)
    found = objstore.stat_many([*urls, "s3://objects/many/missing.idx"])
    assert len(proxy.log) - before == 1 and proxy.log[-1][0] == "GET", "one listing"
    assert found["s3://objects/many/missing.idx"] is None
    assert all(found[url] == objstore.stat(url) for url in urls), "the listing's sizes and ETags are the HEAD's"
