"""The embedded default job behind ``tokenloom demo``: runs on any machine, downloads nothing.

Its corpus is the Python standard library that every Python install has: each
module's source is one document. The demo writes that corpus as JSONL, trains a
small byte-level BPE tokenizer on it, preprocesses it to Megatron ``.bin/.idx`` with
all cores, then inspects and verifies the result.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tokenloom.indexed import inspect, verify
from tokenloom.indexed.tools import format_report
from tokenloom.preprocess import PreprocessConfig
from tokenloom.preprocess import run as preprocess
from tokenloom.tokenizers import TrainTokenizerConfig, load_tokenizer, train_tokenizer

EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}


@dataclass(kw_only=True)
class DemoConfig:
    output_dir: str = "demo-out"
    """Directory for the corpus, token files and reports."""
    max_documents: int = 400
    """Stdlib modules to use (sorted by path, so every run on one Python version sees the same corpus)."""
    vocab_size: int = 4096
    """Vocabulary of the BPE tokenizer the demo trains."""


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
    tok_dir = train_tokenizer(TrainTokenizerConfig(inputs=[str(corpus)], output=str(out / "tokenizer"),
                                                   kind="bpe", vocab_size=cfg.vocab_size))
    tok = load_tokenizer(tok_dir)
    echo(f"trained a byte-level BPE tokenizer ({tok.vocab_size} ids, eod={tok.eod}) -> {tok_dir}")
    prefix = out / "tokens" / "stdlib"
    preprocess(PreprocessConfig(inputs=[str(corpus)], output_prefix=str(prefix), tokenizer=str(tok_dir),
                                append_eod=True, progress=False), echo=echo)
    report = inspect(prefix)
    echo(format_report(report))
    checked = verify(prefix, vocab_size=tok.vocab_size, eod=tok.eod)
    echo(f"verified: {checked['sequences']} sequences, {checked['tokens']} tokens; "
         f"checks: {', '.join(checked['checked'])}")
    return report
