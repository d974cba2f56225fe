"""Input discovery and streaming readers (preprocess and tokenizer training read through them).

Every input is read as *records* cut into :class:`Chunk` objects of about ``chunk_bytes`` of
text. The main process only reads and cuts; parsing and tokenizing happen in the workers:

* ``jsonl`` (plain, ``.gz``, ``.zst``): chunks carry raw lines (blank lines are not records);
  a local plain file is cut into byte ranges the workers read and number themselves, so the
  main process's work grows with neither the input nor the worker count. A file changed while
  read is refused.
* ``parquet`` and HF ``datasets`` directories: pyarrow record batches of the requested columns.
* ``txt``: one document per file, per paragraph (blank-line separated) or per line.

Object-store URLs (globs too) are streamed; HF datasets directories must be local. A resume
position is ``(input index, records consumed)`` plus a byte offset for plain files (a seek);
compressed and columnar inputs skip the consumed records (re-reading, not re-tokenizing).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import os
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import zstandard

from tokenloom import objstore
from tokenloom.errors import TokenloomError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "txt", "txt.gz", "txt.zst", "datasets")
TXT_UNITS = ("file", "paragraph", "line")


@dataclass(frozen=True)
class Input:
    """One input: a file, or an HF ``datasets`` directory."""

    path: str
    format: str
    size: int
    version: str = ""  # object-store inputs: the ETag (local files: their mtime, read when needed)

    @property
    def compressed(self) -> bool:
        return self.format.endswith((".gz", ".zst"))


@dataclass
class Position:
    """Where reading stands: ``records`` consumed from input ``input`` (``offset``: plain files)."""

    input: int = 0
    records: int = 0
    offset: int | None = 0

    def to_json(self) -> dict:
        return {"input": self.input, "records": self.records, "offset": self.offset}

    @classmethod
    def from_json(cls, data: dict) -> Position:
        return cls(int(data["input"]), int(data["records"]), data["offset"])


@dataclass
class Chunk:
    """A batch of consecutive records of one input, in input order (``seq`` orders chunks)."""

    seq: int
    input: int
    kind: str  # "json": ``lines`` are raw bytes; "values": ``columns`` map key -> values
    numbers: list[int]  # 1-based line (jsonl/txt) or row (columnar) number of each record
    lines: list[bytes] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)
    raw_bytes: int = 0  # input bytes consumed by this chunk (compressed bytes for .gz/.zst)
    end: Position = field(default_factory=Position)
    errors: list[tuple[int, str]] = field(default_factory=list)  # reader-level problems (truncated file)
    # A local plain jsonl chunk carries no lines, only ``span`` of ``path``; its records are numbered
    # from 1 (``relative``) until :class:`LineNumbers` places them, in order.
    path: str = ""
    span: tuple[int, int] | None = None
    relative: bool = False

    def __len__(self) -> int:
        return len(self.numbers)


# --------------------------------------------------------------------------- discovery


def detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / "dataset_info.json").exists() and (path / "state.json").exists():
            return "datasets"
        if (path / "dataset_dict.json").exists():
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            raise TokenloomError(f"{path}: a DatasetDict; pass one split directory "
                                 f"({', '.join(str(path / s) for s in splits)})")
        raise TokenloomError(f"{path}: a directory that is not an HF datasets save_to_disk directory "
                             "(use a glob like DIR/*.jsonl for files)")
    return format_of_name(str(path))


def format_of_name(path: str) -> str:
    """The format of a file from its name (``path`` is named in the error)."""
    name = path.rsplit("/", 1)[-1].lower()
    for suffix, comp in ((".zst", ".zst"), (".zstd", ".zst"), (".gz", ".gz")):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            if stem.endswith(JSONL_SUFFIXES):
                return "jsonl" + comp
            if stem.endswith(".txt"):
                return "txt" + comp
            raise TokenloomError(f"{path}: unknown compressed format (expected .jsonl{comp} or .txt{comp})")
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".txt", ".text", ".md")):
        return "txt"
    raise TokenloomError(f"{path}: unknown input format (supported: {', '.join(FORMATS)})")


def discover(patterns: list[str]) -> list[Input]:
    """Expand files, globs and directories in the order given (each glob sorted); no duplicates."""
    inputs, seen = [], set()
    for pattern in patterns:
        if objstore.is_url(pattern):
            found = objstore.expand(pattern)
            if not found:
                raise TokenloomError(f"--input {pattern}: no object matches")
            for url, size, version in found:
                if url not in seen:
                    seen.add(url)
                    inputs.append(Input(url, format_of_name(url), size, version))
            continue
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise TokenloomError(f"--input {pattern}: no file matches")
        for match in matches:
            path = Path(match)
            if not path.exists():
                raise TokenloomError(f"--input {match}: no such file or directory")
            key = os.path.realpath(path)
            if key in seen:
                continue
            seen.add(key)
            fmt = detect_format(path)
            size = (sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir()
                    else path.stat().st_size)
            inputs.append(Input(str(path), fmt, size))
    if not inputs:
        raise TokenloomError("no inputs given (--input)")
    return inputs


def shard_inputs(inputs: list[Input], num_shards: int, shard_index: int) -> list[int]:
    """Indices of one shard's inputs: contiguous, balanced by byte midpoint, so shards concatenate to one run."""
    if not 0 <= shard_index < num_shards:
        raise TokenloomError(f"--shard-index {shard_index} must lie in [0, --num-shards {num_shards})")
    total = sum(max(i.size, 1) for i in inputs)
    chosen, start = [], 0
    for k, inp in enumerate(inputs):
        size = max(inp.size, 1)
        mid = start + size / 2
        if min(int(mid * num_shards / total), num_shards - 1) == shard_index:
            chosen.append(k)
        start += size
    return chosen


