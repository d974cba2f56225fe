"""Best-fit packing (``packing="best-fit"``): the native packer against its reference and a
hand-derived example, the packed indices (every document whole in one sample per epoch, the
pieces of long ones covering them), the loader's masks, the cache, the plan and the dump
(``build --dump-samples``) of both packings, and the acceptance bounds on the shared corpora."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tokenloom import native
from tokenloom.blending import reference
from tokenloom.blending.blend import build_mock_datasets
from tokenloom.blending.build import BuildConfig, build
from tokenloom.blending.dump import sample_layouts
from tokenloom.blending.gpt import (
    PACKER,
    GPTDatasetConfig,
    build_gpt_indices,
    concat_cuts,
    fewest_packed_samples,
    key_fields,
    packed_pieces,
)
from tokenloom.blending.helpers import pack_best_fit
from tokenloom.blending.loader import GPTSamples, SampleConfig
from tokenloom.blending.mock import MockSource
from tokenloom.blending.plan import format_plan
from tokenloom.blending.split import Split
from tokenloom.cli import main
from tokenloom.errors import TokenloomError
from tokenloom.indexed import IndexedDataset, IndexedDatasetWriter

BEST_FIT = dict(packing="best-fit")


def test_worked_example_by_hand():
    # capacity 5 (seq 4 + the extra token), pieces every 4 tokens. Lengths 3, 5, 2, 4, 6:
    # doc 1 fills a sample; doc 4 is cut into [0, 5) (a full sample) and [4, 6). Best fit of
    # the rest, longest first (ties in doc_idx order): 4 (doc 3) opens sample 0 (room 1); 3
    # (doc 0) opens sample 1 (room 2); 2 (doc 2) fills sample 1; 2 (doc 4's tail) opens sample 2.
    sizes = np.array([3, 5, 2, 4, 6], dtype=np.int32)
    parts, starts = pack_best_fit(sizes, np.arange(5, dtype=np.int32), 5, 4)
    assert parts.tolist() == [[3, 0, 4], [0, 0, 3], [2, 0, 2], [4, 4, 2], [1, 0, 5], [4, 0, 5]]
    assert starts.tolist() == [0, 1, 3, 4, 5, 6]


def test_the_refill_by_hand():
    # capacity 9 (seq 8): three documents of 13 tokens are each a full piece [0, 9) and a last
    # piece [8, 13) of 5 (over half a sample: one per sample, room 4 each). 12 tokens of room
    # make a sample, so the emptiest sample of last pieces only (the first opened: all tie) is
    # poured into the others' rooms: doc 0's [8, 13) as [8, 12) and [11, 13) (one token shared).
    sizes = np.array([13, 13, 13], dtype=np.int32)
    parts, starts = pack_best_fit(sizes, np.arange(3, dtype=np.int32), 9, 8)
    assert parts.tolist() == [[1, 8, 5], [0, 8, 4], [2, 8, 5], [0, 11, 2], [0, 0, 9], [1, 0, 9], [2, 0, 9]]
    assert starts.tolist() == [0, 2, 4, 5, 6, 7]
    # doc 3 (2 tokens, whole) takes the room of the sample opened last (rooms 4, 4, 2): sample
    # 0 is still emptied, into sample 1's room and then sample 2's
    sizes = np.array([13, 13, 13, 2], dtype=np.int32)
    parts, starts = pack_best_fit(sizes, np.arange(4, dtype=np.int32), 9, 8)
    assert parts.tolist() == [[1, 8, 5], [0, 8, 4], [2, 8, 5], [3, 0, 2], [0, 11, 2], [0, 0, 9], [1, 0, 9], [2, 0, 9]]
    # doc 3 of 3 tokens leaves rooms 4, 4, 1 (9 in all): the sample holding it is never emptied,
    # and a room of one token (the token a cut shares) holds nothing, so 5 tokens do not fit
    sizes = np.array([13, 13, 13, 3], dtype=np.int32)
    parts, starts = pack_best_fit(sizes, np.arange(4, dtype=np.int32), 9, 8)
    assert parts.tolist() == [[0, 8, 5], [1, 8, 5], [2, 8, 5], [3, 0, 3], [0, 0, 9], [1, 0, 9], [2, 0, 9]]


@pytest.mark.skipif(not native.loaded(), reason="the native extension is not built")
def test_native_equals_reference_on_random_inputs():
    from tokenloom import _native

    rng = np.random.default_rng(0)
    refilled = 0
    for _ in range(300):
        cap = int(rng.integers(2, 40))
        step = cap - int(rng.integers(0, 2)) if cap > 2 else cap
        sizes = rng.integers(0, 100, size=int(rng.integers(1, 80))).astype(np.int32)
        doc = rng.permutation(len(sizes))[: int(rng.integers(0, len(sizes) + 1))].astype(np.int32)
        a, b = _native.pack_best_fit(sizes, doc, cap, step), reference.pack_best_fit(sizes, doc, cap, step)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
        check_epoch(a[0], a[1], sizes, doc, cap, step)
        refilled += len(a[0]) > len(packed_pieces(sizes[doc], GPTDatasetConfig(seq_length=cap - 1)))
    assert refilled > 30  # the refill ran in many of them
    for fn in (_native.pack_best_fit, reference.pack_best_fit):
        with pytest.raises(ValueError, match=r"doc_idx\[1\] = 9 is out of range"):
            fn(np.ones(3, np.int32), np.array([0, 9], np.int32), 5, 4)
        with pytest.raises(TypeError, match="int32"):
            fn(np.ones(3, np.int64), np.array([0], np.int32), 5, 4)


def check_epoch(parts: np.ndarray, starts: np.ndarray, sizes: np.ndarray, docs, capacity: int, step: int) -> None:
    """Every document of ``docs`` is covered exactly: whole in one sample when it fits, else by
    full pieces every ``step`` tokens and a last piece, which the refill may cut again (its
    parts sharing ``capacity - step`` tokens, each holding more); no sample holds more than
    ``capacity`` tokens nor two parts of one document."""
    overlap = capacity - step
    assert np.all(np.add.reduceat(parts[:, 2], starts[:-1]) <= capacity) if len(parts) else True
    for s in range(len(starts) - 1):
        held = parts[starts[s]:starts[s + 1], 0]
        assert len(set(held.tolist())) == len(held)
    pieces: dict[int, list[tuple[int, int]]] = {}
    for d, o, n in parts.tolist():
        pieces.setdefault(d, []).append((o, n))
    for d in docs:
        length = int(sizes[d])
        got = sorted(pieces.pop(d, []))
        if length == 0:
            assert got == []
        elif length <= capacity:
            assert got == [(0, length)]
        else:
            full = (length - overlap - 1) // step  # pieces of capacity before the last piece
            assert got[:full] == [(f * step, capacity) for f in range(full)]
            end = full * step + overlap
            for o, n in got[full:]:
                assert o == end - overlap and overlap < n <= capacity
                end = o + n
            assert end == length
    assert not pieces


def test_packed_indices_cover_every_document_once_per_epoch():
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 60, size=500).astype(np.int32)
    docs = np.arange(100, 400, dtype=np.int32)
    cfg = GPTDatasetConfig(seq_length=16, seed=7, **BEST_FIT)
    one = build_gpt_indices(sizes, docs, None, Split.train, cfg)
    assert one.packed and one.num_epochs == 1 and len(one) == len(one.shuffle_index)
    n = len(one)
    idx = build_gpt_indices(sizes, docs, 2 * n + 1, Split.train, cfg)
    assert idx.num_epochs == 3 and len(idx) == 3 * n  # each epoch packs to as many samples
    assert np.array_equal(idx.document_index[: len(one.document_index)], one.document_index)
    for e in range(3):  # served epoch after epoch, each a permutation of its own samples
        order = idx.shuffle_index[e * n : (e + 1) * n].astype(np.int64)
        assert sorted(order.tolist()) == list(range(e * n, (e + 1) * n))
        lo, hi = idx.sample_index[e * n], idx.sample_index[(e + 1) * n]
        check_epoch(idx.document_index[lo:hi], idx.sample_index[e * n : (e + 1) * n + 1] - lo, sizes, docs, 17, 16)
    assert not np.array_equal(idx.document_index[:lo], idx.document_index[lo:hi])  # epochs pack differently
    again = build_gpt_indices(sizes, docs, 2 * n + 1, Split.train, cfg)
    assert all(np.array_equal(getattr(idx, a), getattr(again, a)) for a in ("document_index", "sample_index",
                                                                            "shuffle_index"))
    with pytest.raises(TokenloomError, match="5 samples requested from a split with no tokens"):
        build_gpt_indices(np.zeros(4, np.int32), np.arange(4, dtype=np.int32), 5, Split.train, cfg)
    with pytest.raises(TokenloomError, match="packing must be one of"):
        GPTDatasetConfig(seq_length=4, packing="first-fit")  # type: ignore[arg-type]


def test_concat_cache_keys_do_not_name_packing():
    assert "packing" not in key_fields(GPTDatasetConfig(seq_length=8))
    assert key_fields(GPTDatasetConfig(seq_length=8, **BEST_FIT))["packer"] == PACKER
    assert key_fields(GPTDatasetConfig(seq_length=8, **BEST_FIT))["packing"] == "best-fit"


def test_concat_cuts_by_hand():
    # windows of 5 tokens every 4: [0,4], [4,8], [8,12]; documents [0,3) [3,8) [8,10) [10,11)
    assert concat_cuts(np.array([3, 5, 2, 1]), 4) == 1  # only [3, 8) spans two windows
    assert concat_cuts(np.array([5, 4]), 4) == 0  # [0, 5) in [0, 4]; [5, 9) in [4, 8] (8 the shared token)
    assert concat_cuts(np.array([4, 6, 0]), 4) == 1  # [4, 10) spans [4, 8] and [8, 12]; empty ones never count


def test_loader_keeps_labels_inside_documents():
    eod = 63
    source = MockSource(64, eod, num_sequences=300, max_length=30, content="random", seed=3)
    train, _, _ = build_mock_datasets(GPTDatasetConfig(seq_length=16, seed=1, **BEST_FIT), (40, 1, 1), source)
    samples = GPTSamples(train, SampleConfig(eod=eod, inter_document_masking=True, labels_within_documents=True))
    padded = 0
    for k in range(len(train)):
        out = samples[k]
        sample, pieces = train.documents_of(k)
        assert pieces.sum() == 17 and np.array_equal(sample, train[k])
        doc = np.repeat(np.arange(len(pieces)), pieces)  # piece of every token
        real = sample != -1
        # a label is trained iff it and its input are real tokens of the same piece
        want = (doc[:-1] == doc[1:]) & real[:-1] & real[1:]
        assert np.array_equal(out["loss_mask"] > 0, want)
        cu = out["cu_seqlens"]
        starts = np.concatenate([[0], np.cumsum(pieces)[:-1]])
        assert cu[: len(starts[starts < 16])].tolist() == starts[starts < 16].tolist()
        padded += int((~real).sum())
    assert padded > 0


def two_sources(tmp: Path) -> tuple[str, str]:
    rng = np.random.default_rng(0)
    out = []
    for name, top in (("short", 30), ("long", 90)):
        with IndexedDatasetWriter(tmp / name, vocab_size=96) as writer:
            for _ in range(120):
                writer.add_document(rng.integers(0, 95, size=int(rng.integers(1, top))).tolist() + [95])
        out.append(str(tmp / name))
    return out[0], out[1]


def test_a_packed_blend_caches_dumps_and_reads_what_it_dumps(tmp_path):
    a, b = two_sources(tmp_path)
    cfg = BuildConfig(data=[(0.3, a), (0.7, b)], split="8,1,1", seq_length=32, num_samples=(200, 10, 5),
                      cache_dir=str(tmp_path / "c"),
                      **BEST_FIT)
    first, second = build(cfg), build(cfg)
    assert first.builds > 0 and second.builds == 0 and second.hits == first.builds
    assert first.fingerprint == second.fingerprint != build(BuildConfig(**{**vars(cfg), "packing": "concat"})).fingerprint
    row = first.plan[0]
    assert row.padding is not None and row.cut is not None and row.concat_cut is not None and row.cut <= row.concat_cut
    text = format_plan(first, cfg)
    assert "padding" in text.splitlines()[0] and "cut (concat)" in text and "packing best-fit" in text
    assert f"{row.padding} ({100 * row.padding_share:.2f}%)" in text.splitlines()[1]
    opened = {p: IndexedDataset(p) for p in (a, b)}
    records = list(sample_layouts(second.train))
    assert [r["sample"] for r in records] == list(range(len(second.train)))
    names = {"short": a, "long": b}
    for r in records[:60]:  # the parts, read back, are the sample the trainer reads
        tokens = [opened[names[s]].get(d, offset=o, length=n) for s, d, o, n in r["parts"]]
        want = second.train[r["sample"]]
        assert r["padding"] == 33 - sum(len(t) for t in tokens)
        assert np.array_equal(np.concatenate(tokens + [np.full(r["padding"], -1)]), want)
    drawn = Counter(r["parts"][0][0] for r in records)
    assert abs(drawn["long"] / len(records) - 0.7) < 0.02  # blended by weight, as concat samples are


def test_dump_of_a_megatron_build_matches_its_samples(tmp_path):
    a, _ = two_sources(tmp_path)
    out = tmp_path / "dump.jsonl"
    result = CliRunner().invoke(main, ["build", "--data", a, "--seq-length", "16", "--num-samples", "50",
                                       "--dump-samples", str(out), "--num", "20"])
    assert result.exit_code == 0, result.output
    assert "samples: 20 of the train split written to" in result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    train = build(BuildConfig(data=[(1.0, a)], seq_length=16, num_samples=(50, None, None))).train
    ds = IndexedDataset(a)
    for r in records:
        tokens = np.concatenate([ds.get(d, offset=o, length=n) for _, d, o, n in r["parts"]])
        assert r["padding"] == 0 and np.array_equal(tokens, train[r["sample"]])
    bad = CliRunner().invoke(main, ["build", "--data", a, "--num", "3"])
    assert bad.exit_code != 0 and "--num goes with --dump-samples FILE" in bad.output
    gone = tmp_path / "missing" / "dump.jsonl"
    bad = CliRunner().invoke(main, ["build", "--data", a, "--seq-length", "16", "--num-samples", "50",
                                    "--dump-samples", str(gone)])
    assert bad.exit_code == 1 and f"No such file or directory on {gone}" in bad.output and not gone.parent.exists()


CORPORA = ["tinyshakespeare_gpt2_eod", "wikitext-2_gpt2_eod"]


@pytest.mark.parametrize("split", ["1,0,0", "969,30,1"])
@pytest.mark.parametrize("seq", [1024, 2048])
@pytest.mark.parametrize("corpus", CORPORA)
def test_acceptance_bounds_on_the_shared_corpora(shared_data, tmp_path, corpus, seq, split):
    """Every document no longer than a sample whole in exactly one sample of the epoch, read
    from ``build --dump-samples``; padding <= 1% of the token slots; samples <= 1.01 x
    ceil(tokens / seq_length). On the whole corpus and on the train split of the default split.
    (The English novels pass too: bench/packing_bench.py.)"""
    prefix = str(shared_data / "megatron-reference" / corpus)
    out = tmp_path / "dump.jsonl"
    result = CliRunner().invoke(main, ["build", "--data", prefix, "--seq-length", str(seq), "--split", split,
                                       "--exhaustive", "--packing", "best-fit", "--dump-samples", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    documents = np.asarray(build(BuildConfig(data=[(1.0, prefix)], split=split, seq_length=seq, exhaustive=True,
                                             **BEST_FIT)).train.documents)
    lengths = IndexedDataset(prefix).sequence_lengths[documents]
    whole = Counter((d, o, n) for r in records for _, d, o, n in r["parts"])
    parts = Counter(d for r in records for _, d, _, _ in r["parts"])
    assert set(parts) <= set(documents.tolist())
    fit = (lengths > 0) & (lengths <= seq + 1)
    assert all(whole[(int(d), 0, int(n))] == 1 == parts[int(d)] for d, n in zip(documents[fit], lengths[fit], strict=True))
    tokens = int(lengths.sum(dtype=np.int64))
    padding = sum(r["padding"] for r in records)
    assert padding <= 0.01 * len(records) * (seq + 1)
    assert len(records) <= 1.01 * math.ceil(tokens / seq)


def fewest_by_search(pieces: list[int], capacity: int) -> int:
    """The fewest samples any packing of ``pieces`` uses, by exhaustive search (a few pieces)."""
    best = len(pieces)

    def place(i: int, rooms: list[int]) -> None:
        nonlocal best
        if len(rooms) >= best:
            return
        if i == len(pieces):
            best = len(rooms)
            return
        for r in sorted(set(rooms)):
            if r >= pieces[i]:
                at = rooms.index(r)
                place(i + 1, rooms[:at] + [r - pieces[i]] + rooms[at + 1:])
        place(i + 1, [*rooms, capacity - pieces[i]])

    place(0, [])
    return best


def test_the_fewest_samples_bound_is_a_bound_and_the_pieces_are_the_packers():
    rng = np.random.default_rng(3)
    for _ in range(200):
        cfg = GPTDatasetConfig(seq_length=int(rng.integers(3, 30)), **BEST_FIT)
        capacity = cfg.seq_length + 1
        lengths = rng.integers(0, 3 * capacity, size=int(rng.integers(1, 5))).astype(np.int32)
        pieces = packed_pieces(lengths, cfg)
        parts, starts = pack_best_fit(lengths, np.arange(len(lengths), dtype=np.int32), capacity, cfg.seq_length)
        # the packer's parts are these pieces, the last ones of cut documents perhaps cut again
        check_epoch(parts, starts, lengths, range(len(lengths)), capacity, cfg.seq_length)
        if len(parts) == len(pieces):
            assert sorted(pieces.tolist()) == sorted(parts[:, 2].tolist())
        if len(pieces) <= 8:
            assert fewest_packed_samples(lengths, cfg) <= fewest_by_search(pieces.tolist(), capacity)
            if len(parts) == len(pieces):  # nothing refilled: best fit, no better than the best
                assert fewest_by_search(pieces.tolist(), capacity) <= len(starts) - 1
    # by hand: capacity 10; pieces 6, 6, 6 (each over half: three samples) and 3, 3 (fit beside them)
    assert fewest_packed_samples(np.array([6, 6, 6, 3, 3], np.int32), GPTDatasetConfig(seq_length=9)) == 3
    # 6, 6, 6 and 5: K = 5 needs a fourth sample (5 fits beside no 6); the token count says 3
    assert fewest_packed_samples(np.array([6, 6, 6, 5], np.int32), GPTDatasetConfig(seq_length=9)) == 4
    # a long document: 25 tokens at seq 9 are pieces of 10, 10 and 7 (each starting 9 after the last)
    assert packed_pieces(np.array([25, 0], np.int32), GPTDatasetConfig(seq_length=9)).tolist() == [10, 10, 7]


def test_the_refill_goes_under_the_fewest_samples_of_uncut_pieces(shared_data):
    """WikiText-2's train split at the default split (969,30,1: whole articles), seq 2048: no
    packing of the pieces uncut has fewer than 264 samples (the L2 bound: 59 last pieces over
    half a sample and too little beside them), 1.11% padding; the refill cuts some of those last
    pieces again and reaches ceil(tokens / seq_length) = 262, the fewest samples there are."""
    prefix = str(shared_data / "megatron-reference" / "wikitext-2_gpt2_eod")
    cfg = BuildConfig(data=[(1.0, prefix)], split="969,30,1", seq_length=2048, exhaustive=True, **BEST_FIT)
    result = build(cfg)
    [row] = [r for r in result.plan if r.split == "train"]
    lengths = result.train.source.sequence_lengths[np.asarray(result.train.documents)]
    uncut = fewest_packed_samples(lengths, GPTDatasetConfig(seq_length=2048, **BEST_FIT))
    assert uncut == 264 and uncut * 2049 - int(packed_pieces(lengths, GPTDatasetConfig(seq_length=2048)).sum()) \
        > 0.01 * uncut * 2049
    assert row.packed_samples == len(result.train) == math.ceil(int(lengths.sum()) / 2048) == 262
    assert row.padding_share <= 0.01 and row.cut == int(np.sum(lengths > 2049))
