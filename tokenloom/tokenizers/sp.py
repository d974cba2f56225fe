"""SentencePiece ``.model`` files (Llama-2, Mistral, and what ``train_tokenizer(kind="unigram")`` writes).

Encoded with ``SentencePieceProcessor.encode`` default options (no BOS/EOS, no
sampling), which matches Megatron's SentencePieceTokenizer/Llama2Tokenizer ids and
the reference counts. bos/eod/pad come from the model (``bos_id``/``eos_id``/
``pad_id``; -1 means absent). Batch encoding uses sentencepiece's own thread pool
(``num_threads``; 1 keeps it on the calling thread).

Files named ``tokenizer.model`` are not always SentencePiece (Llama-3's is a
tiktoken rank file); detection looks at the content, see ``load.detect_kind``.
"""

from __future__ import annotations

import numpy as np
import sentencepiece as spm

from tokenloom.errors import TokenloomError
from tokenloom.tokenizers.base import Tokenizer, TokenizerSpec, flatten, resolve_threads, sha256_file
from tokenloom.tokenizers.gigatoken_engine import GigatokenSource


class SentencePieceTokenizer(Tokenizer):
    """``kind="sentencepiece"``: a .model file (or a directory with tokenizer.model).
    Options: eod/bos/pad (piece or id), num_threads."""

    kind = "sentencepiece"

    def __init__(self, spec: TokenizerSpec):
        path = spec.file_path()
        if path.is_dir():
            path = path / "tokenizer.model"
        if not path.is_file():
            raise TokenloomError(f"{path}: no SentencePiece tokenizer.model here")
        super().__init__(spec, {path.name: sha256_file(path)}, engine="sentencepiece")
        self.model_path = path
        opts = dict(spec.options)
        self.num_threads = resolve_threads(opts.pop("num_threads", None))
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise TokenloomError(f"{path}: not a valid SentencePiece model: {e}") from None
        self.vocab_size = self.sp.get_piece_size()
        defaults = {"eod": self.sp.eos_id(), "bos": self.sp.bos_id(), "pad": self.sp.pad_id()}
        for attr, default in defaults.items():
            token = opts.pop(attr, None)
            if token is None:
                value = default if default >= 0 else None
            elif isinstance(token, int):
                if not 0 <= token < self.vocab_size:
                    raise TokenloomError(f"{path}: {attr} id {token} is outside the vocabulary 0..{self.vocab_size - 1}")
                value = token
            else:
                value = self.sp.piece_to_id(token)
                if value == self.sp.unk_id() and token != self.sp.id_to_piece(value):
                    raise TokenloomError(f"{path}: {attr} piece {token!r} is not in the model")
            setattr(self, attr, value)
        if opts:
            raise TokenloomError(f"unknown sentencepiece options {sorted(opts)} for {path}")

    def encode_batch_reference(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self.num_threads is None:
            seqs = self.sp.encode(texts, out_type=int)
        else:
            seqs = self.sp.encode(texts, out_type=int, num_threads=self.num_threads)
        return flatten(seqs)

    def gigatoken_source(self) -> GigatokenSource:
        """gigatoken's SentencePiece-BPE reader (BPE with byte fallback only; others raise). Control
        pieces are escapes: gigatoken matches them in text, sentencepiece does not. Probed too: the
        pieces of score 0 that are not bytes (user-defined and hand-added pieces)."""
        import gigatoken  # lazy: start-up time, gigatoken loads only when its engine is tried

        sp, ids = self.sp, range(self.vocab_size)
        control = [sp.id_to_piece(i) for i in ids if sp.is_control(i)]
        manual = [sp.id_to_piece(i) for i in ids if sp.get_score(i) == 0 and not (sp.is_byte(i) or sp.is_control(i)
                                                                                  or sp.is_unknown(i))]
        model = gigatoken.Tokenizer.from_sentencepiece(self.model_path.read_bytes())
        return GigatokenSource(model, control + manual[:256], escapes=tuple(control))

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])