# --------------------------------------------------------------------------- byte streams


class TruncatedInput(Exception):
    """A compressed stream ended in the middle of a frame/member, or its data is corrupt."""


class _ZstdLines(io.RawIOBase):
    """Decompress a (multi-frame) zstd file, noticing truncation (``stream_reader`` takes it for EOF)."""

    def __init__(self, raw):
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._error = zstandard.ZstdError
        self._obj = self._dctx.decompressobj()
        self._fed = False  # the current frame has received input
        self._pending = b""
        self._eof = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._pending and not self._eof:
            data = self._raw.read(1 << 20)
            if not data:
                if self._fed and not self._obj.eof:
                    raise TruncatedInput("zstd stream ends in the middle of a frame")
                self._eof = True
                break
            out = []
            while data:
                self._fed = True
                try:
                    out.append(self._obj.decompress(data))
                except self._error as exc:
                    raise TruncatedInput(str(exc)) from None
                if self._obj.eof:
                    data = self._obj.unused_data
                    self._obj = self._dctx.decompressobj()
                    self._fed = False
                else:
                    data = b""
            self._pending = b"".join(out)
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _open_text_stream(inp: Input, raw):
    if inp.format.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if inp.format.endswith(".zst"):
        return io.BufferedReader(_ZstdLines(raw), buffer_size=1 << 20)
    return raw


def text_expansion(inp: Input, sample_bytes: int = 4 << 20) -> float:
    """Decompressed bytes per stored byte over an input's first ``sample_bytes`` (1.0 if plain)."""
    if not inp.compressed:
        return 1.0
    with objstore.reading(inp.path), objstore.open_input(inp.path) as raw:
        head = raw.read(sample_bytes)
    stream, text = _open_text_stream(inp, io.BytesIO(head)), 0
    try:
        while block := stream.read(1 << 16):  # small reads: little is lost where the prefix cuts a block
            text += len(block)
    except (TruncatedInput, EOFError, OSError):
        pass
    return text / max(len(head), 1)


# --------------------------------------------------------------------------- chunking


