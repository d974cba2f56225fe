"""``PREFIX.manifest.json``: what made a ``PREFIX.bin/.idx`` pair. This module owns that file.

Layout (JSON object, keys sorted)::

    format        "tokenloom.manifest/1"
    tool          {"name": "tokenloom", "version": ...}
    output        {"prefix": basename, "key": json key, "dtype": "uint16" | "int32"}
    inputs        [{"path", "format", "size", "blake3"}, ...] in processing order (manifests written
                  before 2026-11-26 have "sha256" there)
    tokenizer     the tokenizer fingerprint (kind, file digests, vocab size, special ids, digest)
    options       the preprocess options that shape the output
    counts        {"documents", "empty_documents", "sequences", "tokens", "bad_records", "bytes_in"}
    shards        present on merged outputs: the manifests' shard descriptions, in order

No timestamps or hostnames: the same run gives the same manifest. ``build``
refuses to blend sources whose tokenizer digests differ.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tokenloom import __version__, objstore
from tokenloom.errors import TokenloomError
from tokenloom.fsio import atomic_writer

FORMAT = "tokenloom.manifest/1"


SUFFIX = ".manifest.json"


def manifest_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}{SUFFIX}")


def manifest_url(prefix: str) -> str:
    """The manifest of an object-store prefix (``Path`` would fold the ``//`` of ``s3://``)."""
    return f"{prefix}{SUFFIX}"


def build(prefix: str, key: str, dtype: str, inputs: list[dict], tokenizer: dict, options: dict,
          counts: dict) -> dict:
    return {
        "format": FORMAT,
        "tool": {"name": "tokenloom", "version": __version__},
        "output": {"prefix": Path(prefix).name, "key": key, "dtype": dtype},
        "inputs": inputs,
        "tokenizer": tokenizer,
        "options": options,
        "counts": counts,
    }


def write(prefix: str | os.PathLike, manifest: dict, path: str | os.PathLike | None = None) -> None:
    """Write ``prefix``'s manifest atomically, to its final name or to ``path`` (staging)."""
    with atomic_writer(path or manifest_path(prefix), "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def read(prefix: str | os.PathLike) -> dict | None:
    """The manifest beside ``prefix`` (a URL's from the node's cache), or None (e.g. Megatron-made files)."""
    path: str | Path = manifest_path(prefix)
    if objstore.is_url(prefix):
        path = manifest_url(os.fspath(prefix))
        local = objstore.local_copy(path, missing_ok=True)
        if local is None:
            return None
        text = Path(local).read_text(encoding="utf-8")
    elif not Path(path).exists():
        return None
    else:
        text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenloomError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if data.get("format") != FORMAT:
        raise TokenloomError(f"{path}: unknown manifest format {data.get('format')!r} (expected {FORMAT})")
    return data


def merged(output_prefix: str, manifests: list[dict], counts: dict) -> dict:
    """The manifest of a merge of outputs that all had manifests (same tokenizer required)."""
    digests = {ids_key(m["tokenizer"]) for m in manifests}  # file names do not matter
    if len(digests) > 1:
        raise TokenloomError("cannot merge outputs made with different tokenizers "
                             f"(fingerprints {', '.join(sorted(d[:12] for d in digests))})")
    first = manifests[0]
    total: dict = {}
    for k, v in first["counts"].items():
        if isinstance(v, dict):  # per-name counts (removed documents per reason): summed per name
            names = sorted({n for m in manifests for n in m["counts"].get(k, {})})
            total[k] = {n: sum(m["counts"].get(k, {}).get(n, 0) for m in manifests) for n in names}
        else:
            total[k] = sum(m["counts"].get(k, 0) for m in manifests)
    total.update(counts)
    out = build(output_prefix, first["output"]["key"], first["output"]["dtype"],
                [i for m in manifests for i in m["inputs"]], first["tokenizer"],
                {k: v for k, v in first["options"].items() if k not in ("shard",)}, total)
    out["shards"] = [m["options"].get("shard") for m in manifests]
    return out


def tokenizer_name(fingerprint: dict) -> str:
    """A tokenizer as people know it, from its fingerprint: kind, files and vocabulary size."""
    files = ", ".join(sorted(fingerprint.get("files") or {})) or "no files"
    return f"{fingerprint.get('kind', '?')} ({files}; vocabulary {fingerprint.get('vocab_size', '?')})"


def ids_key(fingerprint: dict) -> str:
    """A digest of what decides the ids in a tokenizer fingerprint (kind, file contents without names,
    vocab size, special ids, options): equal keys, equal ids. Without ``files``: its ``digest``."""
    if "files" not in fingerprint:
        return str(fingerprint.get("digest"))
    core = {k: fingerprint.get(k) for k in ("kind", "vocab_size", "eod", "bos", "pad", "options")}
    core["files"] = sorted(fingerprint["files"].values())
    blob = json.dumps(core, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()
