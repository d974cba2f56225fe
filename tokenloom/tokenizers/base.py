"""The one tokenizer interface every backend implements, and the picklable spec.

A :class:`Tokenizer` is built from a :class:`TokenizerSpec` (kind + file path +
options). The spec is what crosses process boundaries: preprocess workers each
call ``load_tokenizer(spec)`` instead of pickling a live backend object (Rust and
C++ handles do not pickle, and rebuilding is cheap next to a run, Qwen2's 151k merges
being the slowest of the shared tokenizers). Pickling a Tokenizer pickles
just its spec, so a tokenizer can also be passed to a worker directly.

Fingerprint policy: ``fingerprint()["digest"]`` is a sha256 over the kind, the
sha256 of every file read (keyed by file *name*, never by absolute path), the
vocab size, the eod/bos/pad ids and the options that can change ids. Options that
only change speed (``num_threads``, ``fast``), the engine actually used and the backend
choice with its reason (``backend``, ``backend_reason``) are reported next to the digest
but are not part of it, because the ids are the same.
The digest tells one tokenizer setup from another (it keys caches and resumes).
Checks that ask "do these ids mean the same tokens?" (blending sources, merging
shards) compare :func:`tokenloom.indexed.manifest.ids_key` instead, which also drops the file names: the same
vocab and merges saved as Megatron's ``gpt2-vocab.json``/``gpt2-merges.txt`` and as
HF's ``vocab.json``/``merges.txt`` give the same ids, so they must blend.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from tokenloom.errors import TokenloomError
from tokenloom.fsio import sha256_file  # noqa: F401 - re-exported for the backends
from tokenloom.tokenizers.gigatoken_engine import Unsupported, select_backend

#: Options that never change the emitted ids (or are file paths, whose content is hashed in
#: ``files``); excluded from the fingerprint digest.
RUNTIME_OPTIONS = frozenset({"num_threads", "fast", "merges"})

#: Environment variable giving the default ``num_threads`` for batch encoding.
THREADS_ENV = "TOKENLOOM_TOKENIZER_THREADS"


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """Everything needed to rebuild a tokenizer in another process.

    ``path`` is absolute (or None for file-less kinds such as ``byte``/``null``);
    ``options`` holds plain JSON-like values only, so the spec pickles and prints.
    ``backend`` picks the encoding engine (auto | reference | gigatoken, see
    ``gigatoken_engine``); it never changes the ids, so it is not an option.
    """

    kind: str
    path: str | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    backend: str = "auto"

    def with_options(self, **options: Any) -> TokenizerSpec:
        """A copy with ``options`` merged in, e.g. ``spec.with_options(num_threads=1)``."""
        return dataclasses.replace(self, options={**self.options, **options})

    def file_path(self) -> Path:
        """``path`` for a file-backed kind; a spec without one is refused with the kind's name."""
        if self.path is None:
            raise TokenloomError(f"tokenizer kind {self.kind!r} needs a path")
        return Path(self.path)


def resolve_threads(num_threads: int | None) -> int | None:
    """``num_threads`` if given, else $TOKENLOOM_TOKENIZER_THREADS, else None (backend default)."""
    if num_threads is None:
        env = os.environ.get(THREADS_ENV)
        if not env:
            return None
        try:
            num_threads = int(env)
        except ValueError:
            raise TokenloomError(f"${THREADS_ENV}={env!r} is not an integer") from None
    if num_threads < 1:
        raise TokenloomError(f"num_threads must be >= 1, got {num_threads}")
    return num_threads


def flatten(seqs: list, total: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Flat int64 ids and int64 lengths from a list of per-text id lists."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    count = int(lengths.sum()) if total is None else total
    ids = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=count)
    return ids, lengths


