"""Token sources of a blend: metadata read once and remembered, files opened only when read.

A blend of thousands of sources must start in about a second and must not hold a file
descriptor per source (two per ``IndexedDataset``: each memory map keeps its own in
Python < 3.13). So the build works from :class:`SourceMeta` records -- sequence and
document counts, the content digest that goes into cache keys and the tokenizer the
manifest names -- and a source's ``.idx``/``.bin`` are mapped only when its tokens or
sequence lengths are read, through a small pool of open datasets that closes the least
recently used one beyond ``soft RLIMIT_NOFILE / 8`` (at most 1024).

Records are computed once per file version and remembered in ``CACHE_DIR/sources.jsonl``
(one JSON line per version, appended; lines that do not parse are ignored, so a torn
append costs one recomputation, never a wrong digest). A version is the ``.idx``'s, ``.bin``'s and
manifest's (device, inode, size, mtime in ns): every tokenloom writer publishes by
rename, which gives a new inode, so a rewritten file never matches a stale record.
A warm start therefore costs three ``stat`` calls per source and one file read.

The largest token id of a source without a manifest (:attr:`SourceMeta.max_id`, what the
train preflight compares with the model's vocabulary) is the one field that reads the
``.bin``: a full pass, vectorised over the memory map in chunks of :data:`MAX_ID_CHUNK`
tokens, so memory stays bounded whatever the file's size. It is computed only when a caller
asks (``max_ids=True``), since a build never needs it and a pass over terabytes of tokens
is not free; the record is then appended again with it, and the later line wins.

A source may be an object-store prefix (``s3://...``): its version is then each object's size and
ETag (a listing per folder, or a HEAD each for a few: :func:`tokenloom.objstore.stat_many`), and the ``.idx`` and manifest are read from the node's cached copies.

The digest is BLAKE3 over the ``.idx`` bytes and the manifest (with their base names, which a
fetched copy keeps: a local and a remote copy of the same bytes get the same digest, so the
index cache built from one serves the other): the ``.idx`` fixes every
sequence length and document boundary, which is all an index depends on; the manifest
adds the tokenizer and inputs, so a re-tokenized source with equal lengths still gets a
new key. BLAKE3, not SHA-256: as strong a content address and faster per core.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import resource
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3
import numpy as np

from tokenloom import objstore
from tokenloom.blending.cache import write_error
from tokenloom.errors import TokenloomError
from tokenloom.fsio import hash_file
from tokenloom.indexed import IndexedDataset, manifest
from tokenloom.indexed.format import iter_token_chunks, read_header
from tokenloom.indexed.manifest import ids_key
from tokenloom.indexed.validate import check_pair

MEMO_FILE = "sources.jsonl"
MAX_ID_CHUNK = 1 << 24
"""Tokens per vectorised step of :func:`max_token_id` (64 MiB of int32): its memory bound."""


@dataclass(frozen=True)
class SourceMeta:
    """What a build needs to know about one ``.bin``/``.idx`` pair without opening it."""

    digest: str
    """BLAKE3 of the ``.idx`` bytes and the manifest (the source's part of every cache key)."""
    sequences: int
    """Number of sequences (Megatron's "documents" for splitting and indexing)."""
    documents: int
    """Number of documents in the ``.idx`` document index."""
    tokenizer: str | None
    """``ids_key`` of the manifest's tokenizer; None when the source has no manifest."""
    max_id: int | None = None
    """Largest token id in the ``.bin`` (-1 when it holds none); only for a source without a manifest
    (a manifest names the tokenizer instead), and None until asked for (``max_ids=True``)."""


_MEMO: dict[str, SourceMeta] = {}
_MEMO_LOCK = threading.Lock()


def clear_memo() -> None:
    """Forget the records remembered in this process (a benchmark's cold start)."""
    with _MEMO_LOCK:
        _MEMO.clear()


def _stamp(prefix: str, remote: dict[str, tuple[int, str] | None]) -> str:
    """The version of a source's files: (device, inode, size, mtime_ns) of ``.idx``, ``.bin`` and manifest;
    for an object-store prefix, each object's URL, size and ETag, from ``remote`` (:func:`tokenloom.objstore.stat_many`)."""
    parts = []
    if objstore.is_url(prefix):
        for path in (f"{prefix}.idx", f"{prefix}.bin", f"{prefix}.manifest.json"):
            found = remote[path]
            if found is None and not path.endswith(".manifest.json"):
                raise objstore.StoreError(f"{path}: lookup failed: no such object or bucket")
            parts.append("-" if found is None else "{}:{}:{}".format(path, *found))
        return "/".join(parts)
    for path in (f"{prefix}.idx", f"{prefix}.bin", f"{prefix}.manifest.json"):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if not path.endswith(".manifest.json"):
                raise TokenloomError(f"{path}: no such file") from None
            parts.append("-")
            continue
        parts.append(f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}")
    return "/".join(parts)


def _compute(prefix: str) -> SourceMeta:
    _, sequences, document_indices = read_header(f"{prefix}.idx")
    h = blake3.blake3()
    for name in (f"{prefix}.idx", f"{prefix}.manifest.json"):  # a fetched copy keeps its object's name
        local = objstore.local_copy(name, missing_ok=True) if objstore.is_url(name) else name
        if local is None or not Path(local).exists():
            continue
        path = Path(local)
        h.update(path.name.encode())
        hash_file(h, path)
    saved = manifest.read(prefix)
    check_pair(prefix, saved)
    tokenizer = ids_key(saved["tokenizer"]) if saved is not None else None
    return SourceMeta(h.hexdigest(), sequences, document_indices - 1, tokenizer)


def max_token_id(prefix: str) -> int:
    """The largest token id in ``PREFIX.bin`` (-1 if it holds no token), over the token stream
    the index describes, :data:`MAX_ID_CHUNK` tokens at a time (a pair whose sizes disagree
    raises the reader's error naming both)."""
    ds = IndexedDataset(prefix)
    try:
        return max((int(chunk.max()) for chunk in iter_token_chunks(ds, MAX_ID_CHUNK) if chunk.size), default=-1)
    finally:
        ds.close()


def _with_max_id(prefix: str, meta: SourceMeta) -> SourceMeta:
    return dataclasses.replace(meta, max_id=max_token_id(prefix))


def _read_memo(path: Path) -> dict[str, SourceMeta]:
    out: dict[str, SourceMeta] = {}
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return out
    try:  # one parse for the whole file (several times faster than line by line) ...
        records = json.loads("[" + ",".join(lines) + "]")
    except ValueError:  # ... unless a line is torn: then each line on its own
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # that version is recomputed
    for record in records:
        try:
            meta = SourceMeta(**record["meta"])
        except (KeyError, TypeError):
            continue
        if isinstance(meta.digest, str) and len(meta.digest) == 64:
            out[record["stamp"]] = meta
    return out


def source_metadata(prefixes: list[str], memo_dir: str | os.PathLike | None = None, *,
                    max_ids: bool = False) -> dict[str, SourceMeta]:
    """``{prefix: SourceMeta}``, computed once per file version (see the module docstring).

    Missing records are computed on a thread pool (hashing and numpy's reductions release
    the GIL) and appended to ``memo_dir/sources.jsonl`` in one write. ``max_ids`` also fills
    :attr:`SourceMeta.max_id` of every source without a manifest (one pass over its ``.bin``
    the first time).
    """
    remote = objstore.stat_many([f"{p}{suffix}" for p in prefixes if objstore.is_url(p)
                                 for suffix in (".idx", ".bin", ".manifest.json")])
    stamps = {p: _stamp(p, remote) for p in dict.fromkeys(prefixes)}

    def wanted(p: str) -> bool:
        meta = _MEMO.get(stamps[p])
        return meta is None or (max_ids and meta.tokenizer is None and meta.max_id is None)

    with _MEMO_LOCK:
        missing = [p for p in stamps if wanted(p)]
    memo_file = Path(memo_dir) / MEMO_FILE if memo_dir is not None else None
    if missing and memo_file is not None:
        on_disk = _read_memo(memo_file)
        with _MEMO_LOCK:
            _MEMO.update(on_disk)
            missing = [p for p in missing if wanted(p)]
    if missing:
        def compute(p: str) -> SourceMeta:
            meta = _MEMO.get(stamps[p]) or _compute(p)
            return _with_max_id(p, meta) if max_ids and meta.tokenizer is None else meta

        with ThreadPoolExecutor(max(1, min(len(missing), os.cpu_count() or 1))) as pool:
            computed = dict(zip(missing, pool.map(compute, missing), strict=True))
        with _MEMO_LOCK:
            _MEMO.update({stamps[p]: m for p, m in computed.items()})
        if memo_file is not None:
            lines = "".join(json.dumps({"stamp": stamps[p], "meta": asdict(m)}) + "\n" for p, m in computed.items())
            try:
                memo_file.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(memo_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, lines.encode())  # a short write leaves a torn line, which readers skip
                finally:
                    os.close(fd)
            except OSError as exc:
                raise TokenloomError(write_error(exc, memo_file)) from None
    with _MEMO_LOCK:
        return {p: _MEMO[s] for p, s in stamps.items()}


# --------------------------------------------------------------------------- lazily opened sources


class _OpenPool:
    """The open ``IndexedDataset`` of each recently read source, least recently used closed first.

    A closed dataset's maps (and their descriptors) go away once no array views them;
    samples are copied out, so only views in use at that moment keep one alive.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.open: collections.OrderedDict[str, IndexedDataset] = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, prefix: str):
        with self.lock:
            ds = self.open.get(prefix)
            if ds is not None:
                self.open.move_to_end(prefix)
                return ds
        ds = IndexedDataset(prefix)
        len(ds)  # open and validate now, outside the lock
        with self.lock:
            ds = self.open.setdefault(prefix, ds)
            self.open.move_to_end(prefix)
            while len(self.open) > self.capacity:
                self.open.popitem(last=False)[1].close()
        return ds


def _pool_capacity() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1024 if soft == resource.RLIM_INFINITY else max(4, min(1024, soft // 8))


_POOL = _OpenPool(_pool_capacity())


class LazySource:
    """A ``TokenSource`` over ``PREFIX.bin/.idx`` that opens the files on first read.

    ``len()`` comes from ``meta`` (or the ``.idx`` header when none is given), so building a
    blend's plan and cache keys opens nothing; ``sequence_lengths`` and ``get`` go through
    the process-wide pool of open datasets. Pickles by path, so DataLoader workers open
    their own files.
    """

    def __init__(self, prefix: str, meta: SourceMeta | None = None):
        self.path_prefix = prefix
        if meta is None:
            self._len = read_header(f"{prefix}.idx")[1]
        else:
            self._len = meta.sequences

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"LazySource({self.path_prefix!r})"

    @property
    def sequence_lengths(self) -> np.ndarray:
        return _POOL.get(self.path_prefix).sequence_lengths

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        return _POOL.get(self.path_prefix).get(idx, offset, length)
