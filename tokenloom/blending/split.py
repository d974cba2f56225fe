"""Train/valid/test split strings to contiguous sequence ranges (Megatron-compatible).

``"969,30,1"`` -> weights ``[0.969, 0.03, 0.001]`` -> book-ends ``[0, 0.969, 0.999, 1.0]``
-> for N sequences, split i is ``arange(round(lo * N), round(hi * N))`` as int32.
Every run of ``[.0-9]`` is a number, so commas, spaces or slashes all separate;
rounding is Python's (halves to even) and float artefacts are kept on purpose
(``"90,5,5"`` gives ``(0.9, 0.9500000000000001)``): they decide document
boundaries and end up in Megatron's cache keys.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence

import numpy as np

from tokenloom.errors import TokenloomError

Bookend = tuple[float, float]
_INT32_MAX = 2**31 - 1


class Split(enum.IntEnum):
    """The three splits, in Megatron's order."""

    train = 0
    valid = 1
    test = 2


def normalize(weights: Sequence[float]) -> list[float]:
    """``w / sum(w)`` in float64, back to Python floats (Megatron's ``normalize``)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def parse_split(split: str) -> list[float]:
    """The normalised train/valid/test weights of a split string, padded with zeros."""
    try:
        values = [float(part) for part in re.findall(r"[.0-9]+", split)]
    except ValueError as exc:
        raise TokenloomError(
            f"split {split!r}: {exc}; expected up to three numbers such as '969,30,1'"
        ) from None
    if len(values) > len(Split):
        raise TokenloomError(
            f"split {split!r} has {len(values)} numbers; expected at most 3 (train, valid, test)"
        )
    values += [0.0] * (len(Split) - len(values))
    if sum(values) <= 0:
        raise TokenloomError(f"split {split!r} has no positive weight; expected e.g. '969,30,1'")
    return normalize(values)


def split_matrix(split: str) -> list[Bookend | None]:
    """Per split ``(lo, hi)`` fractions of the data, or None for an empty split.

    The first edge is the integer 0 (not 0.0), as in Megatron.
    """
    edges: list[float] = [0]
    for weight in parse_split(split):
        edges.append(edges[-1] + weight)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(edges[:-1], edges[1:], strict=True)]


def split_bounds(bookend: Bookend, num_sequences: int) -> tuple[int, int]:
    """``(first, end)`` sequence ids of one split of a dataset with ``num_sequences`` sequences."""
    beg = int(round(bookend[0] * float(num_sequences)))
    end = int(round(bookend[1] * float(num_sequences)))
    if end - 1 > _INT32_MAX:
        raise TokenloomError(
            f"{num_sequences} sequences: Megatron's int32 split indices cap a dataset at 2^31"
        )
    return beg, end


def split_documents(bookend: Bookend, num_sequences: int) -> np.ndarray:
    """The int32 sequence ids of one split of a dataset with ``num_sequences`` sequences."""
    return np.arange(*split_bounds(bookend, num_sequences), dtype=np.int32)
