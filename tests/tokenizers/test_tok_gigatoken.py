"""The gigatoken backend: chosen by auto only after its self-check, same ids as the reference library on
every document of the shared corpora, a self-check that fails where gigatoken differs, and a
fingerprint/ids_key that does not depend on the backend."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tl_testing import limit_s
from tok_helpers import TOK, load_shared, needs_shared, seed_verdicts

from tokenloom.errors import TokenloomError
from tokenloom.indexed.manifest import ids_key
from tokenloom.tokenizers import load_tokenizer, use_backend
from tokenloom.tokenizers.gigatoken_engine import GigatokenEngine, probe_texts
from tokenloom.tokenizers.sp import SentencePieceTokenizer

pytestmark = needs_shared

# the files auto is expected to run on gigatoken (Megatron's three families, and the rank file)
GIGATOKEN_FILES = ["gpt2", "gpt2/gpt2.tiktoken", "gpt-neox-20b", "llama2", "qwen2"]


@pytest.mark.parametrize("path", GIGATOKEN_FILES)
def test_auto_picks_gigatoken_after_its_self_check(path):
    tok = load_shared(path)
    fp = tok.fingerprint()
    assert (tok.backend, tok.engine, fp["backend"]) == ("gigatoken", "gigatoken", "gigatoken")
    assert fp["backend_reason"].startswith("self-check passed")


@pytest.mark.parametrize("corpus", ["tinyshakespeare", "wikitext-2"])
@pytest.mark.parametrize("path", GIGATOKEN_FILES)
def test_gigatoken_ids_identical_to_reference(corpora, path, corpus):
    texts = corpora[corpus]
    ref_ids, ref_lengths = load_shared(path, num_threads=1, backend="reference").encode_batch(texts)
    for threads in ({"num_threads": 1}, {}):  # one thread in workers, gigatoken's pool otherwise (its size the process's)
        ids, lengths = load_shared(path, **threads, backend="gigatoken").encode_batch(texts)
        np.testing.assert_array_equal(lengths, ref_lengths)
        np.testing.assert_array_equal(ids, ref_ids)


@pytest.mark.parametrize("path", GIGATOKEN_FILES + ["llama3", "mistral-v3"])
def test_fingerprint_and_ids_key_do_not_depend_on_the_backend(path):
    ref, auto = load_shared(path, backend="reference"), load_shared(path)
    assert ref.backend == "reference" and ref.fingerprint()["backend_reason"] == "reference backend requested"
    assert ref.fingerprint()["digest"] == auto.fingerprint()["digest"]
    assert ids_key(ref.fingerprint()) == ids_key(auto.fingerprint())
    assert (ref.vocab_size, ref.eod, ref.bos, ref.pad) == (auto.vocab_size, auto.eod, auto.bos, auto.pad)


def test_self_check_fails_where_gigatoken_differs(tmp_path):
    """gigatoken ignores an added token's lstrip flag; HF tokenizers strips the spaces before it.
    The self-check sees it: auto falls back (reason recorded), a forced gigatoken refuses."""
    data = json.loads((TOK / "gpt-neox-20b" / "tokenizer.json").read_text(encoding="utf-8"))
    for token in data["added_tokens"]:
        token["lstrip"] = True
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    tok = load_tokenizer(path)
    assert tok.backend == "reference" and tok.engine == "tokenizers"
    assert tok.fingerprint()["backend_reason"].startswith("self-check failed: probe text")
    with pytest.raises(TokenloomError, match="gigatoken cannot be used .* self-check failed"):
        load_tokenizer(path, backend="gigatoken")


def test_user_defined_pieces_fail_the_self_check():
    """Mistral v3's user-defined [REFERENCE_DOC_n] pieces: sentencepiece keeps the dummy-prefix piece
    before them, gigatoken does not; so auto keeps sentencepiece for that model."""
    tok = load_shared("mistral-v3")
    assert tok.backend == "reference" and tok.engine == "sentencepiece"
    assert "self-check failed" in tok.backend_reason and "REFERENCE_DOC" in tok.backend_reason


def test_sentencepiece_control_pieces_are_escaped(monkeypatch):
    """gigatoken reads '<s>' in text as Llama 2's BOS, sentencepiece as text: without the escape
    the self-check fails; with it, such texts go to sentencepiece and keep their place in a batch."""
    texts = ["plain text", "a </s> b <s>", "", "more plain 日本 text", "<s>"]
    ref = load_shared("llama2", num_threads=1, backend="reference")
    tok = load_shared("llama2", num_threads=1)
    assert tok.backend == "gigatoken"
    for got, want in zip(tok.encode_batch(texts), ref.encode_batch(texts), strict=True):
        np.testing.assert_array_equal(got, want)

    original = SentencePieceTokenizer.gigatoken_source

    def no_escapes(self):
        source = original(self)
        source.escapes = ()
        return source

    monkeypatch.setattr(SentencePieceTokenizer, "gigatoken_source", no_escapes)
    unescaped = load_tokenizer(TOK / "llama2")
    assert unescaped.backend == "reference" and "self-check failed" in unescaped.backend_reason
    assert GigatokenEngine(no_escapes(ref)).encode(["<s>"], False)[0].tolist() == [ref.bos]


def test_probes_reach_byte_fallback_and_specials():
    """The probe texts exercise SentencePiece byte-fallback pieces (<0x..>, not valid UTF-8 alone) and
    every special token given to them."""
    ref = load_shared("llama2", num_threads=1, backend="reference")
    ids, _ = ref.encode_batch(probe_texts(["<s>", "</s>"]))
    assert any(ref.sp.is_byte(int(i)) for i in ids)
    probes = probe_texts(["<|special_a|>", "<|special_b|>"])
    assert any("<|special_a|>" in p and "<|special_b|>" not in p for p in probes)
    assert probes == probe_texts(["<|special_a|>", "<|special_b|>"])  # seeded: the same check every load


@pytest.mark.parametrize("path, kind, reason", [
    (None, "byte", "gigatoken does not encode the byte kind"),
    ("llama3", None, "gigatoken has no pretokenizer for this split pattern"),
])
def test_unsupported_falls_back_or_fails_forced(path, kind, reason):
    where = None if path is None else TOK / path
    tok = load_tokenizer(where, kind=kind)
    assert tok.backend == "reference" and tok.backend_reason.startswith(reason)
    with pytest.raises(TokenloomError, match=f"gigatoken cannot be used .*{reason}"):
        load_tokenizer(where, kind=kind, backend="gigatoken")


def test_wordpiece_is_not_gigatoken(wordpiece_vocab):
    assert "does not encode the wordpiece kind" in load_tokenizer(wordpiece_vocab).backend_reason


def test_missing_gigatoken_falls_back(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "gigatoken", None)  # import gigatoken -> ImportError
    tok = load_tokenizer(TOK / "gpt-neox-20b")
    assert tok.backend == "reference" and tok.backend_reason.startswith("gigatoken is not installed")


def test_backend_travels_with_the_spec(shared_verdicts):
    """A forced backend is part of the spec, so a pickled tokenizer (a preprocess worker) rebuilds it;
    use_backend sets the default for tokenizers loaded inside the block only."""
    with use_backend("reference"):
        tok = load_tokenizer(TOK / "gpt-neox-20b")
    assert tok.spec.backend == "reference" and tok.backend == "reference"
    again = pickle.loads(pickle.dumps(tok))
    assert again.backend == "reference" and again.spec == tok.spec
    assert load_tokenizer(TOK / "gpt-neox-20b").backend == "gigatoken"
    one = load_shared("gpt-neox-20b").single_threaded()
    assert one.backend == "gigatoken" and one.num_threads == 1
    with pytest.raises(TokenloomError, match="tokenizer backend must be one of"):
        load_tokenizer(TOK / "gpt-neox-20b", backend="fastest")


def test_cli_forced_gigatoken_that_cannot_load_is_one_line(tmp_path):
    from tl_testing import run_cli

    (tmp_path / "a.jsonl").write_text('{"text": "hi"}\n')
    proc = run_cli("preprocess", "--input", tmp_path / "a.jsonl", "--output-prefix", tmp_path / "out",
                   "--tokenizer-type", "byte", "--tokenizer-backend", "gigatoken", "--no-progress")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "gigatoken does not encode the byte kind" in proc.stderr
    assert not (tmp_path / "out.bin").exists()


@pytest.mark.parametrize("path", ["qwen2"])  # HF tokenizers with NFC (gpt2 runs on tiktoken: nothing to escape)
def test_characters_of_newer_unicode_are_escaped(monkeypatch, tmp_path, path):
    """Combining marks newer than HF tokenizers' NFC tables (U+089B, U+1AC5) and letters newer than
    Qwen2's split regex (CJK Extension J): found on load, such texts go to the reference engine
    with the same ids; with nothing escaped the self-check fails on them."""
    from tokenloom.tokenizers import gigatoken_engine

    texts = ["plain", "\u089b\u0cbc \u1ac5\u0650 a\u1ae0\u0e48", "x", "\U00032a23/V \U00033021[j", ""]
    ref = load_shared(path, num_threads=1, backend="reference")
    tok = load_shared(path, num_threads=1)
    assert tok.backend == "gigatoken" and "characters its Unicode tables treat differently" in tok.backend_reason
    for got, want in zip(tok.encode_batch(texts), ref.encode_batch(texts), strict=True):
        np.testing.assert_array_equal(got, want)

    monkeypatch.setattr(gigatoken_engine, "unstable_chars", lambda reference, engine: "")
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "fresh"))  # not the verdict cached above
    unescaped = load_tokenizer(TOK / path)
    assert unescaped.backend == "reference" and "self-check failed" in unescaped.backend_reason


def test_the_self_check_verdict_is_cached_per_tokenizer_and_versions(monkeypatch, tmp_path):
    """The second load of a tokenizer reads the first one's verdict (no probe is encoded) and ends
    with the same backend, escapes and reason; another library version, a damaged entry or an
    unwritable cache runs the check again. (The Unicode probes, ~90k texts on both engines and
    most of a check's cost, run for real in the first check; the checks again call them too,
    counted, and get that first outcome: the cache, not the probes, is the subject here, and
    test_tok_fingerprint.py compares the verdicts of two independent checks of each tokenizer.)"""
    from tokenloom.tokenizers import gigatoken_engine

    calls, unstable = [], []
    real, real_unstable = gigatoken_engine.self_check, gigatoken_engine.unstable_chars

    def unstable_once(*args):
        unstable.append(unstable[0] if unstable else real_unstable(*args))
        return unstable[-1]

    monkeypatch.setattr(gigatoken_engine, "unstable_chars", unstable_once)
    texts = ["plain", "\u089b\u0cbc \u1ac5\u0650 a\u1ae0\u0e48", "\U00032a23/V \U00033021[j", ""]
    first = load_tokenizer(TOK / "qwen2", num_threads=1)
    entries = list(Path(os.environ["TOKENLOOM_CACHE_DIR"]).glob("tokenizer-checks/*.json"))
    assert first.backend == "gigatoken" and len(entries) == 1 and len(unstable) == 1 and unstable[0]

    def no_check(*args, **kwargs):
        raise AssertionError("the self-check ran although its verdict is cached")

    with monkeypatch.context() as m:
        m.setattr(gigatoken_engine, "unstable_chars", no_check)
        m.setattr(gigatoken_engine, "self_check", no_check)
        again = load_tokenizer(TOK / "qwen2", num_threads=1)
    assert (again.backend, again.backend_reason) == (first.backend, first.backend_reason)
    for got, want in zip(again.encode_batch(texts), first.encode_batch(texts), strict=True):
        np.testing.assert_array_equal(got, want)  # the cached escapes route the same texts

    monkeypatch.setattr(gigatoken_engine, "self_check", lambda *a: calls.append(1) or real(*a))
    versions = gigatoken_engine._library_versions()
    monkeypatch.setattr(gigatoken_engine, "_library_versions", lambda: {**versions, "gigatoken": "0.0.0"})
    assert load_tokenizer(TOK / "qwen2", num_threads=1).backend == "gigatoken"
    assert calls == [1] and len(unstable) == 2
    monkeypatch.setattr(gigatoken_engine, "_library_versions", lambda: versions)
    entries[0].write_text('{"unstable": "", "probes": 3')  # torn
    assert load_tokenizer(TOK / "qwen2", num_threads=1).backend_reason == first.backend_reason
    assert calls == [1, 1] and len(unstable) == 3
    assert json.loads(entries[0].read_text())["probes"] > 3  # rewritten whole
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(blocked))
    assert load_tokenizer(TOK / "qwen2", num_threads=1).backend == "gigatoken"
    assert calls == [1, 1, 1] and len(unstable) == 4


def test_gpt2_rank_file_is_cached_checked_and_rewritten(monkeypatch, tmp_path, corpora):
    """GPT-2's gigatoken model loads from a rank file kept in the user cache: equal to tiktoken's
    r50k_base file, used again by the next load, rewritten when damaged, and replaced by a
    temporary file (removed after loading) when the cache cannot be written; the ids stay the
    reference's in every case. (The cache starts with the session's self-check verdicts only.)"""
    import tempfile

    docs = corpora["tinyshakespeare"][:300]
    want = load_shared("gpt2", num_threads=1, backend="reference").encode_batch(docs)
    load_shared("gpt2")  # its verdict, in the session's cache
    seed_verdicts(tmp_path / "cache")

    def check(tok):
        assert tok.backend == "gigatoken"
        for got, ref in zip(tok.encode_batch(docs), want, strict=True):
            np.testing.assert_array_equal(got, ref)

    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    check(load_tokenizer(TOK / "gpt2", num_threads=1))
    (cached,) = (tmp_path / "cache" / "gigatoken").glob("gpt2-*.tiktoken")
    assert cached.read_bytes() == (TOK / "gpt2" / "gpt2.tiktoken").read_bytes()
    stamp = cached.stat().st_mtime_ns
    check(load_tokenizer(TOK / "gpt2", num_threads=1))
    assert cached.stat().st_mtime_ns == stamp  # read, not written again
    cached.write_bytes(cached.read_bytes().replace(b" 100\n", b" 101\n", 1))  # a damaged rank
    check(load_tokenizer(TOK / "gpt2", num_threads=1))
    assert cached.read_bytes() == (TOK / "gpt2" / "gpt2.tiktoken").read_bytes()
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(blocked))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    check(load_tokenizer(TOK / "gpt2", num_threads=1))
    assert list((tmp_path / "tmp").iterdir()) == []


def test_escaped_equals_a_plain_membership_test():
    """The split character tests (ASCII / Latin-1 / BMP / astral, strings apart) find exactly the texts
    that hold an escape string or character, on random texts mixing all planes; with and without
    escapes below U+0100 (without, a Latin-1 text is not searched), and without astral ones."""
    import random

    from tokenloom.tokenizers.gigatoken_engine import GigatokenSource

    rng = random.Random(0)
    strings = ("<s>", "</s>", "[REF]")
    for chars in ("^-]\\a\u00e9\u0301\u089b\U00010efa\U0001e4ec", "\u0301\u089b\U00010efa", "a\u089b\u1df6"):
        engine = GigatokenEngine(GigatokenSource(model=None, escapes=strings), chars)
        pool = list("xyz <>/s[]REF") + ["\u00e9", "\u00ff", "\u4e2d", "\U0001f600", "\U00020000", *chars]
        for _ in range(3000):
            text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 12)))
            want = any(c in text for c in chars) or any(s in text for s in strings)
            assert engine.escaped(text) == want, (chars, text)
    assert not GigatokenEngine(GigatokenSource(model=None)).escaped("anything \U0001f600")


def _distinct_words(n_texts: int, seed: int = 0, text_bytes: int = 4000) -> list[str]:
    """Random lowercase words, nearly all distinct: the text on which gigatoken's word cache grows most."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    texts = []
    for _ in range(n_texts):
        chars = letters[rng.integers(0, 26, text_bytes)]
        spaces = rng.integers(3, 13, text_bytes // 3).cumsum()
        chars[spaces[spaces < text_bytes]] = ord(" ")
        texts.append(chars.tobytes().decode())
    return texts


def bounded_run() -> None:
    """The body of the bound test, in a fresh interpreter: prints the rebuild count and the peak
    growth as JSON; ids must equal the reference backend's throughout."""
    from tokenloom.tokenizers.gigatoken_engine import resident_bytes

    texts = _distinct_words(2000)  # 8 MB of text: its word cache grows far beyond an 8 MB bound
    reference = load_shared("gpt2/gpt2.tiktoken", num_threads=1, backend="reference")
    tok = load_tokenizer(TOK / "gpt2" / "gpt2.tiktoken", backend="gigatoken").single_threaded()
    tok.encode_batch(texts[:10])  # the first call's own allocations are not the cache's
    tok.bound_memory(8)
    start, peak = resident_bytes(), 0
    for i in range(0, len(texts), 100):
        ids, lengths = tok.encode_batch(texts[i:i + 100])
        peak = max(peak, resident_bytes() - start)
        ref_ids, ref_lengths = reference.encode_batch(texts[i:i + 100])
        np.testing.assert_array_equal(lengths, ref_lengths)
        np.testing.assert_array_equal(ids, ref_ids)
    print(json.dumps({"rebuilds": tok._gigatoken.rebuilds, "peak": peak}))


@needs_shared
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads this process's resident memory")
def test_a_bounded_encoder_is_rebuilt_keeps_its_ids_and_stays_within_the_bound(shared_verdicts):
    """In a process of its own: the bound counts the process's growth, and a long-lived test
    process can grow the cache into pages freed by earlier tests (and kept, as the trainer's
    ``keep_freed_memory`` asks), which is no growth to bound. (The session's self-check verdicts:
    the check is not this test's subject.)"""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent), str(here.parents[1])]))
    done = subprocess.run([sys.executable, "-c", "import test_tok_gigatoken as t; t.bounded_run()"],
                          capture_output=True, text=True, timeout=limit_s(300), env=env, cwd=here)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rebuilds"] >= 2
    assert result["peak"] < (8 << 20) + (48 << 20), f"grew {result['peak'] >> 20} MB under an 8 MB bound"


def test_without_resident_memory_the_bound_counts_text_bytes(monkeypatch, shared_verdicts):
    from tokenloom.tokenizers import gigatoken_engine

    monkeypatch.setattr(gigatoken_engine, "resident_bytes", lambda: None)
    tok = load_tokenizer(TOK / "gpt2" / "gpt2.tiktoken", backend="gigatoken").single_threaded()
    tok.bound_memory(1)
    for i in range(10):  # 400 KB a call under a 1 MiB bound: a rebuild every third call
        tok.encode_batch(_distinct_words(100, seed=i))
    assert tok._gigatoken.rebuilds == 3
    tok.bound_memory(0)
    tok.encode_batch(_distinct_words(400, seed=99))
    assert tok._gigatoken.rebuilds == 3, "0: never"
