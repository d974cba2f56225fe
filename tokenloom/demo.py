"""The embedded default job behind ``tokenloom demo``: runs on any machine, downloads nothing.

Its corpus is the Python standard library that every Python install has: each
module's source is one document. The demo writes that corpus as JSONL, tokenizes it
to Megatron ``.bin/.idx``, then inspects and verifies the result.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenloom.indexed import IndexedDatasetWriter, inspect, verify

EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}


@dataclass(kw_only=True)
class DemoConfig:
    output_dir: str = "demo-out"
    """Directory for the corpus, token files and reports."""
    max_documents: int = 400
    """Stdlib modules to use (sorted by path, so every run on one Python version sees the same corpus)."""


def stdlib_documents(max_documents: int) -> list[dict]:
    """Sorted stdlib ``.py`` sources as ``{"text", "path"}`` records (UTF-8 decodable ones only)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    docs = []
    for path in sorted(files):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append({"text": text, "path": str(path.relative_to(root))})
        if len(docs) >= max_documents:
            break
    return docs


def write_corpus(path: Path, docs: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    return path


def run(cfg: DemoConfig, echo=print) -> dict:
    out = Path(cfg.output_dir)
    docs = stdlib_documents(cfg.max_documents)
    corpus = write_corpus(out / "corpus" / "stdlib.jsonl", docs)
    echo(f"corpus: {len(docs)} Python stdlib modules -> {corpus}")
    prefix = out / "tokens" / "stdlib_bytes"
    eod = 256
    with IndexedDatasetWriter(prefix, vocab_size=257) as writer:
        for doc in docs:
            ids = np.frombuffer(doc["text"].encode("utf-8"), dtype=np.uint8)
            writer.add_document(np.append(ids.astype(np.uint16), eod) if ids.size else ids)
    echo(f"tokenized (byte-level, eod={eod}) -> {prefix}.bin/.idx")
    report = inspect(prefix)
    echo(json.dumps(report, indent=2))
    checked = verify(prefix, vocab_size=257, eod=eod)
    echo(f"verified: {checked['sequences']} sequences, {checked['tokens']} tokens; "
         f"checks: {', '.join(checked['checked'])}")
    return report
