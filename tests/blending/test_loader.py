"""The loader: sample framing, and exact resume at a different data-parallel size."""

from __future__ import annotations

import numpy as np
import pytest

from tokenloom.blending.loader import ConsumedSamplesSampler, GPTSamples, SampleConfig, check_fingerprint
from tokenloom.errors import TokenloomError


def _global_sequence(total, micro, dp_size, consumed=0):
    """Every rank's batches, interleaved per step into the global order."""
    samplers = [ConsumedSamplesSampler(total, consumed, micro, r, dp_size) for r in range(dp_size)]
    out = []
    for step in zip(*samplers, strict=True):
        for batch in step:
            out.extend(batch)
    return out


def test_docstring_example():
    assert [list(b) for b in ConsumedSamplesSampler(10, 0, 2, 0, 2)] == [[0, 1], [4, 5]]
    assert [list(b) for b in ConsumedSamplesSampler(10, 0, 2, 1, 2)] == [[2, 3], [6, 7]]
    assert list(ConsumedSamplesSampler(10, 4, 4, 0, 1)) == [[4, 5, 6, 7]]


@pytest.mark.parametrize("k_steps", [0, 1, 3, 7])
def test_resume_with_a_different_dp_size(k_steps):
    total, micro = 100, 2
    straight = _global_sequence(total, micro * 2, 1)  # global batch 4 at DP 1
    consumed = k_steps * micro * 2  # k steps at DP size 2, micro 2
    first = _global_sequence(total, micro, 2)[:consumed]
    rest = _global_sequence(total, micro * 2, 1, consumed=consumed)
    assert first + rest == straight


def test_framing_masks_and_positions():
    eod, pad = 9, -1
    data = [np.array([1, 2, 9, 3, 4, 9, 5]), np.array([1, 2, 3, -1, -1, -1, -1])]
    samples = GPTSamples(data, SampleConfig(eod=eod, pad_id=pad, eod_mask_loss=True, reset_position_ids=True))
    s = samples[0]
    assert s["tokens"].tolist() == [1, 2, 9, 3, 4, 9]
    assert s["labels"].tolist() == [2, 9, 3, 4, 9, 5]
    assert s["loss_mask"].tolist() == [1, 1, 0, 1, 1, 0]
    assert s["position_ids"].tolist() == [0, 1, 2, 0, 1, 2]
    p = samples[1]
    assert p["loss_mask"].tolist() == [1, 1, 0, 0, 0, 0] and p["tokens"].min() >= 0


def test_fingerprint_mismatch_is_an_error_unless_forced():
    check_fingerprint(None, "a" * 64)
    check_fingerprint("a" * 64, "a" * 64)
    with pytest.raises(TokenloomError, match="different data"):
        check_fingerprint("a" * 64, "b" * 64)
    check_fingerprint("a" * 64, "b" * 64, force=True)


def test_consumed_beyond_the_index_is_an_error():
    with pytest.raises(TokenloomError, match="consumed samples"):
        ConsumedSamplesSampler(10, 11, 1, 0, 1)


def test_an_id_beyond_the_vocabulary_names_its_source():
    from types import SimpleNamespace

    class Member(list):
        def __init__(self, prefix, samples):
            super().__init__(samples)
            self.source = SimpleNamespace(path_prefix=prefix)

    class TwoMembers:  # blended sample i is sample i // 2 of member i % 2
        datasets = [Member("data/web", [np.array([1, 2, 3])] * 2), Member("data/code", [np.array([4, 96, 5])] * 2)]

        def __len__(self):
            return 4

        def locate(self, i):
            return i % 2, i // 2

        def __getitem__(self, i):
            d, k = self.locate(i)
            return self.datasets[d][k]

    samples = GPTSamples(TwoMembers(), SampleConfig(vocab_size=96))
    assert samples[0]["tokens"].tolist() == [1, 2]
    with pytest.raises(TokenloomError, match=r"sample 3 of data/code holds token id 96, beyond the model's "
                                             r"vocabulary \(96 ids\)"):
        samples[3]
    assert GPTSamples(TwoMembers())[3]["labels"].tolist() == [96, 5]  # no vocabulary given: no guard
