"""Test helpers for tests/tokenizers (a uniquely named module: several test dirs have a conftest.py)."""

import json
import os
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("TOKENLOOM_SHARED_DATA", Path(__file__).resolve().parents[2].parent / "shared" / "data"))
TOK = SHARED / "tokenizers"
CORPORA = {
    "tinyshakespeare": SHARED / "tinyshakespeare" / "tinyshakespeare.jsonl",
    "wikitext-2": SHARED / "wikitext-2" / "wikitext-2.jsonl",
}

needs_shared = pytest.mark.skipif(
    not TOK.is_dir(), reason=f"shared data not found at {SHARED} (set TOKENLOOM_SHARED_DATA)"
)


def read_jsonl(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


_LOADED = {}


def load_shared(path: str, **options):
    """load_tokenizer(TOK / path, **options), cached for the session (tokenizers are stateless)."""
    from tokenloom.tokenizers import load_tokenizer

    key = (path, tuple(sorted(options.items())))
    if key not in _LOADED:
        _LOADED[key] = load_tokenizer(TOK / path, **options)
    return _LOADED[key]
