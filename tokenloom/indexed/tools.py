"""Whole-dataset operations on indexed files: verify, inspect, merge.

All three stream the index and tokens in bounded chunks (constant memory on datasets far larger
than RAM; object-store URLs read in place) and raise :class:`FormatError` naming the file and the
first offending sequence or document.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenloom.errors import FormatError, TokenloomError
from tokenloom.indexed import manifest
from tokenloom.indexed.format import (
    IndexedDataset,
    IndexedDatasetWriter,
    data_path,
    index_path,
    iter_token_chunks,
    normalize_prefix,
    size_mismatch,
)

CHUNK = 1 << 24
EXACT_QUANTILES_MAX = 1 << 26  # above this many sequences, quantiles come from the log2 histogram


def _token_offsets(ds: IndexedDataset, seq_ids: np.ndarray) -> np.ndarray:
    """Token offset of the start of each sequence id; id N maps to the total token count."""
    n = len(ds)
    inside = seq_ids < n
    out = np.full(seq_ids.shape, ds.num_tokens, dtype=np.int64)
    out[inside] = ds.sequence_pointers[seq_ids[inside]] // ds.dtype.itemsize
    return out


def _check_structure(ds: IndexedDataset) -> None:
    idx_file, bin_file = index_path(ds.path_prefix), data_path(ds.path_prefix)
    lengths, pointers, doc_index = ds.sequence_lengths, ds.sequence_pointers, ds.document_indices
    itemsize, n = ds.dtype.itemsize, len(ds)
    if n and int(pointers[0]) != 0:
        raise FormatError(f"{idx_file}: first sequence pointer is {int(pointers[0])}, expected 0")
    expected_next = 0
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        lens = lengths[a:b].astype(np.int64)
        if lens.min() < 0:
            i = a + int(np.argmax(lens < 0))
            raise FormatError(f"{idx_file}: sequence {i} has negative length {int(lengths[i])}")
        starts = np.empty(b - a, dtype=np.int64)
        starts[0] = expected_next
        np.cumsum(lens[:-1] * itemsize, out=starts[1:])
        starts[1:] += expected_next
        bad = np.flatnonzero(pointers[a:b] != starts)
        if bad.size:
            i = a + int(bad[0])
            raise FormatError(f"{idx_file}: sequence {i} pointer {int(pointers[i])} is not the running sum "
                              f"of the lengths before it ({int(starts[bad[0]])}): pointers are not monotonic "
                              "and contiguous")
        expected_next = int(starts[-1]) + int(lens[-1]) * itemsize
    if ds.bin_bytes != expected_next:
        raise FormatError(size_mismatch(bin_file, idx_file, ds.bin_bytes, expected_next, itemsize))
    if int(doc_index[0]) != 0:
        raise FormatError(f"{idx_file}: document index starts at {int(doc_index[0])}, expected 0")
    if int(doc_index[-1]) != n:
        raise FormatError(f"{idx_file}: document index ends at {int(doc_index[-1])}, expected {n}")
    for a in range(0, len(doc_index) - 1, CHUNK):
        step = np.diff(doc_index[a:a + CHUNK + 1])
        if step.size and step.min() < 0:
            d = a + int(np.argmax(step < 0))
            raise FormatError(f"{idx_file}: document index decreases at document {d} "
                              f"({int(doc_index[d])} -> {int(doc_index[d + 1])})")


def _sequence_of_token(ds: IndexedDataset, token_pos: int) -> int:
    byte = token_pos * ds.dtype.itemsize
    return int(np.searchsorted(ds.sequence_pointers, byte, side="right")) - 1


def _check_ids(ds: IndexedDataset, vocab_size: int, source: str = "") -> None:
    bin_file = data_path(ds.path_prefix)
    pos = 0
    for chunk in iter_token_chunks(ds, CHUNK):
        bad = (chunk >= vocab_size) | (chunk < 0) if ds.dtype.kind != "u" else chunk >= vocab_size
        if bad.any():
            k = int(np.argmax(bad))
            seq = _sequence_of_token(ds, pos + k)
            doc = int(np.searchsorted(ds.document_indices, seq, side="right")) - 1
            raise FormatError(f"{bin_file}: token id {int(chunk[k])} at token {pos + k} (document {doc}, "
                              f"sequence {seq}) is outside the vocabulary [0, {vocab_size}){source}")
        pos += chunk.size


def _check_document_edges(ds: IndexedDataset, token: int, name: str, last: bool, source: str = "") -> None:
    """Every non-empty document ends (``last``) or starts with ``token``."""
    bin_file = data_path(ds.path_prefix)
    doc_index = ds.document_indices
    missing, first = 0, None
    for a in range(0, len(doc_index) - 1, CHUNK):
        bounds = _token_offsets(ds, np.asarray(doc_index[a:a + CHUNK + 1]))
        nonempty = np.flatnonzero(bounds[1:] > bounds[:-1])
        edge = ds.tokens_at(bounds[1:][nonempty] - 1 if last else bounds[:-1][nonempty])
        wrong = nonempty[edge != token]
        if wrong.size:
            missing += int(wrong.size)
            first = a + int(wrong[0]) if first is None else first
    if missing:
        raise FormatError(f"{bin_file}: {missing} non-empty document(s) do not {'end' if last else 'start'} "
                          f"with {name} {token} (first: document {first}){source}")


def _check_counts(ds: IndexedDataset, expected: dict, source: str) -> None:
    """Counts and dtype equal to ``expected`` (the keys it has of dtype, sequences, documents, tokens)."""
    actual = {"dtype": str(ds.dtype), "sequences": len(ds), "documents": ds.num_documents, "tokens": ds.num_tokens}
    for key in ("dtype", "sequences", "documents", "tokens"):
        if key in expected and str(expected[key]) != str(actual[key]):
            raise FormatError(f"{index_path(ds.path_prefix)}: {actual[key]} {key}, but {expected[key]}{source}: "
                              "the files were changed after they were written; preprocess again")


def verify(prefix: str | os.PathLike, vocab_size: int | None = None, eod: int | None = None,
           bos: int | None = None, expected: dict | None = None, sources: dict | None = None) -> dict:
    """Check a dataset completely (header, sizes, pointers, document index; with ``expected`` dtype and
    counts first, ``vocab_size`` id range, ``eod``/``bos`` document ends/starts; ``sources``: where
    each value came from, for the error); return its counts and checks, or raise :class:`FormatError`."""
    sources = sources or {}

    def said(check: str) -> str:
        return f" ({sources[check]})" if check in sources else ""

    ds = IndexedDataset(prefix)
    _check_structure(ds)
    checked = ["structure"]
    if expected:
        _check_counts(ds, expected, said("counts") or " expected")
        checked.append("counts")
    if vocab_size is not None:
        _check_ids(ds, vocab_size, said("vocab"))
        checked.append("vocab")
    if eod is not None:
        _check_document_edges(ds, eod, "EOD", True, said("eod"))
        checked.append("eod")
    if bos is not None:
        _check_document_edges(ds, bos, "BOS", False, said("bos"))
        checked.append("bos")
    return {"path_prefix": ds.path_prefix, "dtype": str(ds.dtype), "sequences": len(ds),
            "documents": ds.num_documents, "tokens": ds.num_tokens, "checked": checked}


def token_stream_sha256(ds: IndexedDataset) -> str:
    """SHA-256 of the tokens as little-endian int64: equal for uint16 and int32 copies of the same ids."""
    h = hashlib.sha256()
    for chunk in iter_token_chunks(ds, CHUNK):
        h.update(chunk.astype("<i8").tobytes())
    return h.hexdigest()


@dataclass
class LengthSummary:
    """Distribution of sequence lengths; quantiles exact below 2^26 sequences, else bucket bounds."""

    count: int = 0
    min: int = 0
    max: int = 0
    mean: float = 0.0
    quantiles: dict[str, int] = field(default_factory=dict)
    exact: bool = True
    #: log2 buckets: histogram[k] counts lengths in [2^(k-1), 2^k) (bucket 0 holds length 0).
    histogram: list[int] = field(default_factory=list)


def summarize_lengths(lengths: np.ndarray) -> LengthSummary:
    n = len(lengths)
    if n == 0:
        return LengthSummary()
    hist = np.zeros(33, dtype=np.int64)
    lo, hi, total = np.iinfo(np.int64).max, -1, 0
    for a in range(0, n, CHUNK):
        part = np.asarray(lengths[a:a + CHUNK], dtype=np.int64)
        lo, hi, total = min(lo, int(part.min())), max(hi, int(part.max())), total + int(part.sum())
        buckets = np.zeros(part.shape, dtype=np.int64)
        pos = part > 0
        buckets[pos] = np.floor(np.log2(part[pos])).astype(np.int64) + 1
        hist += np.bincount(buckets, minlength=33)[:33]
    qs = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
    if n <= EXACT_QUANTILES_MAX:
        values = np.quantile(np.asarray(lengths), list(qs.values()), method="lower")
        quantiles, exact = {k: int(v) for k, v in zip(qs, values, strict=True)}, True
    else:
        cdf = np.cumsum(hist) / n
        quantiles = {k: int(2 ** int(np.searchsorted(cdf, q)) - 1) for k, q in qs.items()}
        exact = False
    last = int(np.flatnonzero(hist)[-1]) + 1
    return LengthSummary(n, lo, hi, total / n, quantiles, exact, hist[:last].tolist())


def inspect(prefix: str | os.PathLike, with_hash: bool = True) -> dict:
    """Counts, dtype, sizes, sequence-length summary and the dtype-independent token SHA-256."""
    ds = IndexedDataset(prefix)
    doc_sizes = np.diff(ds.document_indices)
    summary = summarize_lengths(ds.sequence_lengths)
    report = {
        "path_prefix": ds.path_prefix,
        "dtype": str(ds.dtype),
        "sequences": len(ds),
        "documents": ds.num_documents,
        "empty_documents": int((doc_sizes == 0).sum()),
        "tokens": ds.num_tokens,
        "bin_bytes": ds.bin_bytes,
        "idx_bytes": ds.idx_bytes,
        "sequence_length": summary.__dict__,
    }
    if with_hash:
        report["token_sha256"] = token_stream_sha256(ds)
    recorded = manifest.read(prefix)
    clean = (recorded or {}).get("options", {}).get("clean")
    if clean:  # what preprocess removed (PREFIX.removed.jsonl lists each record), and how it decided
        report["clean"] = {**{k: v for k, v in clean.items() if k not in ("removed_list", "side_files")},
                           "removed": recorded["counts"].get("removed", {})}  # type: ignore[index]
    return report


def merge(output_prefix: str | os.PathLike, prefixes: Sequence[str | os.PathLike]) -> dict:
    """Concatenate datasets in the given order into one (atomic; dtypes must agree)."""
    if not prefixes:
        raise TokenloomError("merge needs at least one input prefix")
    output_prefix = normalize_prefix(output_prefix)
    sources = [IndexedDataset(p) for p in prefixes]
    for src in sources:
        if os.path.abspath(src.path_prefix) == os.path.abspath(output_prefix):
            raise TokenloomError(f"merge output {output_prefix} is also an input")
    dtype = sources[0].dtype
    for src in sources[1:]:
        if src.dtype != dtype:
            raise TokenloomError(f"cannot merge {src.path_prefix} (dtype {src.dtype}) with "
                                 f"{sources[0].path_prefix} (dtype {dtype}): token dtypes differ")
    with IndexedDatasetWriter(output_prefix, dtype=dtype) as writer:
        for src in sources:
            writer.add_index(src.path_prefix)
        counts = {"sequences": writer.num_sequences, "documents": writer.num_documents,
                  "tokens": writer.num_tokens}
    return {"path_prefix": output_prefix, "dtype": str(dtype), "inputs": len(sources), **counts}


def format_report(report: dict) -> str:
    """Aligned ``key  value`` lines, nested dicts flattened to ``outer.inner``."""
    flat: dict[str, object] = {}
    for key, value in report.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    width = max(map(len, flat))
    return "\n".join(f"{key:<{width}}  {value}" for key, value in flat.items())
