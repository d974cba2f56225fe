"""Fixtures for tests/tokenizers; helpers live in tok_helpers.py."""

from pathlib import Path

import pytest
from tok_helpers import CORPORA, SHARED, read_jsonl


@pytest.fixture(scope="session")
def corpora() -> dict[str, list[str]]:
    if not all(p.is_file() for p in CORPORA.values()):
        pytest.skip(f"shared corpora not found under {SHARED} (set TOKENLOOM_SHARED_DATA)")
    return {name: read_jsonl(path) for name, path in CORPORA.items()}


@pytest.fixture
def wordpiece_vocab(tmp_path) -> Path:
    """A tiny BERT-style vocab.txt (lower-case)."""
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "##s", "a",
              ",", ".", "!", "h", "##e", "##l", "##o", "hello", "world"]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return path
