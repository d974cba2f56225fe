"""Records -> validated texts (``decode_chunk``), and plain iteration over the documents of inputs.

``decode_chunk`` is the one validation of records (JSON, UTF-8, keys, string or list of
strings); ``iter_documents`` gives ``tokenizer train`` exactly the inputs ``preprocess``
accepts, with the same ``file:line`` errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import orjson

from tokenloom.corpus.readers import Chunk, ChunkReader, LineNumbers, discover, json_records
from tokenloom.errors import TokenloomError


def _snippet(raw) -> str:
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    return str(raw)[:200]


def _check_text(value, key: str, valid_utf8: bool = False) -> tuple[list[str] | None, str | None]:
    """The value's texts (one, or a list's), or why it is bad; ``valid_utf8`` skips the encoding check."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            return None, f"invalid UTF-8 at byte {exc.start} of key {key!r}"
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        texts = value
    elif value is None:
        return None, f"key {key!r} is null, not a string"
    else:
        return None, f"key {key!r} is a {type(value).__name__}, not a string"
    for text in () if valid_utf8 else texts:
        if text.isascii():  # O(1), and no surrogate is ASCII
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return None, f"invalid UTF-8 in key {key!r} (unpaired surrogate at character {exc.start})"
    return texts, None


def _all_text(value) -> bool:
    return type(value) is str or (type(value) is list and all(type(v) is str for v in value))


MISSING_KEY = "missing key"
"""How a record without a ``--json-keys`` key is reported (likely every record: not quarantined)."""


def _parse_line(line: bytes, keys: tuple[str, ...]) -> tuple[dict | None, str | None, bool]:
    """The record's object or why it is bad, and whether orjson read it (its strings then valid UTF-8).
    orjson's object is taken only when every key holds text; anything else is parsed again by the
    stdlib, as Megatron's ``preprocess_data.py`` does, so acceptance and messages are the stdlib's."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        obj = None
    if type(obj) is dict and all(_all_text(obj.get(key)) for key in keys):
        return obj, None, True
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}", False
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg} at column {exc.colno})", False
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object", False
    for key in keys:
        if key not in obj:
            found = ", ".join(map(repr, obj)) or "none"
            return None, f"{MISSING_KEY} {key!r} (the record's keys: {found}; choose with --json-keys)", False
    return obj, None, False


@dataclass
class Decoded:
    """A chunk's valid records, flat per key (the tokenizer takes one list per key; per-record
    objects would cost more than the work): ``texts[key]`` every piece, ``pieces[key]`` each
    record's count; ``numbers``, ``bad`` ``[(number, reason, snippet)]``, and ``lines`` a relative
    chunk held (:class:`~tokenloom.corpus.readers.LineNumbers`)."""

    numbers: list[int]
    texts: dict[str, list[str]]
    pieces: dict[str, list[int]]
    bad: list[tuple[int, str, str]]
    lines: int = 0

    def add(self, number: int, texts_per_key: dict[str, list[str]]) -> None:
        self.numbers.append(number)
        for key, texts in texts_per_key.items():
            self.texts[key].extend(texts)
            self.pieces[key].append(len(texts))

    def documents(self, key: str) -> Iterator[list[str]]:
        """Each record's pieces of ``key``, in order."""
        texts, at = self.texts[key], 0
        for n in self.pieces[key]:
            yield texts[at:at + n]
            at += n


def decode_chunk(chunk: Chunk, keys: tuple[str, ...]) -> Decoded:
    """Validate a chunk's records (reader errors go to ``bad`` too), in input order; one key holding
    a string takes a fast path, anything else :func:`_parse_line` and :func:`_check_text`."""
    out = Decoded([], {k: [] for k in keys}, {k: [] for k in keys}, [(n, reason, "") for n, reason in chunk.errors])
    numbers, lines, out.lines = json_records(chunk) if chunk.kind == "json" else (chunk.numbers, None, 0)
    single = keys[0] if len(keys) == 1 else None
    if lines is not None and single is not None:
        add_number, add_text, add_count = out.numbers.append, out.texts[single].append, out.pieces[single].append
        loads, error = orjson.loads, orjson.JSONDecodeError
    for j, number in enumerate(numbers):
        if lines is not None:
            raw = lines[j]
            if single is not None:
                try:
                    obj = loads(raw)
                except error:
                    obj = None
                if type(obj) is dict and type(value := obj.get(single)) is str:
                    add_number(number)
                    add_text(value)
                    add_count(1)
                    continue
            raw = bytes(raw)  # a range chunk's line is a memoryview
            obj, reason, valid_utf8 = _parse_line(raw, keys)
        else:
            obj, reason, valid_utf8 = {k: chunk.columns[k][j] for k in keys}, None, False
            raw = chunk.columns[keys[0]][j]
        texts_per_key = {}
        if obj is not None:
            for key in keys:
                texts, reason = _check_text(obj[key], key, valid_utf8)
                if texts is None:  # exactly when there is a reason
                    break
                texts_per_key[key] = texts
        if reason:
            out.bad.append((number, reason, _snippet(raw)))
        else:
            out.add(number, texts_per_key)
    out.bad.sort(key=lambda b: b[0])
    return out


def iter_documents(inputs: list[str], key: str = "text", txt_unit: str = "file") -> Iterator[str]:
    """Each document's text in input order; the first bad record raises, naming its file and line."""
    found = discover(inputs)
    numbering = LineNumbers()
    for chunk in ChunkReader(found, [key], txt_unit=txt_unit).chunks():
        decoded = decode_chunk(chunk, (key,))
        base = numbering.place(chunk, decoded.lines)
        if decoded.bad:
            number, reason, _ = decoded.bad[0]
            raise TokenloomError(f"{found[chunk.input].path}:{number + base}: {reason}")
        for texts in decoded.documents(key):
            yield "\n".join(texts)
