"""File-less tokenizers: ``byte`` (UTF-8 bytes) and ``null`` (integers written as text).

``byte`` layout: ids 0..255 are the UTF-8 bytes of the text, then the specials:
256 = eod (``<|endoftext|>``), 257 = bos, 258 = pad; vocab_size = 259, so ids fit
uint16. No vocabulary file and no merges: 1 token per byte (several times the
tokens of GPT-2 on English), useful for char-level models and tests. ``decode`` skips the
specials and replaces invalid UTF-8 with U+FFFD.

``null`` follows Megatron's NullTokenizer: the text is whitespace-separated
integer ids, emitted as they are. With ``vocab_size=V`` the text may hold ids
0..V-1, eod = V and ``vocab_size`` reports V + 1. Without the option V defaults to
2**31 - 2, so eod and every id fit int32 storage. Intended for tests and for data
that is already tokenised.
"""

from __future__ import annotations

import numpy as np

from tokenloom.errors import TokenloomError
from tokenloom.tokenizers.base import Tokenizer, TokenizerSpec, flatten

BYTE_EOD, BYTE_BOS, BYTE_PAD = 256, 257, 258
NULL_DEFAULT_VOCAB = 2**31 - 2


class ByteTokenizer(Tokenizer):
    """``kind="byte"``: no options."""

    kind = "byte"
    vocab_size = 259
    eod, bos, pad = BYTE_EOD, BYTE_BOS, BYTE_PAD

    def __init__(self, spec: TokenizerSpec):
        unknown = sorted(set(spec.options) - {"num_threads"})
        if unknown:
            raise TokenloomError(f"the byte tokenizer takes no options, got {unknown}")
        super().__init__(spec, {}, engine="python")

    def encode_batch_reference(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        data = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter((len(d) for d in data), dtype=np.int64, count=len(data))
        return np.frombuffer(b"".join(data), dtype=np.uint8).astype(np.int64), lengths

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class NullTokenizer(Tokenizer):
    """``kind="null"``: option ``vocab_size`` (ids allowed in the text, eod = vocab_size)."""

    kind = "null"

    def __init__(self, spec: TokenizerSpec):
        opts = dict(spec.options)
        opts.pop("num_threads", None)  # single-threaded anyway
        n = int(opts.pop("vocab_size", NULL_DEFAULT_VOCAB))
        if opts:
            raise TokenloomError(f"unknown null tokenizer options {sorted(opts)}")
        if not 0 < n <= NULL_DEFAULT_VOCAB:
            raise TokenloomError(f"null tokenizer vocab_size must be in 1..{NULL_DEFAULT_VOCAB}, got {n}")
        super().__init__(spec, {}, engine="python")
        self.max_text_id = n - 1
        self.eod, self.vocab_size = n, n + 1

    def id_options(self) -> dict:
        return {"vocab_size": self.max_text_id + 1}

    def encode_batch_reference(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        try:
            seqs = [[int(w) for w in t.split()] for t in texts]
        except ValueError as e:
            raise TokenloomError(f"null tokenizer: text must be whitespace-separated integers ({e})") from None
        ids, lengths = flatten(seqs)
        if ids.size and (ids.min() < 0 or ids.max() > self.max_text_id):
            raise TokenloomError(f"null tokenizer: id out of range 0..{self.max_text_id} "
                                 f"(min {ids.min()}, max {ids.max()})")
        return ids, lengths

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids if int(i) != self.eod)
