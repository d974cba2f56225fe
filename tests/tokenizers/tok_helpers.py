"""Test helpers for tests/tokenizers (a uniquely named module: several test dirs have a conftest.py)."""

import contextlib
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


SESSION_CACHE: Path | None = None
"""A user cache (``$TOKENLOOM_CACHE_DIR``) for the whole test session, set by conftest.py: the
self-check verdicts (and GPT-2's gigatoken rank file) of :func:`load_shared`'s tokenizers, each
computed by the first load of the same files in this session. None outside pytest (a test's own
subprocess): then the process's own ``$TOKENLOOM_CACHE_DIR``."""


@contextlib.contextmanager
def session_cache():
    """``$TOKENLOOM_CACHE_DIR`` set to :data:`SESSION_CACHE` inside the block (unchanged where it is None).

    For loads whose subject is not the self-check or its cache: a test about those loads with
    its own cache (tests/conftest.py gives each test one), so its verdict is computed there."""
    if SESSION_CACHE is None:
        yield
        return
    before = os.environ.get("TOKENLOOM_CACHE_DIR")
    os.environ["TOKENLOOM_CACHE_DIR"] = str(SESSION_CACHE)
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENLOOM_CACHE_DIR"]
        else:
            os.environ["TOKENLOOM_CACHE_DIR"] = before


def seed_verdicts(cache_dir: Path) -> None:
    """Copy the session's self-check verdicts (not its other cached files) into the user cache
    ``cache_dir``: for a test that needs a cache of its own but whose subject is not the check."""
    import shutil

    if SESSION_CACHE is not None and (SESSION_CACHE / "tokenizer-checks").is_dir():
        shutil.copytree(SESSION_CACHE / "tokenizer-checks", cache_dir / "tokenizer-checks", dirs_exist_ok=True)


_LOADED = {}


def load_shared(path: str, **options):
    """load_tokenizer(TOK / path, **options), cached for the session (tokenizers are stateless).

    ``num_threads=1`` is the ``single_threaded()`` copy of the tokenizer loaded without it (what
    forked preprocess workers use; test_tok_load.py proves it encodes the same), so the files are
    read and checked once. The loads share :func:`session_cache`'s verdicts."""
    from tokenloom.tokenizers import load_tokenizer

    key = (path, tuple(sorted(options.items())))
    if key not in _LOADED:
        if options.get("num_threads") == 1:
            _LOADED[key] = load_shared(path, **{k: v for k, v in options.items() if k != "num_threads"}).single_threaded()
        else:
            with session_cache():
                _LOADED[key] = load_tokenizer(TOK / path, **options)
    return _LOADED[key]
