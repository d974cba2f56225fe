"""``cli.py export`` and ``train --init-from-hf`` against ``transformers`` (the oracle, CPU, fp32).

Per arch the module fixture trains a one-process run through ``cli.py train`` and exports it (the
seed folder), then starts a 2-rank gloo run from that folder (``--init-from-hf``, one step at a
learning rate of 1e-30: its checkpoint holds what each rank loaded) and exports that checkpoint:
llama (GQA, untied, a RoPE base of its own) at tp 2 with sp, whose fused, column-split ``qkv`` and
vocabulary-split head are the export's hardest reassembly, and gpt2 (tied, biases) at pp 2, whose
last stage holds its own copy of the tied head. Both use the GPT-2 tokenizer with the vocabulary
padded (dropped on export).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tl_testing import run_cli, shared_data_dir

from tokenloom.errors import TokenloomError
from tokenloom.tokenizers.load import load_tokenizer
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.checkpoint import hf
from tokenloom.train.checkpoint.format import model_tensors
from tokenloom.train.config import load_config
from tokenloom.train.data import open_tokenizer
from tokenloom.train.generate import load_model
from tokenloom.train.loop import start_run
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT

transformers = pytest.importorskip("transformers", reason="the [interop] extra (transformers) is the oracle")
TikTokenConverter = pytest.importorskip("transformers.convert_slow_tokenizer").TikTokenConverter
# the module fixture's launches and exports: 130 s of setup in a slow (AVX2-only) box's whole suite
pytestmark = pytest.mark.timeout(900)

GPT2_TOKENIZER = shared_data_dir() / "tokenizers" / "gpt2"
TEXT = shared_data_dir() / "tinyshakespeare" / "input.txt"
TOL = 1e-4
RUN = ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "16",
       "--lr", "1e-2", "--lr-warmup-iters", "1", "--set", "data.mock.num_sequences=50",
       "--set", "data.mock.max_length=40", "--set", "eval_interval=0", "--set", "progress=false",
       "--set", "plot=false", "--set", "log_interval=1"]
SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
ARCHS = {  # the one-process seed run's flags
    "llama_tp2": ["--set", "model.arch=llama", "--num-query-groups", "2", "--set", "model.tie_embeddings=false",
                  "--set", "model.rope_theta=5000"],
    "gpt2_pp2": [],
}
LAYOUTS = {  # the 2-rank run's flags from the seed folder, and the layout its checkpoint records
    "llama_tp2": (["--tp", "2", "--sp"], dict(tp=2, dp=1, zero1=False)),
    "gpt2_pp2": (["--pp", "2"], dict(pp=2, dp=1)),  # the last stage's copy of the tied head
}
LOADED = ["--train-iters", "1", "--lr", "1e-30", "--min-lr", "0", "--weight-decay", "0"]
"""A learning rate of 1e-30 and no weight decay leave fp32 parameters bit-identical through the one
step the run must take, so its checkpoint holds what each rank loaded."""


def train(out: Path, *flags) -> dict:
    done = run_cli("train", "--mock-data", *RUN, "--output-dir", out, *flags, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}


def export(root: Path, folder: Path) -> None:
    done = run_cli("export", "--checkpoint", root, "--output", folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", hf.WEIGHTS,
                                                       "tokenizer.json", "tokenizer_config.json"]
    assert (folder / hf.WEIGHTS).stat().st_mode == (folder / "config.json").stat().st_mode


@dataclasses.dataclass(frozen=True)
class Exported:
    seed: Path
    """The folder the one-process run exported (trained: 4 steps at 1e-2)."""
    run: Path
    """The 2-rank run's output directory (started from ``seed``)."""
    folder: Path
    """The folder its checkpoint exported."""

    @property
    def root(self) -> Path:
        return self.run / "checkpoints"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Exported]:
    """name -> the seed folder, the 2-rank run from it and the folder that run exported."""
    tmp = tmp_path_factory.mktemp("hf")
    out = {}
    for name, flags in ARCHS.items():
        train(tmp / f"{name}_seed", "--tokenizer", GPT2_TOKENIZER, *SHAPE, *flags)
        seed = tmp / f"{name}_seed_hf"
        export(tmp / f"{name}_seed" / "checkpoints", seed)
        train(tmp / name, "--nproc-per-node", "2", *LAYOUTS[name][0], "--init-from-hf", seed, *LOADED)
        out[name] = Exported(seed, tmp / name, tmp / f"{name}_hf")
        export(out[name].root, out[name].folder)
    return out


