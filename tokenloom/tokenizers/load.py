"""``load_tokenizer``: pick the backend from a path (by content, not only by name) or a forced kind.

Detection rules, first match wins:

* directory: ``tokenizer.json`` -> hf; vocab.json + merges.txt (or Megatron's
  gpt2-vocab.json + gpt2-merges.txt) -> gpt2-bpe; ``tokenizer.model`` -> sniffed
  (below); exactly one ``*.tiktoken`` -> tiktoken; ``vocab.txt`` -> wordpiece.
* file: JSON with a ``"model"`` key -> hf; other JSON object -> gpt2-bpe (its vocab,
  merges beside it); ``merges.txt``-like -> gpt2-bpe; ``<base64> <rank>`` lines ->
  tiktoken (Llama-3's ``tokenizer.model`` is one); other UTF-8 text with one token
  per line -> wordpiece; binary -> sentencepiece (a protobuf).

Megatron's ``--tokenizer-type`` names are accepted as kinds too (``KIND_ALIASES``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import orjson

from tokenloom.errors import TokenloomError
from tokenloom.tokenizers.base import Tokenizer, TokenizerSpec
from tokenloom.tokenizers.gigatoken_engine import check_backend, default_backend
from tokenloom.tokenizers.hf import (
    MERGES_NAMES,
    VOCAB_NAMES,
    GPT2BPETokenizer,
    HFTokenizer,
    WordPieceTokenizer,
)
from tokenloom.tokenizers.simple import ByteTokenizer, NullTokenizer
from tokenloom.tokenizers.sp import SentencePieceTokenizer
from tokenloom.tokenizers.tiktoken_bpe import TiktokenTokenizer, looks_like_rank_file

# Each kind's class, called with the spec alone (the base class's constructor takes more).
BACKENDS: dict[str, type[Tokenizer]] = {
    cls.kind: cls
    for cls in (HFTokenizer, GPT2BPETokenizer, WordPieceTokenizer, SentencePieceTokenizer, TiktokenTokenizer,
                ByteTokenizer, NullTokenizer)
}
FILELESS = {"byte", "null"}

# Megatron --tokenizer-type -> (kind, options)
KIND_ALIASES: dict[str, tuple[str, dict]] = {
    "HuggingFaceTokenizer": ("hf", {}),
    "GPT2BPETokenizer": ("gpt2-bpe", {}),
    "BertWordPieceLowerCase": ("wordpiece", {"lowercase": True}),
    "BertWordPieceCase": ("wordpiece", {"lowercase": False}),
    "SentencePieceTokenizer": ("sentencepiece", {}),
    "GPTSentencePieceTokenizer": ("sentencepiece", {}),
    "Llama2Tokenizer": ("sentencepiece", {}),
    "TikTokenizer": ("tiktoken", {}),
    "NullTokenizer": ("null", {}),
}


def check_megatron_type(path: str | Path | None, megatron_type: str) -> None:
    """Megatron's ``--tokenizer-type`` beside the files it names (``--tokenizer-model`` or the
    ``--vocab-file``/``--merge-file`` folder): the kind detected from the files must be the one the type
    means (:data:`KIND_ALIASES`, or a kind's own name); ``NullTokenizer`` names no files. The files
    decide which backend loads them, so the type is a check, not a switch; a mismatch is one line."""
    if megatron_type not in KIND_ALIASES and megatron_type not in BACKENDS:
        raise TokenloomError(f"--tokenizer-type {megatron_type}: unknown (one of {', '.join(KIND_ALIASES)})")
    kind = KIND_ALIASES[megatron_type][0] if megatron_type in KIND_ALIASES else megatron_type
    if kind in FILELESS:
        if path is not None:
            raise TokenloomError(f"--tokenizer-type {megatron_type} reads no files; drop --tokenizer-model {path}")
        return
    if path is None:
        raise TokenloomError(f"--tokenizer-type {megatron_type} needs its files: --tokenizer-model PATH "
                             "(or --vocab-file and --merge-file)")
    found = detect_kind(Path(path))
    if found != kind:
        raise TokenloomError(f"--tokenizer-type {megatron_type} means a {kind} tokenizer, but {path} holds a "
                             f"{found} one")


def list_kinds() -> list[str]:
    return list(BACKENDS)


def load_tokenizer(path_or_spec: str | Path | TokenizerSpec | Tokenizer | None = None, kind: str | None = None,
                   backend: str | None = None, **options) -> Tokenizer:
    """Build a tokenizer from a file/directory (kind auto-detected unless given) or a spec.

    ``load_tokenizer("tok/gpt2")``, ``load_tokenizer("x.model", kind="sentencepiece")``,
    ``load_tokenizer(kind="byte")``, ``load_tokenizer(tok.spec)`` (in a worker process).
    ``backend``: auto | reference | gigatoken (default: ``default_backend()``; a spec keeps its own).
    """
    if isinstance(path_or_spec, Tokenizer) and kind is None and backend is None and not options:
        return path_or_spec
    if isinstance(path_or_spec, Tokenizer):
        path_or_spec = path_or_spec.spec
    if isinstance(path_or_spec, TokenizerSpec):
        spec = path_or_spec
        if kind is not None and kind != spec.kind:
            raise TokenloomError(f"kind={kind!r} conflicts with the spec's kind {spec.kind!r}")
        if options:
            spec = spec.with_options(**options)
        if backend is not None:
            spec = dataclasses.replace(spec, backend=check_backend(backend))
        return _build(spec)
    backend = check_backend(backend or default_backend())
    if kind in KIND_ALIASES:
        kind, alias_options = KIND_ALIASES[kind]
        options = {**alias_options, **options}
    if kind is not None and kind not in BACKENDS:
        raise TokenloomError(f"unknown tokenizer kind {kind!r}; known kinds: {', '.join(list_kinds())} "
                             f"(or Megatron names: {', '.join(KIND_ALIASES)})")
    if kind in FILELESS:
        if path_or_spec is not None:
            raise TokenloomError(f"the {kind} tokenizer takes no file, got {path_or_spec}")
        return _build(TokenizerSpec(kind, None, dict(options), backend))
    if path_or_spec is None:
        raise TokenloomError("no tokenizer given: pass a path, or kind='byte' / kind='null'")
    path = Path(path_or_spec).expanduser()
    if not path.exists():
        raise TokenloomError(f"tokenizer path {path} does not exist")
    path = path.resolve()
    if "merges" in options:  # the spec must work from any working directory
        options["merges"] = str(Path(options["merges"]).expanduser().resolve())
    return _build(TokenizerSpec(kind or detect_kind(path), str(path), dict(options), backend))


def _build(spec: TokenizerSpec) -> Tokenizer:
    if spec.kind not in BACKENDS:
        raise TokenloomError(f"unknown tokenizer kind {spec.kind!r}; known kinds: {', '.join(list_kinds())}")
    return BACKENDS[spec.kind].from_spec(spec)


def detect_kind(path: Path) -> str:
    """The backend kind for a file or directory; TokenloomError if nothing fits."""
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return "hf"
        if any((path / n).is_file() for n in VOCAB_NAMES) and any((path / n).is_file() for n in MERGES_NAMES):
            return "gpt2-bpe"
        if (path / "tokenizer.model").is_file():
            return detect_kind(path / "tokenizer.model")
        if len(list(path.glob("*.tiktoken"))) == 1:
            return "tiktoken"
        if (path / "vocab.txt").is_file():
            return "wordpiece"
        raise TokenloomError(f"{path}: no tokenizer found (looked for tokenizer.json, vocab.json + merges.txt, "
                             f"tokenizer.model, *.tiktoken, vocab.txt)")
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if not head:
        raise TokenloomError(f"{path}: empty file, not a tokenizer")
    if path.name == "tokenizer.json":  # as for a directory holding one: the HF loader reads (and judges) it
        return "hf"
    if head.lstrip()[:1] == b"{" or path.suffix == ".json":
        return _detect_json(path)
    if looks_like_rank_file(head):
        return "tiktoken"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the end of the sample
            return "sentencepiece"
        text = head[: e.start].decode("utf-8")
    if "\x00" in text:
        return "sentencepiece"
    lines = [ln for ln in text.split("\n")[:200] if ln]
    if len(head) == 1 << 16:
        lines = lines[:-1]  # may be cut in the middle
    if lines and (lines[0].startswith("#version") or all(len(ln.split(" ")) == 2 for ln in lines)):
        return "gpt2-bpe"  # a merges file
    if lines and all(len(ln.split()) == 1 for ln in lines):
        return "wordpiece"
    raise TokenloomError(f"{path}: unrecognised tokenizer file (not a tokenizer.json, vocab.json, merges.txt, "
                         f"tiktoken ranks, vocab.txt or SentencePiece model); pass kind= to force a backend")


def _detect_json(path: Path) -> str:
    raw = path.read_bytes()
    try:
        data = orjson.loads(raw)  # several times the stdlib's speed on a tokenizer.json read at every start
    except orjson.JSONDecodeError:
        try:  # the stdlib's reading decides, and describes what does not parse
            data = json.loads(raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenloomError(f"{path}: looks like JSON but does not parse: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        return "hf"
    if isinstance(data, dict) and data and all(isinstance(v, int) for v in data.values()):
        return "gpt2-bpe"
    raise TokenloomError(f"{path}: JSON file is neither a Hugging Face tokenizer.json nor a vocab.json")
