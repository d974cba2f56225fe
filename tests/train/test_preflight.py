"""Checks before launch: each problem is one line naming the flag or file and a fix."""

from __future__ import annotations

import numpy as np
import pytest
from test_loop import tiny

from tokenloom.errors import TokenloomError
from tokenloom.indexed import manifest
from tokenloom.indexed.format import IndexedDatasetWriter
from tokenloom.train.data import BlendDataConfig, DataConfig, MockDataConfig
from tokenloom.train.loop import run
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.preflight import check


def source(tmp_path, name: str, docs: int, tokenizer: dict | None = None) -> str:
    prefix = tmp_path / name
    with IndexedDatasetWriter(prefix, vocab_size=96) as w:
        for i in range(docs):
            w.add_document(np.arange(1, 40 + i, dtype=np.int64) % 95)
    if tokenizer is not None:
        manifest.write(prefix, {"format": manifest.FORMAT, "tokenizer": tokenizer})
    return str(prefix)


def blend(tmp_path, prefixes, split="969,30,1", **kw):
    return tiny(tmp_path / "run", data=DataConfig(blend=BlendDataConfig(prefixes=prefixes, split=split)), **kw)


def test_layout_and_batch_arithmetic():
    with pytest.raises(TokenloomError, match=r"--tp 2 x --pp 2 = 4 does not divide the 2 rank\(s\) of this launch; "
                                             r"use --nproc-per-node 4 or 8"):
        check(tiny("x", tp=2, pp=2), 2)
    with pytest.raises(TokenloomError, match="--global-batch-size 10 is not a multiple of --micro-batch-size 2 x 2 "
                                             "data-parallel rank.s. = 4; use --global-batch-size 8 or 12"):
        check(tiny("x", global_batch_size=10), 2)
    with pytest.raises(TokenloomError, match="needs the 1 micro-batches per step .* multiple of --pp 2"):
        check(tiny("x", pp=2, vpp=2, global_batch_size=2, model=GPTConfig(
            vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=4, n_heads=2, d_model=32)), 2)
    check(tiny("x", tp=2, global_batch_size=8), 4)  # dp 2 x micro 2 divides 8


def test_model_split():
    with pytest.raises(TokenloomError, match="model.n_heads 2 and model.n_kv_heads 2 must be divisible by --tp 4"):
        check(tiny("x", tp=4, global_batch_size=2), 4)
    with pytest.raises(TokenloomError, match=r"model.n_layers 2 must be divisible by --pp 2 x --vpp 2"):
        check(tiny("x", pp=2, vpp=2), 2)
    moe = GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2, n_heads=2, d_model=32,
                    num_experts=4)
    with pytest.raises(TokenloomError, match=r"model.num_experts=4 at tp=2 needs sequence parallelism"):
        tiny("x", tp=2, global_batch_size=2, model=moe)  # refused by the config, before any check
    check(tiny("x", tp=2, sp=True, global_batch_size=2, model=moe), 2)


def test_sources(tmp_path):
    good = source(tmp_path, "good", 200)
    with pytest.raises(TokenloomError, match=r"--data: .*missing.idx does not exist"):
        check(blend(tmp_path, [(1.0, good), (1.0, str(tmp_path / "missing"))]), 1)
    small = source(tmp_path, "small", 10)  # 969,30,1 of 10 documents: no validation documents
    with pytest.raises(TokenloomError, match=r"--split 969,30,1 leaves .*small \(10 documents\) no validation "
                                             r"documents.*--split 949,50,1"):
        check(blend(tmp_path, [(1.0, good), (1.0, small)]), 1)
    check(blend(tmp_path, [(1.0, good), (1.0, small)], eval_interval=0), 1)  # nothing reads valid
    with pytest.raises(TokenloomError, match="--split 1,0,0 has no validation part"):
        check(blend(tmp_path, [(1.0, good)], split="1,0,0"), 1)


def test_tokenizer_against_manifests(tmp_path):
    from tokenloom.tokenizers import load_tokenizer

    byte = load_tokenizer(kind="byte").fingerprint()
    prefix = source(tmp_path, "bytes", 200, tokenizer=byte)
    check(blend(tmp_path, [(1.0, prefix)], tokenizer="byte"), 1)
    with pytest.raises(TokenloomError, match=r"--tokenizer null is null \(no files; vocabulary \d+\), but .*bytes "
                                             r"was tokenized with byte \(no files; vocabulary 2\d\d\)"):
        check(blend(tmp_path, [(1.0, prefix)], tokenizer="null"), 1)


def test_resume_differences_name_old_and_new(tmp_path):
    run(tiny(tmp_path, train_iters=2, eval_interval=0))
    other = GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2, n_heads=4, d_model=32)
    with pytest.raises(TokenloomError, match=r"different model \(model.n_heads 2 -> 4\)"):
        check(tiny(tmp_path, resume="auto", model=other), 1)
    with pytest.raises(TokenloomError, match=r"another learning-rate schedule \(train_iters 2 -> 20\)"):
        check(tiny(tmp_path, resume="auto"), 1)
    check(tiny(tmp_path, resume="auto", override_opt_param_scheduler=True), 1)
    with pytest.raises(TokenloomError, match=r"other data \(data.mock .* -> .*force_data=true"):
        check(tiny(tmp_path, resume="auto", train_iters=2,
                   data=DataConfig(mock=MockDataConfig(num_sequences=301, max_length=200))), 1)
    check(tiny(tmp_path, resume="auto", train_iters=2,
               data=DataConfig(mock=MockDataConfig(num_sequences=300, max_length=200), num_workers=1)), 1)


def test_ids_of_a_source_without_manifest_fit_the_vocabulary(tmp_path, shared_data):
    """Megatron-made Llama 3 ids (no manifest) against the 32,000 pieces of Llama 2: one line before launch."""
    megatron = str(shared_data / "megatron-fixtures" / "fim_text_document")
    llama = str(shared_data / "tokenizers" / "llama2" / "tokenizer.model")
    cfg = blend(tmp_path, [(1.0, megatron)], tokenizer=llama,
                model=GPTConfig(vocab_size=32000, seq_len=32, n_layers=2, n_heads=2, d_model=32))
    with pytest.raises(TokenloomError, match=rf"--data: {megatron}.bin holds token id 1280\d\d, beyond the "
                                             rf"vocabulary of --tokenizer {llama} \(32000 ids\)"):
        check(cfg, 1)
    llama3 = GPTConfig(vocab_size=128256, seq_len=32, n_layers=2, n_heads=2, d_model=32)
    check(blend(tmp_path, [(1.0, megatron)], model=llama3, eval_interval=0), 1)
    fits = source(tmp_path, "fits", 200)  # ids < 95, no manifest: the tiny model's 96
    check(blend(tmp_path, [(1.0, fits)]), 1)
