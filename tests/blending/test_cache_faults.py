"""Faults while ``cli.py build`` writes its index cache (issue 19): a full disk, an I/O error and a
permission error end in one line naming the entry and what to do, leave no entry under its final
name that is not whole and no temporary folder, and the rerun builds the same bytes as a clean run.

The faults are raised inside the ``build`` subprocess where the kernel raises them (opening,
writing, fsyncing or renaming the entry's files; ``tests/fault_site/sitecustomize.py``).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from test_build import make_source
from tl_testing import fault_env, one_line_error, run_cli

from tokenloom.blending.sources import MEMO_FILE

KEY = "?" * 64  # a cache key: 64 hex digits


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("sources")
    return [make_source(d / "a", seed=1), make_source(d / "b", n_docs=500, seed=2)]


def _args(sources, cache: Path) -> list:
    return ["build", "--data", "0.4", sources[0], "0.6", sources[1], "--seq-length", 64, "--split", "90,8,2",
            "--num-samples", "3000,40,10", "--cache-dir", cache, "--json"]


def _entries(cache: Path) -> dict[str, dict[str, bytes]]:
    """Every folder under the cache directory: its files' bytes by name."""
    return {d.name: {f.name: f.read_bytes() for f in d.iterdir()} for d in cache.iterdir()
            if d.is_dir() and not d.name.startswith(".")}


@pytest.fixture(scope="module")
def reference(sources, tmp_path_factory):
    cache = tmp_path_factory.mktemp("ref") / "c"
    done = run_cli(*_args(sources, cache))
    assert done.returncode == 0, done.stderr
    keys = json.loads(done.stdout)["keys"]
    entries = _entries(cache)
    assert sorted(entries) == sorted(keys.values()) and len(entries) == 3
    return keys, entries


FAULTS = {
    "disk-full-writing": ("write", errno.ENOSPC, "*/shuffle_index.npy", 1000, "no space left on device writing",
                          "free space on that disk"),
    "disk-full-at-fsync": ("fsync", errno.ENOSPC, "*/meta.json", 0, "no space left on device writing",
                           "free space on that disk"),
    "disk-full-after-an-entry": ("write", errno.ENOSPC, "{valid}.tmp-*/meta.json", 10,
                                 "no space left on device writing", "free space on that disk"),
    "io-error-writing": ("write", errno.EIO, "*/sample_index.npy", 100, "I/O error on", "check it (dmesg)"),
    "io-error-publishing": ("rename", errno.EIO, KEY, 0, "I/O error on", "check it (dmesg)"),
    "permission-denied": ("open", errno.EACCES, "*/document_index.npy", 0, "permission denied on",
                          "give this user access"),
    "disk-full-recording-sources": ("write", errno.ENOSPC, MEMO_FILE, 0, "no space left on device writing",
                                    "free space on that disk"),
    "permission-denied-recording-sources": ("open", errno.EACCES, MEMO_FILE, 0, "permission denied on",
                                            "give this user access"),
    "permission-denied-locking": ("open", errno.EACCES, f"{KEY}.lock", 0, "permission denied on",
                                  "give this user access"),
    "too-many-open-files": ("open", errno.EMFILE, "*/sample_index.npy", 0, "too many open files at",
                            "raise the open-file limit (ulimit -n)"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_writing_an_entry_ends_in_one_line_and_the_rerun_builds_the_same_bytes(sources, reference, tmp_path,
                                                                                        fault):
    op, err, pattern, room, what, advice = FAULTS[fault]
    keys, ref_entries = reference
    cache = tmp_path / "c"
    pattern = pattern.format(valid=keys["valid"])
    done = run_cli(*_args(sources, cache), env=fault_env(op, err, f"{cache}/{pattern}", room))
    line = one_line_error(done, what, advice, "rerun the same command")
    assert done.returncode == 1
    assert any(f"{what} {cache / name}" in line for name in [*keys.values(), MEMO_FILE]), line  # names the file
    # Nothing half-written under a final name; temporary folders are gone.
    assert not list(cache.glob("*.tmp-*")), sorted(p.name for p in cache.iterdir())
    left = _entries(cache)
    assert len(left) < 3, "the fault stopped the build"
    assert keys["train"] in left or "{valid}" not in FAULTS[fault][2], "an entry built before the fault is kept"
    for key, files in left.items():
        assert files == ref_entries[key], f"entry {key} is not the whole entry"

    again = run_cli(*_args(sources, cache))
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert json.loads(again.stdout)["keys"] == keys
    assert _entries(cache) == ref_entries, "the rerun builds the same bytes as a clean run"
    assert not list(cache.glob("*.tmp-*"))
