"""Document quality filters: Gopher quality, Gopher repetition, C4 and FineWeb's rules.

Each filter decides keep or remove exactly as datatrove's filter of the same name on the same
text and thresholds (rules, order, comparisons, float ratios; words and sentences from the same
spaCy English rules); the tests compare every decision. English only. Thresholds are one
dataclass per filter, datatrove's defaults, field docs as ``--help``; 0 (Gopher) or -1 (C4's
counts) switches a rule off.

C4 also removes lines, by default as C4 and datatrove do: :meth:`Filter.clean` returns the text
to keep or None (others return the text unchanged); ``c4.remove_lines=false`` only decides.
Removed lines are not listed; removed documents are, by the caller. Where datatrove would raise
``ZeroDivisionError`` (a Gopher ratio over no words or lines), the document is removed.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tokenloom.clean.words import (
    PUNCTUATION,
    TERMINAL_PUNCTUATION,
    count_sentences,
    split_sentences,
    split_words,
)
from tokenloom.errors import TokenloomError


class FilterConfigError(TokenloomError, ValueError):
    """An unknown filter name, an unknown field, or a value its field cannot take."""


class Filter(Protocol):
    """One quality filter: ``keep`` decides; ``clean`` also returns the text to keep (or None)."""

    name: str

    def keep(self, text: str) -> bool: ...

    def clean(self, text: str) -> str | None: ...


# --------------------------------------------------------------------------- Gopher quality


class DocumentRule:
    """A whole-document filter: :meth:`reason` decides, ``keep`` and ``clean`` follow (text unchanged)."""

    def reason(self, text: str) -> str | None:
        raise NotImplementedError

    def keep(self, text: str) -> bool:
        return self.reason(text) is None

    def clean(self, text: str) -> str | None:
        return text if self.keep(text) else None


@dataclasses.dataclass(frozen=True)
class GopherQualityConfig:
    """Gopher's quality rules (Rae et al. 2021, appendix A), counted over non-symbol words."""

    min_doc_words: int = 50
    """Remove a document with fewer words than this (words of punctuation only do not count; 0: off)."""
    max_doc_words: int = 100000
    """Remove a document with more words than this (words of punctuation only do not count; 0: off)."""
    min_avg_word_length: float = 3
    """Remove a document whose mean word length, in characters, is below this (0: off)."""
    max_avg_word_length: float = 10
    """Remove a document whose mean word length, in characters, is above this (0: off)."""
    max_symbol_word_ratio: float = 0.1
    """Remove a document with more '#', or more ellipses ('...' or '…'), per word than this (0: off)."""
    max_bullet_lines_ratio: float = 0.9
    """Remove a document with more than this fraction of lines starting with '•' or '-' (0: off)."""
    max_ellipsis_lines_ratio: float = 0.3
    """Remove a document with more than this fraction of lines ending in '...' or '…' (0: off)."""
    max_non_alpha_words_ratio: float = 0.8
    """Remove a document where fewer than this fraction of words hold a letter (datatrove's name; 0: off)."""
    min_stop_words: int = 2
    """Remove a document with fewer distinct stop words than this (case-sensitive; 0: off)."""
    stop_words: tuple[str, ...] = ("the", "be", "to", "of", "and", "that", "have", "with")
    """The stop words min_stop_words counts (comma-separated)."""


class GopherQuality(DocumentRule):
    """Gopher's quality rules, as datatrove's ``GopherQualityFilter``."""

    name = "gopher_quality"

    def __init__(self, config: GopherQualityConfig = GopherQualityConfig()) -> None:
        self.config = config
        self._stop_words = frozenset(config.stop_words)

    def reason(self, text: str) -> str | None:
        """Why the document is removed (datatrove's reason name), or None to keep it."""
        c = self.config
        words = split_words(text)
        n_words = len(words)
        lengths = [len(w) for w in words if not all(ch in PUNCTUATION for ch in w)]
        if c.min_doc_words and len(lengths) < c.min_doc_words:
            return "gopher_short_doc"
        if c.max_doc_words and len(lengths) > c.max_doc_words:
            return "gopher_long_doc"
        if lengths:  # datatrove's mean of no words is NaN, which no comparison rejects
            mean = sum(lengths) / len(lengths)
            if c.min_avg_word_length and mean < c.min_avg_word_length:
                return "gopher_below_avg_threshold"
            if c.max_avg_word_length and mean > c.max_avg_word_length:
                return "gopher_above_avg_threshold"
        if c.max_symbol_word_ratio and (not n_words or text.count("#") / n_words > c.max_symbol_word_ratio):
            return "gopher_too_many_hashes"
        if c.max_symbol_word_ratio and (text.count("...") + text.count("…")) / n_words > c.max_symbol_word_ratio:
            return "gopher_too_many_ellipsis"
        lines = text.splitlines()
        bullets = sum(line.lstrip().startswith(("•", "-")) for line in lines)
        if c.max_bullet_lines_ratio and (not lines or bullets / len(lines) > c.max_bullet_lines_ratio):
            return "gopher_too_many_bullets"
        ellipses = sum(line.rstrip().endswith(("...", "…")) for line in lines)
        if c.max_ellipsis_lines_ratio and (not lines or ellipses / len(lines) > c.max_ellipsis_lines_ratio):
            return "gopher_too_many_end_ellipsis"
        alpha = sum(any(ch.isalpha() for ch in w) for w in words)
        if c.max_non_alpha_words_ratio and (not n_words or alpha / n_words < c.max_non_alpha_words_ratio):
            return "gopher_below_alpha_threshold"
        if c.min_stop_words and len(self._stop_words.intersection(words)) < c.min_stop_words:
            return "gopher_enough_stop_words"
        return None



