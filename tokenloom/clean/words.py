"""English word and sentence splits, and the character sets, that the quality filters share.

datatrove splits words with spaCy's rule-based English tokenizer (``spacy.blank("en")``, rules in
the wheel, no model) and sentences with its ``sentencizer``; this module calls spaCy the same way
(token texts stripped, whitespace-only dropped), since a copy of its rules could only drift.
Differences only where datatrove's result depends on more than the text: no text is too long
here, and a text holding ``IS_ALPHA`` gets spaCy's words as given (datatrove's first-time result).

spaCy is imported on first use. Its vocabulary grows with every new word; datatrove forgets per
text (``memory_zone``), here the pipeline is rebuilt past ``VOCAB_LIMIT`` (memory never changes a
split). The last few splits are cached so chained filters split a document once.
``PUNCTUATION`` and ``TERMINAL_PUNCTUATION`` are datatrove's sets as code point ranges (a test
holds them equal).
"""

from __future__ import annotations

import functools
from typing import Any

_PUNCTUATION_RANGES: tuple[tuple[int, int], ...] = (
    (0x0000, 0x0008), (0x000B, 0x001F), (0x0021, 0x002F), (0x003A, 0x0040), (0x005B, 0x0060),
    (0x007B, 0x009F), (0x00AB, 0x00AB), (0x00B4, 0x00B4), (0x00BB, 0x00BB), (0x2013, 0x2014),
    (0x2019, 0x2019), (0x201C, 0x201E), (0x2026, 0x2026), (0x2236, 0x2236), (0x2501, 0x2501),
    (0x25BA, 0x25BA), (0x3001, 0x3002), (0x3008, 0x300D), (0x3010, 0x3011), (0xFF01, 0xFF01),
    (0xFF05, 0xFF05), (0xFF08, 0xFF09), (0xFF0C, 0xFF0C), (0xFF0E, 0xFF0E), (0xFF11, 0xFF11),
    (0xFF1A, 0xFF1B), (0xFF1F, 0xFF1F), (0xFF5E, 0xFF5E),
)
_TERMINAL_RANGES: tuple[tuple[int, int], ...] = (
    (0x0021, 0x0021), (0x002E, 0x002E), (0x003F, 0x003F), (0x0589, 0x0589), (0x061D, 0x061F),
    (0x06D4, 0x06D4), (0x0700, 0x0702), (0x07F9, 0x07F9), (0x0837, 0x0837), (0x0839, 0x0839),
    (0x083D, 0x083E), (0x0964, 0x0965), (0x104A, 0x104B), (0x1362, 0x1362), (0x1367, 0x1368),
    (0x166E, 0x166E), (0x1735, 0x1736), (0x17D4, 0x17D6), (0x17D9, 0x17DA), (0x1803, 0x1803),
    (0x1809, 0x1809), (0x1944, 0x1945), (0x1AA8, 0x1AAB), (0x1B5A, 0x1B5B), (0x1B5E, 0x1B5F),
    (0x1B7D, 0x1B7E), (0x1C3B, 0x1C3C), (0x1C7E, 0x1C7F), (0x203C, 0x203D), (0x2047, 0x2049),
    (0x2E2E, 0x2E2E), (0x2E3C, 0x2E3C), (0x2E53, 0x2E54), (0x3002, 0x3002), (0xA4FF, 0xA4FF),
    (0xA60E, 0xA60F), (0xA6F3, 0xA6F3), (0xA6F7, 0xA6F7), (0xA876, 0xA877), (0xA8CE, 0xA8CF),
    (0xA92F, 0xA92F), (0xA9C8, 0xA9C9), (0xAA5D, 0xAA5F), (0xAAF0, 0xAAF1), (0xABEB, 0xABEB),
    (0xFE52, 0xFE52), (0xFE56, 0xFE57), (0xFF01, 0xFF01), (0xFF0E, 0xFF0E), (0xFF1F, 0xFF1F),
    (0xFF61, 0xFF61), (0x10A56, 0x10A57), (0x10F55, 0x10F59), (0x10F86, 0x10F89), (0x11047, 0x11048),
    (0x110BE, 0x110C1), (0x11141, 0x11143), (0x111C5, 0x111C6), (0x111CD, 0x111CD), (0x111DE, 0x111DF),
    (0x11238, 0x11239), (0x1123B, 0x1123C), (0x112A9, 0x112A9), (0x1144B, 0x1144C), (0x115C2, 0x115C3),
    (0x115C9, 0x115D7), (0x11641, 0x11642), (0x1173C, 0x1173E), (0x11944, 0x11944), (0x11946, 0x11946),
    (0x11A42, 0x11A43), (0x11A9B, 0x11A9C), (0x11C41, 0x11C42), (0x11EF7, 0x11EF8), (0x11F43, 0x11F44),
    (0x16A6E, 0x16A6F), (0x16AF5, 0x16AF5), (0x16B37, 0x16B38), (0x16B44, 0x16B44), (0x16E98, 0x16E98),
    (0x1BC9F, 0x1BC9F), (0x1DA88, 0x1DA88),
)


def _chars(ranges: tuple[tuple[int, int], ...]) -> str:
    return "".join(chr(c) for first, last in ranges for c in range(first, last + 1))


TERMINAL_PUNCTUATION: str = _chars(_TERMINAL_RANGES)
"""Characters that end a sentence (FineWeb's line-ending test), in code point order."""
PUNCTUATION: frozenset[str] = frozenset(_chars(_PUNCTUATION_RANGES) + TERMINAL_PUNCTUATION)
"""Characters a word made only of is a symbol, not a word (Gopher quality)."""

_CACHED_SPLITS = 8
VOCAB_LIMIT = 1 << 18
"""Distinct words the spaCy pipeline may remember before it is rebuilt (bounds its memory)."""


class _Pipeline:
    nlp: Any = None


def _english() -> Any:
    """spaCy's blank English pipeline with its sentencizer; a fresh one past ``VOCAB_LIMIT``."""
    nlp = _Pipeline.nlp
    if nlp is None or len(nlp.vocab) > VOCAB_LIMIT:
        import spacy  # lazy: start-up time; only a run that filters needs spaCy

        nlp = spacy.blank("en")
        nlp.add_pipe("sentencizer")
        nlp.max_length = 1 << 62  # a limit on text length that datatrove's word split lifts too
        _Pipeline.nlp = nlp
    return nlp


@functools.lru_cache(maxsize=_CACHED_SPLITS)
def split_words(text: str) -> tuple[str, ...]:
    """spaCy's English tokens of ``text``, stripped, whitespace-only ones dropped (``"Hi!"``: ``("Hi", "!")``)."""
    stripped = (token.text.strip() for token in _english().tokenizer(text))
    return tuple(word for word in stripped if word)


def split_sentences(text: str) -> list[str]:
    """``text`` cut at spaCy's sentence ends into pieces that join back to it (gaps go with the next)."""
    ends = [sentence.end_char for sentence in _english()(text).sents]
    starts = [0] + ends[:-1]
    return [text[a:b] for a, b in zip(starts, ends[:-1] + [len(text)], strict=True)] if ends else [text]


def count_sentences(text: str) -> int:
    """How many pieces :func:`split_sentences` cuts ``text`` into (at least one)."""
    return max(1, sum(1 for _ in _english()(text).sents))
