"""Every backend reproduces the reference ids/counts of shared/data/README.md, and the fast
GPT-2 engine is proven id-identical to the reference engine on every document.

Rows here use ``backend="reference"`` (the libraries themselves; gigatoken is compared with
them in test_tok_gigatoken.py) except the ``-auto`` rows, which take whatever ``auto`` picks."""

import json

import numpy as np
import pytest
from tok_helpers import TOK, load_shared, needs_shared

from tokenloom.tokenizers import load_tokenizer
from tokenloom.tokenizers.hf import bytes_to_unicode
from tokenloom.tokenizers.tiktoken_bpe import read_rank_file

pytestmark = needs_shared

# (tokenizer path, load options) -> reference token counts from shared/data/README.md
REFERENCE_COUNTS = {
    "gpt2": {"tinyshakespeare": 323_585, "wikitext-2": 554_410},
    "gpt-neox-20b": {"tinyshakespeare": 325_800, "wikitext-2": 553_340},
    "llama2": {"tinyshakespeare": 355_001, "wikitext-2": 637_430},
    "mistral-v3": {"tinyshakespeare": 348_337, "wikitext-2": 623_939},
}
REF = {"backend": "reference"}
TOKENIZERS = {
    "gpt2-reference": ("gpt2", {"fast": False, **REF}),
    "gpt2-fast": ("gpt2", REF),
    "gpt2-tiktoken-file": ("gpt2/gpt2.tiktoken", REF),
    "gpt-neox-20b": ("gpt-neox-20b", REF),
    "llama2": ("llama2", REF),
    "mistral-v3": ("mistral-v3", REF),
    "gpt2-auto": ("gpt2", {}),
    "gpt-neox-20b-auto": ("gpt-neox-20b", {}),
    "llama2-auto": ("llama2", {}),
    "mistral-v3-auto": ("mistral-v3", {}),
}


@pytest.fixture(scope="module")
def encoded(corpora):
    cache = {}

    def get(name: str, corpus: str):
        if (name, corpus) not in cache:
            path, options = TOKENIZERS[name]
            tok = load_shared(path, num_threads=1, **options)
            cache[name, corpus] = tok.encode_batch(corpora[corpus])
        return cache[name, corpus]

    return get


@pytest.mark.parametrize("corpus", ["tinyshakespeare", "wikitext-2"])
@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_reference_token_counts(encoded, corpora, name, corpus):
    ids, lengths = encoded(name, corpus)
    expected = REFERENCE_COUNTS[TOKENIZERS[name][0].split("/")[0]][corpus]
    assert len(lengths) == len(corpora[corpus])
    assert int(lengths.sum()) == len(ids) == expected


@pytest.mark.parametrize("corpus", ["tinyshakespeare", "wikitext-2"])
@pytest.mark.parametrize("fast", ["gpt2-fast", "gpt2-tiktoken-file"])
def test_fast_engine_ids_identical_to_reference(encoded, corpus, fast):
    ref_ids, ref_lengths = encoded("gpt2-reference", corpus)
    ids, lengths = encoded(fast, corpus)
    # equal lengths + equal flat ids == equal ids for every document
    np.testing.assert_array_equal(lengths, ref_lengths)
    np.testing.assert_array_equal(ids, ref_ids)


def test_engines_and_shared_digest():
    ref = load_tokenizer(TOK / "gpt2", fast=False, backend="reference")
    fast = load_tokenizer(TOK / "gpt2", backend="reference")
    assert (ref.engine, fast.engine) == ("tokenizers", "tiktoken")
    assert ref.fingerprint()["digest"] == fast.fingerprint()["digest"]
    assert ref.fingerprint()["engine"] != fast.fingerprint()["engine"]


def test_gpt2_ranks_derived_from_vocab_equal_tiktoken_file():
    """The fast engine's ranks (derived from vocab.json) are exactly r50k_base's."""
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    vocab = json.loads((TOK / "gpt2" / "gpt2-vocab.json").read_text(encoding="utf-8"))
    derived = {bytes(byte_decoder[c] for c in t): i for t, i in vocab.items() if t != "<|endoftext|>"}
    assert derived == read_rank_file(TOK / "gpt2" / "gpt2.tiktoken")


def test_fast_path_for_reserialised_gpt2(tmp_path, corpora):
    """Same content, different bytes (indented JSON, no #version header): still proven, same ids."""
    vocab = json.loads((TOK / "gpt2" / "gpt2-vocab.json").read_text(encoding="utf-8"))
    (tmp_path / "vocab.json").write_text(json.dumps(vocab, indent=1, ensure_ascii=False), encoding="utf-8")
    merges = (TOK / "gpt2" / "gpt2-merges.txt").read_bytes()
    (tmp_path / "merges.txt").write_bytes(merges.split(b"\n", 1)[1])
    tok = load_tokenizer(tmp_path, num_threads=1, backend="reference")
    assert tok.engine == "tiktoken"
    docs = corpora["tinyshakespeare"][:500]
    ref_ids, _ = load_shared("gpt2", num_threads=1, fast=False, backend="reference").encode_batch(docs)
    np.testing.assert_array_equal(tok.encode_batch(docs)[0], ref_ids)