# --------------------------------------------------------------------------- Gopher repetition


@dataclasses.dataclass(frozen=True)
class GopherRepetitionConfig:
    """Gopher's repetition rules (Rae et al. 2021, table A1); fractions of the text's characters."""

    dup_line_frac: float = 0.3
    """Remove a document with more than this fraction of its lines repeating an earlier line (0: off)."""
    dup_para_frac: float = 0.3
    """Remove a document with more than this fraction of its paragraphs repeating an earlier one (0: off)."""
    dup_line_char_frac: float = 0.2
    """Remove a document whose repeated lines hold more than this fraction of its characters (0: off)."""
    dup_para_char_frac: float = 0.2
    """Remove a document whose repeated paragraphs hold more than this fraction of its characters (0: off)."""
    top_n_grams: tuple[tuple[int, float], ...] = ((2, 0.2), (3, 0.18), (4, 0.16))
    """N:FRACTION pairs: remove a document whose top word n-gram, times its count, exceeds FRACTION of the text."""
    dup_n_grams: tuple[tuple[int, float], ...] = ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11),
                                                  (10, 0.10))
    """N:FRACTION pairs: remove a document whose repeated word n-grams (not overlapping) exceed FRACTION of it."""


def _repeats(items: Sequence[str]) -> tuple[int, int]:
    """How many of ``items`` repeat an earlier one, and their characters."""
    seen: set[str] = set()
    count = chars = 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


def _n_grams(words: Sequence[str], n: int, sep: str) -> list[str]:
    return list(map(sep.join, zip(*(words[i:] for i in range(n)), strict=False)))


def _top_n_gram_chars(grams: list[str]) -> int:
    """Length times count of the most frequent n-gram; of equally frequent ones, the first seen."""
    counts = Counter(grams)
    top = max(counts.values())
    first = next(g for g, k in counts.items() if k == top)  # insertion order: first seen
    return len(first) * top


def _repeated_n_gram_chars(words: Sequence[str], n: int) -> int:
    """Characters of the n-grams (joined without separator) repeating an earlier one, jumping past each repeat."""
    grams = _n_grams(words, n, "")
    seen: set[str] = set()
    chars = i = 0
    while i < len(grams):
        gram = grams[i]
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


_PARAGRAPH_BREAK = re.compile(r"\n{2,}")
_LINE_BREAK = re.compile(r"\n+")


class GopherRepetition(DocumentRule):
    """Gopher's repetition rules, as datatrove's ``GopherRepetitionFilter``."""

    name = "gopher_repetition"

    def __init__(self, config: GopherRepetitionConfig = GopherRepetitionConfig()) -> None:
        self.config = config

    def reason(self, text: str) -> str | None:
        """Why the document is removed (datatrove's reason name), or None to keep it."""
        c = self.config
        if not text:
            return "empty"
        paragraphs = _PARAGRAPH_BREAK.split(text.strip())
        count, chars = _repeats(paragraphs)
        if c.dup_para_frac and count / len(paragraphs) > c.dup_para_frac:
            return "dup_para_frac"
        if c.dup_para_char_frac and chars / len(text) > c.dup_para_char_frac:
            return "dup_para_char_frac"
        lines = _LINE_BREAK.split(text)
        count, chars = _repeats(lines)
        if c.dup_line_frac and count / len(lines) > c.dup_line_frac:
            return "dup_line_frac"
        if c.dup_line_char_frac and chars / len(text) > c.dup_line_char_frac:
            return "dup_line_char_frac"
        words = split_words(text)
        for n, frac in c.top_n_grams:
            grams = _n_grams(words, n, " ")
            if grams and _top_n_gram_chars(grams) / len(text) > frac:
                return f"top_{n}_gram"
        for n, frac in c.dup_n_grams:
            if _repeated_n_gram_chars(words, n) / len(text) > frac:
                return f"duplicated_{n}_n_grams"
        return None



