"""The mock source reproduces Megatron's synthetic data; random content is seeded per sequence."""

from __future__ import annotations

import numpy as np
import pytest

from tokenloom.blending.mock import MockSource
from tokenloom.errors import TokenloomError


def test_megatron_defaults():
    source = MockSource(vocab_size=1000, eod=0)
    expected = np.random.default_rng(0).integers(1, 4096, size=100_000, dtype=np.int32)
    np.testing.assert_array_equal(source.sequence_lengths, expected)
    seq = source[7]
    assert seq.dtype == np.int64 and len(seq) == expected[7] and seq[-1] == 0
    np.testing.assert_array_equal(seq[:-1], (np.arange(expected[7] - 1) + 1) % 1000)
    np.testing.assert_array_equal(source.get(7, offset=3, length=4), seq[3:7])
    np.testing.assert_array_equal(source.get(7, offset=3), seq[3:])


def test_random_content_is_seeded_and_in_vocab():
    a = MockSource(50, 49, num_sequences=20, min_length=5, max_length=40, seed=3, content="random")
    b = MockSource(50, 49, num_sequences=20, min_length=5, max_length=40, seed=3, content="random")
    assert len(a) == 20 and a.sequence_lengths.min() >= 5 and a.sequence_lengths.max() < 40
    for i in range(20):
        np.testing.assert_array_equal(a[i], b[i])
        assert a[i].max() < 50 and a[i][-1] == 49


def test_bad_arguments():
    with pytest.raises(TokenloomError):
        MockSource(0, 0)
    with pytest.raises(TokenloomError):
        MockSource(10, 0, content="zeros")