@functools.cache
def hf_model(folder: Path):
    """``folder``'s model in ``transformers``, loaded once per module (the tests only read it)."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_loss(model, batches: list[dict]) -> float:
    """Mean over micro-batches of the masked mean next-token loss, as our loop logs it."""
    losses = []
    with torch.no_grad():
        for b in batches:
            logits = model(b["tokens"]).logits
            per = F.cross_entropy(logits.flatten(0, 1), b["labels"].reshape(-1), reduction="none")
            mask = b["loss_mask"].reshape(-1).float()
            losses.append(float((per * mask).sum() / mask.sum()))
    return sum(losses) / len(losses)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHS))
def test_exported_folder_gives_our_logits_and_token_ids_in_transformers(exported, name):
    """The 2-rank checkpoint, reassembled by export, gives our logits in ``transformers``; the GPT-2
    tokenizer (the seed run's: export converts its tiktoken file) gives our ids there."""
    root, folder = exported[name].root, exported[name].folder
    ours, state = load_model(checkpoint.resolve(str(root), root), "cpu")
    cfg = ours.cfg
    theirs = hf_model(folder)
    assert type(theirs).__name__ == hf.ARCHS[cfg.arch]
    assert cfg.padded_vocab_size > cfg.vocab_size  # padded rows exist and were dropped
    assert theirs.get_output_embeddings().weight.shape[0] == cfg.vocab_size
    tied = theirs.get_output_embeddings().weight.data_ptr() == theirs.get_input_embeddings().weight.data_ptr()
    assert tied == cfg.tie_embeddings == (cfg.arch == "gpt2")
    if cfg.arch == "llama":
        assert theirs.config.num_key_value_heads == 2 < theirs.config.num_attention_heads
        assert theirs.config.rope_parameters["rope_theta"] == 5000
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine, hf_logits = ours(ids)[..., : cfg.vocab_size], theirs(ids).logits
    assert mine.abs().max() > 1.0  # trained away from a near-uniform start
    assert (mine - hf_logits).abs().max() < TOL

    assert state["config"]["tokenizer"] == str(exported[name].seed)  # the folder's, as --init-from-hf takes it
    folder = exported[name].seed  # exported from the run with --tokenizer GPT2_TOKENIZER
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = TEXT.read_text()
    expected = open_tokenizer(str(GPT2_TOKENIZER)).encode(text).tolist()
    assert tok(text, add_special_tokens=False)["input_ids"] == expected
    assert tok(text)["input_ids"] == expected  # no template tokens added either
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id == 50256
    # the seed folder's tokenizer.json lists <|endoftext|> in its vocabulary only: the 2-rank run takes
    # eod from its tokenizer_config.json, so the re-export names the EOS too
    again = json.loads((exported[name].folder / "generation_config.json").read_text())
    assert again["eos_token_id"] == 50256


def init_cfg(folder: Path, out: Path, *overrides: str):
    """A one-process run of 1 step starting from ``folder`` (the model shape from there)."""
    return load_config(None, [f"init_from_hf={json.dumps(str(folder))}", f"output_dir={json.dumps(str(out))}",
                              "micro_batch_size=2", "global_batch_size=4", "train_iters=1", "eval_interval=0",
                              "progress=false", "plot=false", "log_interval=1", "model.seq_len=16",
                              "data.mock.num_sequences=50", "data.mock.max_length=40", *overrides])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHS))
