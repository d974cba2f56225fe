"""bench/RESULTS.md's hand-written notes (the figures tokenloom's docstrings point to) survive
``bench/run_all.py``: its full regeneration writes back the block it reads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", BENCH / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_md_holds_the_notes_block_run_all_keeps():
    run_all = _run_all()
    text = (BENCH / "RESULTS.md").read_text()
    notes = run_all.kept_notes(text)
    assert notes.startswith(run_all.NOTES_BEGIN) and notes.endswith(run_all.NOTES_END)
    assert "### ddp_bench" in notes and "### kernels_bench" in notes


def test_kept_notes_is_empty_without_a_whole_block():
    run_all = _run_all()
    assert run_all.kept_notes("# Benchmark results\n\n## ddp_bench\n") == ""
    assert run_all.kept_notes(f"{run_all.NOTES_BEGIN}\n\n- no end marker\n") == ""
