"""Fixtures for tests/tokenizers; helpers live in tok_helpers.py."""

from pathlib import Path

import pytest
import tok_helpers
from tok_helpers import CORPORA, SHARED, read_jsonl


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """The session's shared user cache (``tok_helpers.SESSION_CACHE``) for ``load_shared`` and ``session_cache``."""
    tok_helpers.SESSION_CACHE = tmp_path_factory.mktemp("session-user-cache")
    yield
    tok_helpers.SESSION_CACHE = None


@pytest.fixture
def shared_verdicts(monkeypatch):
    """``$TOKENLOOM_CACHE_DIR`` set to the session's shared user cache for the whole test (its
    subprocesses included): for a test whose subject is not the self-check, so a tokenizer the
    session has checked already is not checked again."""
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tok_helpers.SESSION_CACHE))


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
