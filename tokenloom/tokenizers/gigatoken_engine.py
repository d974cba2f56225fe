"""gigatoken as the encoding engine, used only where a self-check on load proves it gives the reference ids.

Backends (``--tokenizer-backend``, ``load_tokenizer(..., backend=)``, ``TokenizerSpec.backend``):
``reference`` is the library each kind is defined by (tokenizers, tiktoken, sentencepiece);
``gigatoken`` is the Rust byte-level BPE / SentencePiece-BPE encoder (faster on one core;
``bench/preprocess_bench.py``), or a one-line error when it cannot load the file or fails the
self-check; ``auto`` (default) takes gigatoken when it loads and passes, else the reference.
The choice and its reason go into ``fingerprint()["backend"]`` / ``["backend_reason"]`` and
every manifest, but not into the digest or ``ids_key``: same ids, same key.

Contract: the self-check encodes probe texts on both engines and requires identical ids
(whitespace runs, CJK, emoji and ZWJ sequences, combining marks, digits, control characters,
byte-fallback pieces, a very long word, every special/added token in context, seeded mixtures
of these). It is not a proof for every text (the tests compare both engines on the shared
corpora and Megatron's outputs) but it catches a different split regex, normalizer, merge
order or special-token policy for the exact file loaded. Its verdict is cached per user
(:class:`VerdictCache`) because it costs noticeable start-up time.

Unicode versions differ between the engines (HF tokenizers' NFC tables and older split
regexes miss characters assigned since), so on load every suspect character (non-zero
canonical combining class, or assigned after this Python's Unicode) is encoded in three
contexts on both engines; those that differ become escapes, and texts holding one go to the
reference engine.

One policy difference is routed instead of refused: gigatoken matches a SentencePiece model's
*control* pieces (Llama 2's ``<s>``, ``</s>``) written in the text, where sentencepiece and
Megatron spell them as text, so texts containing one go to the reference engine (the
self-check covers both paths). Differences not understood are refused, e.g. Mistral v3's
``[REFERENCE_DOC_n]`` pieces: the self-check fails and ``auto`` keeps sentencepiece.

Threads: one thread when the tokenizer has ``num_threads=1`` (preprocess workers) or a single
text, so a parent never starts gigatoken's pool before forking; otherwise its process-wide
pool (all cores, or ``RAYON_NUM_THREADS``).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import json
import logging
import os
import random
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import regex

from tokenloom.errors import TokenloomError

if TYPE_CHECKING:  # imported where a tokenizer kind builds its model, never at module load
    import gigatoken

log = logging.getLogger(__name__)

BACKEND_CHOICES = ("auto", "reference", "gigatoken")
_DEFAULT_BACKEND = contextvars.ContextVar("tokenloom_tokenizer_backend", default="auto")


def check_backend(name: str) -> str:
    if name not in BACKEND_CHOICES:
        raise TokenloomError(f"tokenizer backend must be one of {', '.join(BACKEND_CHOICES)}, got {name!r}")
    return name


def default_backend() -> str:
    """The backend ``load_tokenizer`` uses when none is given (``auto`` unless inside :func:`use_backend`)."""
    return _DEFAULT_BACKEND.get()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the block, tokenizers loaded without an explicit backend use ``name`` (the CLI's
    ``--tokenizer-backend``). The choice is stored in each spec, so workers rebuild the same."""
    token = _DEFAULT_BACKEND.set(check_backend(name))
    try:
        yield
    finally:
        _DEFAULT_BACKEND.reset(token)


class Unsupported(Exception):
    """Raised by ``Tokenizer.gigatoken_source`` for a tokenizer gigatoken cannot encode; the message is the reason."""


@dataclass
class GigatokenSource:
    """What a tokenizer kind hands over: the loaded gigatoken model, the special/added token strings
    to probe, and ``escapes``: strings gigatoken treats specially where the reference does not
    (texts containing one go to the reference engine)."""

    model: gigatoken.Tokenizer
    specials: list[str] = field(default_factory=list)
    escapes: tuple[str, ...] = ()


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux ``/proc/self/statm``), None where unknown."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _return_free_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc's ``malloc_trim``): a freed cache
    lies between live allocations, which ``free`` alone keeps mapped, so each rebuild would leave
    the process a little larger than the last. A no-op where there is no glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # no glibc (musl, macOS), or no CDLL(None) (Windows)
        pass


