"""Worker side of preprocess: a chunk of raw records in, token arrays per key out.

Each worker process builds its own tokenizer from the picklable spec once
(``init``) and then encodes whole chunks with the backend's batch API, one
thread per process (parallelism comes from processes). The same function runs
in-process for ``--workers 1``, so outputs cannot depend on the worker count.

Per record and key the value may be a string (one document) or a list of
strings (pre-split sentences, as Megatron accepts): each sentence that
tokenizes to something is one sequence; a document whose sentences all
tokenize to nothing is an *empty document* (no sequence, no EOD), exactly as
Megatron's ``preprocess_data.py`` writes it. ``--append-eod`` adds EOD to the
last sequence of each non-empty document; ``--prepend-bos`` adds BOS to its first.

Workers die with their parent: on Linux each asks the kernel for SIGKILL when the
process that forked it exits (``PR_SET_PDEATHSIG``), so a killed preprocess leaves
no orphan tokenizing for nobody. Elsewhere the pool's own shutdown is all there is
(:mod:`tokenloom.preprocess.pool`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass, field

import numpy as np

from tokenloom.clean.stage import CleanResult, CleanSpec, clean_decoded
from tokenloom.corpus.documents import decode_chunk
from tokenloom.corpus.readers import Chunk

_TOKENIZER = None
_INIT_ERROR: BaseException | None = None
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass(frozen=True)
class EncodeOptions:
    keys: tuple[str, ...]
    dtype: str
    vocab_size: int
    append_eod: bool = False
    prepend_bos: bool = False
    eod: int | None = None
    bos: int | None = None
    clean: CleanSpec | None = None  # filters and dedup keys, before tokenizing (tokenloom.clean.stage)


@dataclass
class KeyOutput:
    """Ready for ``IndexedDatasetWriter.add_documents``."""

    tokens: np.ndarray
    sequence_lengths: np.ndarray
    sequences_per_document: np.ndarray
    empty_documents: int = 0
    max_id: int | None = None  # the largest of ``tokens`` (None: no tokens)


@dataclass
class EncodedChunk:
    seq: int
    outputs: dict[str, KeyOutput]
    bad: list[tuple[int, str, str]] = field(default_factory=list)  # (number, reason, snippet)
    documents: int = 0
    text_bytes: int = 0
    lines: int = 0  # lines of a ``relative`` chunk (its record numbers count from 1)
    clean: CleanResult | None = None  # with ``EncodeOptions.clean``: kept and removed records, dedup keys


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits (Linux); exit now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the prctl: nobody will read our results
        os._exit(1)


def init(spec, inherited=None, parent_pid: int | None = None, encoder_memory_mb: int | None = None) -> None:
    """Process-pool initializer: this process's tokenizer, encoding on one thread.

    ``inherited`` is the parent's tokenizer when the worker was forked: the child already
    holds a copy, so it only switches it to one thread instead of rebuilding it from the
    spec (building a BPE is a visible start-up cost per process). A failure is kept and raised by
    the first task, so the parent sees the real error instead of a broken pool.
    ``parent_pid`` ties the worker's life to that process (:func:`die_with_parent`);
    ``encoder_memory_mb`` bounds what the encoder may add to it (``Tokenizer.bound_memory``).
    """
    global _TOKENIZER, _INIT_ERROR
    if parent_pid is not None:
        die_with_parent(parent_pid)
    try:
        if inherited is not None:
            _TOKENIZER = inherited.single_threaded()
        else:
            from tokenloom.tokenizers import load_tokenizer  # lazy: start-up time (merge loads no tokenizer)

            _TOKENIZER = load_tokenizer(spec.with_options(num_threads=1))
        _TOKENIZER.bound_memory(encoder_memory_mb)
    except Exception as exc:  # noqa: BLE001 - re-raised in encode_in_worker
        _INIT_ERROR = exc


def set_tokenizer(tokenizer, encoder_memory_mb: int | None = None) -> None:
    """Use an already built tokenizer in this process (the in-process ``--workers 1`` path)."""
    global _TOKENIZER
    _TOKENIZER = tokenizer
    tokenizer.bound_memory(encoder_memory_mb)


def encode_chunk(chunk: Chunk, opts: EncodeOptions) -> EncodedChunk:
    """Validate, clean (``opts.clean``: filters, dedup keys), tokenize and frame one chunk; bad records are
    returned, never raised; records a filter removes are not tokenized."""
    decoded = decode_chunk(chunk, opts.keys)
    cleaned = None
    if opts.clean is not None:
        decoded, cleaned = clean_decoded(decoded, opts.keys, opts.clean)
    result = EncodedChunk(chunk.seq, {}, decoded.bad, documents=len(decoded.numbers), lines=decoded.lines,
                          clean=cleaned)
    for key in opts.keys:
        texts = decoded.texts[key]
        result.text_bytes += sum(map(len, texts))
        result.outputs[key] = _frame(texts, np.array(decoded.pieces[key], dtype=np.int64), opts)
    return result


def _frame(texts: list[str], pieces_per_doc: np.ndarray, opts: EncodeOptions) -> KeyOutput:
    """Tokenize the pieces and lay them out as sequences/documents with EOD/BOS.

    The ids are range-checked once, as the tokenizer returns them, and cast to the output dtype
    before EOD/BOS are inserted: three passes over the tokens, where checking and inserting in
    int64 took five."""
    if texts:
        if _TOKENIZER is None:
            raise RuntimeError("no tokenizer in this process: init or set_tokenizer runs first")
        ids, lengths = _TOKENIZER.encode_batch(texts)
    else:
        ids, lengths = np.empty(0, np.int64), np.empty(0, np.int64)
    max_id = None
    if ids.size:
        max_id, low = int(ids.max()), (0 if ids.dtype.kind == "u" else int(ids.min()))
        if max_id >= opts.vocab_size or low < 0:
            bad = max_id if max_id >= opts.vocab_size else low
            raise ValueError(f"tokenizer emitted id {bad} outside its vocab size {opts.vocab_size}")
    ids = ids.astype(opts.dtype)
    doc_of_piece = np.repeat(np.arange(len(pieces_per_doc)), pieces_per_doc)
    keep = lengths > 0  # a sentence that tokenizes to nothing is dropped (Megatron)
    lengths, doc_of_piece = lengths[keep], doc_of_piece[keep]
    seqs_per_doc = np.bincount(doc_of_piece, minlength=len(pieces_per_doc)).astype(np.int64)
    nonempty = seqs_per_doc > 0
    empty_documents = int((~nonempty).sum())
    if len(lengths) and (opts.append_eod or opts.prepend_bos):
        ends = np.cumsum(lengths)
        first_piece = np.cumsum(seqs_per_doc)[nonempty] - seqs_per_doc[nonempty]
        last_piece = first_piece + seqs_per_doc[nonempty] - 1
        positions, values = [], []
        if opts.append_eod:  # listed before BOS: at a shared position EOD (end of d) precedes BOS (start of d+1)
            positions.append(ends[last_piece])
            values.append(np.full(len(last_piece), opts.eod, dtype=np.int64))
        if opts.prepend_bos:
            positions.append(ends[first_piece] - lengths[first_piece])
            values.append(np.full(len(first_piece), opts.bos, dtype=np.int64))
        for special in ((opts.eod,) if opts.append_eod else ()) + ((opts.bos,) if opts.prepend_bos else ()):
            if special is None or not 0 <= special < opts.vocab_size:  # None: refused before the run
                raise ValueError(f"tokenizer emitted id {special} outside its vocab size {opts.vocab_size}")
            max_id = special if max_id is None else max(max_id, special)  # never None here: lengths > 0
        ids = np.insert(ids, np.concatenate(positions), np.concatenate(values).astype(ids.dtype))
        lengths = lengths.copy()
        if opts.append_eod:
            lengths[last_piece] += 1
        if opts.prepend_bos:
            lengths[first_piece] += 1
    return KeyOutput(ids, lengths, seqs_per_doc, empty_documents, max_id)


def encode_in_worker(chunk: Chunk, opts: EncodeOptions) -> EncodedChunk:
    """Entry point submitted to the process pool."""
    if _INIT_ERROR is not None:
        raise _INIT_ERROR
    return encode_chunk(chunk, opts)
