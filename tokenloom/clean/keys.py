"""Bucket keys: what dedup matches documents on, computed per document in the tokenizing workers.

A document's keys are ``(bands, 2)`` uint64 words, one 128-bit key per band; documents sharing
any band's key are duplicates (clusters joined by :mod:`tokenloom.clean.buckets`).

* exact: one band, the 128-bit XXH3 digest of :func:`~tokenloom.clean.normalize.exact_form`.
* minhash: datatrove's scheme and defaults: XXH64 (seed 0) of each space-joined word
  ``ngrams``-gram of :func:`~tokenloom.clean.normalize.shingle_words`; ``bands x rows``
  permutations ``(a * h + b) mod (2^61 - 1)`` (wrapping at 64 bits) with ``a, b`` drawn by
  ``RandomState(seed)``; the minima are the signature, bit for bit datatrove's. A band's key is
  a 128-bit SplitMix64 digest of its values and number (datatrove compares the values: a false
  match has probability about 2^-128, for 24 bytes per band). Fewer than ``ngrams`` words: no key.

The native ``minhash_signatures`` simplifies ASCII documents itself and hashes and takes minima
in one pass; other documents are simplified in Python. The numpy + ``xxhash`` reference is its
fallback and test oracle, far slower than tokenizing (bench/RESULTS.md, dedup rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from tokenloom import native
from tokenloom.clean.normalize import exact_form, shingle_words

MERSENNE = np.uint64((1 << 61) - 1)
_BLOCK = 1 << 13  # shingles per block of the signature: a block's products are BLOCK x bands x rows words
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_LANES = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03))
METHODS = ("none", "exact", "minhash")


@dataclass(frozen=True)
class MinHashParams:
    """The MinHash settings (datatrove's ``MinhashConfig`` defaults)."""

    ngrams: int = 5
    bands: int = 14
    rows: int = 8
    seed: int = 1


@dataclass(frozen=True)
class DedupParams:
    method: str  # "exact" or "minhash"
    minhash: MinHashParams = MinHashParams()

    @property
    def bands(self) -> int:
        return self.minhash.bands if self.method == "minhash" else 1


def permutations(p: MinHashParams) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)``, each of shape ``(bands * rows,)``: the seeded hash family (see the module)."""
    gen = np.random.RandomState(p.seed)
    n = p.bands * p.rows
    a = gen.randint(1, MERSENNE, dtype=np.uint64, size=(1, n))
    b = gen.randint(0, MERSENNE, dtype=np.uint64, size=(1, n))
    return a[0], b[0]


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _MIX[0]
    x = (x ^ (x >> np.uint64(27))) * _MIX[1]
    return x ^ (x >> np.uint64(31))


def band_keys(signatures: np.ndarray, bands: int) -> np.ndarray:
    """``(n, bands * rows)`` signatures -> ``(n, bands, 2)`` 128-bit keys of each band and its number."""
    n = signatures.shape[0]
    sig = signatures.reshape(n, bands, -1)
    out = np.empty((n, bands, 2), np.uint64)
    band = np.arange(bands, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        for lane, start in enumerate(_LANES):
            h = np.broadcast_to(_splitmix(band * _MIX[lane] + start), (n, bands)).copy()
            for r in range(sig.shape[2]):
                h = _splitmix(h ^ sig[:, :, r] + start)
            out[:, :, lane] = h
    return out


def _packed(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The texts' UTF-8 bytes concatenated, and each one's byte offsets."""
    parts = [t.encode("utf-8", "surrogatepass") for t in texts]
    offsets = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    return np.frombuffer(b"".join(parts), np.uint8), offsets


def signatures_reference(data: np.ndarray, offsets: np.ndarray, ngrams: int, a: np.ndarray,
                         b: np.ndarray, ascii_text: bool = False) -> np.ndarray:
    """What the native ``minhash_signatures`` computes: per document (``data[offsets[i]:offsets[i+1]]``,
    space-joined words, or raw ASCII text with ``ascii_text``) its signature; all ones without a shingle."""
    n = len(offsets) - 1
    out = np.full((n, a.size), np.iinfo(np.uint64).max, np.uint64)
    raw = data.tobytes()
    hashes, owner = [], []
    for i in range(n):
        doc = raw[offsets[i]:offsets[i + 1]]
        if ascii_text:
            doc = " ".join(shingle_words(doc.decode("ascii"))).encode()
        if not doc or doc.count(b" ") + 1 < ngrams:
            continue
        spaces = np.flatnonzero(np.frombuffer(doc, np.uint8) == 32)
        starts = np.r_[0, spaces + 1][: len(spaces) + 2 - ngrams].tolist()
        ends = np.r_[spaces, len(doc)][ngrams - 1:].tolist()
        hashes.append(np.fromiter((xxhash.xxh64_intdigest(doc[s:e]) for s, e in zip(starts, ends, strict=True)),
                                  np.uint64))
        owner.append(np.full(len(ends), i))
    if not hashes:
        return out
    flat, doc_of = np.concatenate(hashes), np.concatenate(owner)
    with np.errstate(over="ignore"):
        for s in range(0, flat.size, _BLOCK):
            h, d = flat[s:s + _BLOCK, None], doc_of[s:s + _BLOCK]
            values = (h * a + b) % MERSENNE
            starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
            rows = d[starts]
            out[rows] = np.minimum(out[rows], np.minimum.reduceat(values, starts, axis=0))
    return out


def minhash_keys(texts: list[str], p: MinHashParams, family=None) -> tuple[np.ndarray, np.ndarray]:
    """``(keys (n, bands, 2), has_keys (n,))`` of each text's MinHash bands (see the module)."""
    a, b = family if family is not None else permutations(p)
    compute = native.pick("minhash_signatures", signatures_reference)
    sig = np.empty((len(texts), a.size), np.uint64)
    ascii_rows = np.fromiter((t.isascii() for t in texts), bool, len(texts))
    for rows, simplified in ((np.flatnonzero(ascii_rows), False), (np.flatnonzero(~ascii_rows), True)):
        if not len(rows):
            continue
        chosen = [texts[i] for i in rows.tolist()]
        data, offsets = _packed([" ".join(shingle_words(t)) for t in chosen] if simplified else chosen)
        sig[rows] = compute(data, offsets, p.ngrams, a, b, ascii_text=not simplified)
    has = sig[:, 0] != np.iinfo(np.uint64).max  # a minimum is below 2^61 as soon as there is one shingle
    return band_keys(sig, p.bands), has


def exact_keys(texts: list[str]) -> np.ndarray:
    """``(n, 1, 2)``: the 128-bit XXH3 digest of each text's exact form."""
    out = np.empty((len(texts), 1, 2), np.uint64)
    for i, text in enumerate(texts):
        d = xxhash.xxh3_128_intdigest(exact_form(text).encode("utf-8", "surrogatepass"))
        out[i, 0, 0], out[i, 0, 1] = d >> 64, d & 0xFFFFFFFFFFFFFFFF
    return out


def document_keys(texts: list[str], params: DedupParams, family=None) -> tuple[np.ndarray, np.ndarray]:
    """``(keys (n, bands, 2), has_keys (n,) bool)`` of each text (see the module)."""
    if params.method == "exact":
        return exact_keys(texts), np.ones(len(texts), bool)
    return minhash_keys(texts, params.minhash, family)
