"""Dedup keys: the native MinHash equals its numpy reference and datatrove's signatures; exact forms."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from tl_testing import patch_datatrove_xxhash

from tokenloom import native
from tokenloom.clean import keys
from tokenloom.clean.normalize import exact_form, shingle_words

TEXTS = ["The quick brown fox jumps over the lazy dog, again and again!",
         "Ünïcödé wörds: café, naïve, résumé — ‘quoted’ and “double” in 1,234.5 and ٣٤ numbers here",
         "short text", "", "one two three four five", "日本語 の テキスト と English words mixed in one line here",
         "Tabs\tand\nnewlines   and  spaces\u00a0count as one space in the words list too"]


def test_exact_form_folds_whitespace_and_composition_not_case():
    assert exact_form("  a\tb\n\nc  ") == exact_form("a b c") == "a b c"
    assert exact_form("cafe\u0301") == exact_form("caf\u00e9")  # NFC
    assert exact_form("Hello") != exact_form("hello")
    k = keys.exact_keys(["a  b", "a b", "A b"])
    assert (k[0] == k[1]).all() and not (k[0] == k[2]).all()


def _same_as_datatrove(text: str) -> bool:
    """Without the characters our punctuation rule takes and datatrove's list lacks (normalize's docstring)."""
    return "‘" not in text


def test_shingle_words_follow_datatrove_simplification():
    datatrove_text = pytest.importorskip("datatrove.utils.text")
    for text in TEXTS:
        theirs = datatrove_text.simplify_text(text).split()
        if _same_as_datatrove(text):
            assert shingle_words(text) == theirs
        else:  # the documented difference: the left quote is punctuation here, part of a word there
            assert shingle_words(text) == [w.replace("‘", "") for w in theirs]


@pytest.mark.skipif(not native.loaded(), reason="native extension not built")
def test_native_signatures_equal_the_numpy_reference_and_xxhash():
    rng = np.random.default_rng(0)
    texts = TEXTS + [" ".join(rng.choice(["alpha", "beta", "gämma", "δ", "x" * 40], int(n)))
                     for n in rng.integers(0, 60, 40)]
    ascii = [t for t in texts if t.isascii()] + ["Numbers 1,234.5 and 3.14.15, x9y, A-B_C d'e \x01\x1f\x7f end ... 12,"]
    compute = native.pick("minhash_signatures", None)
    for ngrams in (1, 3, 5):
        a, b = keys.permutations(keys.MinHashParams(ngrams=ngrams, bands=3, rows=4, seed=7))
        joined, offsets = keys._packed([" ".join(shingle_words(t)) for t in texts])
        got = compute(joined, offsets, ngrams, a, b)
        assert np.array_equal(got, keys.signatures_reference(joined, offsets, ngrams, a, b))
        few = np.array([len(shingle_words(t)) < ngrams for t in texts])
        assert (got[few] == np.iinfo(np.uint64).max).all() and (got[~few] < 2**61).all()
        raw, offsets = keys._packed(ascii)  # simplified by the native code
        got = compute(raw, offsets, ngrams, a, b, ascii_text=True)
        assert np.array_equal(got, keys.signatures_reference(raw, offsets, ngrams, a, b, ascii_text=True))
        assert np.array_equal(got, compute(*keys._packed([" ".join(shingle_words(t)) for t in ascii]), ngrams, a, b))
    blob = rng.integers(0, 256, 3000, dtype=np.uint8)
    cuts = np.sort(rng.integers(0, 3000, 200)).astype(np.int64)
    hashes = native.pick("xxh64_array", None)(blob, cuts)
    assert [int(h) for h in hashes] == [xxhash.xxh64_intdigest(blob[s:e].tobytes()) for s, e in zip(cuts[:-1], cuts[1:], strict=True)]


def test_signatures_equal_datatrove_minhash(monkeypatch):
    minhash = pytest.importorskip("datatrove.pipeline.dedup.minhash")
    patch_datatrove_xxhash(monkeypatch)
    step = minhash.MinhashDedupSignature(output_folder="/nonexistent-unused")
    texts = [t for t in TEXTS if len(shingle_words(t)) >= 5 and _same_as_datatrove(t)]
    k, has = keys.minhash_keys(texts, keys.MinHashParams())
    for text, mine in zip(texts, k, strict=True):
        theirs = np.array(step.get_signature(step.get_shingles(text)), np.uint64)
        assert np.array_equal(keys.band_keys(theirs.reshape(1, -1), 14)[0], mine)
    assert has.all()
