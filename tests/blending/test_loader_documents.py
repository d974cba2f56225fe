"""Document-isolated samples (``inter_document_masking``): ``cu_seqlens``, ``max_seqlen`` and
restarting position ids, from the document pieces a sample is cut from."""

from __future__ import annotations

import numpy as np

from tokenloom.blending.blend import build_mock_datasets
from tokenloom.blending.gpt import GPTDatasetConfig
from tokenloom.blending.loader import GPTSamples, SampleConfig, document_boundaries
from tokenloom.blending.mock import MockSource

SEQ = 16


def test_boundaries_derived_by_hand():
    # pieces of 3, 5 and 9 tokens cover 16 inputs + the extra label token
    out = document_boundaries(np.array([3, 5, 9]), SEQ)
    assert out["cu_seqlens"].dtype == np.int32 and len(out["cu_seqlens"]) == SEQ + 1
    assert out["cu_seqlens"].tolist() == [0, 3, 8] + [16] * 14
    assert int(out["max_seqlen"]) == 8
    assert out["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, *range(8)]
    # one document covering the whole sample
    one = document_boundaries(np.array([17]), SEQ)
    assert one["cu_seqlens"].tolist() == [0] + [16] * 16 and int(one["max_seqlen"]) == 16
    # a piece ending exactly at the last input: the extra token starts a piece of its own
    edge = document_boundaries(np.array([16, 1]), SEQ)
    assert edge["cu_seqlens"].tolist() == [0] + [16] * 16


def test_samples_agree_with_eod_positions_and_reassemble():
    """Pieces reassemble the sample; every document start follows an EOD (mock documents end
    with one); position ids restart at each start."""
    eod = 63
    source = MockSource(64, eod, num_sequences=300, max_length=12, content="random", seed=3)
    train, _, _ = build_mock_datasets(GPTDatasetConfig(seq_length=SEQ, seed=1), (40, 1, 1), source)
    docs = GPTSamples(train, SampleConfig(eod=eod, inter_document_masking=True))
    plain = GPTSamples(train, SampleConfig(eod=eod))
    checked = 0
    for k in range(len(train)):
        a, b = docs[k], plain[k]
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["labels"], b["labels"])
        sample, pieces = train.documents_of(k)
        np.testing.assert_array_equal(sample, train[k])
        assert pieces.sum() == SEQ + 1
        cu = a["cu_seqlens"]
        starts = cu[: np.argmax(cu == SEQ)]
        assert np.all(np.diff(cu) >= 0) and cu[-1] == SEQ
        assert int(a["max_seqlen"]) == np.diff(np.append(starts, SEQ)).max()
        # every document ends with EOD (random content may also hold EOD ids inside a document)
        after_eod = np.flatnonzero(a["tokens"][:-1] == eod) + 1
        assert set(starts[1:].tolist()) <= set(after_eod.tolist())
        for s, e in zip(starts, np.append(starts[1:], SEQ), strict=True):
            assert a["position_ids"][s:e].tolist() == list(range(e - s))
        checked += 1
    assert checked == len(train) >= 40


def test_ramp_documents_match_reset_position_ids():
    """Ramp documents hold no EOD inside, so EOD-based position resets equal document ones."""
    eod = 0
    source = MockSource(1000, eod, num_sequences=200, max_length=9, content="ramp", seed=0)
    train, _, _ = build_mock_datasets(GPTDatasetConfig(seq_length=SEQ, seed=2), (30, 1, 1), source)
    docs = GPTSamples(train, SampleConfig(eod=eod, inter_document_masking=True))
    reset = GPTSamples(train, SampleConfig(eod=eod, reset_position_ids=True))
    for k in range(len(train)):
        np.testing.assert_array_equal(docs[k]["position_ids"], reset[k]["position_ids"])
