"""Object storage (``s3://bucket/key`` and other fsspec URLs) for preprocess inputs and outputs.

Local paths fall back to the plain file system (the local path is unchanged code); URLs go
through fsspec (``s3://`` needs the ``s3`` extra). Endpoint and credentials are botocore's
standard variables (``AWS_ENDPOINT_URL`` for MinIO and the like, ``AWS_ACCESS_KEY_ID``, ...).

* Reading streams ranged GETs with read-ahead (about two blocks per open object, nothing
  spooled); the input digest reads every object a second time.
* Writing is not streamed: an output is completed in a local staging directory (which must hold
  it all), then uploaded object by object (:func:`upload`), each PUT or multipart upload atomic.
* Failures become a :class:`StoreError`: one line naming the URL and what to check.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import hashlib
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from tokenloom.errors import TokenloomError
from tokenloom.fsio import hash_file, publish, temp_name

READ_BLOCK = 8 << 20
"""Bytes per ranged GET when reading an object (read-ahead keeps one more in memory)."""

UPLOAD_PART = 16 << 20
"""Bytes per part of a multipart upload (files under two parts go in one PUT)."""
UPLOAD_CONCURRENCY = 4
"""Parts uploaded at once: an upload holds up to ``UPLOAD_CONCURRENCY x UPLOAD_PART`` bytes in memory."""
S3_MAX_PARTS = 10_000


class StoreError(TokenloomError):
    """An object store could not be reached, or refused or lacked what was asked for."""


def is_url(path: str | os.PathLike) -> bool:
    """True for ``scheme://...`` paths other than ``file://`` (those are local)."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def _store_failures() -> tuple[type[BaseException], ...]:
    failures: tuple[type[BaseException], ...] = (OSError,)
    with contextlib.suppress(ImportError):
        from botocore.exceptions import (  # lazy: optional dependency, the [s3] extra
            BotoCoreError,
            ClientError,
        )

        failures += (BotoCoreError, ClientError)
    return failures


def _reason(exc: BaseException) -> str:
    name = type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        return "no such object or bucket"
    if isinstance(exc, PermissionError):
        return "access denied (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's policy)"
    if name == "NoCredentialsError":
        return "no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ClientConnectorError"):
        return f"cannot reach the object store ({str(exc).splitlines()[0]}; check AWS_ENDPOINT_URL)"
    first = str(exc).splitlines()[0] if str(exc) else name
    return f"{name}: {first}"


@contextlib.contextmanager
def store_errors(url: str, action: str) -> Iterator[None]:
    """Turn an object-store failure inside the block into one :class:`StoreError` line naming ``url``."""
    try:
        yield
    except TokenloomError:
        raise
    except _store_failures() as exc:
        raise StoreError(f"{url}: {action} failed: {_reason(exc)}") from None


def filesystem(url: str):
    """The fsspec file system of ``url`` and the path inside it."""
    import fsspec  # lazy: optional dependency, the [s3] extra

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError:
        scheme = url.split("://", 1)[0]
        raise TokenloomError(f"{url}: {scheme}:// paths need the object-storage extra "
                             f"(pip install 'tokenloom[{scheme}]')") from None


def expand(pattern: str) -> list[tuple[str, int, str]]:
    """``(url, size, version)`` of the objects a URL or URL glob names, sorted; version: ETag or mtime."""
    with store_errors(pattern, "lookup"):
        fs, path = filesystem(pattern)
        scheme = pattern.split("://", 1)[0]
        paths = sorted(fs.glob(path)) if any(c in path for c in "*?[") else [path]
        found = []
        for p in paths:
            info = fs.info(p)
            if info.get("type") == "directory":
                raise TokenloomError(f"{scheme}://{p}: a directory; object-store inputs must be files "
                                     "(use a glob like s3://bucket/dir/*.jsonl.zst)")
            version = info.get("ETag") or info.get("mtime") or info.get("LastModified") or ""
            found.append((f"{scheme}://{p}", int(info["size"]), str(version)))
    return found


def open_input(path: str | os.PathLike):
    """A binary file to read ``path``: the local file, or a streaming read of the object."""
    if not is_url(path):
        return open(path, "rb")
    url = os.fspath(path)
    with store_errors(url, "opening"):
        fs, inner = filesystem(url)
        return fs.open(inner, "rb", block_size=READ_BLOCK, cache_type="readahead")