class ChunkReader:
    """Reads inputs from a position and yields chunks of about ``chunk_bytes`` text each."""

    def __init__(self, inputs: list[Input], keys: list[str], chunk_bytes: int = 1 << 20,
                 max_records: int = 4096, txt_unit: str = "file"):
        if txt_unit not in TXT_UNITS:
            raise TokenloomError(f"--txt-unit {txt_unit!r}: expected one of {', '.join(TXT_UNITS)}")
        self.inputs = inputs
        self.keys = keys
        self.chunk_bytes = chunk_bytes
        self.max_records = max_records
        self.txt_unit = txt_unit
        self._seq = 0

    def chunks(self, start: Position | None = None) -> Generator[Chunk, None, None]:
        start = start or Position()
        for k in range(start.input, len(self.inputs)):
            pos = start if k == start.input else Position(k, 0, 0)
            inp = self.inputs[k]
            with objstore.reading(inp.path):  # a network failure mid-object: one line naming it
                if inp.format == "jsonl" and not objstore.is_url(inp.path):
                    yield from self._span_chunks(k, pos)
                elif inp.format.startswith("jsonl"):
                    yield from self._json_chunks(k, pos)
                elif inp.format.startswith("txt"):
                    if self.txt_unit == "file":
                        yield from self._file_chunk(k, pos)
                    else:
                        yield from self._line_chunks(k, pos, self.txt_unit)
                else:
                    yield from self._columnar_chunks(k, pos)

    def _new_chunk(self, k: int, kind: str) -> Chunk:
        chunk = Chunk(self._seq, k, kind, [])
        if kind == "values":
            chunk.columns = {key: [] for key in self.keys}
        self._seq += 1
        return chunk

    # -- jsonl: raw line bytes, cut at record boundaries
    def _span_chunks(self, k: int, pos: Position) -> Iterator[Chunk]:
        """A local plain jsonl file as byte ranges of ~``chunk_bytes``, each cut past the first newline
        at its nominal end (a small window read): the main process counts no lines, which would be a
        serial pass over every byte. A read error keeps the lines before it."""
        inp = self.inputs[k]
        start, size = pos.offset or 0, inp.size  # bytes written since discovery are not read (refused at the end)
        with open(inp.path, "rb", buffering=0) as f:
            while start < size:
                try:
                    end = _line_end(f.fileno(), start + self.chunk_bytes, size)
                except OSError as exc:
                    chunk = self._new_chunk(k, "json")
                    chunk.relative = True
                    chunk.errors.append((1, _rest_skipped(inp, exc)))  # the line after the ranges before
                    chunk.end = Position(k + 1, 0, 0)
                    yield chunk
                    return
                chunk = self._new_chunk(k, "json")
                chunk.path, chunk.span, chunk.relative, chunk.raw_bytes = inp.path, (start, end), True, end - start
                chunk.end = Position(k + 1, 0, 0) if end >= size else Position(k, -1, end)  # records: LineNumbers
                yield chunk
                start = end

    def _json_chunks(self, k: int, pos: Position) -> Iterator[Chunk]:
        """The records of a jsonl input, a block at a time split by ``bytes.split`` (far cheaper per line
        in the main process than iterating the file, bench/RESULTS.md), with the line-by-line
        reading's numbers and positions; each block is one ``read1``, so a corrupt compressed input
        keeps every line decoded before the error, which names the next line."""
        inp = self.inputs[k]
        with _opened_at(inp, pos) as (raw, stream, number, offset):
            read = getattr(stream, "read1", stream.read)
            chunk, size, last_raw = self._new_chunk(k, "json"), 0, raw.tell()
            numbers, lines = chunk.numbers, chunk.lines
            skip_to, limit, max_records = pos.records, self.chunk_bytes, self.max_records
            carry: list[bytes] = []  # a line's start, until its newline is read
            while True:
                try:
                    block = read(_BLOCK)
                except (TruncatedInput, EOFError, OSError) as exc:
                    if _unreadable(inp, exc):
                        raise
                    chunk.errors.append((number + 1, _rest_skipped(inp, exc)))
                    break
                if block:
                    cut = block.rfind(b"\n") + 1
                    if not cut:
                        carry.append(block)
                        continue
                    found = (b"".join([*carry, block[:cut]]) if carry else block[:cut]).split(b"\n")
                    found.pop()  # the empty piece after the last newline
                    newline = 1
                    carry = [block[cut:]] if cut < len(block) else []
                elif carry:  # the last line, without its newline
                    found, carry, newline = [b"".join(carry)], [], 0
                else:
                    break
                for line in found:
                    number += 1
                    n = len(line) + newline
                    if offset is not None:
                        offset += n
                    if number <= skip_to or not line or line.isspace():  # done before a resume; blank: not a record
                        continue
                    numbers.append(number)
                    lines.append(line)
                    size += n
                    if size >= limit or len(numbers) >= max_records:
                        now = raw.tell() if offset is None else offset  # a block reads ahead of the cut
                        chunk.raw_bytes, last_raw = now - last_raw, now
                        chunk.end = Position(k, number, offset)
                        yield chunk
                        chunk, size = self._new_chunk(k, "json"), 0
                        numbers, lines = chunk.numbers, chunk.lines
            chunk.raw_bytes = (raw.tell() if offset is None else offset) - last_raw
            chunk.end = Position(k + 1, 0, 0)
            if len(chunk) or chunk.errors or chunk.raw_bytes:
                yield chunk

    # -- txt (line / paragraph): raw bytes, cut at record boundaries
    def _line_chunks(self, k: int, pos: Position, unit: str) -> Iterator[Chunk]:
        inp = self.inputs[k]
        with _opened_at(inp, pos) as (raw, stream, number, offset):
            chunk, size, last_raw = self._new_chunk(k, "values"), 0, raw.tell()
            records = self._records(stream, unit)
            while True:
                try:
                    item = next(records, None)
                except (TruncatedInput, EOFError, OSError) as exc:
                    if _unreadable(inp, exc):
                        raise
                    chunk.errors.append((number + 1, _rest_skipped(inp, exc)))
                    item = None
                if item is None:
                    break
                consumed, record = item
                first, number = number + 1, number + consumed
                nbytes = sum(map(len, record)) if isinstance(record, list) else len(record)
                if offset is not None:
                    offset += nbytes
                if number <= pos.records:  # compressed input on resume: skip what was done
                    continue
                if self._add(chunk, unit, first, record):
                    size += nbytes
                if size >= self.chunk_bytes or len(chunk) >= self.max_records:
                    now = raw.tell()
                    chunk.raw_bytes, last_raw = now - last_raw, now
                    chunk.end = Position(k, number, offset)
                    yield chunk
                    chunk, size = self._new_chunk(k, "values"), 0
            chunk.raw_bytes = raw.tell() - last_raw
            chunk.end = Position(k + 1, 0, 0)
            if len(chunk) or chunk.errors or chunk.raw_bytes:
                yield chunk

    @staticmethod
    def _records(stream, unit: str) -> Iterator[tuple[int, bytes | list[bytes]]]:
        """(physical lines consumed, record) pairs; a record's lines include their newlines."""
        if unit == "line":
            for line in stream:
                yield 1, line
            return
        block: list[bytes] = []
        for line in stream:
            if line in (b"\n", b"\r\n") and block:
                block.append(line)
                yield len(block), block
                block = []
            else:
                block.append(line)
        if block:
            yield len(block), block

    def _add(self, chunk: Chunk, unit: str, number: int, record) -> bool:
        """Add one record to the chunk; False for what is not a record (a blank block)."""
        if unit == "line":
            value = record[:-1] if record.endswith(b"\n") else record
        else:  # paragraph: the block's text, like text.split("\n\n") (blank separator line removed)
            ends_with_separator = len(record) > 1 and record[-1] in (b"\n", b"\r\n")
            value = b"".join(record[:-1] if ends_with_separator else record)
            if ends_with_separator and value.endswith(b"\n"):
                value = value[:-1]
            if not value.strip():
                return False
        chunk.numbers.append(number)
        chunk.columns[self.keys[0]].append(value)
        return True

    # -- txt, one document per file
    def _file_chunk(self, k: int, pos: Position) -> Iterator[Chunk]:
        if pos.records:
            return
        inp = self.inputs[k]
        chunk = self._new_chunk(k, "values")
        with objstore.open_input(inp.path) as raw:
            try:
                data = _open_text_stream(inp, raw).read()
            except (TruncatedInput, EOFError, OSError) as exc:
                if _unreadable(inp, exc):
                    raise
                chunk.errors.append((1, f"truncated or corrupt {inp.format} input ({exc})"))
                data = None
            chunk.raw_bytes = raw.tell()
        if data is not None:
            chunk.numbers.append(1)
            chunk.columns[self.keys[0]].append(data)
        chunk.end = Position(k + 1, 0, 0)
        yield chunk

    # -- parquet and HF datasets: record batches of the key columns
    def _columnar_chunks(self, k: int, pos: Position) -> Iterator[Chunk]:
        inp = self.inputs[k]
        number = 0
        chunk, size = self._new_chunk(k, "values"), 0
        for batch, raw_bytes in _arrow_batches(inp, self.keys):
            n = batch.num_rows
            if number + n <= pos.records:
                number += n
                continue
            lo = max(0, pos.records - number)
            cols = {key: batch.column(key).to_pylist()[lo:] for key in self.keys}
            # A chunk that ends inside the batch gets its rows' share of the batch's bytes (exact
            # integer shares, so the shares of a batch sum to its bytes however it is cut or resumed).
            counted = raw_bytes * lo // n if n else 0
            for j in range(n - lo):
                number_j = number + lo + j + 1
                chunk.numbers.append(number_j)
                for key in self.keys:
                    value = cols[key][j]
                    chunk.columns[key].append(value)
                    size += len(value) if isinstance(value, str) else 8
                if size >= self.chunk_bytes or len(chunk) >= self.max_records:
                    share = raw_bytes * (lo + j + 1) // n
                    chunk.raw_bytes += share - counted
                    counted = share
                    chunk.end = Position(k, number_j, None)
                    yield chunk
                    chunk, size = self._new_chunk(k, "values"), 0
            chunk.raw_bytes += raw_bytes - counted
            number += n
        chunk.end = Position(k + 1, 0, 0)
        if len(chunk) or chunk.raw_bytes:
            yield chunk


