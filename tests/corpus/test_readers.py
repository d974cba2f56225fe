"""``ChunkReader`` on jsonl: the records, numbers and resume positions of the block reader (compressed
or from object storage) and of the range chunks (local plain files) are those of plain line-by-line reading
(written out here as the reference): lines longer than a block, resume from every chunk end, damaged inputs."""

from __future__ import annotations

import gzip
import random

import pytest
import zstandard

from tokenloom.corpus import readers
from tokenloom.corpus.readers import (
    ChunkReader,
    LineNumbers,
    Position,
    TruncatedInput,
    discover,
    json_records,
)
from tokenloom.errors import TokenloomError


def _reference_chunks(inp, k, chunk_bytes, max_records):
    """(numbers, lines, end, errors) per chunk, reading the input a line at a time."""
    out, numbers, lines, size, number, offset = [], [], [], 0, 0, None if inp.compressed else 0
    errors = []
    with open(inp.path, "rb") as raw:
        stream = readers._open_text_stream(inp, raw)
        try:
            for line in stream:
                number += 1
                if offset is not None:
                    offset += len(line)
                if not line.strip():
                    continue
                numbers.append(number)
                lines.append(line.removesuffix(b"\n"))  # a record: its line without the newline
                size += len(line)
                if size >= chunk_bytes or len(numbers) >= max_records:
                    out.append((numbers, lines, Position(k, number, offset), []))
                    numbers, lines, size = [], [], 0
        except (TruncatedInput, EOFError, OSError) as exc:
            errors.append(number + 1)
            assert "truncated" in str(exc) or "zstd" in str(exc) or "gzip" in str(exc).lower() or exc
    out.append((numbers, lines, Position(k + 1, 0, 0), errors))
    return out


def _numbered(chunks, start=None):
    """(chunk, numbers, lines, errors) with the input's line numbers, as the pipeline places them
    (a range chunk's worker numbers its lines from 1; ``LineNumbers`` also sets ``chunk.end``)."""
    numbering = LineNumbers(start)
    for c in chunks:
        numbers, lines, read = json_records(c)
        base = numbering.place(c, read)
        yield c, [n + base for n in numbers], lines, [n + base for n, _ in c.errors]


def _ours(inputs, chunk_bytes, max_records, start=None):
    chunks = ChunkReader(inputs, ["text"], chunk_bytes, max_records).chunks(start)
    return _records_or_errors([(numbers, lines, c.end, errors) for c, numbers, lines, errors in _numbered(chunks, start)])


def _records_or_errors(chunks):
    """Chunks holding a record or an error (the reader may also end an input with an empty one)."""
    return [c for c in chunks if c[0] or c[3]]


def _corpus(seed: int) -> bytes:
    rng = random.Random(seed)
    parts = []
    for i in range(400):
        kind = rng.random()
        if kind < 0.1:
            parts.append(rng.choice([b"\n", b"   \n", b"\t\r\n", b"\r\n"]))  # blank: not a record
        elif kind < 0.15:
            parts.append(b'{"text": "' + b"x" * rng.randint(50, 300) + b'"}\r\n')  # longer than a block
        else:
            parts.append(b'{"text": "doc %d %s"}\n' % (i, "\u00e9".encode() * rng.randint(0, 9)))
    if seed % 2:
        parts.append(b'{"text": "last, no newline"}')
    return b"".join(parts)


@pytest.mark.parametrize("compression", ["", ".gz", ".zst"])
@pytest.mark.parametrize("seed", [0, 1])
def test_block_reading_equals_line_reading(tmp_path, monkeypatch, compression, seed):
    monkeypatch.setattr(readers, "_BLOCK", 37)  # many blocks, lines that span several
    data = _corpus(seed)
    path = tmp_path / f"c.jsonl{compression}"
    path.write_bytes({"": data, ".gz": gzip.compress(data),
                      ".zst": zstandard.ZstdCompressor().compress(data)}[compression])
    other = tmp_path / "first.jsonl"
    other.write_bytes(b'{"text": "a"}\n\n{"text": "b"}\n')
    inputs = discover([str(other), str(path)])
    want = [(k, n, line) for k in (0, 1) for n, line in
            zip(*[sum((c[i] for c in _reference_chunks(inputs[k], k, 1 << 20, 4096)), []) for i in (0, 1)],
                strict=True)]
    for chunk_bytes, max_records in ((1 << 20, 4096), (200, 4096), (1 << 20, 7), (1, 1)):
        chunks = list(ChunkReader(inputs, ["text"], chunk_bytes, max_records).chunks())
        assert [c.span is not None for c in chunks if c.input == 1] == [not compression] * sum(
            c.input == 1 for c in chunks)  # a local plain file: ranges the workers read
        got = [(c.input, n, line) for c, numbers, lines, _ in _numbered(chunks)
               for n, line in zip(numbers, lines, strict=True)]
        assert got == want
        for c in chunks[:-1]:  # resume from every chunk's end: exactly the records after it
            end = c.end
            tail = [r for r in want if r[0] > end.input or (r[0] == end.input and r[1] > end.records)]
            resumed = ChunkReader(inputs, ["text"], chunk_bytes, max_records).chunks(end)
            assert [(r.input, n, line) for r, numbers, lines, _ in _numbered(resumed, end)
                    for n, line in zip(numbers, lines, strict=True)] == tail
    if not compression:  # bytes consumed: exact for plain files, also from a resume point
        nine = sum(len(line) + 1 for line in data.split(b"\n")[:9])
        for start, skipped in ((None, 0), (Position(1, 9, nine), other.stat().st_size + nine)):
            chunks = ChunkReader(inputs, ["text"], 200, 4096).chunks(start)
            assert sum(c.raw_bytes for c in chunks) == other.stat().st_size + path.stat().st_size - skipped
    assert len(want) == 2 + sum(1 for line in data.split(b"\n") if line.strip())


@pytest.mark.parametrize("compression", [".gz", ".zst"])
def test_a_truncated_input_keeps_what_line_reading_keeps(tmp_path, compression):
    """At the real block size (several decompressor reads per block would lose decoded lines)."""
    data = "".join(f'{{"text": "document number {i}"}}\n' for i in range(200_000)).encode()
    packed = gzip.compress(data) if compression == ".gz" else zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"t.jsonl{compression}"
    path.write_bytes(packed[: len(packed) // 2])
    inputs = discover([str(path)])
    want = _records_or_errors(_reference_chunks(inputs[0], 0, 1 << 16, 4096))
    got = _ours(inputs, 1 << 16, 4096)
    assert got == want and got[-1][3] and 0 < sum(len(n) for n, *_ in got) < 200_000


def test_a_file_changed_under_the_reader_is_refused(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"".join(b'{"text": "doc %d"}\n' % i for i in range(100)))
    chunks = list(ChunkReader(discover([str(path)]), ["text"], 256).chunks())
    path.write_bytes(b'{"text": "inserted"}\n' + path.read_bytes())
    with pytest.raises(TokenloomError, match="changed while being read"):
        for c in chunks:
            json_records(c)