class GigatokenEngine:
    """gigatoken's model behind tokenloom's batch API, with escapes and a memory bound.

    The memory bound (:meth:`bound_memory`): gigatoken keeps every distinct pre-token it has
    encoded in a per-model cache with no limit and no way to clear it (a known upstream limitation), so on text
    of mostly distinct words (URLs, numbers, hashes, code, other scripts) a process grows with
    the corpus. The cache belongs to the model object: dropping the model frees it. So when the
    process has grown by more than the bound since the model was built, the model is dropped and
    built again from ``rebuild`` (ids do not change: the same files, no state but the cache).
    Trade-off: a rebuilt model starts with a cold cache, which encodes slower until it is warm
    again; on ordinary text the cache stops growing long before the bound and it never fires.
    Where resident memory cannot be read (not Linux), the bound counts the characters encoded
    instead: a cache entry is larger than the text it came from, so that bound is conservative.
    The cache is freed with the model whether gigatoken encoded on one thread or on its pool.
    """

    def __init__(self, source: GigatokenSource, escape_chars: str = "", rebuild=None):
        # gigatoken returns awkward arrays: import it here, in the process that loads the tokenizer,
        # so forked preprocess workers inherit it (imported in each worker it cost every worker a
        # start-up at the start of every run, the workers importing at once on the same cores)
        import awkward  # lazy: in the loading process, before workers fork (above)  # noqa: F401

        self.model = source.model
        self._rebuild = rebuild  # () -> a fresh model of the same files
        self._bound: int | None = None
        self._baseline = self._grown = 0
        self.rebuilds = 0
        # One regex for the escape strings (Mistral v3 has 750 control pieces), longest first. The
        # characters get their own tests by the widest character a text can hold: an ASCII text
        # (most of a corpus; ``isascii`` is O(1)) against the ASCII ones, a Latin-1 text (proven by
        # ``encode("latin-1")``: a copy for those, an early exception for wider ones) against those
        # up to U+00FF, any other against one class of the BMP ones plus the whole astral range:
        # a class listing characters past U+FFFF makes ``re`` test them one by one at every position
        # (several times the encoding for NeoX's 69), a range is one test, and only when it finds an
        # astral character are the astral ones looked for: most non-ASCII texts of a corpus are
        # Latin-1 (see bench/RESULTS.md, notes). ``max(text)``
        # would say the same as the encode but builds a string per character.
        longest_first = sorted(source.escapes, key=len, reverse=True)
        self._strings = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None

        def char_class(chars, extra=""):
            return re.compile(f"[{re.escape(''.join(sorted(chars)))}{extra}]") if chars or extra else None

        chars = set(escape_chars)
        bmp = {c for c in chars if ord(c) <= 0xFFFF}
        self._ascii_chars = char_class({c for c in bmp if c.isascii()})
        self._latin1_chars = char_class({c for c in bmp if ord(c) <= 0xFF})
        self._bmp_chars = char_class(bmp)
        self._wide_chars = char_class(bmp, "\U00010000-\U0010ffff" if chars - bmp else "")
        self._astral_chars = char_class(chars - bmp)

    def escaped(self, text: str) -> bool:
        """Does ``text`` hold an escape string or character (then the reference engine encodes it)?"""
        if self._strings is not None and self._strings.search(text):
            return True
        if text.isascii():
            return self._ascii_chars is not None and self._ascii_chars.search(text) is not None
        try:
            text.encode("latin-1")
        except UnicodeEncodeError:
            pass
        else:
            return self._latin1_chars is not None and self._latin1_chars.search(text) is not None
        found = self._wide_chars.search(text) if self._wide_chars is not None else None
        if found is None or ord(found.group()) <= 0xFFFF:
            return found is not None
        # an astral character, escaped or not: the astral escapes, and the BMP ones after it
        return (self._astral_chars.search(text, found.start()) is not None
                or (self._bmp_chars is not None and self._bmp_chars.search(text, found.end()) is not None))

    def warm_up(self) -> None:
        """Encode one text on this thread (never gigatoken's pool, so forking stays safe), in the process
        that loads the tokenizer: the first batch imports what awkward builds its result with (numpy.ma,
        its kernels) and fills its caches, which each forked preprocess worker otherwise did on its first
        chunk, all of them at once on the same cores."""
        self.model.encode_batch(["a"], parallel=False)

    def bound_memory(self, limit_bytes: int | None) -> None:
        """Rebuild the model whenever the process has grown by more than ``limit_bytes`` since it was
        built (None or 0: never; without a ``rebuild`` there is nothing to bound with)."""
        self._bound = (limit_bytes or None) if self._rebuild is not None else None
        self._baseline, self._grown = resident_bytes() or 0, 0

    def _check_memory(self, text_bytes: int) -> None:
        now = resident_bytes()
        self._grown = now - self._baseline if now is not None else self._grown + text_bytes
        if self._bound is not None and self._rebuild is not None and self._grown > self._bound:
            del self.model  # free the old cache before the new model is built
            _return_free_memory()
            self.model = self._rebuild()
            self.rebuilds += 1
            self._baseline, self._grown = resident_bytes() or 0, 0

    def encode(self, texts: list[str], parallel: bool) -> tuple[np.ndarray, np.ndarray]:
        """Flat uint32 ids (gigatoken's dtype: the output dtype's cast reads them once, where a cast to
        int64 first cost a pass over 8 bytes a token) and int64 lengths, read from the awkward
        result's two buffers (ids and offsets) directly: ``ak.flatten``/``ak.num`` cost a tenth of a
        warm encode (see bench/RESULTS.md, notes)."""
        rows = self.model.encode_batch(texts, parallel=parallel).layout
        offsets = np.asarray(rows.offsets.data, dtype=np.int64)
        ids = np.asarray(rows.content.data)[offsets[0]:offsets[-1]] if len(offsets) else np.empty(0, np.uint32)
        if self._bound is not None:
            self._check_memory(sum(map(len, texts)))
        return ids, np.diff(offsets)

    def encode_batch(self, texts: list[str], parallel: bool, reference) -> tuple[np.ndarray, np.ndarray]:
        """Flat ids and lengths; texts holding an escape string are encoded by ``reference``."""
        escaped = [i for i, t in enumerate(texts) if self.escaped(t)]
        if not escaped:
            return self.encode(texts, parallel)
        mask = np.zeros(len(texts), dtype=bool)
        mask[escaped] = True
        parts = [self.encode([t for t, m in zip(texts, mask, strict=True) if not m], parallel),
                 reference([texts[i] for i in escaped])]
        lengths = np.empty(len(texts), dtype=np.int64)
        lengths[~mask], lengths[mask] = parts[0][1], parts[1][1]
        pieces = [np.split(ids, np.cumsum(lens)[:-1]) if len(lens) else [] for ids, lens in parts]
        own, ref = iter(pieces[0]), iter(pieces[1])
        ids = [next(ref) if m else next(own) for m in mask]
        return (np.concatenate(ids) if ids else np.empty(0, np.int64)), lengths


