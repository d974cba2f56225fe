"""Split strings to sequence ranges (Megatron's rules, rounding artefacts included)."""

from __future__ import annotations

import pytest

from tokenloom.blending.split import Split, parse_split, split_documents, split_matrix
from tokenloom.errors import TokenloomError


def test_parse_and_matrix():
    assert parse_split("969,30,1") == [0.969, 0.03, 0.001]
    assert parse_split("969, 30, 1") == parse_split("969/30/1") == parse_split("969 30 1")
    assert parse_split("1") == [1.0, 0.0, 0.0]
    matrix = split_matrix("969,30,1")
    assert matrix[0][0] == 0 and type(matrix[0][0]) is int  # Megatron's integer leading edge
    assert [m[1] for m in matrix] == [0.969, 0.999, 1.0]
    assert split_matrix("90,5,5")[1] == (0.9, 0.9500000000000001)
    assert split_matrix("98,2,0")[2] is None
    assert split_matrix("0,1,0") == [None, (0.0, 1.0), None]


def test_documents_per_split():
    matrix = split_matrix("969,30,1")
    ranges = [split_documents(b, 2200) for b in matrix]
    assert [(int(r[0]), int(r[-1]) + 1) for r in ranges] == [(0, 2132), (2132, 2198), (2198, 2200)]
    assert all(r.dtype.name == "int32" for r in ranges)
    # round() halves to even: 0.5 * 5 = 2.5 -> 2
    assert len(split_documents((0, 0.5), 5)) == 2


@pytest.mark.parametrize("bad", ["", "0,0,0", "1,2,3,4", "1.2.3"])
def test_bad_split_strings(bad):
    with pytest.raises(TokenloomError, match="split"):
        parse_split(bad)


def test_split_names():
    assert [s.name for s in Split] == ["train", "valid", "test"]