@contextlib.contextmanager
def reading(path: str | os.PathLike) -> Iterator[None]:
    """Object-store failures while reading ``path`` become one line (no-op for local paths)."""
    if not is_url(path):
        yield
        return
    with store_errors(os.fspath(path), "reading"):
        yield


def check_output(url: str) -> None:
    """Fail before any work when an ``s3://`` output's bucket is missing or unreachable; a denied
    look is let through (write-only credentials), a denied upload then fails at the end."""
    if not url.startswith("s3://"):
        return
    with store_errors(url, "checking the output bucket"):
        fs, inner = filesystem(url)
        with contextlib.suppress(PermissionError):
            fs.call_s3("head_bucket", Bucket=inner.split("/", 1)[0])


def upload(local: str | os.PathLike, url: str) -> None:
    """Upload a complete local file to ``url`` as one atomic object (PUT, or one multipart upload)."""
    with store_errors(url, "upload"):
        fs, inner = filesystem(url)
        options = {}
        if url.startswith("s3://"):  # bounded memory: s3fs would read up to 10 parts of 50 MiB at once
            size = os.path.getsize(local)
            options = {"chunksize": max(UPLOAD_PART, -(-size // S3_MAX_PARTS)), "max_concurrency": UPLOAD_CONCURRENCY}
        fs.put_file(os.fspath(local), inner, **options)


def remove(url: str) -> None:
    """Delete the object at ``url`` if there is one."""
    with store_errors(url, "delete"):
        fs, inner = filesystem(url)
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(inner)


# ---- reading datasets in place: small objects fetched once per node; a .bin read by ranges

CACHE_ENV = "TOKENLOOM_CACHE"
"""Root of the node-local object cache, shared by a node's ranks (default ``$XDG_CACHE_HOME/tokenloom``)."""

BLOCK_ENV, CACHE_SIZE_ENV, READ_AHEAD_ENV = "TOKENLOOM_READ_BLOCK_MIB", "TOKENLOOM_READ_CACHE_MIB", \
    "TOKENLOOM_READ_AHEAD"
DEFAULT_BLOCK_MIB = 16
"""Bytes per ranged GET of a ``.bin``, in MiB (``TOKENLOOM_READ_BLOCK_MIB``)."""
DEFAULT_CACHE_MIB = 256
"""Block cache per process, shared by every object it reads, in MiB (``TOKENLOOM_READ_CACHE_MIB``): the memory bound."""
DEFAULT_READ_AHEAD = 2
"""Blocks fetched in the background past the one read (``TOKENLOOM_READ_AHEAD``; 0 turns it off)."""
RETRIES = 6
"""Retries of a transient failure (backoff doubling from ``RETRY_BACKOFF`` seconds); missing or denied is final."""
RETRY_BACKOFF = 0.05


_INHERITED: list = []


def _keep_inherited_filesystems() -> None:
    """In a forked child, keep the parent's cached s3fs file systems alive, unused: otherwise their
    finalizer closes the parent's connections from the child's loop, with noise on stderr."""
    s3fs = sys.modules.get("s3fs.core")
    if s3fs is not None:
        _INHERITED.extend(getattr(s3fs.S3FileSystem, "_cache", {}).values())


os.register_at_fork(after_in_child=_keep_inherited_filesystems)


def _env_int(name: str, default: int, minimum: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise TokenloomError(f"{name}={text!r}: expected an integer >= {minimum}")
    return value


def cache_root() -> str:
    """The node-local object cache folder (see :data:`CACHE_ENV`)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenloom")
    return os.path.join(root, "objects")


def stat(url: str) -> tuple[int, str]:
    """``(size, version)`` of the object at ``url`` (ETag, else mtime), asked afresh, with retries."""
    fs, inner = filesystem(url)
    info = _retrying(url, "lookup", lambda: fs.info(inner, refresh=True))
    if info.get("type") == "directory":
        raise StoreError(f"{url}: lookup failed: no such object (a folder)")
    version = info.get("ETag") or info.get("mtime") or info.get("LastModified") or ""
    return int(info["size"]), str(version)


LIST_AT = 8
"""Objects asked for in one folder from which :func:`stat_many` lists the folder instead of asking each."""


def stat_many(urls: list[str]) -> dict[str, tuple[int, str] | None]:
    """:func:`stat` of many objects, None for a missing one; :data:`LIST_AT` or more in one folder are
    answered by listing it (few requests, at the price of listing a large folder whole)."""
    folders: dict[str, list[str]] = collections.defaultdict(list)
    for url in dict.fromkeys(urls):
        folders[url.rsplit("/", 1)[0]].append(url)
    out: dict[str, tuple[int, str] | None] = {}
    for folder, members in folders.items():
        if len(members) < LIST_AT:
            for url in members:
                try:
                    out[url] = stat(url)
                except StoreError as exc:
                    if "no such object" not in str(exc):
                        raise
                    out[url] = None
            continue
        fs, inner = filesystem(folder)
        try:
            entries = _retrying(folder, "listing", functools.partial(fs.ls, inner, detail=True, refresh=True))
        except StoreError as exc:
            if "no such object" not in str(exc):
                raise
            entries = []
        found = {e["name"].rsplit("/", 1)[-1]: e for e in entries if e.get("type") != "directory"}
        for url in members:
            e = found.get(url.rsplit("/", 1)[-1])
            version = None if e is None else e.get("ETag") or e.get("mtime") or e.get("LastModified") or ""
            out[url] = None if e is None else (int(e["size"]), str(version))
    return out


def _transient(exc: BaseException) -> bool:
    """True unless retrying cannot help: a missing object, denied access, no credentials."""
    if isinstance(exc, (FileNotFoundError, PermissionError, TokenloomError)):
        return False
    return type(exc).__name__ not in ("NoCredentialsError", "PartialCredentialsError")


_JITTER = random.Random()
"""The retries' own generator: drawing from the global one would change a training run's saved RNG state."""


def _retrying(url: str, action: str, fn):
    """``fn()`` retried with doubling backoff on transient failures; the last one as a :class:`StoreError`."""
    for attempt in range(RETRIES + 1):
        try:
            with store_errors(url, action):
                try:
                    return fn()
                except _store_failures() as exc:
                    if attempt == RETRIES or not _transient(exc):
                        raise
        except StoreError:
            raise
        time.sleep(RETRY_BACKOFF * (2 ** attempt) * (1 + _JITTER.random()))
    raise AssertionError("unreachable")


def _plain_md5(version: str) -> str | None:
    """The MD5 an S3 ETag is for a single-part upload (None for a multipart one or another version)."""
    tag = version.strip('"')
    return tag if len(tag) == 32 and all(c in "0123456789abcdef" for c in tag) else None


def local_copy(url: str, *, missing_ok: bool = False) -> str | None:
    """A local path holding the object at ``url``, fetched once per node into :func:`cache_root`, keyed
    by size and ETag (content, not name). Streamed to a temporary file, size- and MD5-checked, fsynced
    and renamed under an exclusive ``flock`` (a node's ranks fetch once). ``missing_ok``: None if missing."""
    try:
        size, version = stat(url)
    except StoreError as exc:
        if missing_ok and "no such object" in str(exc):
            return None
        raise
    key = hashlib.sha256(f"{size}\0{version}".encode()).hexdigest()[:32]
    entry = os.path.join(cache_root(), key)
    path = os.path.join(entry, url.rstrip("/").rsplit("/", 1)[-1])
    if os.path.isfile(path) and os.path.getsize(path) == size:
        return path
    try:
        os.makedirs(entry, exist_ok=True)
        with open(os.path.join(entry, ".lock"), "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            if os.path.isfile(path) and os.path.getsize(path) == size:
                return path
            for stale in os.listdir(entry):  # left by a killed fetcher (the lock is ours)
                if ".tmp-" in stale:
                    os.unlink(os.path.join(entry, stale))
            fs, inner = filesystem(url)
            tmp = temp_name(path)
            _retrying(url, "fetching", lambda: fs.get_file(inner, tmp))  # streamed: an .idx may be large
            got, digest = os.path.getsize(tmp), hash_file(hashlib.md5(usedforsecurity=False), tmp).hexdigest()
            if got != size or _plain_md5(version) not in (None, digest):
                os.unlink(tmp)
                raise StoreError(f"{url}: fetching failed: got {got} bytes that do not match the object's "
                                 f"size {size} and ETag {version} (changed while read?); rerun")
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            publish(tmp, path)
    except OSError as exc:
        raise TokenloomError(f"{entry}: cannot write the object cache ({exc.strerror}); set {CACHE_ENV} to a "
                             "writable folder") from None
    return path


class BlockCache:
    """A thread-safe LRU of (URL, block) blocks, at most ``capacity`` bytes, shared by a process's readers."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._blocks: collections.OrderedDict[tuple[str, int], bytes] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> bytes | None:
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
            return data

    def __contains__(self, key: tuple[str, int]) -> bool:
        with self._lock:
            return key in self._blocks

    def put(self, key: tuple[str, int], data: bytes) -> None:
        with self._lock:
            old = self._blocks.pop(key, None)
            self.used += len(data) - (len(old) if old is not None else 0)
            self._blocks[key] = data
            while self.used > self.capacity and len(self._blocks) > 1:
                self.used -= len(self._blocks.popitem(last=False)[1])


_SHARED: list[tuple[int, BlockCache]] = []


def block_cache() -> BlockCache:
    """This process's shared :class:`BlockCache` (a forked child starts an empty one)."""
    if not _SHARED or _SHARED[0][0] != os.getpid():
        _SHARED[:] = [(os.getpid(), BlockCache(_env_int(CACHE_SIZE_ENV, DEFAULT_CACHE_MIB, 1) << 20))]
    return _SHARED[0][1]


class RangedReader:
    """Random access to an object's bytes by ranged GETs of whole blocks through a bounded LRU cache,
    reading ``read_ahead`` blocks ahead in the background. Memory: the shared :func:`block_cache` (or
    ``cache_bytes``) plus blocks in flight; a forked worker starts afresh. Trade-off: large blocks
    amortise GET latency, so shuffled reads over data far beyond the cache pay a block per miss."""

    def __init__(self, url: str, size: int, block: int | None = None, cache_bytes: int | None = None,
                 read_ahead: int | None = None):
        self.url, self.size = url, size
        self.block = block or _env_int(BLOCK_ENV, DEFAULT_BLOCK_MIB, 1) << 20
        self.cache_bytes = cache_bytes
        cache = cache_bytes if cache_bytes is not None else _env_int(CACHE_SIZE_ENV, DEFAULT_CACHE_MIB, 1) << 20
        ahead = read_ahead if read_ahead is not None else _env_int(READ_AHEAD_ENV, DEFAULT_READ_AHEAD, 0)
        self.read_ahead = min(ahead, max(1, cache // self.block) - 1)
        self._pid = -1

    def _fresh(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._fs, self._inner = filesystem(self.url)
            self._cache = block_cache() if self.cache_bytes is None else BlockCache(self.cache_bytes)
            self._pending: dict[int, Future] = {}
            self._lock = threading.Lock()
            self._pool = ThreadPoolExecutor(max(1, self.read_ahead), thread_name_prefix="tokenloom-read-ahead") \
                if self.read_ahead else None

    def _get(self, b: int) -> bytes:
        start, end = b * self.block, min(self.size, (b + 1) * self.block)

        def once() -> bytes:
            data = self._fs.cat_file(self._inner, start=start, end=end)
            if len(data) != end - start:
                raise ConnectionError(f"short read: {len(data)} of {end - start} bytes")
            return data

        return _retrying(self.url, f"reading bytes {start}-{end}", once)

    def _ahead(self, b: int) -> bytes:
        data = self._get(b)
        self._cache.put((self.url, b), data)
        return data

    def block_data(self, b: int) -> bytes:
        """Block ``b`` (bytes ``b * block`` up to the next block or the end)."""
        self._fresh()
        data = self._cache.get((self.url, b))
        with self._lock:
            for done in [k for k, f in self._pending.items() if f.done()]:
                del self._pending[done]  # stored by the thread (or failed: fetched again when needed)
            pending = None if data is not None else self._pending.get(b)
            if self._pool is not None:
                last = (self.size - 1) // self.block
                for ahead in range(b + 1, min(last, b + self.read_ahead) + 1):
                    if ahead not in self._pending and (self.url, ahead) not in self._cache:
                        self._pending[ahead] = self._pool.submit(self._ahead, ahead)
        if data is not None:
            return data
        try:
            data = pending.result() if pending is not None else self._get(b)
        except StoreError:
            if pending is None:
                raise
            data = self._get(b)  # a read-ahead that failed is retried by the reader that needs it
        self._cache.put((self.url, b), data)
        return data

    def read(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` bytes from ``offset`` (within the object)."""
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"{self.url}: bytes [{offset}, {offset + nbytes}) outside the object's {self.size}")
        parts, pos, end = [], offset, offset + nbytes
        while pos < end:
            b = pos // self.block
            data = self.block_data(b)
            take = data[pos - b * self.block: min(end, (b + 1) * self.block) - b * self.block]
            parts.append(take)
            pos += len(take)
        return parts[0] if len(parts) == 1 else b"".join(parts)
