"""What a tokenizing worker runs on a chunk's documents before tokenizing them.

:class:`CleanSpec` is small and picklable (it travels with every chunk); each process builds its
:class:`Cleaner` once. Per document the filters run first (the first refusal names the reason; no
tokenizing or keys), then a kept document gets its bucket keys. Both read the first
``--json-keys`` text (sentences joined by newlines); a removal drops the record from every key.
Filters before dedup, so a duplicate's kept twin always passed them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from tokenloom.clean.keys import DedupParams, document_keys, permutations
from tokenloom.corpus.documents import Decoded


@dataclass(frozen=True)
class CleanSpec:
    """Filters (by name, with ``NAME.FIELD`` overrides) and dedup (None: off) of a run."""

    filters: tuple[str, ...] = ()
    overrides: tuple[tuple[str, str], ...] = ()
    dedup: DedupParams | None = None

    @property
    def active(self) -> bool:
        return bool(self.filters) or self.dedup is not None


def build_filters(names, overrides: Mapping[str, object]):
    """The filters of ``names`` (:func:`tokenloom.clean.filters.build_filters`; ``ValueError`` names a bad one)."""
    import tokenloom.clean.filters as filters  # lazy: its word lists load only when --filters asks for them

    return filters.build_filters(names, overrides)


def filter_names() -> tuple[str, ...]:
    import tokenloom.clean.filters as filters  # lazy: its word lists load only when --filters asks for them

    return tuple(filters.FILTER_NAMES)


class Cleaner:
    def __init__(self, spec: CleanSpec):
        self.spec = spec
        self.filters = build_filters(list(spec.filters), dict(spec.overrides)) if spec.filters else []
        self.family = permutations(spec.dedup.minhash) if spec.dedup and spec.dedup.method == "minhash" else None


@dataclass
class CleanResult:
    """A chunk's kept record numbers, removed ``(number, reason index)`` rows, kept keys and which have keys."""

    numbers: np.ndarray
    removed: np.ndarray
    keys: np.ndarray
    has_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))


_CLEANERS: dict[CleanSpec, Cleaner] = {}


def cleaner(spec: CleanSpec) -> Cleaner:
    """This process's cleaner for ``spec`` (built on first use)."""
    if spec not in _CLEANERS:
        _CLEANERS.clear()
        _CLEANERS[spec] = Cleaner(spec)
    return _CLEANERS[spec]


def clean_decoded(decoded: Decoded, keys: tuple[str, ...], spec: CleanSpec) -> tuple[Decoded, CleanResult]:
    """Filter a chunk's valid records and key the rest; return the kept records and the result."""
    c = cleaner(spec)
    texts = ["\n".join(pieces) for pieces in decoded.documents(keys[0])]
    reasons = np.full(len(texts), -1, np.int64)
    for k, text in enumerate(texts):
        for i, f in enumerate(c.filters):
            if not f.keep(text):
                reasons[k] = i
                break
    numbers = np.asarray(decoded.numbers, np.int64)
    gone = reasons >= 0
    if gone.any():
        kept = Decoded([], {k: [] for k in keys}, {k: [] for k in keys}, decoded.bad, decoded.lines)
        per_key = {k: list(decoded.documents(k)) for k in keys}
        for j in np.flatnonzero(~gone).tolist():
            kept.add(decoded.numbers[j], {k: per_key[k][j] for k in keys})
        decoded = kept
        texts = [t for t, g in zip(texts, gone.tolist(), strict=True) if not g]
    removed = np.stack([numbers[gone], reasons[gone]], axis=1) if gone.any() else np.empty((0, 2), np.int64)
    if spec.dedup is None:
        bands = 0
        doc_keys, has = np.zeros((len(texts), bands, 2), np.uint64), np.zeros(len(texts), bool)
    else:
        doc_keys, has = document_keys(texts, spec.dedup, c.family)
    return decoded, CleanResult(numbers[~gone], removed, doc_keys, has)
