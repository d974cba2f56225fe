"""Acceptance: the same documents in every input format give identical outputs."""

from __future__ import annotations

import blake3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from preprocess_helpers import preprocess, same_bytes, write_jsonl

from tokenloom.indexed import IndexedDataset, manifest


def test_all_formats_identical(tmp_path, docs):
    src = tmp_path / "src"
    src.mkdir()
    inputs = {
        "jsonl": [write_jsonl(src / "d.jsonl", docs)],
        "gz": [write_jsonl(src / "d.jsonl.gz", docs, "gz")],
        "zst": [write_jsonl(src / "d.jsonl.zst", docs, "zst")],
    }
    pq.write_table(pa.table({"text": [d["text"] for d in docs], "id": [d["id"] for d in docs]}),
                   src / "d.parquet", row_group_size=3)
    inputs["parquet"] = [src / "d.parquet"]
    txt_dir = src / "txt"
    txt_dir.mkdir()
    for i, d in enumerate(docs):
        (txt_dir / f"{i:03d}.txt").write_text(d["text"], encoding="utf-8")
    inputs["txt"] = [txt_dir / "*.txt"]
    import datasets

    datasets.Dataset.from_list(docs).save_to_disk(str(src / "hfds"))
    inputs["datasets"] = [src / "hfds"]
    outs = {name: preprocess(tmp_path, paths, name=name, append_eod=True, chunk_bytes=64)
            for name, paths in inputs.items()}
    for name, out in outs.items():
        assert same_bytes(out, outs["jsonl"]), name
    ds = IndexedDataset(outs["jsonl"])
    assert ds.num_documents == len(docs)
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3, 4, 5, 6]  # the empty document has no sequence
    assert ds[0].tolist() == list(b"hello world") + [256]
    assert manifest.read(outs["parquet"])["counts"]["empty_documents"] == 1


def test_txt_paragraphs_equal_the_jsonl_blocks(tmp_path, shared_data):
    """tinyshakespeare.jsonl is input.txt cut at blank lines (shared/data/README.md)."""
    base = shared_data / "tinyshakespeare"
    a = preprocess(tmp_path, [base / "input.txt"], name="txt", txt_unit="paragraph", append_eod=True)
    b = preprocess(tmp_path, [base / "tinyshakespeare.jsonl"], name="jsonl", append_eod=True)
    assert same_bytes(a, b)
    assert IndexedDataset(a).num_documents == 7222


def test_txt_lines(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\nthree\n")
    out = preprocess(tmp_path, [tmp_path / "a.txt"], txt_unit="line")
    ds = IndexedDataset(out)
    assert ds.num_documents == 3 and [bytes(ds[i].astype("u1")) for i in range(len(ds))] == [b"one", b"three"]


def test_multiple_keys_and_megatron_names(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ab", "title": "T"}, {"text": "c", "title": ""}])
    preprocess(tmp_path, [path], name="m", json_keys=["text", "title"], megatron_names=True)
    text = IndexedDataset(tmp_path / "m_text_document")
    title = IndexedDataset(tmp_path / "m_title_document")
    assert text.num_tokens == 3 and title.num_tokens == 1 and title.num_documents == 2
    assert manifest.read(tmp_path / "m_title_document")["output"]["key"] == "title"
    preprocess(tmp_path, [path], name="k", json_keys=["text", "title"])
    assert (tmp_path / "k_text.idx").exists() and (tmp_path / "k_title.idx").exists()


def test_sentence_lists_eod_and_bos(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": ["ab", "", "c"]}, {"text": []}, {"text": ["d"]}])
    out = preprocess(tmp_path, [path], append_eod=True, prepend_bos=True)
    ds = IndexedDataset(out)
    # document 0: sequences "ab" and "c" (the empty sentence is dropped); BOS first, EOD last
    assert [ds[i].tolist() for i in range(len(ds))] == [[257, 97, 98], [99, 256], [257, 100, 256]]
    assert ds.document_indices.tolist() == [0, 2, 2, 3]


@pytest.mark.parametrize("workers", [1, 2])
def test_manifest_contents(tmp_path, docs, workers):
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    out = preprocess(tmp_path, [path], append_eod=True, workers=workers)
    m = manifest.read(out)
    assert m["tokenizer"]["kind"] == "byte" and m["tokenizer"]["digest"]
    assert m["inputs"][0]["size"] == path.stat().st_size and m["inputs"][0]["blake3"] == blake3.blake3(path.read_bytes()).hexdigest()
    assert m["counts"]["documents"] == len(docs) and m["counts"]["tokens"] == IndexedDataset(out).num_tokens
    assert m["output"]["dtype"] == "uint16"
