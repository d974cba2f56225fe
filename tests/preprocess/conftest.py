"""Fixtures for preprocess tests (helpers are in preprocess_helpers)."""

import pytest


@pytest.fixture
def docs():
    texts = ["hello world", "", "second document\nwith two lines", "ünïcödé ✓ 日本語", "x" * 3000, " ", "last"]
    return [{"text": t, "id": i} for i, t in enumerate(texts)]