def test_init_from_hf_reproduces_the_exported_parameters_and_the_transformers_loss(exported, tmp_path, name):
    """No padding (make_vocab_size_divisible_by=1): our softmax then covers exactly HF's vocabulary."""
    folder = exported[name].folder
    r = start_run(init_cfg(folder, tmp_path / "run", "model.make_vocab_size_divisible_by=1"))
    model = r.strategy.chunks[0]
    assert model.cfg.padded_vocab_size == model.cfg.vocab_size == 50257
    saved = load_file(folder / hf.WEIGHTS)
    again = hf.to_hf(model.cfg, model.state_dict())
    assert again.keys() == saved.keys()
    assert all(torch.equal(again[k], saved[k]) for k in saved)
    batches = next(r.strategy.global_batches(r.data.train, eod=r.data.eod, consumed=0, total=4))
    expected = hf_loss(hf_model(folder), batches)
    summary = r.train()
    assert summary["iteration"] == 1 and abs(summary["train_loss"] - expected) < TOL, (summary, expected)


@pytest.mark.slow
def test_padded_rows_are_those_of_a_fresh_model(exported, tmp_path):
    folder = exported["llama_tp2"].folder
    cfg = hf.resolve_config(init_cfg(folder, tmp_path / "run"))
    assert cfg.model.padded_vocab_size > cfg.model.vocab_size and not cfg.model.tie_embeddings
    loaded, fresh = hf.from_hf(cfg.model, folder), GPT(cfg.model).state_dict()
    saved = load_file(folder / hf.WEIGHTS)
    v = cfg.model.vocab_size
    for ours, theirs in (("tok_emb.weight", "model.embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
        assert torch.equal(loaded[ours][:v], saved[theirs])
        assert torch.equal(loaded[ours][v:], fresh[ours][v:])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama_tp2", "llama_zero1", "gpt2_pp2"])
def test_init_from_hf_in_a_parallel_layout_loads_the_one_process_parameters(exported, tmp_path, case):
    """Each rank of a 2-rank run from a folder loads its part of what one process loads
    (:data:`LOADED`: the checkpoint of its one step holds it): tp 2 with sp and pp 2 (the last
    stage's copy of the tied head) are the module fixture's runs from the seed folders; dp 2 with
    zero1 starts here from the llama folder that tp 2 run exported."""
    if case == "llama_zero1":
        folder, out, layout = exported["llama_tp2"].folder, tmp_path / "run", dict(tp=1, dp=2, zero1=True)
        train(out, "--nproc-per-node", "2", "--zero1", "--init-from-hf", folder, *LOADED)
    else:
        folder, out, layout = exported[case].seed, exported[case].run, LAYOUTS[case][1]
    path = checkpoint.find_latest(out / "checkpoints")
    state = checkpoint.read_state(path)
    assert {k: state["layout"][k] for k in layout} == layout
    assert state["config"]["model"]["arch"] == case.split("_")[0]  # the folder's shape
    loaded = model_tensors(path, state)
    expected = hf.from_hf(hf.resolve_config(init_cfg(folder, out)).model, folder)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_resume_wins_over_init_from_hf(exported, tmp_path):
    """Megatron's --pretrained-checkpoint + --finetune: the folder starts the run once; a rerun
    with --resume auto continues the run's own checkpoint and does not load the folder again."""
    folder = exported["gpt2_pp2"].folder
    out = tmp_path / "run"
    first = run_cli("train", "--mock-data", *RUN, "--output-dir", out, "--init-from-hf", folder,
                    "--train-iters", "2", "--resume", "auto")
    assert first.returncode == 0 and f"init_from_hf {folder}: loaded" in first.stderr, first.stderr[-2000:]
    again = run_cli("train", "--mock-data", *RUN, "--output-dir", out, "--init-from-hf", folder,
                    "--train-iters", "3", "--override-opt_param-scheduler", "--resume", "auto")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"not loaded: resumed from {out / 'checkpoints' / 'iter_0000002'}" in again.stderr
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["iteration"] == 3 and math.isfinite(summary["train_loss"])


def test_a_sharded_folder_loads_as_its_single_file(tmp_path):
    """``model.safetensors.index.json`` and its shards (transformers' form for large models) give
    the tensors the single file gives; a shard the index names but the folder lacks is refused."""
    cfg = GPTConfig(arch="llama", vocab_size=100, make_vocab_size_divisible_by=64, seq_len=8, n_layers=2,
                    n_heads=4, n_kv_heads=2, d_model=16, tie_embeddings=False)
    tensors = hf.to_hf(cfg, GPT(dataclasses.replace(cfg, seed=4)).state_dict())
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for folder in (single, sharded):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(hf.hf_config(cfg, None, None)))
    save_file(tensors, str(single / hf.WEIGHTS))
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / file))
    index = {"metadata": {}, "weight_map": {k: file for file, keys in parts.items() for k in keys}}
    (sharded / hf.INDEX).write_text(json.dumps(index))
    one, many = hf.from_hf(cfg, single), hf.from_hf(cfg, sharded)
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    assert torch.equal(one["blocks.1.attn.qkv.weight"][:16], tensors["model.layers.1.self_attn.q_proj.weight"])
    stage = hf.from_hf(cfg, sharded, names={"blocks.1.attn.qkv.weight", "lm_head.weight"})  # a last stage's own
    assert stage.keys() == {"blocks.1.attn.qkv.weight", "lm_head.weight"}
    assert all(torch.equal(stage[k], one[k]) for k in stage)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(TokenloomError, match="model-00002-of-00002.safetensors does not exist"):
        hf.from_hf(cfg, sharded)