# --------------------------------------------------------------------------- C4


@dataclasses.dataclass(frozen=True)
class C4Config:
    """C4's rules (Raffel et al. 2020) as datatrove's, without the bad-words list."""

    remove_lines: bool = True
    """Write only the kept lines (as C4 and datatrove); false keeps the text unchanged and only decides."""
    split_paragraph: bool = True
    """Judge the text line by line (C4); false: sentence by sentence (each kept one counting as one)."""
    remove_citations: bool = True
    """Delete Wikipedia citation marks ('[1]', '[edit]', '[citation needed]') from each line."""
    filter_no_terminal_punct: bool = True
    """Remove lines that do not end in '.', '?', '!', '"' or "'", or that end in '...'."""
    min_num_sentences: int = 5
    """Remove a document whose kept lines hold fewer sentences than this (-1: off)."""
    min_words_per_line: int = 3
    """Remove lines with fewer whitespace-separated words than this."""
    max_word_length: int = 1000
    """Remove lines holding a word longer than this many characters (-1: off)."""
    filter_lorem_ipsum: bool = True
    """Remove a document with a kept line holding 'lorem ipsum' (any case)."""
    filter_javascript: bool = True
    """Remove lines mentioning 'javascript' (any case)."""
    filter_curly_bracket: bool = True
    """Remove a document with a kept line holding '{'."""
    filter_policy: bool = True
    """Remove lines holding 'terms of use', 'privacy policy' or a cookie notice (any case)."""


_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_END_PUNCTUATION = (".", "?", "!", '"', "'")
_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


class C4:
    """C4's line and document rules, as datatrove's ``C4QualityFilter`` (its text and its decision)."""

    name = "c4"

    def __init__(self, config: C4Config = C4Config()) -> None:
        self.config = config

    def judge(self, text: str) -> tuple[str | None, str | None]:
        """``(kept text, None)``, or ``(None, reason)`` with datatrove's reason name."""
        c = self.config
        pieces = text.splitlines() if c.split_paragraph else split_sentences(text)
        sentences = 0
        kept = []
        for piece in pieces:
            line = piece.strip()
            words = line.split()
            if c.max_word_length != -1 and any(len(w) > c.max_word_length for w in words):
                continue
            if c.remove_citations:
                line = _CITATION.sub("", line)
            if c.filter_no_terminal_punct and (not line.endswith(_END_PUNCTUATION) or line.endswith("...")):
                continue
            if len(words) < c.min_words_per_line:
                continue
            lower = line.lower()
            if c.filter_lorem_ipsum and "lorem ipsum" in lower:
                return None, "lorem_ipsum"
            if c.filter_javascript and "javascript" in lower:
                continue
            if c.filter_curly_bracket and "{" in line:
                return None, "curly_bracket"
            if c.filter_policy and any(p in lower for p in _POLICY):
                continue
            if c.min_num_sentences != -1:
                sentences += count_sentences(line) if c.split_paragraph else 1
            kept.append(line)
        if sentences < c.min_num_sentences:
            return None, "too_few_sentences"
        return ("\n" if c.split_paragraph else " ").join(kept).strip(), None

    def reason(self, text: str) -> str | None:
        """Why the document is removed (datatrove's reason name), or None to keep it."""
        return self.judge(text)[1]

    def keep(self, text: str) -> bool:
        return self.reason(text) is None

    def clean(self, text: str) -> str | None:
        kept, _ = self.judge(text)
        if kept is None:
            return None
        return kept if self.config.remove_lines else text


# --------------------------------------------------------------------------- FineWeb


@dataclasses.dataclass(frozen=True)
class FineWebConfig:
    """FineWeb's own rules (Penedo et al. 2024), over the non-blank lines of a document."""

    line_punct_thr: float = 0.12
    """Remove a document where fewer than this fraction of lines end in one of stop_chars."""
    line_punct_exclude_zero: bool = False
    """Keep a document none of whose lines end in one of stop_chars (line_punct_thr then judges only the rest)."""
    stop_chars: str = TERMINAL_PUNCTUATION
    """The characters that end a line for line_punct_thr, as one string (default: datatrove's sentence terminals)."""
    short_line_thr: float = 0.67
    """Remove a document where more than this fraction of lines have at most short_line_length characters."""
    short_line_length: int = 30
    """The length, in characters, up to which a line is short."""
    char_duplicates_ratio: float = 0.01
    """Remove a document whose repeated lines hold more than this fraction of its characters (no newlines)."""
    new_line_ratio: float = 0.3
    """Remove a document with more than this many newlines per word."""


