"""Acceptance: byte-identical to Megatron-LM's tools/preprocess_data.py on the shared corpora.

shared/data/README.md says how the references were made (core_v0.16.1, ``--append-eod``, json key
``text``): GPT2BPETokenizer with vocab+merges, HuggingFaceTokenizer with the NeoX-20B
tokenizer.json (no BOS), SentencePieceTokenizer with Llama 2's model (``encode_as_ids``, no BOS;
EOD is the model's ``</s>``; a document that tokenizes to nothing writes no sequence).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from preprocess_helpers import preprocess, same_bytes

from tokenloom.cli import main
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


FAMILIES = {  # reference suffix -> tokenizer under shared/data/tokenizers, as Megatron was given it
    "gpt2": "gpt2",
    "neox": "gpt-neox-20b/tokenizer.json",
    "llama2": "llama2/tokenizer.model",
}


@pytest.mark.parametrize("backend", ["auto", "reference", "gigatoken"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cli_matches_megatron_through_every_backend(tmp_path, shared_data, family, backend):
    """``cli.py preprocess`` with each backend (auto picks gigatoken for all three: its self-check
    passes) writes Megatron's bytes; the manifest names the backend that ran."""
    out = tmp_path / f"{family}_{backend}"
    result = CliRunner().invoke(main, [
        "preprocess", "--input", str(shared_data / "tinyshakespeare" / "tinyshakespeare.jsonl"),
        "--output-prefix", str(out), "--tokenizer", str(shared_data / "tokenizers" / FAMILIES[family]),
        "--append-eod", "--workers", "2", "--chunk-bytes", str(1 << 16), "--tokenizer-backend", backend,
        "--no-progress"])
    assert result.exit_code == 0, result.output
    assert same_bytes(out, shared_data / "megatron-reference" / f"tinyshakespeare_{family}_eod")
    tokenizer = json.loads((tmp_path / f"{out.name}.manifest.json").read_text())["tokenizer"]
    assert tokenizer["backend"] == ("reference" if backend == "reference" else "gigatoken")
    assert tokenizer["backend_reason"]
