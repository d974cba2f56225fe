"""Interop tests compare against megatron-core 0.16.1 (the ``[interop]`` extra) and skip without it."""

import warnings

import pytest


def import_megatron(module: str):
    """Import a megatron.core module quietly, or skip the test with the reason."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(module, reason="megatron-core not installed (pip install -e '.[interop]')")