class FineWeb(DocumentRule):
    """FineWeb's quality rules, as datatrove's ``FineWebQualityFilter``."""

    name = "fineweb"

    def __init__(self, config: FineWebConfig = FineWebConfig()) -> None:
        self.config = config
        self._stop_chars = tuple(config.stop_chars)

    def reason(self, text: str) -> str | None:
        """Why the document is removed (datatrove's reason name), or None to keep it."""
        c = self.config
        lines = [line for line in text.split("\n") if line.strip()]
        if not lines:
            return "empty"
        ratio = sum(line.endswith(self._stop_chars) for line in lines) / len(lines)
        if ratio < c.line_punct_thr and not (ratio == 0 and c.line_punct_exclude_zero):
            return "line_punct_ratio"
        if sum(len(line) <= c.short_line_length for line in lines) / len(lines) > c.short_line_thr:
            return "short_line_ratio"
        if _repeats(lines)[1] / len(text.replace("\n", "")) > c.char_duplicates_ratio:
            return "char_dup_ratio"
        words = split_words(text)  # not empty: a non-blank line holds a word
        if text.count("\n") / len(words) > c.new_line_ratio:
            return "list_ratio"
        return None



# --------------------------------------------------------------------------- registry

_REGISTRY: dict[str, tuple[type, type]] = {
    GopherQuality.name: (GopherQuality, GopherQualityConfig),
    GopherRepetition.name: (GopherRepetition, GopherRepetitionConfig),
    C4.name: (C4, C4Config),
    FineWeb.name: (FineWeb, FineWebConfig),
}
FILTER_NAMES: tuple[str, ...] = tuple(_REGISTRY)
"""The filter names :func:`build_filters` knows."""


def config_class(name: str) -> type:
    """The thresholds dataclass of filter ``name`` (for ``--help`` and ``config show``)."""
    if name not in _REGISTRY:
        raise FilterConfigError(f"unknown filter {name!r} (known: {', '.join(FILTER_NAMES)})")
    return _REGISTRY[name][1]


def build_filters(names: Sequence[str], overrides: Mapping[str, object] = {}) -> list[Filter]:
    """The filters ``names`` in order with ``{"NAME.FIELD": value}`` overrides, a value of its field's
    type or a string (``"0.2"``, ``"true"``, ``"the,of,and"``, ``"2:0.2,3:0.18"``). An unknown or
    unchosen filter, unknown field or bad value raises :class:`FilterConfigError` naming it."""
    for name in names:
        config_class(name)
        if list(names).count(name) > 1:
            raise FilterConfigError(f"filter {name!r} named twice")
    fields: dict[str, dict[str, object]] = {name: {} for name in names}
    for key, value in overrides.items():
        name, dot, field = key.partition(".")
        if not dot or not field:
            raise FilterConfigError(f"filter override {key!r}: expected NAME.FIELD")
        cls = config_class(name)
        if name not in fields:
            raise FilterConfigError(f"filter override {key!r}: filter {name!r} is not among those chosen "
                                    f"({', '.join(names) or 'none'})")
        hints = typing.get_type_hints(cls)
        if field not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            raise FilterConfigError(f"filter override {key!r}: {name} has no field {field!r} (known: {known})")
        fields[name][field] = _convert(hints[field], value, key)
    out: list[Filter] = []
    for name in names:
        filter_cls, cls = _REGISTRY[name]
        out.append(filter_cls(cls(**fields[name])))
    return out


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _convert(hint: Any, value: object, key: str) -> object:
    """``value`` as type ``hint`` (bool, int, float, str, a tuple of str, a tuple of (int, float))."""
    def bad(expected: str) -> FilterConfigError:
        return FilterConfigError(f"filter override {key}={value!r}: expected {expected}")

    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise bad("true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise bad("an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise bad("a number")
    if hint is str:
        if isinstance(value, str) and value:
            return value
        raise bad("a non-empty string")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and args == (str, Ellipsis):
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, (list, tuple)) and all(isinstance(v, str) and v.strip() for v in items):
            return tuple(v.strip() for v in items)
        raise bad("comma-separated words")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and typing.get_origin(args[0]) is tuple:
        pairs = [p.split(":") for p in value.split(",")] if isinstance(value, str) else value
        try:
            out = tuple((_convert(int, str(n).strip(), key), _convert(float, str(f).strip(), key))
                        for n, f in typing.cast(Sequence[Sequence[object]], pairs))
        except (TypeError, ValueError):
            raise bad("N:FRACTION pairs, comma-separated (2:0.2,3:0.18)") from None
        if any(typing.cast(int, n) < 1 for n, _ in out):
            raise bad("n-gram sizes of at least 1")
        return out
    raise AssertionError(f"no conversion for {hint!r}")
