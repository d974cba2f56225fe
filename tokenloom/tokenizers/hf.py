"""Backends built on Hugging Face ``tokenizers``: tokenizer.json, GPT-2 vocab+merges, BERT WordPiece.

``hf``: a ``tokenizer.json`` as released. Encoded with ``add_special_tokens=False``
(no template BOS/EOS); note that HF still matches *added tokens* written in the
text (e.g. a literal ``<|endoftext|>`` becomes one id), which is what the model's
own tokenizer does. eod/bos/pad: the options, else the usual names among the added tokens;
eod else the ``eos_token`` of ``tokenizer_config.json`` beside it (GPT-2's is an ordinary entry).

``gpt2-bpe``: ``vocab.json`` + ``merges.txt`` (or Megatron's ``gpt2-vocab.json`` /
``gpt2-merges.txt``) as a ByteLevel BPE with the GPT-2 split regex, which gives the
ids of Megatron's ``GPT2BPETokenizer`` (tested against the .bin files Megatron's own
preprocess_data.py wrote for both shared corpora). Special-token strings in the text are plain
text here (as in Megatron). A ``tokenizer_config.json`` beside the files that names
``Qwen2Tokenizer`` switches to Qwen2 pre-tokenisation (NFC, Qwen2 regex, ByteLevel
without its own regex, added tokens from ``added_tokens_decoder``); any other
``tokenizer_class`` except GPT-2's is refused instead of silently mis-tokenised.

Speed by proven equivalence: when the vocab and merges are OpenAI's GPT-2
``encoder.json`` / ``vocab.bpe`` (byte-identical, or the same token->id map and merge order
after parsing, so HF's re-serialised copies qualify), encoding runs on tiktoken, faster on
one thread (``bench/preprocess_bench.py``). The tests prove these files give the reference
engine's ids on every document of both shared corpora. Any other vocab, even one merge
apart, stays on the reference engine: tiktoken merges any adjacent pair whose bytes form a
token, BPE only listed merges, and they agree only for special merge tables, so no general
proof is attempted. ``fast=False`` forces the reference engine; the engine shows in
``fingerprint()["engine"]`` only.

``wordpiece``: BERT ``vocab.txt``; ``lowercase`` defaults to "no upper-case letter
in any non-[BRACKET] token of the vocab" (uncased BERT vocabs have none).
eod=[SEP], bos=[CLS], pad=[PAD].

Threads: with ``num_threads=1`` texts are encoded one by one on the calling
thread (no rayon pool); otherwise ``encode_batch`` uses the rayon pool, whose size
is set by ``RAYON_NUM_THREADS`` before the first batch call in the process.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import orjson
import tiktoken
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers.implementations import BertWordPieceTokenizer

from tokenloom.errors import TokenloomError
from tokenloom.tokenizers.base import Tokenizer, TokenizerSpec, flatten, resolve_threads, sha256_file
from tokenloom.tokenizers.gigatoken_engine import GigatokenSource, user_cache_dir
from tokenloom.tokenizers.tiktoken_bpe import R50K_PATTERN, decode_skipping, encode_ordinary_flat

EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[CLS]")
PAD_CANDIDATES = ("<pad>", "<|padding|>", "<|pad|>", "[PAD]")

GPT2_VOCAB_SHA = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_MERGES_SHA = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
# bpe_content_digest() of those two files: also matches re-serialised copies (HF vocab.json/merges.txt)
GPT2_CONTENT_SHA = "0de43c278a8bcab9bf33707fdb5ab279e9e4c9816a21a21e5fc3dc1c0d263a66"
GPT2_RANKS_SHA = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # as tiktoken's r50k_base file
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
GPT2_CLASSES = {None, "GPT2Tokenizer", "GPT2TokenizerFast"}
QWEN2_CLASSES = {"Qwen2Tokenizer", "Qwen2TokenizerFast"}
VOCAB_NAMES = ("vocab.json", "gpt2-vocab.json")
MERGES_NAMES = ("merges.txt", "gpt2-merges.txt")


def configured_specials(folder: Path) -> dict[str, str]:
    """``{"eod"|"bos"|"pad": token}`` as ``folder``'s tokenizer_config.json names them (``eos_token``,
    ``bos_token``, ``pad_token``: a string or an added-token object), where ``transformers`` reads a
    folder's specials; empty without the file."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenloomError(f"{path}: not a readable tokenizer_config.json: {e}") from None
    out = {}
    for attr, key in (("eod", "eos_token"), ("bos", "bos_token"), ("pad", "pad_token")):
        value = data.get(key) if isinstance(data, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[attr] = value
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


class _HFBase(Tokenizer):
    """Shared encode/decode over a ``tokenizers.Tokenizer`` in ``self.tk``."""

    _tk: tokenizers.Tokenizer | None = None

    @property
    def tk(self) -> tokenizers.Tokenizer:
        """The ``tokenizers`` object; kinds that build it on first use override this."""
        if self._tk is None:
            raise TokenloomError(f"{self.kind} tokenizer has no model")  # set by every __init__
        return self._tk

    def _setup(self, spec: TokenizerSpec):
        opts = dict(spec.options)
        self.num_threads = resolve_threads(opts.pop("num_threads", None))
        return opts

    def _set_specials(
        self, opts: dict, path, defaults: dict[str, int] | None = None, ids: dict[str, int] | None = None,
        folder: Path | None = None,
    ) -> None:
        """eod/bos/pad from options (token or id), else the first candidate found among ``defaults``
        (default: the added tokens -- ordinary vocab entries such as Qwen2's "<s>" are not specials),
        else, for eod only, the token ``folder``'s tokenizer_config.json names (:func:`configured_specials`:
        a GPT-2 tokenizer.json lists ``<|endoftext|>`` in its vocabulary only, as tokenloom's export
        writes it; bos and pad keep their old rule, so no released folder's fingerprint moves). ``ids``: the full token -> id map (default: the model's vocabulary with added tokens)."""
        if ids is None:
            ids = self.tk.get_vocab(with_added_tokens=True)
        self.vocab_size = max(ids.values()) + 1
        if defaults is None:
            defaults = {t.content: i for i, t in self.tk.get_added_tokens_decoder().items()}
        for attr, candidates in (("eod", EOD_CANDIDATES), ("bos", BOS_CANDIDATES), ("pad", PAD_CANDIDATES)):
            token = opts.pop(attr, None)
            if token is None:
                found = [defaults[c] for c in candidates if c in defaults]
                if not found and folder is not None and attr == "eod":
                    named = configured_specials(folder).get(attr)
                    found = [ids[named]] if named in ids else []
                setattr(self, attr, found[0] if found else None)
            elif isinstance(token, int):
                if not 0 <= token < self.vocab_size:
                    raise TokenloomError(f"{path}: {attr} id {token} is outside the vocabulary 0..{self.vocab_size - 1}")
                setattr(self, attr, token)
            elif token in ids:
                setattr(self, attr, ids[token])
            else:
                raise TokenloomError(f"{path}: {attr} token {token!r} is not in the vocabulary")
        if opts:
            raise TokenloomError(f"unknown {self.kind} tokenizer options {sorted(opts)} for {path}")

    def encode_batch_reference(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self.num_threads == 1:
            encs = [self.tk.encode(t, add_special_tokens=False) for t in texts]
        else:
            encs = self.tk.encode_batch(texts, add_special_tokens=False)
        return flatten([e.ids for e in encs])

    def decode(self, ids) -> str:
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=True)

    def added_tokens(self) -> list[str]:
        return [t.content for _, t in sorted(self.tk.get_added_tokens_decoder().items())]


class HFTokenizer(_HFBase):
    """``kind="hf"``: a tokenizer.json file, or a directory holding one. Options: eod/bos/pad, num_threads.

    For a BPE model the vocabulary size and the special ids are read from the file's JSON, and the
    ``tokenizers`` object is built on first use: where gigatoken is the engine (its self-check
    verdict cached) nothing needs it, and building it costs several times reading the JSON in a
    run's serial start. It is built at once when gigatoken is not the engine, so a file
    that only ``tokenizers`` refuses is refused on load, not in a worker. Other models build it at
    load, their specials read from it."""

    kind = "hf"

    def __init__(self, spec: TokenizerSpec):
        path = spec.file_path()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenloomError(f"{path}: no tokenizer.json here")
        super().__init__(spec, {path.name: sha256_file(path)}, engine="tokenizers")
        opts = self._setup(spec)
        self.json_path = path
        self._tk: tokenizers.Tokenizer | None = None
        self._added: list[str] | None = None
        try:
            data = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError as e:
            raise TokenloomError(f"{path}: not a valid Hugging Face tokenizer.json: {e}") from None
        added = _bpe_added_tokens(data)
        if added is None:
            self._set_specials(opts, path, folder=path.parent)
        else:
            self._added = [content for content, _ in sorted(added.items(), key=lambda item: item[1])]
            self._set_specials(opts, path, defaults=added, ids={**data["model"]["vocab"], **added}, folder=path.parent)

    @property
    def tk(self) -> tokenizers.Tokenizer:
        """The ``tokenizers`` object (built on first use for a BPE model)."""
        if self._tk is None:
            try:
                self._tk = tokenizers.Tokenizer.from_file(str(self.json_path))
            except Exception as e:  # the Rust side raises a bare Exception for parse errors
                raise TokenloomError(f"{self.json_path}: not a valid Hugging Face tokenizer.json: {e}") from None
        return self._tk

    def set_backend(self, gigatoken_engine, reason: str) -> None:
        super().set_backend(gigatoken_engine, reason)
        if gigatoken_engine is None:
            self.tk  # noqa: B018 -- built now: the engine, and the proof that tokenizers reads the file

    def added_tokens(self) -> list[str]:
        return list(self._added) if self._added is not None else super().added_tokens()

    def gigatoken_source(self) -> GigatokenSource:
        """The same tokenizer.json in gigatoken (BPE models only; WordPiece/Unigram raise)."""
        import gigatoken  # lazy: start-up time, gigatoken loads only when its engine is tried

        return GigatokenSource(gigatoken.Tokenizer.from_json(self.json_path.read_bytes()), self.added_tokens())


def _bpe_added_tokens(data) -> dict[str, int] | None:
    """A BPE tokenizer.json's added tokens (content -> id), or None when ``data`` is not one whose
    vocabulary is a plain JSON object (then ``tokenizers`` reads it, and describes what is wrong)."""
    model = data.get("model") if isinstance(data, dict) else None
    if not (isinstance(model, dict) and model.get("type") == "BPE" and isinstance(model.get("vocab"), dict)
            and set(map(type, model["vocab"].values())) <= {int}):
        return None
    added = data.get("added_tokens") or []
    if not (isinstance(added, list) and all(isinstance(t, dict) and isinstance(t.get("content"), str)
                                            and isinstance(t.get("id"), int) for t in added)):
        return None
    return {t["content"]: t["id"] for t in added}


def find_vocab_merges(path: Path, merges: str | None) -> tuple[Path, Path]:
    """(vocab.json, merges.txt) from a directory, a vocab file, or a merges file."""
    if path.is_dir():
        vocab = next((path / n for n in VOCAB_NAMES if (path / n).is_file()), None)
        found = next((path / n for n in MERGES_NAMES if (path / n).is_file()), None)
    elif path.suffix == ".json":
        vocab = path
        guesses = [path.with_name(path.name.replace("vocab", "merges").replace(".json", ".txt"))]
        found = next((p for p in guesses + [path.parent / n for n in MERGES_NAMES] if p.is_file()), None)
    else:
        found = path
        guesses = [path.with_name(path.name.replace("merges", "vocab").replace(".txt", ".json"))]
        vocab = next((p for p in guesses + [path.parent / n for n in VOCAB_NAMES] if p.is_file()), None)
    if merges is not None:
        found = Path(merges)
    if vocab is None or found is None or not found.is_file():
        raise TokenloomError(f"{path}: gpt2-bpe needs vocab.json and merges.txt side by side "
                             f"(or gpt2-vocab.json / gpt2-merges.txt); pass merges=<file> if named otherwise")
    return vocab, found


def bpe_content_digest(vocab: dict[str, int], merges: list[tuple[str, str]]) -> str:
    """sha256 of a BPE's content, independent of JSON formatting and the merges header."""
    h = hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode())
    h.update("\n".join(f"{a} {b}" for a, b in merges).encode())
    return h.hexdigest()