@contextlib.contextmanager
def _opened_at(inp: Input, pos: Position) -> Iterator[tuple[BinaryIO, BinaryIO, int, int | None]]:
    """``(raw file, text stream, lines consumed, byte offset)`` of an input opened at ``pos``: plain
    files seek; compressed ones restart (offset None) and the caller skips ``pos.records`` lines."""
    with objstore.open_input(inp.path) as raw:
        number, offset = 0, None if inp.compressed else 0
        if not inp.compressed and pos.offset:
            raw.seek(pos.offset)
            number, offset = pos.records, pos.offset
        yield raw, _open_text_stream(inp, raw), number, offset


def _rest_skipped(inp: Input, exc: BaseException) -> str:
    """The bad-record reason of an input that cannot be read past some line."""
    return f"truncated or corrupt {inp.format} input ({exc}); the rest of the file is skipped"


def _unreadable(inp: Input, exc: BaseException) -> bool:
    """An object store failed to deliver the bytes (raised as such), rather than the bytes being corrupt."""
    return objstore.is_url(inp.path) and isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile)


_BLOCK = 1 << 20


def json_records(chunk: Chunk) -> tuple[list[int], list, int]:
    """The (line numbers, raw lines as memoryviews) of a jsonl chunk's records, and its line count; a
    span chunk is read here, in the worker, numbered from 1 and checked against the main process's cut."""
    if chunk.span is None:
        return chunk.numbers, chunk.lines, 0
    start, end = chunk.span
    with open(chunk.path, "rb", buffering=0) as f:
        data = os.pread(f.fileno(), end - start, start)
    last = chunk.end.input != chunk.input  # the file's last range may end without a newline
    if len(data) != end - start or not (last or data.endswith(b"\n")):
        raise TokenloomError(f"{chunk.path}: changed while being read (bytes {start}-{end} no longer "
                             f"end a line where they did); rerun when it is complete")
    view, find, size = memoryview(data), data.find, len(data)
    numbers, kept, number, at = [], [], 0, 0
    while at < size:
        stop = find(b"\n", at)
        if stop < 0:
            stop = size
        number += 1
        # blank (not a record) only if it starts with whitespace: the full test is rarely run
        if stop > at and (data[at] not in _WHITESPACE or not data[at:stop].isspace()):
            numbers.append(number)
            kept.append(view[at:stop])
        at = stop + 1
    return numbers, kept, number


_WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")  # what ``bytes.isspace`` accepts


def _line_end(fd: int, target: int, size: int, window: int = 1 << 16) -> int:
    """The offset just past the first newline at or after ``target - 1``; ``size`` if none follows."""
    at = target - 1
    while at < size:
        block = os.pread(fd, min(window, size - at), at)  # bytes appended since discovery stay unread
        if not block:  # the file shrank: the range's reader reports it
            return size
        found = block.find(b"\n")
        if found >= 0:
            return at + found + 1
        at += len(block)
    return size


class LineNumbers:
    """The input's line numbers for chunks their worker numbered from 1: fed every chunk in input
    order, :meth:`place` returns the offset to add and sets ``chunk.end.records``; ``start``: the resume point."""

    def __init__(self, start: Position | None = None):
        start = start or Position()
        self._input, self._done = start.input, (start.records if start.offset else 0)

    def place(self, chunk: Chunk, lines: int) -> int:
        if chunk.input != self._input:
            self._input, self._done = chunk.input, 0
        if not chunk.relative:
            return 0
        base, self._done = self._done, self._done + lines
        if chunk.end.input == chunk.input:
            chunk.end = Position(chunk.input, self._done, chunk.end.offset)
        return base


def _arrow_batches(inp: Input, keys: list[str]):
    """(pyarrow RecordBatch, approximate raw bytes) for a parquet file or a datasets directory."""
    import pyarrow as pa  # lazy: start-up time, pyarrow loads only for parquet and datasets inputs
    import pyarrow.parquet as pq  # lazy: start-up time, pyarrow loads only for parquet and datasets inputs

    try:
        if inp.format == "parquet":
            # A local file by path (pyarrow's own reader); an object through its streaming file.
            handle = objstore.open_input(inp.path) if objstore.is_url(inp.path) else None
            try:
                pf = pq.ParquetFile(inp.path if handle is None else handle)
                missing = [k for k in keys if k not in pf.schema_arrow.names]
                if missing:
                    raise TokenloomError(f"{inp.path}: no column {missing[0]!r} "
                                         f"(columns: {', '.join(pf.schema_arrow.names)})")
                per_row = inp.size / max(1, pf.metadata.num_rows)
                for batch in pf.iter_batches(batch_size=1024, columns=keys):
                    yield batch, int(batch.num_rows * per_row)
            finally:
                if handle is not None:
                    handle.close()
            return
        state = json.loads((Path(inp.path) / "state.json").read_text())
        files = [Path(inp.path) / f["filename"] for f in state.get("_data_files", [])]
        total_rows = 0
        for path in files:
            with pa.memory_map(str(path)) as source:
                reader = pa.ipc.open_stream(source)
                missing = [k for k in keys if k not in reader.schema.names]
                if missing:
                    raise TokenloomError(f"{inp.path}: no column {missing[0]!r} (columns: {', '.join(reader.schema.names)})")
                size = path.stat().st_size
                batches = list(reader)
                rows = sum(b.num_rows for b in batches) or 1
                for batch in batches:
                    total_rows += batch.num_rows
                    yield batch.select(keys), int(size * batch.num_rows / rows)
    except (pa.ArrowException, OSError) as exc:  # a corrupt or truncated file: one line naming it
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TokenloomError(f"{inp.path}: not a readable {inp.format} input ({first})") from None
