"""Object storage (``s3://bucket/key`` and other fsspec URLs) for preprocess inputs and outputs.

Local paths never come here: every helper that takes a path falls back to the
plain file system, so the local fast path is the same code as before. URLs go
through fsspec (``s3://`` needs the ``s3`` extra, s3fs). The endpoint and the
credentials come from the standard variables, read by botocore itself:
``AWS_ENDPOINT_URL`` (an S3-compatible server such as MinIO), ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` (and ``AWS_DEFAULT_REGION``, profiles, ...).

Policy and its costs:

* Reading streams: an object is read front to back through ranged GETs of
  ``READ_BLOCK`` bytes with read-ahead, so memory stays at about two blocks per open
  object and nothing is spooled to disk; a resume that seeks (plain files) costs one
  new ranged GET. The input digest (sha256 in the manifest) reads every object a
  second time over the network.
* Writing is not streamed: an object-store output is completed in a local staging
  directory (its resume state too), then uploaded one object at a time
  (:func:`upload`; multipart above ``2 x UPLOAD_PART``, memory bounded by
  ``UPLOAD_CONCURRENCY x UPLOAD_PART``). A PUT, and a multipart upload (completed
  or aborted as one), is atomic per object: a failed upload leaves no object under
  its key. The staging directory must hold the whole output.
* Failures (unreachable endpoint, missing bucket or object, denied access, missing
  credentials) become a :class:`StoreError`: one line naming the URL and what to check.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from tokenloom.errors import TokenloomError

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
    """Fail early, before any work, when the bucket of an ``s3://`` output is missing or unreachable.

    Write permission cannot be checked without writing, and credentials may be allowed to
    write but not to look at the bucket: a denied look is let through, and a denied upload
    fails at the end (nothing is then under the final keys, and the rerun uploads).
    """
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