def test_export_follows_the_features_and_refuses_what_transformers_cannot_express(tmp_path):
    """The class is the one the features (not the arch preset) describe; a mix is refused naming its
    fields; import sets the features, so the folder rebuilds the same model."""
    shape = dict(vocab_size=100, make_vocab_size_divisible_by=64, seq_len=8, n_layers=1, n_heads=4, d_model=16)
    as_llama = GPTConfig(**shape, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)  # arch gpt2 preset
    assert hf.family(as_llama) == "llama" and hf.hf_config(as_llama, None, None)["model_type"] == "llama"
    tensors = hf.to_hf(as_llama, GPT(as_llama).state_dict())
    assert "model.layers.0.mlp.gate_proj.weight" in tensors
    with pytest.raises(TokenloomError, match=r"model.positions=rope has no transformers form: GPT2LMHeadModel"):
        hf.check_expressible(GPTConfig(**shape, positions="rope"))
    with pytest.raises(TokenloomError, match=r"model.norm=layernorm, model.mlp=gelu has no transformers form"):
        hf.to_hf(GPTConfig(**shape, arch="llama", norm="layernorm", mlp="gelu"), {})
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config(as_llama, None, None)))
    fields = hf.model_fields(json.loads((tmp_path / "config.json").read_text()), tmp_path / "config.json")
    assert {k: fields[k] for k in ("arch", "norm", "mlp", "positions", "bias")} == dict(
        arch="llama", norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)


SPECIAL_TEXTS = ["  two leading spaces", "a <s> b</s>c<unk>", " x\n\n  y ", "", "\t\u2603 \U0001d11e end  "]


@pytest.mark.parametrize("name", ["llama2", "mistral-v3"])
def test_a_sentencepiece_tokenizer_exports_as_tokenizer_model_giving_our_ids(tmp_path, name):
    """The files export writes (through :func:`hf.write_tokenizer`) load in ``AutoTokenizer`` next to
    a llama ``config.json`` and give our ids on the whole text, with no BOS/EOS added either way;
    the folder reloads here as the same SentencePiece tokenizer."""
    ours = open_tokenizer(str(shared_data_dir() / "tokenizers" / name / "tokenizer.model"))
    cfg = GPTConfig(arch="llama", vocab_size=ours.vocab_size, seq_len=16, n_layers=1, n_heads=4, d_model=16)
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config(cfg, ours.eod, ours.bos)))
    written = hf.write_tokenizer(ours, tmp_path, cfg.seq_len)
    assert sorted(written) == ["tokenizer.model", "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", *sorted(written)]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert type(theirs).__name__ == "SentencePieceBackend"
    text = TEXT.read_text()
    expected = ours.encode(text).tolist()
    assert theirs(text, add_special_tokens=False)["input_ids"] == expected
    assert theirs(text)["input_ids"] == expected
    for t in SPECIAL_TEXTS:
        assert theirs(t)["input_ids"] == ours.encode(t).tolist(), t
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.unk_token_id) == (ours.bos, ours.eod, 0)
    again = open_tokenizer(str(tmp_path))
    assert again.kind == "sentencepiece" and again.fingerprint()["digest"] == ours.fingerprint()["digest"]


