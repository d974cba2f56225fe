"""train_tokenizer: bpe and unigram on tinyshakespeare, loadable, deterministic; the small reader."""

import gzip
import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tok_helpers import CORPORA

from tokenloom.corpus.documents import iter_documents
from tokenloom.errors import TokenloomError
from tokenloom.tokenizers import TrainTokenizerConfig, load_tokenizer, train_tokenizer

SHAKESPEARE = CORPORA["tinyshakespeare"]
needs_corpus = pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} not found")


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@needs_corpus
def test_train_bpe(tmp_path):
    cfg = TrainTokenizerConfig(inputs=[str(SHAKESPEARE)], kind="bpe", vocab_size=512, output=str(tmp_path / "a"))
    out = train_tokenizer(cfg)
    tok = load_tokenizer(out)
    assert tok.kind == "hf" and tok.eod == 0 and tok.vocab_size == 512
    for text in ["ROMEO:\nBut, soft! what light through yonder window breaks?", "unicode ✓ 😀 \t\n", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("First Citizen:")) < len("First Citizen:")  # it learned merges
    again = train_tokenizer(TrainTokenizerConfig(**{**vars(cfg), "output": str(tmp_path / "b")}))
    assert _sha(out / "tokenizer.json") == _sha(again / "tokenizer.json")


@needs_corpus
def test_train_unigram(tmp_path):
    subset = tmp_path / "subset.jsonl"  # a quarter of the corpus keeps two trainings ~2 s
    subset.write_text("".join(SHAKESPEARE.read_text(encoding="utf-8").splitlines(keepends=True)[:1800]))
    cfg = TrainTokenizerConfig(inputs=[str(subset)], kind="unigram", vocab_size=512,
                               special_tokens=["<|endoftext|>", "<|pad|>"], output=str(tmp_path / "a"))
    out = train_tokenizer(cfg)
    tok = load_tokenizer(out)
    assert tok.kind == "sentencepiece" and tok.vocab_size == 512
    assert tok.sp.id_to_piece(tok.eod) == "<|endoftext|>"
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?"
    assert tok.decode(tok.encode(text)) == text
    again = train_tokenizer(TrainTokenizerConfig(**{**vars(cfg), "output": str(tmp_path / "b")}))
    assert _sha(out / "tokenizer.model") == _sha(again / "tokenizer.model")


def test_reads_every_preprocess_format(tmp_path):
    docs = ["one doc", "two\nlines", "ünï"]
    jsonl = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    (tmp_path / "a.jsonl").write_bytes(jsonl)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    pq.write_table(pa.table({"body": docs}), tmp_path / "a.parquet")
    (tmp_path / "a.txt").write_text("l1\nl2\n")
    for name in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst"):
        assert list(iter_documents([str(tmp_path / name)])) == docs
    assert list(iter_documents([str(tmp_path / "a.parquet")], "body")) == docs
    assert list(iter_documents([str(tmp_path / "a.txt")], txt_unit="line")) == ["l1", "l2"]
    with pytest.raises(TokenloomError, match=r"a.jsonl:1: missing key 'body'"):
        list(iter_documents([str(tmp_path / "a.jsonl")], "body"))
    with pytest.raises(TokenloomError, match="no column 'text'"):
        list(iter_documents([str(tmp_path / "a.parquet")]))
    cfg = TrainTokenizerConfig(inputs=[str(tmp_path / "a.*")], output=str(tmp_path / "tok"), vocab_size=300,
                               json_key="body", min_frequency=1)
    with pytest.raises(TokenloomError, match="missing key 'body'"):
        train_tokenizer(cfg)  # the glob includes the jsonl files, which have no 'body'
