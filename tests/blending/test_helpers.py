"""C++ index builders vs their numpy references (and hand-checked cases)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.blending import helpers, reference

_native = pytest.importorskip("tokenloom._native", reason="native extension not built")

IMPLS = [pytest.param(reference, id="numpy"), pytest.param(_native, id="native")]
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def sample_idx_case(draw):
    num_sequences = draw(st.integers(1, 12))
    sizes = np.array(
        draw(st.lists(st.integers(0, 40), min_size=num_sequences, max_size=num_sequences)), np.int32
    )
    docs = np.array(sorted(draw(st.sets(st.integers(0, num_sequences - 1), min_size=1))), np.int32)
    num_epochs = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    doc_idx = np.tile(docs, num_epochs)
    np.random.RandomState(seed).shuffle(doc_idx)
    tokens_per_epoch = int(sizes[docs].sum())
    seq_length = draw(st.integers(1, 50))
    drop_last = draw(st.booleans())
    add_extra = draw(st.integers(0, 1))
    exact_ceil = draw(st.booleans())
    return sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, add_extra, exact_ceil


@FAST
@given(sample_idx_case())
def test_sample_idx_native_matches_reference(case):
    sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, add_extra, exact_ceil = case
    args = (sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, add_extra, exact_ceil)
    if num_epochs * tokens_per_epoch - add_extra < 0 and seq_length == 1:
        for impl in (reference, _native):
            with pytest.raises(ValueError):
                impl.build_sample_idx_int32(*args)
        return
    expected = reference.build_sample_idx_int32(*args)
    for name in ("build_sample_idx_int32", "build_sample_idx_int64"):
        for impl in (reference, _native):
            got = getattr(impl, name)(*args)
            assert got.dtype == (np.int32 if name.endswith("int32") else np.int64)
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_sample_idx_worked_example(impl):
    # sequences of 5, 3 and 7 tokens in that order, S = 4, x = 1: windows of 5 tokens
    # sharing one boundary token: [0:5) [4:9) [8:13), then 2 tokens are left over.
    sizes = np.array([5, 3, 7], np.int32)
    doc_idx = np.array([0, 1, 2], np.int32)
    got = impl.build_sample_idx_int32(sizes, doc_idx, 4, 1, 15, True, 1)
    np.testing.assert_array_equal(got, [[0, 0], [0, 4], [2, 0], [2, 4]])
    kept = impl.build_sample_idx_int32(sizes, doc_idx, 4, 1, 15, False, 1)  # keep the partial window
    np.testing.assert_array_equal(kept, [[0, 0], [0, 4], [2, 0], [2, 4], [2, 6]])


@pytest.mark.parametrize("impl", IMPLS)
def test_sample_idx_past_2_31_tokens(impl):
    # 3 epochs of 5 sequences of ~1 G tokens: 15 G tokens, offsets stay below 2^31.
    sizes = np.array([2**30 - 7, 2**30 + 11, 5, 2**31 - 1, 999_999_937], np.int32)
    docs = np.arange(5, dtype=np.int32)
    doc_idx = np.concatenate([np.random.RandomState(e).permutation(docs) for e in range(3)]).astype(np.int32)
    tokens_per_epoch = int(sizes.astype(np.int64).sum())
    assert 3 * tokens_per_epoch > 2**33
    for drop_last in (True, False):
        args = (sizes, doc_idx, 2**27 + 3, 3, tokens_per_epoch, drop_last, 1)
        wide = impl.build_sample_idx_int64(*args)
        narrow = impl.build_sample_idx_int32(*args)
        assert wide.dtype == np.int64 and narrow.dtype == np.int32
        np.testing.assert_array_equal(wide, narrow)
        np.testing.assert_array_equal(wide, reference.build_sample_idx_int64(*args))
        # every window covers exactly S + 1 tokens of the flattened stream
        lengths = sizes[doc_idx].astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])[wide[:, 0]] + wide[:, 1]
        assert (np.diff(starts)[:-1] == 2**27 + 3).all()
        assert starts[-1] <= 3 * tokens_per_epoch - 1


@pytest.mark.parametrize("impl", IMPLS)
def test_single_precision_ceil_quirk(impl):
    # 2^25 + 2 tokens after the extra token, S = 4096: float32 says 8192 samples,
    # exact arithmetic 8193 (the last, partial, one).
    sizes = np.array([2**25 + 3], np.int32)
    doc_idx = np.array([0], np.int32)
    args = (sizes, doc_idx, 4096, 1, 2**25 + 3, False, 1)
    assert impl.build_sample_idx_int32(*args).shape == (8193, 2)
    assert impl.build_sample_idx_int32(*args, True).shape == (8194, 2)
    assert reference.count_samples(2**25 + 2, 4096, drop_last=False) == 8192
    assert reference.count_samples(2**25 + 2, 4096, drop_last=False, exact_ceil=True) == 8193


def test_dispatch_picks_dtype():
    sizes = np.array([3, 4], np.int32)
    doc_idx = np.array([0, 1], np.int32)
    assert helpers.build_sample_idx(sizes, doc_idx, 2, 1, 7).dtype == np.int32
    assert helpers.sample_idx_dtype(np.array([2**31 - 1], np.int32), np.zeros(3, np.int32)) is np.int32


weights_strategy = st.lists(
    st.one_of(st.floats(1e-4, 1.0), st.sampled_from([0.001, 0.999, 0.5, 1 / 3])), min_size=1, max_size=12
)  # up to 8 sources take the register-resident path, more the generic one


@FAST
@given(weights_strategy, st.integers(0, 400))
def test_blending_native_matches_reference(raw_weights, size):
    w = np.array(raw_weights, np.float64)
    w = w / w.sum()
    outs = []
    for impl in (reference, _native):
        index = np.full(size, -1, np.int16)
        sample = np.full(size, -1, np.int64)
        impl.build_blending_indices(index, sample, w, len(w), size, False)
        outs.append((index, sample))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    index, sample = outs[1]
    for d in range(len(w)):  # per-dataset draws are 0, 1, 2, ... in order
        np.testing.assert_array_equal(sample[index == d], np.arange((index == d).sum()))
        assert abs((index == d).sum() - w[d] * size) < 2  # max(i, 1) lags the target by up to w


@FAST
@given(st.lists(st.integers(1, 60), min_size=0, max_size=6))
def test_exhaustive_native_matches_reference(sizes):
    s = np.array(sizes, np.int64)
    outs = []
    for impl in (reference, _native):
        index = np.full(int(s.sum()), -1, np.int16)
        sample = np.full(int(s.sum()), -1, np.int64)
        impl.build_exhaustive_blending_indices(index, sample, s, len(s))
        outs.append((index, sample))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    assert np.bincount(outs[1][0], minlength=len(s)).tolist() == list(sizes)


@pytest.mark.parametrize("impl", IMPLS)
def test_blending_max_i_1_quirk(impl):
    # Megatron targets w * max(i, 1), so steps 0 and 1 share t = 1. For (0.25, 0.75)
    # that gives 1 0 1 1 0 1 1 1; the textbook w * (i + 1) gives 1 0 1 1 1 0 1 1.
    index = np.zeros(8, np.int16)
    sample = np.zeros(8, np.int64)
    impl.build_blending_indices(index, sample, np.array([0.25, 0.75]), 2, 8, False)
    assert index.tolist() == [1, 0, 1, 1, 0, 1, 1, 1]
    assert sample.tolist() == [0, 0, 1, 2, 1, 3, 4, 5]


@pytest.mark.parametrize("impl", IMPLS)
def test_wrong_dtypes_raise_instead_of_casting(impl):
    w = np.array([0.5, 0.5])
    with pytest.raises(TypeError, match="dataset_index.*int16"):
        impl.build_blending_indices(np.zeros(4, np.int64), np.zeros(4, np.int64), w, 2, 4, False)
    with pytest.raises(TypeError, match="dataset_sample_index.*int64"):
        impl.build_blending_indices(np.zeros(4, np.int16), np.zeros(4, np.int32), w, 2, 4, False)
    with pytest.raises(TypeError, match="weights.*float64"):
        impl.build_blending_indices(np.zeros(4, np.int16), np.zeros(4, np.int64), [0.5, 0.5], 2, 4, False)
    with pytest.raises(TypeError, match="sizes.*int64"):
        impl.build_exhaustive_blending_indices(
            np.zeros(4, np.int16), np.zeros(4, np.int64), np.array([2, 2], np.int32), 2
        )
    with pytest.raises(TypeError, match="sizes.*int32"):
        impl.build_sample_idx_int32(np.array([3, 4]), np.array([0, 1], np.int32), 2, 1, 7, True, 1)
    with pytest.raises(TypeError, match="doc_idx.*int32"):
        impl.build_sample_idx_int64(np.array([3, 4], np.int32), np.array([0, 1]), 2, 1, 7, True, 1)
    with pytest.raises(TypeError, match="sizes.*int32"):
        impl.build_sample_idx_int32(np.array([3, 4], ">i4"), np.array([0, 1], np.int32), 2, 1, 7, True, 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_values_raise_value_error(impl):
    w = np.array([0.5, 0.5])
    i16, i64 = np.zeros(4, np.int16), np.zeros(4, np.int64)
    sizes = np.array([3, 4], np.int32)
    with pytest.raises(ValueError, match="out of range"):
        impl.build_sample_idx_int32(sizes, np.array([0, 2], np.int32), 2, 1, 7, True, 1)
    with pytest.raises(ValueError, match="negative"):
        impl.build_sample_idx_int32(np.array([3, -4], np.int32), np.array([0, 1], np.int32), 2, 1, 7, True, 1)
    with pytest.raises(ValueError, match="doc_idx is empty"):
        impl.build_sample_idx_int32(sizes, np.zeros(0, np.int32), 2, 1, 7, True, 1)
    with pytest.raises(ValueError, match="seq_length"):
        impl.build_sample_idx_int32(sizes, np.array([0, 1], np.int32), 0, 1, 7, True, 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        impl.build_sample_idx_int32(np.zeros(8, np.int32)[::2], np.array([0, 1], np.int32), 2, 1, 0, True, 1)
    with pytest.raises(ValueError, match="dataset_index"):
        impl.build_blending_indices(np.zeros(3, np.int16), i64, w, 2, 4, False)
    with pytest.raises(ValueError, match="weights"):
        impl.build_blending_indices(i16, i64, w, 3, 4, False)
    with pytest.raises(ValueError, match="32767"):
        impl.build_blending_indices(i16, i64, np.ones(40_000) / 40_000, 40_000, 4, False)
    with pytest.raises(ValueError, match="num_datasets"):
        impl.build_blending_indices(i16, i64, w, 0, 4, False)
    readonly = np.zeros(4, np.int16)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        impl.build_blending_indices(readonly, i64, w, 2, 4, False)
    with pytest.raises(ValueError, match=r"sizes\[1\]"):
        impl.build_exhaustive_blending_indices(i16, i64, np.array([2, 0], np.int64), 2)
    with pytest.raises(ValueError, match="dataset_sample_index"):
        impl.build_exhaustive_blending_indices(i16, np.zeros(3, np.int64), np.array([2, 2], np.int64), 2)


@FAST
@given(
    st.integers(0, 2**32 - 1),
    st.integers(0, 1500),
    st.lists(st.sampled_from([0, 1, 2, 3, 623, 624, 625, 5000, 70_000]), min_size=1, max_size=3),
    st.sampled_from([np.int32, np.uint32, np.int64]),
)
def test_native_shuffle_is_numpy_legacy_shuffle(seed, draws_before, lengths, dtype):
    """Same permutation and same generator state after, from any point of the MT19937 stream."""
    ours, numpys = np.random.RandomState(seed), np.random.RandomState(seed)
    ours.randint(0, 2**31, size=draws_before)  # start mid-block: any state position
    numpys.randint(0, 2**31, size=draws_before)
    _assert_same_shuffles(ours, numpys, lengths, dtype)
    assert ours.get_state()[2] == numpys.get_state()[2]
    assert ours.randint(0, 2**31, size=3).tolist() == numpys.randint(0, 2**31, size=3).tolist()


@given(
    st.integers(0, 2**32 - 1),
    st.lists(st.sampled_from([0, 1, 7, 624, 5000, 70_000]), min_size=1, max_size=4),
    st.sampled_from([np.int32, np.uint32, np.int64, np.int16]),  # int16: no native shuffle, numpy's path
)
@settings(max_examples=30, deadline=None)
def test_seeded_stream_draws_what_a_fresh_random_state_draws(seed, lengths, dtype):
    ours, numpys = helpers.SeededStream(seed), np.random.RandomState(seed)
    _assert_same_shuffles(ours, numpys, lengths, dtype)
    assert ours.pos == numpys.get_state()[2] and np.array_equal(ours.key, numpys.get_state()[1])


def _assert_same_shuffles(ours, numpys, lengths, dtype) -> None:
    """helpers.shuffle with ``ours`` permutes like numpy's own shuffle with ``numpys``, array after array."""
    for n in lengths:
        a = np.arange(n, dtype=dtype)
        b = a.copy()
        helpers.shuffle(ours, a)
        numpys.shuffle(b)
        np.testing.assert_array_equal(a, b)