TIKTOKEN_TEXTS = [*SPECIAL_TEXTS, "<|endoftext|> as text", "  hello   world\n\n\n  x", "\t\tfoo  \r\n bar",
                  "数字123456 ok", "<|begin_of_text|><|eot_id|>"]


@pytest.mark.parametrize("path", [GPT2_TOKENIZER / "gpt2.tiktoken",
                                  shared_data_dir() / "tokenizers" / "llama3" / "tokenizer.model"],
                         ids=["gpt2", "llama3"])
def test_a_tiktoken_tokenizer_exports_as_tokenizer_json_giving_tiktokens_ids(tmp_path, path):
    """A tiktoken rank file becomes a ``tokenizer.json`` BPE: ``AutoTokenizer`` on the folder gives
    tiktoken's ids on the whole text and on awkward strings (special tokens' text stays text, as
    ``encode_ordinary`` reads it), its special tokens keep their ids, and the construction gives
    the same ids as ``transformers``' own ``TikTokenConverter``."""
    ours = open_tokenizer(str(path))
    assert ours.kind == "tiktoken"
    written = hf.write_tokenizer(ours, tmp_path, 16)
    assert sorted(written) == ["tokenizer.json", "tokenizer_config.json"]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = TEXT.read_text()
    assert theirs(text)["input_ids"] == ours.encode(text).tolist()
    for t in TIKTOKEN_TEXTS:
        assert theirs(t)["input_ids"] == ours.encode(t).tolist(), t
    specials = ours.id_options()["special_tokens"]
    assert all(theirs.convert_tokens_to_ids(name) == i for name, i in specials.items())
    assert theirs.eos_token_id == ours.eod
    oracle = TikTokenConverter(vocab_file=str(ours.rank_path), pattern=ours.id_options()["pattern"],
                               extra_special_tokens=specials).converted()
    assert oracle.encode(text, add_special_tokens=False).ids == theirs(text)["input_ids"]


def test_a_file_less_tokenizer_is_refused_in_one_line_naming_it(tmp_path):
    byte = load_tokenizer(kind="byte")
    with pytest.raises(TokenloomError, match=r"^--tokenizer byte: a byte tokenizer has no transformers form"):
        hf.check_tokenizer(byte, "--tokenizer byte")
    with pytest.raises(TokenloomError, match="a byte tokenizer has no transformers form"):
        hf.write_tokenizer(byte, tmp_path, 16)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_llama_moe_exports_as_mixtral_giving_our_logits_and_generates(tmp_path):
    """A one-process llama MoE run (8 experts, top-2): ``generate``'s loader and
    ``MixtralForCausalLM`` from the exported folder give the same logits; a GPT-2 MoE is refused."""
    moe = ["--set", "model.arch=llama", "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
           "--moe-aux-loss-coeff", "0.01"]
    train(tmp_path / "run", "--tokenizer", GPT2_TOKENIZER, *SHAPE, *moe)
    root, folder = tmp_path / "run" / "checkpoints", tmp_path / "hf"
    done = run_cli("export", "--checkpoint", root, "--output", folder)
    assert done.returncode == 0, done.stderr[-3000:]
    ours, _ = load_model(checkpoint.resolve(str(root), root), "cpu")
    theirs = hf_model(folder)
    assert type(theirs).__name__ == hf.MIXTRAL
    assert (theirs.config.num_local_experts, theirs.config.num_experts_per_tok) == (8, 2)
    ids = torch.randint(0, ours.cfg.vocab_size, (3, ours.cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine, hf_logits = ours(ids)[..., : ours.cfg.vocab_size], theirs(ids).logits
    assert (mine - hf_logits).abs().max() < TOL
    done = run_cli("generate", "--checkpoint", root, "--prompt", "To be", "--max-new-tokens", "4")
    assert done.returncode == 0 and done.stdout.startswith("To be"), done.stderr[-3000:]
    with pytest.raises(TokenloomError, match="model.num_experts on a GPT-2 model has no transformers form"):
        hf.check_expressible(GPTConfig(num_experts=4))
    with pytest.raises(TokenloomError, match="model.moe_layer_freq=2 / model.bias=False has no MixtralForCausalLM"):
        hf.check_expressible(GPTConfig(arch="llama", num_experts=4, moe_layer_freq=2))