class Tokenizer(abc.ABC):
    """Text <-> ids. Subclasses set the attributes below in ``__init__``.

    ``vocab_size`` bounds every id the tokenizer can emit (max id + 1, special and
    added tokens included); callers use it to pick uint16 vs int32 storage.
    ``encode``/``encode_batch`` never add BOS/EOS: the caller appends ``eod``.
    """

    kind: str
    vocab_size: int
    eod: int | None = None
    bos: int | None = None
    pad: int | None = None
    num_threads: int | None
    """Backends that pool threads set it in ``__init__`` (None: the backend's default)."""

    def __init__(self, spec: TokenizerSpec, files: dict[str, str], engine: str):
        self._spec = spec
        self._files = files  # {file name: sha256}
        self.engine = engine
        self.backend, self.backend_reason = "reference", "not selected yet"
        self._gigatoken = None  # a GigatokenEngine once the self-check has passed

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Flat ids of all texts concatenated (int64; uint32 where gigatoken encoded them all), and
        per-text lengths (int64)."""
        if self._gigatoken is None:
            return self.encode_batch_reference(texts)
        parallel = getattr(self, "num_threads", None) != 1 and len(texts) > 1
        return self._gigatoken.encode_batch(texts, parallel, self.encode_batch_reference)

    @abc.abstractmethod
    def encode_batch_reference(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``encode_batch`` on the reference library of this kind."""

    def gigatoken_source(self):
        """A ``GigatokenSource`` for this tokenizer's files; raises (with the reason) where gigatoken
        cannot encode this kind. Kinds that gigatoken supports override it."""
        raise Unsupported(f"gigatoken does not encode the {self.kind} kind")

    def set_backend(self, gigatoken_engine, reason: str) -> None:
        """Encode with ``gigatoken_engine`` (None: the reference library); ``reason`` goes to the manifest."""
        self._gigatoken = gigatoken_engine
        self.backend = "reference" if gigatoken_engine is None else "gigatoken"
        if gigatoken_engine is not None:
            self.engine = "gigatoken"
        self.backend_reason = reason

    def bound_memory(self, limit_mb: int | None) -> None:
        """Keep the encoder from growing this process by more than ``limit_mb`` MB (None or 0: no bound).

        Only gigatoken's encoder grows with the text (its word cache, see
        :class:`~tokenloom.tokenizers.gigatoken_engine.GigatokenEngine`); the reference libraries
        keep no cache (tiktoken, sentencepiece) or a bounded one (tokenizers), so there is nothing
        to bound for them. Shared with :meth:`single_threaded` copies in this process."""
        if self._gigatoken is not None:
            self._gigatoken.bound_memory(limit_mb << 20 if limit_mb else None)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    @abc.abstractmethod
    def decode(self, ids) -> str:
        """Text of ``ids``; special tokens (eod/bos/pad, control tokens) are skipped."""

    @property
    def spec(self) -> TokenizerSpec:
        return self._spec

    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> Tokenizer:
        """A tokenizer of this class built from ``spec``, with the backend ``spec.backend`` selects."""
        tok = cls(spec)  # type: ignore[call-arg]  # every backend takes its spec alone; this base's __init__ is their super()
        select_backend(tok, spec.backend)
        return tok

    def __reduce__(self):
        # pickling a tokenizer sends its class and spec; the receiver rebuilds the backend
        return type(self).from_spec, (self._spec,)

    def single_threaded(self) -> Tokenizer:
        """A shallow copy that encodes on the calling thread (``num_threads=1``).

        For forked preprocess workers: they hold the parent's tokenizer already, and this
        costs nothing where rebuilding from the spec costs a noticeable start-up per process. Safe
        after fork only if the parent never ran the backend's own thread pool.
        (Not ``copy.copy``: that goes through ``__reduce__``, which rebuilds.)
        """
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._spec = self._spec.with_options(num_threads=1)
        if "num_threads" in clone.__dict__:
            clone.num_threads = 1
        return clone

    def id_options(self) -> dict[str, Any]:
        """Resolved options that affect ids (subclasses add auto-detected ones)."""
        return {k: v for k, v in sorted(self._spec.options.items()) if k not in RUNTIME_OPTIONS}

    def fingerprint(self) -> dict:
        fp = {
            "kind": self.kind,
            "files": dict(sorted(self._files.items())),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "bos": self.bos,
            "pad": self.pad,
            "options": self.id_options(),
        }
        blob = json.dumps(fp, sort_keys=True, separators=(",", ":")).encode()
        fp["digest"] = hashlib.sha256(blob).hexdigest()
        fp["engine"] = self.engine  # not in the digest: every engine gives the same ids
        fp["backend"], fp["backend_reason"] = self.backend, self.backend_reason
        return fp

    def __repr__(self) -> str:
        name = Path(self._spec.path).name if self._spec.path else ""
        return f"<{type(self).__name__} kind={self.kind} {name} vocab_size={self.vocab_size} eod={self.eod}>"
