"""Fingerprints: stable, equal after the spec crosses into a fresh process, distinct across tokenizers."""

import json
import multiprocessing
import pickle
import shutil

import pytest
from tok_helpers import TOK, load_shared, needs_shared

from tokenloom.indexed.manifest import ids_key
from tokenloom.tokenizers import TokenizerSpec, load_tokenizer

SAMPLE = "Fingerprints should travel: héllo wörld 123!"


def _in_worker(spec: TokenizerSpec):
    tok = load_tokenizer(spec)
    return tok.fingerprint(), tok.encode(_sample(tok)).tolist()


def _sample(tok) -> str:
    return "1 2 3" if tok.kind == "null" else SAMPLE


def _shared(path, **options):
    return pytest.param(path, options, marks=needs_shared)


SPECS = [
    _shared("gpt2"),
    _shared("gpt2", fast=False),
    _shared("gpt2/gpt2.tiktoken"),
    _shared("gpt-neox-20b"),
    _shared("llama2"),
    _shared("mistral-v3"),
    _shared("llama3"),
    _shared("qwen2"),
]


@pytest.mark.parametrize("path, options", SPECS)
def test_fingerprint_stable_and_json(path, options):
    a, b = load_shared(path, **options), load_tokenizer(TOK / path, **options)
    fp = a.fingerprint()
    assert fp == b.fingerprint()
    assert json.loads(json.dumps(fp)) == fp
    digest_part = {k: v for k, v in fp.items() if k not in ("digest", "engine")}
    assert str(TOK) not in json.dumps(digest_part)  # no absolute paths
    assert set(fp) >= {"kind", "files", "vocab_size", "eod", "bos", "pad", "digest", "engine"}


@pytest.mark.parametrize("path, options", SPECS)
def test_spec_pickle_roundtrip(path, options, shared_verdicts):
    """A spec and a whole tokenizer pickle and rebuild to the same fingerprint and ids (the
    rebuilds read the session's self-check verdicts: the check is not the subject)."""
    tok = load_shared(path, **options)
    again = load_tokenizer(pickle.loads(pickle.dumps(tok.spec)))
    assert again.fingerprint() == tok.fingerprint()
    assert list(again.encode(SAMPLE)) == list(tok.encode(SAMPLE))
    whole = pickle.loads(pickle.dumps(tok))  # a tokenizer pickles as its spec
    assert whole.fingerprint() == tok.fingerprint() and whole is not tok


def test_runtime_options_do_not_change_digest(shared_verdicts):
    tok = load_tokenizer(kind="byte")
    assert tok.spec.with_options().options == {}
    if TOK.is_dir():
        a = load_shared("llama2")
        b = load_tokenizer(a.spec.with_options(num_threads=1))
        assert a.fingerprint() == b.fingerprint()


@needs_shared
def test_fingerprint_in_fresh_process(shared_verdicts):
    """Each spec, loaded again in a spawned process, has the same fingerprint and ids (the worker
    reads the session's self-check verdicts, as a preprocess worker reads its parent's)."""
    toks = [load_shared(p) for p in ("gpt2", "gpt-neox-20b", "llama2", "llama3")]
    toks += [load_tokenizer(kind="byte"), load_tokenizer(kind="null", vocab_size=7)]
    specs = [t.spec.with_options(num_threads=1) for t in toks[:4]] + [t.spec for t in toks[4:]]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        results = pool.map(_in_worker, specs)
    for tok, (fp, ids) in zip(toks, results, strict=True):
        assert fp == tok.fingerprint()
        assert ids == tok.encode(_sample(tok)).tolist()


@needs_shared
def test_fingerprints_differ():
    toks = [load_shared(p) for p in ("gpt2", "gpt2/gpt2.tiktoken", "gpt-neox-20b", "llama2",
                                              "mistral-v3", "llama3", "qwen2")]
    toks += [load_tokenizer(kind="byte"), load_tokenizer(kind="null"), load_tokenizer(kind="null", vocab_size=9)]
    digests = [t.fingerprint()["digest"] for t in toks]
    assert len(set(digests)) == len(digests)
    keys = [ids_key(t.fingerprint()) for t in toks]
    assert len(set(keys)) == len(keys)


@needs_shared
def test_ids_key_ignores_file_names(tmp_path):
    """GPT-2's files (Megatron's names in the shared data) under HF's names give the same
    ids: same ids_key, while the digest (which keys caches) still tells the setups apart;
    other contents change the key. (The copies load on the reference backend, no self-check: the
    backend is no part of the digest or ids_key, test_tok_gigatoken.py.)"""
    megatron = load_shared("gpt2")
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(TOK / "gpt2" / "gpt2-vocab.json", hf / "vocab.json")
    shutil.copy(TOK / "gpt2" / "gpt2-merges.txt", hf / "merges.txt")
    renamed = load_tokenizer(hf, backend="reference")
    assert renamed.encode(SAMPLE).tolist() == megatron.encode(SAMPLE).tolist()
    assert renamed.fingerprint()["digest"] != megatron.fingerprint()["digest"]
    assert ids_key(renamed.fingerprint()) == ids_key(megatron.fingerprint())
    # read back from JSON, as a manifest stores it
    assert ids_key(json.loads(json.dumps(renamed.fingerprint()))) == ids_key(megatron.fingerprint())
    merges = (hf / "merges.txt").read_text(encoding="utf-8").splitlines()
    (hf / "merges.txt").write_text("\n".join(merges[:-1]) + "\n", encoding="utf-8")  # one merge fewer
    assert ids_key(load_tokenizer(hf, backend="reference").fingerprint()) != ids_key(megatron.fingerprint())
