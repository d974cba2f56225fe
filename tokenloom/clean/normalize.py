"""The text a comparison sees: exact dedup's normal form and MinHash's simplified words.

* :func:`exact_form`: Unicode NFC, then every run of whitespace (``str.split``'s: spaces, tabs,
  newlines, the Unicode spaces) made one space, leading and trailing whitespace dropped. Two
  documents are exact duplicates when these forms are equal: a copy re-wrapped, re-indented or
  stored decomposed (``e`` + combining accent) is a copy; a change of case or punctuation is not.
* :func:`shingle_words`: the words MinHash shingles are made of, following datatrove's
  ``simplify_text`` defaults (its MinHash's normalisation, which the agreement with it relies on):
  lowercase; every run of digits in any script, with one decimal part, becomes ``0``;
  punctuation becomes a space; whitespace is collapsed; the text is NFD-decomposed and its
  combining marks (category Mn) dropped. Words are then split on whitespace, where datatrove's
  English word tokenizer (spaCy) also splits a few contractions (``cannot``): the shingles differ
  only for documents holding those.

Punctuation here is every character of the Unicode categories P* and S* plus the C0/C1 control
characters other than whitespace: a rule, not datatrove's hand list. It holds every character of
that list that the steps before do not take (whitespace, digits), and more: the quotes the list
lacks (``‘``), dingbats, math and currency symbols, so a few rare shingles differ from datatrove's.
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