def test_fast_path_needs_proof(tmp_path):
    """Change one merge's position and the proof fails: reference engine."""
    (tmp_path / "vocab.json").write_bytes((TOK / "gpt2" / "gpt2-vocab.json").read_bytes())
    header, first, second, rest = (TOK / "gpt2" / "gpt2-merges.txt").read_bytes().split(b"\n", 3)
    (tmp_path / "merges.txt").write_bytes(b"\n".join([header, second, first, rest]))
    tok = load_tokenizer(tmp_path, backend="reference")
    assert tok.engine == "tokenizers"
    assert list(tok.encode("Hello world!")) == [15496, 995, 0]


@pytest.mark.parametrize("text, expected", [
    ("Hello world! The quick brown fox.", [9906, 1917, 0, 578, 4062, 14198, 39935, 13]),
])
def test_llama3_tiktoken_example(text, expected):
    tok = load_shared("llama3")
    assert tok.kind == "tiktoken"
    assert list(tok.encode(text)) == expected
    assert (tok.vocab_size, tok.bos, tok.eod) == (128256, 128000, 128001)
    assert tok.decode(tok.encode(text)) == text


def test_qwen2_example():
    tok = load_shared("qwen2")
    assert tok.kind == "gpt2-bpe"
    assert tok.fingerprint()["options"]["pretokenizer"] == "qwen2"
    assert list(tok.encode("Hello world!")) == [9707, 1879, 0]
    assert (tok.vocab_size, tok.eod) == (151646, 151643)


def test_gpt2_megatron_special_text_is_plain_text():
    """Megatron's GPT2BPETokenizer (and tiktoken encode_ordinary) never map text to <|endoftext|>."""
    for options in ({}, {"fast": False}, REF):
        tok = load_shared("gpt2", **options)
        ids = list(tok.encode("a<|endoftext|>b"))
        assert 50256 not in ids and len(ids) > 3


@pytest.mark.parametrize("path", ["gpt2", "gpt2/gpt2.tiktoken"])
def test_tiktoken_numpy_path_equals_encode_ordinary(corpora, path):
    """One thread encodes through encode_to_numpy; ids equal tiktoken's encode_ordinary and the
    threaded batch path, special-token strings included (they stay plain text)."""
    texts = corpora["wikitext-2"][:300] + ["a<|endoftext|>b", "<|endoftext|>", "", "x <|endofprompt|> y\n\n"]
    one, many = load_shared(path, num_threads=1, **REF), load_shared(path, num_threads=2, **REF)
    ids, lengths = one.encode_batch(texts)
    assert ids.dtype == lengths.dtype == np.int64
    expected = [one.enc.encode_ordinary(t) for t in texts]
    np.testing.assert_array_equal(lengths, [len(e) for e in expected])
    np.testing.assert_array_equal(ids, [i for e in expected for i in e])
    threaded = many.encode_batch(texts)
    np.testing.assert_array_equal(threaded[0], ids)
    np.testing.assert_array_equal(threaded[1], lengths)


def test_decode_same_on_both_engines():
    ids = [15496, 995, 50256, 0, 220, 129, 30]  # includes eod and a partial UTF-8 byte sequence
    ref, fast = load_shared("gpt2", fast=False), load_shared("gpt2")
    assert ref.decode(ids) == fast.decode(ids) == "Hello world! \ufffd?"


def test_explicit_merges_option(tmp_path):
    (tmp_path / "my-vocab.json").write_bytes((TOK / "gpt2" / "gpt2-vocab.json").read_bytes())
    (tmp_path / "my.bpe").write_bytes((TOK / "gpt2" / "gpt2-merges.txt").read_bytes())
    tok = load_tokenizer(tmp_path / "my-vocab.json", merges=tmp_path / "my.bpe", backend="reference")
    assert tok.engine == "tiktoken"  # byte-identical files, so still proven
    assert str(tmp_path) not in str(tok.fingerprint())


@pytest.mark.parametrize("corpus", ["tinyshakespeare", "wikitext-2"])
@pytest.mark.parametrize("name", ["gpt2-reference", "gpt2-fast"])
def test_ids_equal_megatron_preprocess_output(encoded, corpus, name):
    """Megatron's own GPT2BPETokenizer output (preprocess_data.py --append-eod, uint16 .bin)."""
    bin_path = TOK.parent / "megatron-reference" / f"{corpus}_gpt2_eod.bin"
    if not bin_path.is_file():
        pytest.skip(f"{bin_path} not found")
    ids, lengths = encoded(name, corpus)
    docs = np.split(ids, np.cumsum(lengths)[:-1])
    with_eod = np.concatenate([np.append(d, 50256) for d in docs if len(d)])
    np.testing.assert_array_equal(with_eod, np.fromfile(bin_path, dtype=np.uint16))
