"""``cli.py export`` and ``train --init-from-hf`` on bad input: one line naming the file or flag, exit != 0."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import save_file
from tl_testing import fault_env, one_line_error, run_cli, shared_data_dir

from tokenloom.train.checkpoint import hf
from tokenloom.train.data import open_tokenizer
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT

TOKENIZER = shared_data_dir() / "tokenizers" / "gpt2"
TRAIN = ["train", "--mock-data", "--train-iters", "1", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--seq-length", "16", "--set", "data.mock.num_sequences=20", "--set", "data.mock.max_length=40",
         "--set", "eval_interval=0", "--set", "progress=false", "--set", "plot=false"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny llama transformers folder, written by the library's own mapping."""
    tok = open_tokenizer(str(TOKENIZER))
    cfg = GPTConfig(arch="llama", vocab_size=tok.vocab_size, seq_len=16, n_layers=1, n_heads=2, d_model=16,
                    tie_embeddings=False)
    out = tmp_path_factory.mktemp("hf") / "tiny"
    out.mkdir()
    save_file(hf.to_hf(cfg, GPT(cfg).state_dict()), str(out / hf.WEIGHTS))
    (out / "config.json").write_text(json.dumps(hf.hf_config(cfg, tok.eod, tok.bos)))
    tok.tk.save(str(out / "tokenizer.json"))
    return out


def variant(folder: Path, tmp_path: Path, config: dict | None = None, drop: str | None = None) -> Path:
    """A copy of ``folder`` with ``config.json`` updated by ``config`` and file ``drop`` removed."""
    out = tmp_path / "variant"
    shutil.copytree(folder, out)
    if config is not None:
        data = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**data, **config}))
    if drop is not None:
        (out / drop).unlink()
    return out


def init(path: Path, tmp_path: Path, *flags: str):
    return run_cli(*TRAIN, "--output-dir", tmp_path / "run", "--init-from-hf", path, *flags)


@pytest.fixture(scope="module")
def trained(folder, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The one-step run from ``folder`` (its output directory ``run``) and what ``cli.py`` printed;
    its checkpoint (with the folder's tokenizer) is also what the full-disk export writes out."""
    tmp = tmp_path_factory.mktemp("trained")
    return tmp / "run", init(folder, tmp)


def test_the_folder_trains(folder, trained):
    run, done = trained
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"init_from_hf {folder}: loaded" in done.stderr
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["arch"] == "llama" and saved["tokenizer"] == str(folder)


def test_missing_folder(tmp_path):
    one_line_error(init(tmp_path / "nowhere", tmp_path), "--init-from-hf", "nowhere", "not a directory")


def test_no_config_json(folder, tmp_path):
    one_line_error(init(variant(folder, tmp_path, drop="config.json"), tmp_path), "config.json", "does not exist")


def test_unknown_model_type(folder, tmp_path):
    one_line_error(init(variant(folder, tmp_path, {"model_type": "bert"}), tmp_path), "config.json", "'bert'",
                   "gpt2 or llama")


def test_pickled_weights_are_refused(folder, tmp_path):
    path = variant(folder, tmp_path, drop=hf.WEIGHTS)
    (path / "pytorch_model.bin").write_bytes(b"not read")
    one_line_error(init(path, tmp_path), "pytorch_model.bin", "no unpickling")


def test_shape_mismatch(folder, tmp_path):
    one_line_error(init(variant(folder, tmp_path, {"intermediate_size": 96}), tmp_path), hf.WEIGHTS,
                   "mlp.down_proj.weight", "has shape [16, 64], config.json implies [16, 96]")


def test_unsupported_shape(folder, tmp_path):
    one_line_error(init(variant(folder, tmp_path, {"hidden_act": "gelu"}), tmp_path), "config.json", "hidden_act")


@pytest.mark.parametrize("flags,fragments", [
    (["--num-layers", "3"], ["model.n_layers=3", "conflicts with num_hidden_layers=1", "config.json"]),
    (["--tokenizer", str(TOKENIZER)], ["tokenizer=", "conflicts with --init-from-hf"]),
    (["--seq-length", "32"], ["model.seq_len=32", "16 positions"]),
])
def test_conflicting_flags(folder, tmp_path, flags, fragments):
    one_line_error(init(folder, tmp_path, *flags), *fragments)


@pytest.mark.slow
def test_export_refuses_a_used_output_and_a_shape_gpt2_lacks(tmp_path):
    run = tmp_path / "run"
    done = run_cli(*TRAIN, "--output-dir", run, "--set", "model.n_layers=1", "--set", "model.d_model=16",
                   "--set", "model.n_heads=2", "--set", "model.vocab_size=64", "--set", "model.bias=false")
    assert done.returncode == 0, done.stderr[-2000:]
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    one_line_error(run_cli("export", "--checkpoint", run / "checkpoints", "--output", used), "--output", "used",
                   "not an empty directory")
    one_line_error(run_cli("export", "--checkpoint", run / "checkpoints", "--output", tmp_path / "out"),
                   "model.bias=false", "GPT2LMHeadModel")
    one_line_error(run_cli("export", "--checkpoint", tmp_path / "none", "--output", tmp_path / "out"),
                   "--checkpoint", "does not exist")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.slow
def test_export_on_a_full_disk_leaves_nothing_and_says_so(trained, tmp_path):
    run, done = trained
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "out"
    env = fault_env("write", errno.ENOSPC, str(tmp_path / ".out.tmp-*" / "generation_config.json"))
    one_line_error(run_cli("export", "--checkpoint", run / "checkpoints", "--output", out, env=env),
                   "no space left on device", "generation_config.json", f"{out} was not written")
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert run_cli("export", "--checkpoint", run / "checkpoints", "--output", out).returncode == 0
    assert (out / hf.WEIGHTS).is_file()
