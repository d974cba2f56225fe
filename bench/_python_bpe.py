"""The classic pure-Python GPT-2 byte-level BPE, as Megatron-LM's GPT2BPETokenizer runs it.

Megatron's ``tools/preprocess_data.py --tokenizer-type GPT2BPETokenizer`` encodes with
``megatron/training/tokenizer/gpt2_tokenization.py``: a Python implementation of
OpenAI's original encoder (regex pre-split, byte-to-unicode map, greedy lowest-rank
merges, a per-word cache). ``megatron.training`` is not in the megatron-core wheel, so
the bench uses this clean re-implementation of the same published algorithm as the
baseline's tokenizer, doing per token what Megatron's does (cached merges looked up per
pre-token, ``extend`` over a generator, then a second loop mapping symbols to ids through
the special-token table and the vocabulary). The bench checks that it gives the same ids
as tokenloom.
"""

from __future__ import annotations

import json

import regex

from tokenloom.tokenizers.tiktoken_bpe import byte_characters

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_alphabet() -> dict[int, str]:
    """Map every byte to a printable unicode character (printable bytes map to themselves):
    GPT-2's table, the one tokenloom's tiktoken export uses."""
    return dict(enumerate(byte_characters()))


class PythonGPT2BPE:
    def __init__(self, vocab_json: str, merges_txt: str):
        with open(vocab_json, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(merges_txt, encoding="utf-8") as f:
            lines = [ln for ln in f.read().split("\n") if ln and not ln.startswith("#version")]
        self.ranks = {tuple(ln.split()): i for i, ln in enumerate(lines)}
        self.alphabet = byte_alphabet()
        self.pattern = regex.compile(GPT2_PATTERN)
        self.cache: dict[str, str] = {}
        self.special_tokens: dict[str, int] = {}  # Megatron's GPT2BPETokenizer adds none
        self.eod = self.encoder["<|endoftext|>"]

    def bpe(self, word: str) -> str:
        """The merged symbols of one pre-token, space-joined (cached per pre-token, like Megatron's)."""
        cached = self.cache.get(word)
        if cached is not None:
            return cached
        parts = list(word)
        while len(parts) > 1:
            best, best_rank = None, None
            for pair in zip(parts, parts[1:], strict=False):
                rank = self.ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = pair, rank
            if best is None:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        joined = " ".join(parts)
        self.cache[word] = joined
        return joined

    def tokenize(self, text: str) -> list[str]:
        symbols: list[str] = []
        for piece in self.pattern.findall(text):
            piece = "".join(self.alphabet[b] for b in piece.encode("utf-8"))
            symbols.extend(symbol for symbol in self.bpe(piece).split(" "))  # a generator, as Megatron's
        return symbols

    def convert_tokens_to_ids(self, symbols: list[str]) -> list[int]:
        """Per symbol: the special-token table first, then the vocabulary (Megatron's loop)."""
        ids = []
        for symbol in symbols:
            if symbol in self.special_tokens:
                ids.append(self.special_tokens[symbol])
            else:
                ids.append(self.encoder.get(symbol, 0))
        return ids

    def encode(self, text: str) -> list[int]:
        """Two passes as in Megatron's tokenizer: text -> BPE symbols, then symbols -> ids."""
        return self.convert_tokens_to_ids(self.tokenize(text))