@functools.lru_cache(maxsize=1)
def unicode_suspects() -> str:
    """Characters whose handling may depend on the Unicode version: every one with a non-zero
    canonical combining class (NFC reorders it) and every one assigned in ``regex``'s tables but
    not in this Python's ``unicodedata`` (Unicode 15+: CJK Extensions H-J, ...; an older split
    regex does not see them as letters). All lie below U+40000. Trade-off: ~30k characters probed
    on load (a fraction of a second) instead of a list of ranges that ages with each Unicode."""
    everything = "".join(map(chr, range(0xD800))) + "".join(map(chr, range(0xE000, 0x40000)))
    marks = regex.findall(r"\P{ccc=0}", everything)
    newer = [c for c in regex.findall(r"[^\p{Cn}\p{Co}]", everything) if unicodedata.category(c) == "Cn"]
    return "".join(sorted(set(marks) | set(newer)))


def unstable_chars(reference, engine: GigatokenEngine) -> str:
    """The suspect characters on which the two engines disagree (tables of different Unicode versions)."""
    suspects = unicode_suspects()
    texts = [t for c in suspects for t in (f"a{c}\u0301", f"a\u0316{c}", f"{c}x{c}/V {c}(S")]
    want, got = reference(texts), engine.encode(texts, False)
    differs = per_text_differs(want, got)
    return "".join(c for k, c in enumerate(suspects) if differs[3 * k: 3 * k + 3].any())