def read_merges(path: Path) -> list[tuple[str, str]]:
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = []
    for lineno, line in enumerate(lines, 1):
        if not line:
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise TokenloomError(f"{path}:{lineno}: not a BPE merge line (expected 'a b'): {line[:60]!r}")
        merges.append((parts[0], parts[1]))
    return merges


def read_tokenizer_config(directory: Path) -> dict:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenloomError(f"{path}: not valid JSON: {e}") from None


class GPT2BPETokenizer(_HFBase):
    """``kind="gpt2-bpe"``. Options: ``merges`` (path), ``pretokenizer`` ("gpt2" | "qwen2"; default
    from tokenizer_config.json), ``fast`` (default True: tiktoken when proven identical), eod/bos/pad,
    num_threads."""

    kind = "gpt2-bpe"

    def __init__(self, spec: TokenizerSpec):
        opts = dict(spec.options)
        vocab_path, merges_path = find_vocab_merges(spec.file_path(), opts.pop("merges", None))
        files = {vocab_path.name: sha256_file(vocab_path), merges_path.name: sha256_file(merges_path)}
        config = read_tokenizer_config(vocab_path.parent)
        pretok = opts.pop("pretokenizer", None)
        if pretok is None:
            cls = config.get("tokenizer_class")
            if cls in QWEN2_CLASSES:
                pretok = "qwen2"
            elif cls in GPT2_CLASSES:
                pretok = "gpt2"
            else:
                raise TokenloomError(
                    f"{vocab_path.parent / 'tokenizer_config.json'}: tokenizer_class {cls!r} is not supported "
                    f"for vocab.json+merges.txt (only GPT-2 and Qwen2 pre-tokenisation are); use its "
                    f"tokenizer.json with kind='hf', or pass pretokenizer='gpt2'/'qwen2' if you know it matches"
                )
        if pretok not in ("gpt2", "qwen2"):
            raise TokenloomError(f"pretokenizer must be 'gpt2' or 'qwen2', got {pretok!r}")
        self.pretokenizer = pretok
        fast = opts.pop("fast", True)
        super().__init__(spec, files, engine="tokenizers")
        self.num_threads = resolve_threads(opts.pop("num_threads", None))

        try:
            vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenloomError(f"{vocab_path}: not a valid vocab.json: {e}") from None
        if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
            raise TokenloomError(f"{vocab_path}: vocab.json must map token strings to integer ids")
        self._paths, self._config, self._tk = (vocab_path, merges_path), config, None
        if fast and pretok == "gpt2" and self._is_gpt2(files, vocab, merges_path):
            # tiktoken encodes and decodes; the tokenizers model is built only if asked for
            self.engine = "tiktoken"
            self._set_specials(opts, vocab_path, {"<|endoftext|>": vocab["<|endoftext|>"]}
                               if "<|endoftext|>" in vocab else {}, ids=vocab)
            self._build_tiktoken(vocab)
            return
        self._tk = self._build_model(vocab, read_merges(merges_path))
        # GPT-2's <|endoftext|> is an ordinary vocab entry (Megatron's eod), not an added token
        defaults = {t.content: i for i, t in self.tk.get_added_tokens_decoder().items()}
        if "<|endoftext|>" in vocab:
            defaults.setdefault("<|endoftext|>", vocab["<|endoftext|>"])
        self._set_specials(opts, vocab_path, defaults)

    @property
    def tk(self) -> tokenizers.Tokenizer:
        """The ``tokenizers`` model (built on first use when tiktoken is the engine)."""
        if self._tk is None:
            vocab_path, merges_path = self._paths
            self._tk = self._build_model(json.loads(vocab_path.read_text(encoding="utf-8")),
                                         read_merges(merges_path))
        return self._tk

    def _build_model(self, vocab: dict[str, int], merges: list[tuple[str, str]]) -> tokenizers.Tokenizer:
        tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tk.decoder = decoders.ByteLevel()
        if self.pretokenizer == "gpt2":
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tk.normalizer = normalizers.NFC()
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
            self._add_config_tokens(tk, self._config, self._paths[0])
        return tk

    @staticmethod
    def _is_gpt2(files: dict[str, str], vocab: dict[str, int], merges_path: Path) -> bool:
        """The proof for the fast engine: the files are OpenAI's GPT-2 files, byte for byte or
        re-serialised (same vocab entries and ids, same merges in the same order)."""
        if sorted(files.values()) == sorted([GPT2_VOCAB_SHA, GPT2_MERGES_SHA]):
            return True
        return len(vocab) == 50257 and bpe_content_digest(vocab, read_merges(merges_path)) == GPT2_CONTENT_SHA

    @staticmethod
    def _add_config_tokens(tk: tokenizers.Tokenizer, config: dict, vocab_path: Path) -> None:
        added = sorted(((int(i), t) for i, t in config.get("added_tokens_decoder", {}).items()))
        for i, tok in added:
            tk.add_special_tokens([AddedToken(tok["content"], special=tok.get("special", True), normalized=False)])
            if tk.token_to_id(tok["content"]) != i:
                raise TokenloomError(f"{vocab_path.parent / 'tokenizer_config.json'}: added token "
                                     f"{tok['content']!r} should get id {i}, the vocab gives it "
                                     f"{tk.token_to_id(tok['content'])}")

    def _build_tiktoken(self, vocab: dict[str, int]) -> None:
        self._vocab, self._enc = vocab, None

    @property
    def enc(self):
        """The tiktoken encoding, built on first use (a visible part of a start): a run whose
        gigatoken self-check verdict is cached never encodes with it, unless a text holds an
        escape."""
        if self._enc is None:
            self._enc = tiktoken.Encoding("gpt2", pat_str=R50K_PATTERN, mergeable_ranks=self._ranks(),
                                          special_tokens={"<|endoftext|>": self._vocab["<|endoftext|>"]})
        return self._enc

    def _ranks(self) -> dict[bytes, int]:
        # str.translate maps GPT-2's printable stand-ins back to chr(byte) in C; latin-1 then
        # gives the bytes (several times faster than a per-character generator)
        to_bytes = {ord(c): b for b, c in bytes_to_unicode().items()}
        return {tok.translate(to_bytes).encode("latin-1"): i for tok, i in self._vocab.items()
                if tok != "<|endoftext|>"}

    def _rank_file(self) -> Path:
        """OpenAI's GPT-2 ranks as a tiktoken rank file (the files were proven to be GPT-2's), kept in
        the user cache and checked against its sha256 on every use (far cheaper than writing it at
        every run's start); written again when missing or different."""
        cached = user_cache_dir() / "gigatoken" / f"gpt2-{GPT2_RANKS_SHA[:16]}.tiktoken"
        with contextlib.suppress(OSError):
            if hashlib.sha256(cached.read_bytes()).hexdigest() == GPT2_RANKS_SHA:
                return cached
        data = b"".join(b"%s %d\n" % (base64.b64encode(t), r) for t, r in self._ranks().items())
        if hashlib.sha256(data).hexdigest() != GPT2_RANKS_SHA:
            raise AssertionError("GPT-2's ranks do not give the rank file they were proven to give")
        tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, cached)  # a concurrent run reads the old file or the whole new one
            return cached
        except OSError:  # an unwritable cache: a file of this process's own
            with contextlib.suppress(OSError):
                tmp.unlink()
            own = Path(tempfile.mkdtemp(prefix="tokenloom-gpt2-")) / "gpt2.tiktoken"
            own.write_bytes(data)
            return own

    def id_options(self) -> dict:
        return {**super().id_options(), "pretokenizer": self.pretokenizer}

    def gigatoken_source(self) -> GigatokenSource:
        """The vocab+merges in gigatoken: OpenAI's GPT-2 as the ranks tiktoken encodes with (a rank
        file, no special tokens, as ``encode_ordinary``), any other as the tokenizer.json of the
        reference model. Loading the rank file is cheaper than building the ``tokenizers`` model and
        its JSON for gigatoken at every run's start."""
        import gigatoken  # lazy: start-up time, gigatoken loads only when its engine is tried

        if self.engine != "tiktoken":
            return GigatokenSource(gigatoken.Tokenizer.from_json(self.tk.to_str()), ["<|endoftext|>", *self.added_tokens()])
        specials = ["<|endoftext|>"]  # GPT-2's files add no tokens (``_build_model`` adds them for qwen2 only)
        path = self._rank_file()
        try:
            model = gigatoken.Tokenizer.from_tiktoken(path, pretokenizer="gpt2", special_tokens={})
        finally:
            if path.parent.name.startswith("tokenloom-gpt2-"):
                shutil.rmtree(path.parent, ignore_errors=True)
        return GigatokenSource(model, specials)

    def encode_batch_reference(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self.engine == "tiktoken":
            return encode_ordinary_flat(self.enc, texts, self.num_threads)
        return super().encode_batch_reference(texts)

    def decode(self, ids) -> str:
        # GPT-2's <|endoftext|> is a plain vocab entry, so skip eod/bos/pad by id (same on both engines)
        specials = {i for i in (self.eod, self.bos, self.pad) if i is not None}
        if self.engine == "tiktoken":
            return decode_skipping(self.enc, ids, specials)
        return super().decode([int(i) for i in ids if int(i) not in specials])


class WordPieceTokenizer(_HFBase):
    """``kind="wordpiece"``: BERT vocab.txt (file or directory). Options: ``lowercase`` (bool; default
    inferred from the vocab), eod/bos/pad, num_threads."""

    kind = "wordpiece"

    def __init__(self, spec: TokenizerSpec):
        path = spec.file_path()
        if path.is_dir():
            path = path / "vocab.txt"
        if not path.is_file():
            raise TokenloomError(f"{path}: no vocab.txt here")
        super().__init__(spec, {path.name: sha256_file(path)}, engine="tokenizers")
        opts = self._setup(spec)
        try:
            tokens = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise TokenloomError(f"{path}: not a UTF-8 vocab.txt: {e}") from None
        if "[UNK]" not in tokens:
            raise TokenloomError(f"{path}: a WordPiece vocab.txt needs an [UNK] token")
        lowercase = opts.pop("lowercase", None)
        if lowercase is None:
            lowercase = not any(c.isupper() for t in tokens if not t.startswith("[") for c in t)
        self.lowercase = bool(lowercase)
        self._tk = BertWordPieceTokenizer(str(path), lowercase=self.lowercase)._tokenizer
        self._set_specials(opts, path, defaults={t: i for i, t in enumerate(tokens)})

    def id_options(self) -> dict:
        return {**super().id_options(), "lowercase": self.lowercase}
