"""The Megatron-LM indexed dataset format: ``PREFIX.bin`` + ``PREFIX.idx``. This module owns it.

Layout (version 1, all scalars little-endian; N sequences, M = documents + 1)::

    PREFIX.bin   tokens of every sequence, concatenated, no header or padding;
                 size = sum(lengths) * itemsize
    PREFIX.idx   offset      size   type       content
                 0           9      bytes      magic  b"MMIDIDX\\x00\\x00"
                 9           8      u64        version = 1
                 17          1      u8         dtype code (table DTYPE_CODES)
                 18          8      u64        N
                 26          8      u64        M
                 34          4N     int32[N]   sequence lengths (tokens)
                 34+4N       8N     int64[N]   sequence pointers (BYTE offsets into .bin)
                 34+12N      8M     int64[M]   document index: 0, ..., N (non-decreasing)
                 34+12N+8M   N      int8[N]    sequence modes (multimodal files only; not announced)

A *document* is the range of sequences ``document_index[d] : document_index[d+1]``;
an empty document repeats a value. The writer picks uint16 for vocabularies below
65,500 ids and int32 otherwise, exactly as Megatron's ``DType.optimal_dtype``.

Against Megatron's ``IndexedDatasetBuilder``: index columns are compact arrays, not Python
lists; token ids are range-checked before the cast (Megatron wraps 70000 to 4464 in uint16);
both files are written under temporary names, fsynced and renamed ``.bin`` first, ``.idx``
last (the ``.idx`` marks a dataset present), so a killed writer leaves only ``*.tmp-*`` files
(callers with a stronger commit point use :meth:`~IndexedDatasetWriter.stage`); merging copies
in-kernel, keeping holes. The reader maps both files, returns zero-copy views and validates on
open (:class:`FormatError` naming the file). An object-store prefix maps a node-local ``.idx``
copy and reads the ``.bin`` through a block cache (copies, not views).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import mmap
import os
import struct
import sys
from collections.abc import Iterable, Sequence

import numpy as np

from tokenloom import objstore
from tokenloom.errors import FormatError, TokenloomError
from tokenloom.fsio import naming, publish, temp_name

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # magic 9 + version 8 + dtype code 1 + N 8 + M 8

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}

#: The largest sequence length the int32 length field holds.
_INT32_MAX = 2**31 - 1

#: Megatron's writer rule: uint16 strictly below this many ids, else int32.
UINT16_VOCAB_LIMIT = 65500


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """Token dtype for a vocabulary: uint16 if ``vocab_size < 65500`` else int32 (``None``: int32)."""
    if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def data_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def index_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def normalize_prefix(path: str | os.PathLike) -> str:
    """Accept ``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx`` and return ``PREFIX``."""
    text = os.fspath(path)
    for ext in (".bin", ".idx"):
        if text.endswith(ext):
            return text[: -len(ext)]
    return text


def exists(prefix: str | os.PathLike) -> bool:
    if objstore.is_url(prefix):
        try:
            objstore.stat(index_path(prefix))
            objstore.stat(data_path(prefix))
        except objstore.StoreError as exc:
            if "no such object" in str(exc):
                return False
            raise
        return True
    return os.path.isfile(index_path(prefix)) and os.path.isfile(data_path(prefix))


def file_size(path: str) -> int:
    """Size of a local file or an object (:class:`~tokenloom.objstore.StoreError` naming a missing one)."""
    return objstore.stat(path)[0] if objstore.is_url(path) else os.path.getsize(path)


def local_file(path: str) -> str:
    """``path``, or for an object-store URL the node's cached copy (small files only, never a ``.bin``)."""
    return objstore.local_copy(path) if objstore.is_url(path) else path  # type: ignore[return-value]


# --------------------------------------------------------------------------- writing


def encode_header(dtype: np.dtype, num_sequences: int, num_document_indices: int) -> bytes:
    return (MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODE_OF_DTYPE[np.dtype(dtype)])
            + struct.pack("<Q", num_sequences) + struct.pack("<Q", num_document_indices))