def per_text_differs(want: tuple[np.ndarray, np.ndarray], got: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Boolean per text: do the two ``(ids, lengths)`` encodings differ for it?"""
    (w_ids, w_lens), (g_ids, g_lens) = want, got
    w_lens, g_lens = np.asarray(w_lens, np.int64), np.asarray(g_lens, np.int64)
    differs = w_lens != g_lens
    same = np.flatnonzero(~differs)  # texts of equal length: compare their ids element by element
    lens = w_lens[same]
    total = int(lens.sum())
    if total:
        offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        w_at = np.repeat((np.cumsum(w_lens) - w_lens)[same], lens) + offsets
        g_at = np.repeat((np.cumsum(g_lens) - g_lens)[same], lens) + offsets
        unequal = np.asarray(w_ids)[w_at] != np.asarray(g_ids)[g_at]
        text_of = np.repeat(np.arange(len(same)), lens)
        differs[same[np.unique(text_of[unequal])]] = True
    return differs


def probe_texts(specials: list[str], seed: int = 0) -> list[str]:
    """Texts on which gigatoken must reproduce the reference ids (see the module docstring)."""
    fixed = [
        "", " ", "  ", "\n", "\n\n\n", "\t", " \t\n \r\n", "Hello world", " Hello  world ", "hello\tworld\n",
        "a  b   c    d     e" + " " * 40 + "f", "trailing spaces   ", "   leading spaces", "line\r\nbreaks\rold mac",
        "I'm you're they'll we've she'd it's DON'T", "12345678901234567890 3.14159 1,000,000 0x7fff 2024-01-31",
        "日本語のテキストと中文文本 한국어 텍스트", "Ünïcödé façade naïve coöperate", "e\u0301 a\u0308 n\u0303 Z\u0351\u0352",
        "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 🎉", "\u00a0nbsp\u2009thin\u3000ideographic\u200bzero-width\ufeffbom",
        "\x00\x01\x07\x1b[0m ctrl \x7f", "𓀀𓀁 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﬁﬂ \ue000\U0010fffd \ufffd",
        "Ελληνικά русский עברית العربية हिन्दी ไทย", "<|endoftext|>", "a<|endoftext|>b", "<s> </s> <unk> <pad>",
        "[CLS] [SEP] <|im_start|>user\nhi<|im_end|>", "x" * 5000, "supercalifragilisticexpialidocious " * 20,
        "ab" * 700, "1" * 1000, " " * 1000, "\n" * 300, "def f(x):\n    return x  # comment\n\n\tpass\n",
        "https://example.com/path?q=1&r=%20#frag user@example.org", "...!!!???---___***",
        "\u089b\u0cbc \u1ac5\u0650 a\u1ae0\u0e48", "\U00032a23/V \U00033021[j \U000332ee(S",  # Unicode 14-16
    ]
    texts = fixed + [f"{s}" for s in specials] + [f" {s} x{s}y\n{s}{s}  " for s in specials]
    pool = list("abcdefXYZ0123456789 .,;:'\"!?-_()[]{}<>/\\|") + [" ", "  ", "\n", "\t", "\r\n", "   "]
    pool += list("日本中文한글ÜéñçøßΩжש") + ["e\u0301", "a\u0308", "👍", "👍🏽", "🇫🇷", "𓀀", "\ue000", "\u200b", "\x00"]
    pool += ["'s", "'ll", " the", "ing", "tion", "1234", "http://"] + list(specials[:64])
    rng = random.Random(seed)
    for _ in range(240):
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 120))))
    return texts


def self_check(reference, engine: GigatokenEngine, probes: list[str]) -> str | None:
    """None when ``engine`` gives ``reference``'s ids on every probe text, else the first difference.
    ``reference``: ``texts -> (ids, lengths)`` on the calling thread."""
    want, got = reference(probes), engine.encode_batch(probes, False, reference)
    differs = per_text_differs(want, got)
    if not differs.any():
        return None
    k = int(np.flatnonzero(differs)[0])
    w = want[0][np.cumsum(want[1])[k] - want[1][k]:][:8].tolist()
    g = got[0][np.cumsum(got[1])[k] - got[1][k]:][:8].tolist()
    return f"probe text {probes[k][:40]!r} encodes to {g}... instead of {w}..."


CACHE_ENV = "TOKENLOOM_CACHE_DIR"
"""Where per-user caches live (default ``$XDG_CACHE_HOME/tokenloom``, else ``~/.cache/tokenloom``)."""


def user_cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenloom"


@functools.lru_cache(maxsize=1)
def _checker_digest() -> str:
    """sha256 of the code that decides a verdict: every module of ``tokenloom.tokenizers`` (the
    probes, the comparison, each kind's gigatoken source and reference encoder)."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _library_versions() -> dict[str, str]:
    found = {"unicodedata": unicodedata.unidata_version}
    for name in ("gigatoken", "tokenizers", "tiktoken", "sentencepiece", "regex"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = ""
    return found


class VerdictCache:
    """The self-check's outcome for one tokenizer, kept per user so a later load skips the check.

    The check costs about a second and ~150 MB per load (the Unicode probes encode ~90k texts on both
    engines), paid by every preprocess run and by each spawned worker. Its outcome depends only
    on the tokenizer's files and id options (``fingerprint()["digest"]``), the reference engine, the
    special strings and escapes its gigatoken source declares,
    the versions of gigatoken, the reference libraries, ``regex`` and Python's Unicode tables, and
    the code that runs the check (hashed): the key covers all of them, so a changed file, upgrade
    or probe list runs the check again. Trade-off: a verdict is trusted from disk, so a cache
    entry edited by hand can select gigatoken for a tokenizer it fails on; ``--tokenizer-backend
    reference`` or removing ``$TOKENLOOM_CACHE_DIR/tokenizer-checks`` is the way out. An
    unreadable or unwritable cache is no error: the check runs, as without one.
    """

    def __init__(self, tok, source: GigatokenSource):
        key = {"tokenizer": tok.fingerprint()["digest"], "engine": tok.engine,
               "specials": list(source.specials), "escapes": sorted(source.escapes),
               "checker": _checker_digest(), "versions": _library_versions()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        self.path = user_cache_dir() / "tokenizer-checks" / f"{digest}.json"

    def load(self) -> dict | None:
        try:
            found = json.loads(self.path.read_text(encoding="utf-8"))
            if (isinstance(found.get("unstable"), str) and isinstance(found.get("probes"), int)
                    and (found.get("mismatch") is None or isinstance(found["mismatch"], str))):
                return found
        except (OSError, ValueError, AttributeError):
            pass
        return None

    def store(self, verdict: dict) -> None:
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(verdict), encoding="utf-8")
            os.replace(tmp, self.path)  # a reader sees the old entry or the whole new one
        except OSError as exc:
            log.debug("tokenizer self-check not cached at %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()


def select_backend(tok, requested: str) -> None:
    """Attach gigatoken to ``tok`` when ``requested`` allows it and the self-check passes; record why."""
    requested = check_backend(requested)
    if requested == "reference":
        tok.set_backend(None, "reference backend requested")
        return
    reference = tok.single_threaded().encode_batch_reference  # never starts a thread pool before a fork
    try:
        source = tok.gigatoken_source()
        verdict = VerdictCache(tok, source)
        known = verdict.load()
        if known is None:
            unstable = unstable_chars(reference, GigatokenEngine(source))
            probes = probe_texts(source.specials)
            engine = GigatokenEngine(source, unstable, rebuild=lambda: tok.gigatoken_source().model)
            mismatch = self_check(reference, engine, probes)
            probed = len(probes)
            verdict.store({"unstable": unstable, "probes": probed, "mismatch": mismatch})
        else:
            unstable, mismatch, probed = known["unstable"], known["mismatch"], known["probes"]
            engine = GigatokenEngine(source, unstable, rebuild=lambda: tok.gigatoken_source().model)
        reason = None if mismatch is None else f"self-check failed: {mismatch}"
    except Unsupported as exc:
        reason = str(exc)
    except ImportError:
        reason = "gigatoken is not installed"
    except BaseException as exc:  # ValueError, OSError, Rust errors, and pyo3 panics (not Exceptions)
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise  # KeyboardInterrupt, SystemExit
        reason = f"gigatoken cannot load it: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    if reason is None:
        engine.warm_up()
        escaped = f"; texts with one of {len(unstable)} characters its Unicode tables treat differently use {tok.engine}"
        tok.set_backend(engine, f"self-check passed: {probed} probe texts give the same ids as {tok.engine}"
                        + (escaped if unstable else ""))
    elif requested == "gigatoken":
        raise TokenloomError(f"tokenizer backend gigatoken cannot be used for {tok.spec.path or tok.kind}: {reason} "
                             f"(use --tokenizer-backend auto or reference)")
    else:
        tok.set_backend(None, f"{reason}; using {tok.engine}")
