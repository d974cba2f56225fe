"""Acceptance: byte-identical to Megatron-LM's tools/preprocess_data.py on the shared corpora."""

from __future__ import annotations

import pytest
from preprocess_helpers import preprocess, same_bytes

from tokenloom.indexed import IndexedDataset

CASES = [
    # corpus file, reference prefix, GPT-2 tokens without EOD (shared/data/README.md), documents
    ("tinyshakespeare/tinyshakespeare.jsonl", "tinyshakespeare_gpt2_eod", 323_585, 7222),
    ("wikitext-2/wikitext-2.jsonl", "wikitext-2_gpt2_eod", 554_410, 122),
]


@pytest.mark.parametrize("corpus, reference, tokens, documents", CASES)
def test_gpt2_append_eod_matches_megatron(tmp_path, shared_data, corpus, reference, tokens, documents):
    out = preprocess(tmp_path, [shared_data / corpus], tokenizer=str(shared_data / "tokenizers" / "gpt2"),
                     tokenizer_type=None, append_eod=True, workers=2, chunk_bytes=1 << 16)
    assert same_bytes(out, shared_data / "megatron-reference" / reference)
    ds = IndexedDataset(out)
    assert ds.num_tokens == tokens + documents
    assert ds.num_documents == documents


def test_reference_path_gives_the_same_bytes(tmp_path, shared_data):
    """The slow reference engine (HF tokenizers from vocab+merges) writes the same files as the fast one."""
    out = preprocess(tmp_path, [shared_data / "tinyshakespeare" / "tinyshakespeare.jsonl"],
                     tokenizer=str(shared_data / "tokenizers" / "gpt2"), tokenizer_type="gpt2-bpe",
                     append_eod=True)
    assert same_bytes(out, shared_data / "megatron-reference" / "tinyshakespeare_gpt2_eod")
