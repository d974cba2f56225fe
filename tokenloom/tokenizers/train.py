"""Train a new tokenizer from text files: byte-level BPE (``tokenizers``) or unigram (``sentencepiece``).

Both are deterministic for the same inputs and config: the BPE trainer has no
randomness (ties are broken by pair order), and the unigram trainer runs with
fixed input order (no sentence sampling or shuffling) and ``seed`` as its random
seed. Unigram training uses one thread, so float sums are in a fixed order; it is
slower but repeatable.

* ``bpe`` writes ``tokenizer.json``: ByteLevel pre-tokeniser with the GPT-2 regex,
  the 256-byte initial alphabet (every text is encodable, decode(encode(x)) == x),
  specials first (``<|endoftext|>`` = 0 by default).
* ``unigram`` writes ``tokenizer.model``: the first special
  token becomes the model's eos piece (so ``eod`` is it), the rest are
  user-defined symbols; identity normalisation, no whitespace collapsing, byte
  fallback on, so text is not silently changed. Documents are fed line by line
  (SentencePiece skips "sentences" longer than ``max_sentence_length``).

Inputs are read through the corpus readers (``tokenloom.corpus.documents``),
so training accepts exactly the formats and globs preprocess does, with the same
``file:line`` errors.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenloom.corpus.documents import iter_documents
from tokenloom.errors import TokenloomError
from tokenloom.tokenizers.load import load_tokenizer


@dataclasses.dataclass(kw_only=True)
class TrainTokenizerConfig:
    inputs: list[str]
    """Inputs exactly as preprocess takes them: files, globs or datasets dirs (jsonl[.gz|.zst], parquet, txt)."""
    output: str
    """Directory to write tokenizer.json (bpe) or tokenizer.model (unigram) into; created if missing."""
    kind: str = "bpe"
    """"bpe" (byte-level BPE via tokenizers) or "unigram" (SentencePiece unigram)."""
    vocab_size: int = 32000
    """Total vocabulary size, special tokens included."""
    special_tokens: list[str] = dataclasses.field(default_factory=lambda: ["<|endoftext|>"])
    """Special tokens; the first one is the end-of-document (eod) token."""
    min_frequency: int = 2
    """BPE: minimum pair count for a merge. Unigram: ignored (SentencePiece has no such knob)."""
    json_key: str = "text"
    """Field holding the text in jsonl / parquet / datasets inputs (one key)."""
    txt_unit: str = "file"
    """What one document is in a .txt input: file, paragraph or line (as in preprocess)."""
    seed: int = 0
    """Random seed (unigram); BPE training is deterministic without one."""


def _iter_all(cfg: TrainTokenizerConfig) -> Iterator[str]:
    yield from iter_documents(cfg.inputs, key=cfg.json_key, txt_unit=cfg.txt_unit)


def train_tokenizer(cfg: TrainTokenizerConfig) -> Path:
    """Train per ``cfg`` and return the output directory (loadable with ``load_tokenizer``)."""
    if not cfg.inputs:
        raise TokenloomError("train_tokenizer: no input files")
    if not cfg.special_tokens:
        raise TokenloomError("train_tokenizer: need at least one special token (the first is the eod)")
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.kind == "bpe":
        _train_bpe(cfg, out)
    elif cfg.kind == "unigram":
        _train_unigram(cfg, out)
    else:
        raise TokenloomError(f"train_tokenizer: kind must be 'bpe' or 'unigram', got {cfg.kind!r}")
    return out


def vocabulary_shortfall(cfg: TrainTokenizerConfig, out: Path) -> str | None:
    """A warning when the tokenizer trained into ``out`` has fewer ids than ``cfg.vocab_size``, with the
    reason, or None. Only BPE can fall short: its trainer stops when no pair of tokens occurs
    ``min_frequency`` times any more, while SentencePiece fails instead (an error)."""
    got = load_tokenizer(out).vocab_size
    if got >= cfg.vocab_size:
        return None
    return (f"the trained vocabulary has {got} ids, fewer than --vocab-size {cfg.vocab_size}: after {got} ids no pair "
            f"of tokens occurs --min-frequency {cfg.min_frequency} times in the input; more text (or a lower "
            "--min-frequency) gives more ids")


def _train_bpe(cfg: TrainTokenizerConfig, out: Path) -> None:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    min_vocab = 256 + len(cfg.special_tokens)
    if cfg.vocab_size < min_vocab:
        raise TokenloomError(f"train_tokenizer: bpe vocab_size must be >= {min_vocab} (256 bytes + specials)")
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency, special_tokens=list(cfg.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tk.train_from_iterator(_iter_all(cfg), trainer=trainer)
    tk.save(str(out / "tokenizer.json"))


def _train_unigram(cfg: TrainTokenizerConfig, out: Path) -> None:
    def lines() -> Iterator[str]:
        for text in _iter_all(cfg):
            yield from (ln for ln in text.split("\n") if ln.strip())

    eod, *others = cfg.special_tokens
    spm.set_random_generator_seed(cfg.seed)  # process-global in sentencepiece; no TrainerSpec field
    model = io.BytesIO()  # not model_prefix: that would store the output path inside the model
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(), model_writer=model, model_type="unigram",
            vocab_size=cfg.vocab_size, eos_piece=eod, user_defined_symbols=others or None,
            normalization_rule_name="identity", remove_extra_whitespaces=False, byte_fallback=True,
            character_coverage=1.0, input_sentence_size=0, shuffle_input_sentence=False,
            num_threads=1, minloglevel=2,
        )
    except RuntimeError as e:
        raise TokenloomError(f"train_tokenizer: sentencepiece failed: {e}") from None
    (out / "tokenizer.model").write_bytes(model.getvalue())