def sequence_pointers(lengths: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte offset of each sequence: an exclusive running sum in int64 (never int32)."""
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= itemsize
    return pointers


def write_index(path: str, dtype: np.dtype, lengths: np.ndarray, document_indices: np.ndarray,
                modes: np.ndarray | None = None) -> None:
    """Write a complete ``.idx`` to ``path`` (no temp/rename: callers own atomicity), fsynced."""
    dtype = np.dtype(dtype)
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    document_indices = np.ascontiguousarray(document_indices, dtype=np.int64)
    with naming(path), open(path, "wb") as out:
        out.write(encode_header(dtype, len(lengths), len(document_indices)))
        out.write(lengths.astype("<i4", copy=False).tobytes())
        out.write(sequence_pointers(lengths, dtype.itemsize).astype("<i8", copy=False).tobytes())
        out.write(document_indices.astype("<i8", copy=False).tobytes())
        if modes is not None:
            out.write(np.ascontiguousarray(modes, dtype=np.int8).tobytes())
        out.flush()
        os.fsync(out.fileno())


class _Growable:
    """An append-only int32/int64 ``array.array`` column: cheap ``append``, numpy batches as raw bytes."""

    def __init__(self, dtype, initial: Iterable[int] = ()):
        self._dtype = np.dtype(dtype)
        self._data = array.array({4: "i", 8: "q"}[self._dtype.itemsize])
        if self._data.itemsize != self._dtype.itemsize:  # not reached on CPython's LP64/LLP64 builds
            raise TokenloomError(f"array.array has no {self._dtype} type code on this platform")
        self._data.extend(initial)
        self.append = self._data.append  # no Python frame per document

    @property
    def data(self) -> array.array:
        """The underlying column (the writer's hot path appends to it directly)."""
        return self._data

    def extend(self, values: np.ndarray) -> None:
        self._data.frombytes(np.ascontiguousarray(values, dtype=self._dtype).tobytes())

    def __len__(self) -> int:
        return len(self._data)

    @property
    def last(self) -> int:
        return self._data[-1]

    def view(self) -> np.ndarray:
        """A copy (a numpy view would pin the array.array's buffer and block later appends)."""
        return np.frombuffer(self._data, dtype=self._dtype).copy()


def _copy_preserving_holes(src_path: str, dst_fd: int, dst_offset: int) -> int:
    """Copy ``src_path`` into ``dst_fd`` at ``dst_offset`` in-kernel, skipping holes; return its size."""
    size = os.path.getsize(src_path)
    with open(src_path, "rb") as src:
        fd = src.fileno()
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
                end = os.lseek(fd, start, os.SEEK_HOLE)
            except OSError:  # ENXIO: no data past pos; other errors: no SEEK_DATA support
                if pos == 0 and not hasattr(os, "SEEK_DATA"):
                    start, end = 0, size
                else:
                    break
            while start < end:
                copied = _copy_range(fd, dst_fd, start, dst_offset + start, end - start)
                start += copied
            pos = end
    return size


def _copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, count: int) -> int:
    count = min(count, 1 << 30)
    if hasattr(os, "copy_file_range"):
        try:
            copied = os.copy_file_range(src_fd, dst_fd, count, src_off, dst_off)
            if copied > 0:
                return copied
        except OSError:
            pass
    chunk = os.pread(src_fd, min(count, 16 << 20), src_off)
    if not chunk:
        raise FormatError(f"unexpected end of file while copying (fd {src_fd})")
    return os.pwrite(dst_fd, chunk, dst_off)


# .bin write buffer: far fewer write calls than Python's 8 KB default (bench/indexed_bench.py)
_BIN_BUFFER = 1 << 20

# Every _WRITEBACK bytes, Linux starts writing back the .bin's dirty pages (sync_file_range, no
# wait), so the staging fsync waits for the last _WRITEBACK bytes, not the whole file; errors still
# surface at that fsync. A no-op elsewhere.
_WRITEBACK = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2  # from <fcntl.h>


@functools.cache
def _sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except AttributeError:
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def start_writeback(fd: int) -> None:
    """Start writing ``fd``'s dirty pages without waiting (errors are left to the next fsync)."""
    function = _sync_file_range()
    if function is not None:
        function(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


class IndexedDatasetWriter:
    """Streaming writer of ``PREFIX.bin``/``PREFIX.idx``; byte-identical to Megatron's builder.

    Use as a context manager: leaving the block normally finalizes (atomic rename);
    leaving on an exception removes the temporary files and publishes nothing::

        with IndexedDatasetWriter("out/corpus", vocab_size=50257) as w:
            w.add_document([464, 3290, 50256])           # one sequence
            w.add_document([1, 2, 3, 4], lengths=[2, 2])  # two sequences, one document
            w.add_document([])                            # an empty document
    """

    def __init__(self, prefix: str | os.PathLike, dtype=None, vocab_size: int | None = None,
                 bin_tmp: str | os.PathLike | None = None, resume: dict | None = None,
                 idx_tmp: str | os.PathLike | None = None):
        """``bin_tmp``/``idx_tmp``: the in-progress files (default: temp names beside the output);
        ``resume`` continues from a :meth:`checkpoint` whose data is in ``bin_tmp``."""
        self.prefix = normalize_prefix(prefix)
        if dtype is None:
            dtype = optimal_dtype(vocab_size)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise TokenloomError(f"unsupported token dtype {self.dtype} (supported: "
                                 f"{', '.join(str(np.dtype(t)) for t in DTYPE_CODES.values())})")
        self.vocab_size = vocab_size
        # Inclusive id bounds: the dtype's range, narrowed by the vocabulary when known (None: float).
        info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._id_bounds = (int(info.min), int(info.max)) if info else None
        if vocab_size is not None and self._id_bounds is not None:
            self._id_bounds = (max(self._id_bounds[0], 0), min(self._id_bounds[1], vocab_size - 1))
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._bin_tmp = os.fspath(bin_tmp) if bin_tmp else temp_name(data_path(self.prefix))
        self._idx_tmp = os.fspath(idx_tmp) if idx_tmp else temp_name(index_path(self.prefix))
        self._lengths = _Growable(np.int32)
        self._doc_index = _Growable(np.int64, [0])
        if resume is None:
            self._bin = open(self._bin_tmp, "wb", buffering=_BIN_BUFFER)
            self._num_tokens = 0
        else:
            size = int(resume["bin_bytes"])
            self._bin = open(self._bin_tmp, "r+b", buffering=_BIN_BUFFER)
            if os.fstat(self._bin.fileno()).st_size < size:
                raise TokenloomError(f"{self._bin_tmp}: shorter than its checkpoint ({size} bytes); "
                                     "cannot resume")
            self._bin.truncate(size)  # drop whatever was written after the checkpoint
            self._bin.seek(size)
            self._num_tokens = size // self.dtype.itemsize
            self._lengths.extend(resume["lengths"])
            self._doc_index = _Growable(np.int64, [])
            self._doc_index.extend(resume["document_indices"])
        self._finalized = self._staged = False
        self._unsynced = 0  # bytes written since the last start_writeback
        self._native_le = self.dtype.byteorder in "=|<" and sys.byteorder == "little"

    # -- properties
    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    @property
    def num_documents(self) -> int:
        return len(self._doc_index) - 1

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    # -- adding data
    def _checked(self, tokens, max_id: int | None = None) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.size == 0:
            return arr.astype(self.dtype)
        if arr.dtype.kind not in "iub":
            if arr.dtype.kind == "f" and self.dtype.kind == "f":
                return arr.astype(self.dtype, copy=False)
            raise TokenloomError(f"{self.prefix}: token ids must be integers, got dtype {arr.dtype}")
        # A same-dtype array with no vocabulary bound is in range by construction.
        if self._id_bounds is not None and not (arr.dtype == self.dtype and self.vocab_size is None):
            min_ok, max_ok = self._id_bounds
            lo = 0 if arr.dtype.kind in "ub" else int(arr.min())  # unsigned: one pass, not two
            hi = int(arr.max()) if max_id is None else max_id
            if lo < min_ok or hi > max_ok:
                bad = lo if lo < min_ok else hi
                bound = f" and vocab size {self.vocab_size}" if self.vocab_size is not None else ""
                raise TokenloomError(f"{self.prefix}: token id {bad} out of range [{min_ok}, "
                                     f"{max_ok}] for dtype {self.dtype}{bound}")
        return arr.astype(self.dtype, copy=False)

    def _write_tokens(self, arr: np.ndarray) -> None:
        if not self._native_le:
            arr = arr.astype(self.dtype.newbyteorder("<"))
        with naming(self._bin_tmp):
            self._bin.write(np.ascontiguousarray(arr).data)  # buffer protocol: no extra copy
        self._wrote(arr.size)

    def _wrote(self, tokens: int) -> None:
        self._num_tokens += tokens
        self._unsynced += tokens * self.dtype.itemsize
        if self._unsynced >= _WRITEBACK:
            self._unsynced = 0
            start_writeback(self._bin.fileno())

    def add_item(self, tokens) -> None:
        """Append one sequence without closing the document (Megatron's ``add_item``)."""
        arr = self._checked(tokens)
        if arr.size > _INT32_MAX:
            raise TokenloomError(f"{self.prefix}: a sequence of {arr.size} tokens exceeds the int32 length field")
        self._write_tokens(arr)
        self._lengths.append(arr.size)

    def add_document(self, tokens, lengths: Sequence[int] | np.ndarray | None = None) -> None:
        """Append one document of sequences ``lengths`` (default: one; no tokens: an empty document)."""
        if (lengths is None and type(tokens) is np.ndarray and tokens.dtype == self.dtype  # hot path:
                and self.vocab_size is None and self._native_le and tokens.ndim == 1  # in range by
                and tokens.flags.c_contiguous and tokens.size <= _INT32_MAX):  # construction, no copy
            n = tokens.size
            self._bin.write(tokens.data)
            self._wrote(n)
            lengths_column = self._lengths.data
            if n:
                lengths_column.append(n)
            self._doc_index.append(len(lengths_column))
            return
        arr = self._checked(tokens)
        if lengths is None:  # one sequence (or none), the common case in preprocessing
            if arr.size > _INT32_MAX:
                raise TokenloomError(f"{self.prefix}: a sequence of {arr.size} tokens exceeds the int32 "
                                     "length field")
            self._write_tokens(arr)
            if arr.size:
                self._lengths.append(arr.size)
            self._doc_index.append(len(self._lengths))
            return
        lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
        self._add(arr, lens, np.asarray([len(lens)], dtype=np.int64))

    def add_documents(self, tokens, sequence_lengths, sequences_per_document, max_id: int | None = None) -> None:
        """Batched :meth:`add_document`: ``sequences_per_document[d]`` sequences make document ``d``;
        ``max_id``, when the caller knows it, spares the serial range check a pass over the tokens."""
        self._add(self._checked(tokens, max_id), np.asarray(sequence_lengths, dtype=np.int64).reshape(-1),
                  np.asarray(sequences_per_document, dtype=np.int64).reshape(-1))

    def _add(self, arr: np.ndarray, lens: np.ndarray, per_doc: np.ndarray) -> None:
        if lens.size and (lens.min() < 0 or lens.max() > _INT32_MAX):
            raise TokenloomError(f"{self.prefix}: sequence lengths must lie in [0, 2^31-1]")
        if int(lens.sum()) != arr.size:
            raise TokenloomError(f"{self.prefix}: sequence lengths sum to {int(lens.sum())} "
                                 f"but the document has {arr.size} tokens")
        if per_doc.size and (per_doc.min() < 0 or int(per_doc.sum()) != lens.size):
            raise TokenloomError(f"{self.prefix}: sequences per document sum to {int(per_doc.sum())}, "
                                 f"expected {lens.size}")
        self._write_tokens(arr)
        self._lengths.extend(lens.astype(np.int32))
        self._doc_index.extend(len(self._lengths) - lens.size + np.cumsum(per_doc))

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append every sequence and document of another dataset (same dtype required)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise TokenloomError(f"cannot merge {other.path_prefix} (dtype {other.dtype}) into "
                                 f"{self.prefix} (dtype {self.dtype}): token dtypes differ")
        self._bin.flush()
        start = self._bin.tell()
        if objstore.is_url(other.path_prefix):  # streamed through the reader's blocks
            size = other.bin_bytes
            for chunk in iter_token_chunks(other):
                self._bin.write(chunk.data)
            self._bin.flush()
        else:
            size = _copy_preserving_holes(data_path(other.path_prefix), self._bin.fileno(), start)
            os.ftruncate(self._bin.fileno(), start + size)
        self._bin.seek(start + size)
        self._num_tokens += size // self.dtype.itemsize
        base = len(self._lengths)
        self._lengths.extend(other.sequence_lengths)
        self._doc_index.extend(other.document_indices[1:] + base)
        other.close()

    def add_kept(self, prefix: str | os.PathLike, keep: np.ndarray, block_tokens: int = 1 << 22) -> None:
        """Append the documents of another dataset (same dtype) where ``keep``, about ``block_tokens``
        tokens (whole documents) at a time, so memory does not grow with the dataset."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise TokenloomError(f"cannot copy {other.path_prefix} (dtype {other.dtype}) into "
                                 f"{self.prefix} (dtype {self.dtype}): token dtypes differ")
        doc_index, lengths, pointers = other.document_indices, other.sequence_lengths, other.sequence_pointers
        n = len(doc_index) - 1
        if len(keep) != n:
            raise TokenloomError(f"{other.path_prefix}: {n} documents, but {len(keep)} keep flags")
        itemsize = self.dtype.itemsize
        total = other.num_tokens
        # token offset where each document starts (its first sequence's pointer; the end for none left)
        first_seq = np.asarray(doc_index, np.int64)
        starts = np.full(n + 1, total, np.int64)
        has_seq = first_seq < len(lengths)
        starts[has_seq] = np.asarray(pointers, np.int64)[first_seq[has_seq]] // itemsize
        fd = os.open(data_path(other.path_prefix), os.O_RDONLY)  # read, not mapped: no resident pages pile up
        try:
            self._copy_kept(other, fd, keep, starts, block_tokens)
        finally:
            os.close(fd)
            other.close()

    def _copy_kept(self, other: IndexedDataset, fd: int, keep: np.ndarray, starts: np.ndarray,
                   block_tokens: int) -> None:
        doc_index, lengths, pointers = other.document_indices, other.sequence_lengths, other.sequence_pointers
        n, itemsize = len(doc_index) - 1, self.dtype.itemsize
        s = 0
        while s < n:
            e = max(s + 1, int(np.searchsorted(starts, starts[s] + block_tokens, "right")) - 1)
            e = min(e, n)
            mask = np.asarray(keep[s:e], bool)
            if mask.any():
                a, b = int(doc_index[s]), int(doc_index[e])
                lens = np.asarray(lengths[a:b], np.int64)
                count = int(lens.sum())
                data = os.pread(fd, count * itemsize, int(pointers[a])) if count else b""
                if len(data) != count * itemsize:
                    raise TokenloomError(f"{data_path(other.path_prefix)}: shorter than its index says")
                tokens = np.frombuffer(data, self.dtype)
                per_doc: np.ndarray = np.diff(np.asarray(doc_index[s:e + 1], np.int64))
                seq_keep = np.repeat(mask, per_doc)
                self._add(np.ascontiguousarray(tokens[np.repeat(seq_keep, lens)]), lens[seq_keep], per_doc[mask])
            s = e

    def checkpoint(self) -> dict[str, np.ndarray]:
        """Make everything written so far durable and return the state that resumes from here."""
        with naming(self._bin_tmp):
            self._bin.flush()
            os.fsync(self._bin.fileno())
        return {"lengths": self._lengths.view(), "document_indices": self._doc_index.view(),
                "bin_bytes": np.asarray(self._bin.tell(), dtype=np.int64)}

    # -- publishing
    def stage(self) -> tuple[str, str]:
        """Complete both files under their temporary names, fsynced; return (bin, idx) paths."""
        if not self._staged:
            with naming(self._bin_tmp):
                self._bin.flush()
                os.fsync(self._bin.fileno())
            self._bin.close()
            write_index(self._idx_tmp, self.dtype, self._lengths.view(), self._doc_index.view())
            self._staged = True
        return self._bin_tmp, self._idx_tmp

    def finalize(self) -> None:
        """fsync both files and rename them into place (``.bin`` first, ``.idx`` last)."""
        if self._finalized:
            return
        self.stage()
        publish(self._bin_tmp, data_path(self.prefix))
        publish(self._idx_tmp, index_path(self.prefix))
        self._finalized = True

    def close(self) -> None:
        """Close the in-progress file without publishing or deleting it (for a later ``resume``);
        unwritable buffered bytes (full disk) are dropped: a resume cuts back to its checkpoint."""
        if not self._bin.closed:
            with contextlib.suppress(OSError):
                self._bin.close()  # the file is closed even when its last flush fails

    def abort(self) -> None:
        """Drop everything written so far; nothing is published."""
        self.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        self._finalized = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


# --------------------------------------------------------------------------- reading


class IndexedDataset:
    """Memory-mapped reader of ``PREFIX.bin``/``PREFIX.idx`` (``ds[i]``, ``ds[a:b]``, ``ds.get(i, offset,
    length)``: read-only views); opened on first use, pickled by path, so each worker maps its own."""

    def __init__(self, path_prefix: str | os.PathLike, multimodal: bool = False):
        self.path_prefix = normalize_prefix(path_prefix)
        self.multimodal = multimodal
        self._state = None

    # -- pickling by path
    def __getstate__(self):
        return {"path_prefix": self.path_prefix, "multimodal": self.multimodal}

    def __setstate__(self, state):
        self.path_prefix = state["path_prefix"]
        self.multimodal = state["multimodal"]
        self._state = None

    def __repr__(self) -> str:
        return f"IndexedDataset({self.path_prefix!r})"

    # -- opening and validation
    def _open(self):
        if self._state is None:
            self._state = _open_files(self.path_prefix, self.multimodal)
        return self._state

    def close(self) -> None:
        if self._state is not None:
            self._state.close()
            self._state = None

    @property
    def dtype(self) -> np.dtype:
        return self._open().dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._open().lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self._open().pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self._open().doc_index

    @property
    def num_tokens(self) -> int:
        return self._open().bin_size // self.dtype.itemsize

    @property
    def bin_bytes(self) -> int:
        """Size of ``PREFIX.bin`` in bytes."""
        return self._open().bin_size

    @property
    def idx_bytes(self) -> int:
        """Size of ``PREFIX.idx`` in bytes."""
        return self._open().idx_size

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return len(self._open().lengths)

    def _read(self, pointer: int, count: int, state: _OpenFiles | None = None) -> np.ndarray:
        state = state or self._open()
        if count == 0:
            return np.empty(0, dtype=state.dtype)
        if isinstance(state.bin_map, objstore.RangedReader):
            return np.frombuffer(state.bin_map.read(pointer, count * state.dtype.itemsize), dtype=state.dtype)
        return np.frombuffer(state.bin_map, dtype=state.dtype, count=count, offset=pointer)

    def tokens_at(self, positions: np.ndarray) -> np.ndarray:
        """The tokens at the given token positions (ascending order reads a remote ``.bin`` in one pass)."""
        state = self._open()
        positions = np.asarray(positions, dtype=np.int64)
        if not isinstance(state.bin_map, objstore.RangedReader):
            stream = np.frombuffer(state.bin_map, dtype=state.dtype) if state.bin_size else np.empty(0, state.dtype)
            return stream[positions]
        reader, itemsize = state.bin_map, state.dtype.itemsize
        out = np.empty(positions.shape, dtype=state.dtype)
        blocks = positions * itemsize // reader.block  # a block holds whole tokens (its size is a power of 2)
        for b in np.unique(blocks):
            here = blocks == b
            data = np.frombuffer(reader.block_data(int(b)), dtype=state.dtype)
            out[here] = data[positions[here] - int(b) * reader.block // itemsize]
        return out

    def __getitem__(self, idx):
        state = self._open()
        n = len(state.lengths)
        if isinstance(idx, (int, np.integer)):
            i = int(idx)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"sequence index {idx} out of range for {n} sequences")
            return self._read(int(state.pointers[i]), int(state.lengths[i]), state)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(n)
            if step != 1:
                raise ValueError("only contiguous slices (step 1) are supported")
            if start >= stop:
                return []
            lengths = state.lengths[start:stop]
            flat = self._read(int(state.pointers[start]), int(lengths.sum(dtype=np.int64)))
            return np.split(flat, np.cumsum(lengths[:-1], dtype=np.int64))
        raise TypeError(f"indices must be integers or slices, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """``length`` tokens of sequence ``idx`` starting ``offset`` tokens in (default: to its end)."""
        state = self._open()
        seq_len = int(state.lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {idx} of length {seq_len}")
        return self._read(int(state.pointers[idx]) + offset * state.dtype.itemsize, length, state)

    @staticmethod
    def exists(path_prefix: str | os.PathLike) -> bool:
        return exists(normalize_prefix(path_prefix))


class _OpenFiles:
    """The mapped arrays of one open dataset."""

    def __init__(self, dtype, lengths, pointers, doc_index, modes, idx_map, bin_map, bin_size, idx_size):
        self.idx_size = idx_size
        self.dtype = dtype
        self.lengths = lengths
        self.pointers = pointers
        self.doc_index = doc_index
        self.modes = modes
        self.idx_map = idx_map
        self.bin_map = bin_map
        self.bin_size = bin_size

    def close(self) -> None:
        # Views into the maps may still be alive; dropping our references lets GC unmap.
        self.idx_map = self.bin_map = None


def read_header(idx_file: str) -> tuple[np.dtype, int, int]:
    """(dtype, N, M) from an ``.idx`` header (a file or a URL), or :class:`FormatError` saying what is wrong."""
    return _header(local_file(idx_file), idx_file)


def _header(path: str, idx_file: str) -> tuple[np.dtype, int, int]:
    """:func:`read_header` of the local file ``path``, errors naming ``idx_file`` (its URL, for a fetched copy)."""
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
        found = head[: len(MAGIC)]
        raise FormatError(f"{idx_file}: not a Megatron indexed dataset (magic {found!r}, expected {MAGIC!r})")
    if len(head) < HEADER_SIZE:
        raise FormatError(f"{idx_file}: truncated header ({len(head)} of {HEADER_SIZE} bytes)")
    (version,) = struct.unpack_from("<Q", head, 9)
    if version != VERSION:
        raise FormatError(f"{idx_file}: unknown format version {version} (supported: {VERSION})")
    (code,) = struct.unpack_from("<B", head, 17)
    if code not in DTYPE_CODES:
        raise FormatError(f"{idx_file}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    n, m = struct.unpack_from("<QQ", head, 18)
    return np.dtype(DTYPE_CODES[code]), int(n), int(m)


def described_bin_size(idx_file: str) -> int:
    """The ``.bin`` size an ``.idx`` describes (last pointer plus last length), read from the header
    and two entries: checks a pair belongs together without reading either."""
    dtype, n, _ = read_header(idx_file)
    if n == 0:
        return 0
    with open(local_file(idx_file), "rb") as f:
        f.seek(HEADER_SIZE + 4 * (n - 1))
        (length,) = struct.unpack("<i", f.read(4))
        f.seek(HEADER_SIZE + 4 * n + 8 * (n - 1))
        (pointer,) = struct.unpack("<q", f.read(8))
    return pointer + length * dtype.itemsize


def size_mismatch(bin_file: str, idx_file: str, bin_size: int, expected: int, itemsize: int) -> str:
    """The message for a ``.bin`` whose size is not its ``.idx``'s: both sizes and the fix (make it again)."""
    how = "shorter" if bin_size < expected else "longer"
    whole = "" if bin_size % itemsize == 0 else f", not a whole number of {itemsize}-byte tokens"
    return (f"{bin_file} is {bin_size} bytes{whole}, {how} than the {expected} bytes ({expected // itemsize} "
            f"tokens x {itemsize}) its index {idx_file} describes: the pair is damaged (a copy cut short or "
            "written to) or mismatched (the .idx of another .bin); preprocess again")


def _open_files(prefix: str, multimodal: bool) -> _OpenFiles:
    idx_file, bin_file = index_path(prefix), data_path(prefix)
    remote = objstore.is_url(prefix)
    for path in (() if remote else (idx_file, bin_file)):  # a missing object fails naming its URL
        if not os.path.exists(path):
            raise FormatError(f"{path}: no such file (expected a dataset written by `tokenloom preprocess` "
                              "or Megatron's preprocess_data.py)")
    idx_local = local_file(idx_file)
    dtype, n, m = _header(idx_local, idx_file)
    idx_size = os.path.getsize(idx_local)
    expected = HEADER_SIZE + 12 * n + 8 * m + (n if multimodal else 0)
    if idx_size < expected:
        raise FormatError(f"{idx_file}: truncated ({idx_size} bytes, the header's {n} sequences and {m} "
                          f"document indices need {expected})")
    if idx_size > expected and idx_size != expected + n:
        raise FormatError(f"{idx_file}: {idx_size - expected} unexpected trailing bytes "
                          f"(size {idx_size}, expected {expected})")
    if m < 1:
        raise FormatError(f"{idx_file}: empty document index (must hold at least the leading 0)")
    with open(idx_local, "rb") as f:
        idx_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    lengths = np.frombuffer(idx_map, dtype="<i4", count=n, offset=HEADER_SIZE)
    pointers = np.frombuffer(idx_map, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
    doc_index = np.frombuffer(idx_map, dtype="<i8", count=m, offset=HEADER_SIZE + 12 * n)
    modes = (np.frombuffer(idx_map, dtype=np.int8, count=n, offset=HEADER_SIZE + 12 * n + 8 * m)
             if multimodal else None)
    if int(doc_index[-1]) != n:
        raise FormatError(f"{idx_file}: document index ends at {int(doc_index[-1])}, expected the sequence "
                          f"count {n}")
    bin_size = file_size(bin_file)
    expected_bin = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if n else 0
    if bin_size != expected_bin:
        raise FormatError(size_mismatch(bin_file, idx_file, bin_size, expected_bin, dtype.itemsize))
    bin_map: mmap.mmap | objstore.RangedReader | None = None
    if bin_size and remote:
        bin_map = objstore.RangedReader(bin_file, bin_size)
    elif bin_size:
        with open(bin_file, "rb") as f:
            bin_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _OpenFiles(dtype, lengths, pointers, doc_index, modes, idx_map, bin_map, bin_size, idx_size)


def iter_token_chunks(ds: IndexedDataset, chunk_tokens: int = 1 << 24) -> Iterable[np.ndarray]:
    """The whole token stream in bounded chunks (views; no copy of the file)."""
    total = ds.num_tokens
    for start in range(0, total, chunk_tokens):
        count = min(chunk_tokens, total - start)
        yield ds._read(start * ds.dtype.itemsize, count)


__all__ = [
    "MAGIC", "VERSION", "DTYPE_CODES", "IndexedDataset", "IndexedDatasetWriter", "optimal_dtype",
    "read_header", "write_index", "sequence_pointers", "data_path", "index_path", "normalize_prefix",
    "exists", "iter_token_chunks", "size_mismatch", "described_bin_size", "file_size", "local_file",
]
