"""Records -> validated texts (``decode_chunk``), and plain iteration over the documents of inputs.

``decode_chunk`` is the one validation of records (JSON, UTF-8, keys, string or list of
strings) that preprocess workers run before tokenizing. ``iter_documents`` is for stages
that need text, not tokens: ``tokenizer train`` reads its corpus through it, so it accepts
exactly the inputs ``preprocess`` accepts (same formats, same validation, same
``file:line`` errors). This module imports no tokenizer, so ``tokenloom.tokenizers`` can
import it without an import cycle between the two packages.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import orjson

from tokenloom.errors import TokenloomError
from tokenloom.preprocess.readers import Chunk, ChunkReader, LineNumbers, discover, json_records


def _snippet(raw) -> str:
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    return str(raw)[:200]


def _check_text(value, key: str, valid_utf8: bool = False) -> tuple[list[str] | None, str | None]:
    """The value's texts (one, or the sentences of a list), or the reason it is bad.

    ``valid_utf8``: the strings are known to encode (orjson builds none with an unpaired
    surrogate), so the check that encodes every non-ASCII text is skipped."""
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
"""How a record without a ``--json-keys`` key is reported (every record likely lacks it: no
point quarantining them)."""


def _parse_line(line: bytes, keys: tuple[str, ...]) -> tuple[dict | None, str | None, bool]:
    """The record's object, or why it is bad, and whether orjson read it (then its strings are
    valid UTF-8: orjson refuses unpaired surrogates).

    ``orjson`` parses (3-4x the stdlib's speed on text-heavy records; ~1 s of CPU saved per
    500 MB); its object is taken only when every key holds a string or a list of strings.
    Everything else -- what orjson refuses (NaN, lone surrogate escapes, invalid UTF-8, bad
    JSON) and what it reads differently (integers past 64 bits become floats) -- is parsed again
    by the stdlib, as Megatron's ``preprocess_data.py`` does, so a record is accepted, and a bad
    one described, exactly as before.
    """
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


def decode_chunk(chunk: Chunk, keys: tuple[str, ...]):
    """Validate a chunk's records: ``(good, bad, lines)`` with good = ``[(number, {key: [texts]})]``
    and bad = ``[(number, reason, snippet)]``, both in input order (reader errors included in
    ``bad``), and the lines a ``relative`` chunk held (its numbers count from 1: see
    :class:`~tokenloom.preprocess.readers.LineNumbers`)."""
    good, bad = [], [(n, reason, "") for n, reason in chunk.errors]
    numbers, lines, read = json_records(chunk) if chunk.kind == "json" else (chunk.numbers, None, 0)
    for j, number in enumerate(numbers):
        if lines is not None:
            obj, reason, valid_utf8 = _parse_line(lines[j], keys)
            raw = lines[j]
        else:
            obj, reason, valid_utf8 = {k: chunk.columns[k][j] for k in keys}, None, False
            raw = chunk.columns[keys[0]][j]
        texts_per_key = {}
        if obj is not None:
            for key in keys:
                texts, reason = _check_text(obj[key], key, valid_utf8)
                if reason:
                    break
                texts_per_key[key] = texts
        if reason:
            bad.append((number, reason, _snippet(raw)))
        else:
            good.append((number, texts_per_key))
    bad.sort(key=lambda b: b[0])
    return good, bad, read


def iter_documents(inputs: list[str], key: str = "text", txt_unit: str = "file") -> Iterator[str]:
    """Each document's text in input order (a list-of-sentences value is joined with newlines).

    The first bad record raises :class:`TokenloomError` naming its file and line.
    """
    found = discover(inputs)
    numbering = LineNumbers()
    for chunk in ChunkReader(found, [key], txt_unit=txt_unit).chunks():
        good, bad, read = decode_chunk(chunk, (key,))
        base = numbering.place(chunk, read)
        if bad:
            number, reason, _ = bad[0]
            raise TokenloomError(f"{found[chunk.input].path}:{number + base}: {reason}")
        for _, texts in good:
            yield "\n".join(texts[key])
