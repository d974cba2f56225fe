"""tiktoken rank files (``base64-token rank`` lines): GPT-2 r50k, Llama-3, cl100k, ...

A rank file holds only the BPE ranks; the split regex and the special tokens live
elsewhere. Known files are recognised by sha256 and get their published pattern
and specials (table ``KNOWN_RANK_FILES``); for any other file pass ``pattern``
(a regex or a name from ``PATTERNS``) and ``special_tokens`` ({name: id}, or a
list of names numbered from the first id after the ranks), else loading fails
rather than guessing.

Trade-offs: we parse the rank file ourselves instead of calling
``tiktoken.load.load_tiktoken_bpe``, which copies even local files into a cache
keyed by path (a changed file at the same path would be served stale). Text is
encoded with ``encode_ordinary``: special-token strings in the text are encoded as
ordinary text (as Megatron's GPT-2 tokenizer does); callers append ``eod`` ids.
Llama-3 uses Meta's layout (specials at 128000..128255), not Megatron
TikTokenizer's layout (specials shifted to the front), because that is the layout
of the released checkpoints and of the shared FIM fixture.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

import numpy as np
import tiktoken

from tokenloom.errors import TokenloomError
from tokenloom.tokenizers.base import Tokenizer, TokenizerSpec, flatten, resolve_threads, sha256_file
from tokenloom.tokenizers.gigatoken_engine import GigatokenSource, Unsupported

ENDOFTEXT = "<|endoftext|>"

R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CL100K_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# our split patterns -> gigatoken's name for the same pretokenizer (the self-check proves each file)
GIGATOKEN_SCHEMES = {R50K_PATTERN: "gpt2", CL100K_PATTERN: "gpt4", O200K_PATTERN: "o200k"}
PATTERNS = {"r50k": R50K_PATTERN, "gpt2": R50K_PATTERN, "llama3": LLAMA3_PATTERN, "cl100k": CL100K_PATTERN,
            "o200k": O200K_PATTERN}


def _llama3_specials() -> dict[str, int]:
    names = [
        "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>",
        "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
    ] + [f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)]
    return {name: 128000 + i for i, name in enumerate(names)}


# sha256 of the rank file -> (name, pattern, specials, eod, bos). The OpenAI hashes are the
# ones tiktoken pins (tiktoken_ext/openai_public.py); only r50k and llama3 are in the shared
# test data, the others are recognised on the strength of the pinned hash.
KNOWN_RANK_FILES = {
    "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930":
        ("r50k_base", R50K_PATTERN, {ENDOFTEXT: 50256}, ENDOFTEXT, None),
    "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069":
        ("p50k_base", R50K_PATTERN, {ENDOFTEXT: 50256}, ENDOFTEXT, None),
    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7":
        ("cl100k_base", CL100K_PATTERN, {ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                                         "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}, ENDOFTEXT, None),
    "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d":
        ("o200k_base", O200K_PATTERN, {ENDOFTEXT: 199999, "<|endofprompt|>": 200018}, ENDOFTEXT, None),
    "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55":
        ("llama3", LLAMA3_PATTERN, _llama3_specials(), "<|end_of_text|>", "<|begin_of_text|>"),
}


def looks_like_rank_file(head: bytes) -> bool:
    """True if the first lines of a file are ``<base64> <int>`` pairs."""
    lines = [ln for ln in head.split(b"\n")[:-1] if ln.strip()][:50]  # last line may be cut
    if not lines:
        return False
    for line in lines:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            return False
        try:
            base64.b64decode(parts[0], validate=True)
        except (binascii.Error, ValueError):
            return False
    return True


def read_rank_file(path: str | Path) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise TokenloomError(
                    f"{path}:{lineno}: not a tiktoken rank line (expected '<base64> <rank>'): {line[:60]!r}"
                ) from None
    if not ranks:
        raise TokenloomError(f"{path}: empty tiktoken rank file")
    return ranks


def encode_ordinary_flat(enc: tiktoken.Encoding, texts: list[str], num_threads: int | None):
    """``(ids int64, lengths int64)`` of ``texts``, every special-token string encoded as text.

    One thread (preprocess workers): ``encode_to_numpy`` per text, which hands tiktoken's
    token buffer straight to numpy instead of building a Python int per token, then one
    concatenate (a visible part of a worker's time saved). With no special token allowed and
    none disallowed it runs tiktoken's ``encode`` with an empty allowed set, which encodes
    the whole text as ordinary text, as ``encode_ordinary`` does (tests prove the ids equal,
    special-token strings included). Several threads: tiktoken's own batch API.
    """
    if num_threads == 1 or len(texts) == 1:
        arrays = [enc.encode_to_numpy(t, disallowed_special=()) for t in texts]
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        ids = np.concatenate(arrays).astype(np.int64) if arrays else np.empty(0, np.int64)
        return ids, lengths
    if num_threads is None:
        return flatten(enc.encode_ordinary_batch(texts))
    return flatten(enc.encode_ordinary_batch(texts, num_threads=num_threads))


def decode_skipping(enc: tiktoken.Encoding, ids, special_ids: set[int]) -> str:
    return enc.decode([int(i) for i in ids if int(i) not in special_ids])


class TiktokenTokenizer(Tokenizer):
    """``kind="tiktoken"``. Options: ``pattern``, ``special_tokens``, ``eod``, ``bos``, ``pad``
    (token names), ``num_threads``."""

    kind = "tiktoken"

    def __init__(self, spec: TokenizerSpec):
        path = spec.file_path()
        if path.is_dir():
            found = sorted(path.glob("*.tiktoken")) or [p for p in [path / "tokenizer.model"] if p.is_file()]
            if len(found) != 1:
                raise TokenloomError(f"{path}: expected exactly one *.tiktoken (or tokenizer.model) file, "
                                     f"found {[p.name for p in found]}")
            path = found[0]
        digest = sha256_file(path)
        super().__init__(spec, {path.name: digest}, engine="tiktoken")
        self.rank_path = path
        opts = dict(spec.options)
        self.num_threads = resolve_threads(opts.pop("num_threads", None))
        name, pattern, specials, eod, bos = KNOWN_RANK_FILES.get(digest, (None, None, None, None, None))
        pattern = opts.pop("pattern", pattern)
        pattern = PATTERNS.get(pattern, pattern)
        specials = opts.pop("special_tokens", specials)
        eod, bos, pad = opts.pop("eod", eod), opts.pop("bos", bos), opts.pop("pad", None)
        if opts:
            raise TokenloomError(f"unknown tiktoken options {sorted(opts)} for {path}")
        if pattern is None:
            raise TokenloomError(
                f"{path}: unknown tiktoken rank file (sha256 {digest[:16]}...); pass pattern=<regex or one of "
                f"{sorted(PATTERNS)}> and special_tokens={{name: id}} so the ids are not guessed"
            )
        ranks = read_rank_file(path)
        n_ranks = max(ranks.values()) + 1
        if specials is None:
            specials = {ENDOFTEXT: n_ranks}
            eod = eod or ENDOFTEXT
        elif isinstance(specials, (list, tuple)):
            specials = {s: n_ranks + i for i, s in enumerate(specials)}
        specials = {str(k): int(v) for k, v in specials.items()}
        if eod is None and ENDOFTEXT in specials:
            eod = ENDOFTEXT
        self._resolved = {"pattern": pattern, "special_tokens": dict(sorted(specials.items(), key=lambda kv: kv[1]))}
        try:
            self.enc = tiktoken.Encoding(name or f"tokenloom-{digest[:12]}", pat_str=pattern,
                                         mergeable_ranks=ranks, special_tokens=specials)
        except Exception as e:  # tiktoken raises ValueError/pyo3 errors for bad regexes or clashing ids
            raise TokenloomError(f"{path}: cannot build tiktoken encoding: {e}") from None
        self.vocab_size = max(n_ranks, *[i + 1 for i in specials.values()])
        self.eod, self.bos, self.pad = (self._special_id(path, specials, t) for t in (eod, bos, pad))
        self._special_ids = set(specials.values())

    @staticmethod
    def _special_id(path, specials: dict[str, int], token) -> int | None:
        if token is None or isinstance(token, int):
            return token
        if token not in specials:
            raise TokenloomError(f"{path}: special token {token!r} is not among the special_tokens")
        return specials[token]

    def id_options(self) -> dict:
        return {**super().id_options(), **self._resolved}

    def encode_batch_reference(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return encode_ordinary_flat(self.enc, texts, self.num_threads)

    def gigatoken_source(self) -> GigatokenSource:
        """gigatoken's rank-file reader with the same split scheme and no special tokens (special-token
        strings stay text, as in ``encode_ordinary``); other split patterns raise."""
        import gigatoken  # lazy: start-up time, gigatoken loads only when its engine is tried

        scheme = GIGATOKEN_SCHEMES.get(self._resolved["pattern"])
        if scheme is None:
            raise Unsupported("gigatoken has no pretokenizer for this split pattern")
        model = gigatoken.Tokenizer.from_tiktoken(self.rank_path, pretokenizer=scheme, special_tokens={})
        return GigatokenSource(model, list(self._resolved["special_tokens"]))

    def decode(self, ids) -> str:
        return decode_skipping(self.enc, ids, self._special_ids)

    def to_tokenizers(self):
        """This encoding as a ``tokenizers`` BPE (what a ``tokenizer.json`` holds), giving the
        same ids: each rank-file token is a vocabulary entry under GPT-2's byte-to-character
        map; every split of a token into two tokens is a merge, ordered by the merged token's
        rank, so the lowest-ranked pair merges first as in tiktoken; ``ignore_merges`` takes a
        pretoken that is itself a token whole, as tiktoken does; the split regex and the
        special tokens (at their ids) are kept. Written here rather than taken from
        ``transformers``' ``TikTokenConverter`` (the same construction, the test's oracle),
        which the product does not depend on."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers  # lazy: export only
        from tokenizers import Tokenizer as TokenizersTokenizer  # lazy: export only

        ranks = read_rank_file(self.rank_path)
        char = byte_characters()

        def text(token: bytes) -> str:
            return "".join(char[b] for b in token)

        vocab = {text(token): rank for token, rank in ranks.items()}
        merges = sorted((rank, ranks[token[:i]], text(token[:i]), text(token[i:]))
                        for token, rank in ranks.items() for i in range(1, len(token))
                        if token[:i] in ranks and token[i:] in ranks)
        specials = self._resolved["special_tokens"]
        vocab.update(specials)
        bpe = models.BPE(vocab, [(left, right) for _, _, left, right in merges], fuse_unk=False,
                         ignore_merges=True)
        tk = TokenizersTokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(self._resolved["pattern"]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
        return tk


def byte_characters() -> list[str]:
    """GPT-2's byte-to-character map (``bytes_to_unicode``), as a list indexed by byte: the
    printable bytes stand for themselves, the others for the characters from U+0100 on, in
    byte order. ``tokenizers``' ByteLevel pre-tokenizer uses the same map."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    out, extra = [""] * 256, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out
