"""encode_batch == per-text encode (random unicode, empty strings included), threaded or not."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tok_helpers import TOK, load_shared

from tokenloom.tokenizers import load_tokenizer

# (name, path or None for file-less, options, byte-exact round trip)
BACKENDS = [
    ("byte", None, {"kind": "byte"}, True),
    ("gpt2-reference", "gpt2", {"fast": False}, True),
    ("gpt2-fast", "gpt2", {}, True),
    ("llama3-tiktoken", "llama3", {}, True),
    ("neox-hf", "gpt-neox-20b", {}, False),
    ("llama2-sp", "llama2", {}, False),
    ("qwen2", "qwen2", {}, False),
]

texts_strategy = st.lists(
    st.one_of(st.text(max_size=40), st.just(""), st.text(alphabet=" \n\tab'é😀", max_size=20)), max_size=8
)


@pytest.fixture(scope="module", params=BACKENDS, ids=[b[0] for b in BACKENDS])
def backend(request):
    name, path, options, roundtrip = request.param
    if path is not None and not TOK.is_dir():
        pytest.skip(f"shared tokenizers not found at {TOK}")
    load = (lambda **kw: load_shared(path, **options, **kw)) if path else (
        lambda **kw: load_tokenizer(**options, **kw))
    threaded = load() if name == "byte" else load(num_threads=2)
    single = load() if name == "byte" else load(num_threads=1)
    return threaded, single, roundtrip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=texts_strategy)
def test_batch_matches_single(backend, texts):
    threaded, single, roundtrip = backend
    ids, lengths = threaded.encode_batch(texts)
    assert lengths.dtype == np.int64 and len(lengths) == len(texts)
    assert ids.dtype in (np.int64, np.int32, np.uint32) and len(ids) == int(lengths.sum())
    per_text = [single.encode(t) for t in texts]
    assert [len(p) for p in per_text] == lengths.tolist()
    assert ids.tolist() == [i for p in per_text for i in p.tolist()]
    s_ids, s_lengths = single.encode_batch(texts)
    np.testing.assert_array_equal(s_ids, ids)
    np.testing.assert_array_equal(s_lengths, lengths)
    if ids.size:
        assert 0 <= ids.min() and ids.max() < threaded.vocab_size
    if roundtrip:
        for t, p in zip(texts, per_text, strict=True):
            assert single.decode(p) == t
