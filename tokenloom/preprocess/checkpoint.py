"""The resume state of a preprocess run, kept in its ``OUTPUT.partial/`` folder.

``checkpoint.npz`` (:class:`Checkpoint`) holds the writers' index arrays and the run's JSON
state (input position, counters, rejects offset); ``staged.json`` (``STAGED_FORMAT``) marks
outputs completed and waiting to be published. Both carry the run's :func:`config_digest`
(inputs with their sizes and versions, tokenizer, the options that shape the output, shard):
a rerun with another digest starts afresh instead of resuming.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from tokenloom import objstore
from tokenloom.corpus.readers import Input
from tokenloom.fsio import atomic_writer
from tokenloom.indexed.format import IndexedDatasetWriter
from tokenloom.preprocess.config import PreprocessConfig

CHECKPOINT_FORMAT = "tokenloom.preprocess-checkpoint/1"
STAGED_FORMAT = "tokenloom.preprocess-staged/1"


def input_stats(inputs: list[Input]) -> list[tuple]:
    """(path, format, size, version) per input: an object's ETag, a local file's mtime."""
    return [(i.path, i.format, i.size, i.version if objstore.is_url(i.path) else os.stat(i.path).st_mtime_ns)
            for i in inputs]


def config_digest(cfg: PreprocessConfig, stats: list[tuple], tokenizer_fp: dict, shard) -> str:
    """What a resume must match: the inputs' :func:`input_stats`, the tokenizer digest, the options
    that shape the output (not those that only change speed or where the work runs) and the shard."""
    shape = {k: v for k, v in asdict(cfg).items()
             if k not in ("workers", "chunk_bytes", "checkpoint_interval", "encoder_memory_mb", "check_space",
                          "progress", "executor", "ray_address", "ray_retries", "staging_dir")}
    blob = json.dumps([stats, tokenizer_fp["digest"], shape, shard], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class Checkpoint:
    """One atomic ``checkpoint.npz`` in the partial directory: writer arrays + JSON state."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.path = directory / "checkpoint.npz"

    def save(self, state: dict, writers: dict[str, IndexedDatasetWriter], rejects) -> None:
        arrays = {}
        for n, writer in enumerate(writers.values()):
            for name, arr in writer.checkpoint().items():
                arrays[f"w{n}_{name}"] = arr
        if rejects is not None:
            rejects.flush()
            os.fsync(rejects.fileno())
            state["rejects_bytes"] = rejects.tell()
        arrays["state"] = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8)
        with atomic_writer(self.path) as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub lets a ** dict reach allow_pickle

    def load(self) -> tuple[dict, list[dict]] | None:
        if not self.path.exists():
            return None
        try:
            with np.load(self.path, allow_pickle=False) as data:
                state = json.loads(bytes(data["state"]).decode())
                writers = [{name: data[f"w{n}_{name}"] for name in ("lengths", "document_indices", "bin_bytes")}
                           for n in range(len(state["keys"]))]
        except (OSError, ValueError, KeyError) as exc:
            print(f"warning: ignoring unreadable checkpoint {self.path} ({exc})", file=sys.stderr)
            return None
        if state.get("format") != CHECKPOINT_FORMAT:
            return None
        return state, writers
