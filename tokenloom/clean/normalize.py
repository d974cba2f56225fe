"""The text a comparison sees: exact dedup's normal form and MinHash's simplified words.

* :func:`exact_form`: NFC, whitespace runs as one space, ends stripped: a re-wrapped or
  decomposed copy is a copy, a change of case or punctuation is not.
* :func:`shingle_words`: datatrove's ``simplify_text`` defaults (which agreement relies on):
  lowercase, digit runs as ``0``, punctuation as space, NFD without combining marks, split on
  whitespace (spaCy also splits a few contractions, ``cannot``: only those shingles differ).

Punctuation is Unicode P* and S* plus non-whitespace control characters: a rule, a superset of
datatrove's hand list, so a few rare shingles (dingbats, symbols) differ from datatrove's.
"""

from __future__ import annotations

import re
import unicodedata

import regex

_NUMBERS = regex.compile(r"\p{Nd}+([.,،٫⎖⎗⎘]\p{Nd}+)?")
_PUNCTUATION = regex.compile(r"[\p{P}\p{S}\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f]+")
_MARKS = regex.compile(r"\p{Mn}+")
_SPACE = re.compile(r"\s+")


def exact_form(text: str) -> str:
    """NFC with whitespace runs collapsed to one space and the ends stripped (see the module)."""
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
    return " ".join(text.split())


def shingle_words(text: str) -> list[str]:
    """The simplified words of ``text`` (lowercase, numbers as ``0``, no punctuation or accents)."""
    text = _PUNCTUATION.sub(" ", _NUMBERS.sub("0", text.lower()))
    if not text.isascii():
        text = _MARKS.sub("", unicodedata.normalize("NFD", text))
    return text.split()
