"""Helpers for preprocess tests: write corpora in every format, run preprocess, compare outputs.

A uniquely named module (not conftest) so ``import`` is unambiguous across test folders.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from tl_testing import REPO  # noqa: F401 - re-exported for the tests

from tokenloom.preprocess import PreprocessConfig, run


def write_jsonl(path: Path, docs: list[dict], compress: str | None = None) -> Path:
    data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()
    if compress == "gz":
        data = gzip.compress(data, mtime=0)
    elif compress == "zst":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def preprocess(tmp_path: Path, inputs, name="out", quiet=True, **kw) -> Path:
    kw.setdefault("tokenizer_type", "byte")
    kw.setdefault("workers", 1)
    cfg = PreprocessConfig(inputs=[str(i) for i in inputs], output_prefix=str(tmp_path / name), progress=False,
                           **kw)
    run(cfg, echo=(lambda *a, **k: None) if quiet else print)
    return tmp_path / name


def same_bytes(a: Path, b: Path) -> bool:
    return all(Path(f"{a}{ext}").read_bytes() == Path(f"{b}{ext}").read_bytes() for ext in (".bin", ".idx"))
