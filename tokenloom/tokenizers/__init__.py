"""Tokenizers: one interface over Hugging Face, GPT-2 BPE, WordPiece, SentencePiece, tiktoken, byte, null.

    tok = load_tokenizer("/data/tokenizers/gpt2")        # kind auto-detected from the content
    ids, lengths = tok.encode_batch(["a doc", "another"])  # flat ids + per-text lengths, no specials
    tok.eod, tok.vocab_size, tok.fingerprint()["digest"]
    worker_tok = load_tokenizer(tok.spec.with_options(num_threads=1))  # in a worker process

Policy (details in each backend's module docstring):

* ``encode``/``encode_batch`` add no BOS/EOS; the caller appends ``eod``. ids are
  the ids of the matching Megatron tokenizer type (tests check the reference
  counts of the shared corpora).
* ``vocab_size`` is max id + 1 over everything the tokenizer can emit, so it is
  safe for choosing uint16 vs int32.
* Threads: ``num_threads`` option, default from ``$TOKENLOOM_TOKENIZER_THREADS``,
  else the backend's default (tiktoken 8 threads, HF rayon = all cores,
  sentencepiece all cores). Preprocess workers should pass ``num_threads=1``: the
  parallelism then comes from the processes, and no thread pool is started.
* A faster engine is used only when it is proven to give identical ids (GPT-2
  vocab+merges -> tiktoken, see ``hf.py``; ``fast=False`` turns it off), and gigatoken
  only after a self-check on load against that engine (``gigatoken_engine.py``;
  ``backend="reference"`` or ``use_backend("reference")`` turns it off).
"""

from tokenloom.tokenizers.base import THREADS_ENV, Tokenizer, TokenizerSpec
from tokenloom.tokenizers.gigatoken_engine import BACKEND_CHOICES, use_backend
from tokenloom.tokenizers.load import KIND_ALIASES, detect_kind, list_kinds, load_tokenizer
from tokenloom.tokenizers.train import TrainTokenizerConfig, train_tokenizer

__all__ = [
    "BACKEND_CHOICES",
    "KIND_ALIASES",
    "THREADS_ENV",
    "Tokenizer",
    "TokenizerSpec",
    "TrainTokenizerConfig",
    "detect_kind",
    "list_kinds",
    "load_tokenizer",
    "train_tokenizer",
    "use_backend",
]
