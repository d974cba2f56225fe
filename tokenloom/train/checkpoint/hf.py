"""Hugging Face ``transformers`` folders, out and in: the one module that owns that format.

Out (:func:`export`): a checkpoint of any layout becomes a folder ``GPT2LMHeadModel`` or
``LlamaForCausalLM`` loads (:func:`family`; other feature combinations are refused naming the
fields): ``config.json``, fp32 ``model.safetensors``, ``generation_config.json`` and the tokenizer
(:func:`write_tokenizer`, our ids, no BOS/EOS added). In (:func:`init_from_hf`, ``--init-from-hf``):
such a folder's safetensors (no pickle, local only) become the starting parameters in any layout.

Mapping (:func:`to_hf` / :func:`from_hf`):

* GPT-2: ``Conv1D`` is ``[in, out]``, ours ``[out, in]``: transposed. ``qkv`` rows are ``[q | k |
  v]`` as ``c_attn``'s columns; GELU is ``gelu_new``. GQA or ``bias: false`` is refused.
* Llama: ``qkv`` splits by rows into ``q/k/v_proj``; our RoPE is HF's rotate-half, no permutation.
  SwiGLU ``fc`` is ``[gate | up]``; ``bias: true`` maps to ``attention_bias`` and ``mlp_bias``.
* MoE (llama family, every block MoE, no biases): ``MixtralForCausalLM`` with transformers 5's
  stacked experts (``gate_up_proj`` [E, 2 inner, d], ``down_proj`` [E, d, inner]; ours transposed).
* Padded vocabulary rows are dropped on export and take a fresh model's values on import (as
  deterministic as a fresh run); real ids' logits agree with ``transformers``'.
* ``seq_len`` is the run's, bounded on import by the folder's positions.

On import (:func:`resolve_config`) shape fields come from ``config.json`` (a differing non-default
configured value is refused naming both) and the tokenizer is the folder's. Resume wins: with a
complete checkpoint under ``--resume auto`` the folder is not loaded again (Megatron's
``--pretrained-checkpoint`` + ``--finetune``); otherwise the optimizer starts fresh at iteration 0.

Trade-offs: export holds the full model in host memory; import memory-maps the safetensors and each
rank reads the full tensors it holds before cutting its shard. Tokenizers: ``tokenizers`` ones as
they are, SentencePiece ``.model`` copied (a ``tokenizer.json`` conversion changes ids for runs of
spaces), tiktoken converted to a ``tokenizer.json`` BPE (tested equal); file-less kinds are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenloom.errors import TokenloomError
from tokenloom.fsio import fsync_dir, naming, os_error_message
from tokenloom.tokenizers.base import Tokenizer
from tokenloom.tokenizers.sp import SentencePieceTokenizer
from tokenloom.tokenizers.tiktoken_bpe import TiktokenTokenizer
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.checkpoint.format import model_tensors
from tokenloom.train.checkpoint.reshard import load_params
from tokenloom.train.config import TrainConfig, config_from_dict
from tokenloom.train.data import open_tokenizer
from tokenloom.train.model.config import ARCH_FEATURES, FEATURE_VALUES, GPTConfig
from tokenloom.train.model.gpt import GPT

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
ARCHS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
MIXTRAL = "MixtralForCausalLM"
"""The class a llama-family model with experts exports as (export only: no import of Mixtral folders)."""
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


# --------------------------------------------------------------------------- names and layouts


def family(cfg: GPTConfig) -> str:
    """``gpt2`` or ``llama``: the ``transformers`` class whose layers ``cfg``'s features (norm, mlp,
    positions) are; a combination neither class has is refused, naming the fields that differ
    from the ``arch`` preset's class."""
    for name, preset in ARCH_FEATURES.items():
        if all(getattr(cfg, k) == preset[k] for k in FEATURE_VALUES):
            return name
    preset = ARCH_FEATURES[cfg.arch]
    bad = [f"model.{k}={getattr(cfg, k)}" for k in FEATURE_VALUES if getattr(cfg, k) != preset[k]]
    raise TokenloomError(f"{', '.join(bad)} has no transformers form: {ARCHS['gpt2']} has layernorm, gelu and "
                         f"learned positions, {ARCHS['llama']} rmsnorm, swiglu and rope")



def _block_map(cfg: GPTConfig, i: int) -> list[tuple[str, str, Callable, Callable]]:
    """(ours, HF, ours -> HF, HF -> ours) for block ``i``'s tensors that map one to one."""
    ours, t = f"blocks.{i}.", lambda w: w.t()
    if family(cfg) == "gpt2":
        hf = f"transformer.h.{i}."
        pairs = [("norm1", "ln_1", None), ("attn.qkv", "attn.c_attn", t), ("attn.proj", "attn.c_proj", t),
                 ("norm2", "ln_2", None), ("mlp.fc", "mlp.c_fc", t), ("mlp.proj", "mlp.c_proj", t)]
        out = []
        for a, b, fn in pairs:
            out.append((f"{ours}{a}.weight", f"{hf}{b}.weight", fn or _same, fn or _same))
            out.append((f"{ours}{a}.bias", f"{hf}{b}.bias", _same, _same))
        return out
    hf = f"model.layers.{i}."
    out = [(f"{ours}norm1.weight", f"{hf}input_layernorm.weight", _same, _same),
           (f"{ours}norm2.weight", f"{hf}post_attention_layernorm.weight", _same, _same),
           (f"{ours}attn.proj.weight", f"{hf}self_attn.o_proj.weight", _same, _same)]
    if cfg.is_moe_layer(i):  # Mixtral: experts stacked [E, out, in], ours [E, in, out]
        out += [(f"{ours}mlp.router.weight", f"{hf}mlp.gate.weight", _same, _same),
                (f"{ours}mlp.experts.fc", f"{hf}mlp.experts.gate_up_proj", _swap_last, _swap_last),
                (f"{ours}mlp.experts.proj", f"{hf}mlp.experts.down_proj", _swap_last, _swap_last)]
    else:
        out.append((f"{ours}mlp.proj.weight", f"{hf}mlp.down_proj.weight", _same, _same))
    if cfg.use_bias:
        out += [(f"{ours}attn.proj.bias", f"{hf}self_attn.o_proj.bias", _same, _same),
                (f"{ours}mlp.proj.bias", f"{hf}mlp.down_proj.bias", _same, _same)]
    return out


def _same(w: torch.Tensor) -> torch.Tensor:
    return w


def _swap_last(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(-2, -1)


def _fused(cfg: GPTConfig, i: int) -> list[tuple[str, list[str], list[int]]]:
    """Llama's fused tensors of block ``i``: (ours, HF parts in row order, part sizes)."""
    hd, inner = cfg.head_dim, cfg.ffn_size
    ours, hf = f"blocks.{i}.", f"model.layers.{i}."
    qkv = [cfg.n_heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd]
    out = [(f"{ours}attn.qkv.weight", [f"{hf}self_attn.{p}_proj.weight" for p in "qkv"], qkv)]
    if not cfg.is_moe_layer(i):
        out.append((f"{ours}mlp.fc.weight", [f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"], [inner, inner]))
    if cfg.use_bias:
        out += [(f"{ours}attn.qkv.bias", [f"{hf}self_attn.{p}_proj.bias" for p in "qkv"], qkv),
                (f"{ours}mlp.fc.bias", [f"{hf}mlp.gate_proj.bias", f"{hf}mlp.up_proj.bias"], [inner, inner])]
    return out


def _outer_map(cfg: GPTConfig) -> list[tuple[str, str]]:
    """(ours, HF) for the embeddings, final norm and LM head (vocabulary tensors hold real rows in HF)."""
    if family(cfg) == "gpt2":
        out = [("tok_emb.weight", "transformer.wte.weight"), ("pos_emb.weight", "transformer.wpe.weight"),
               ("norm.weight", "transformer.ln_f.weight"), ("norm.bias", "transformer.ln_f.bias")]
    else:
        out = [("tok_emb.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", "lm_head.weight"))
    return out


def check_expressible(cfg: GPTConfig) -> None:
    """Refuse, naming the field, a model no ``transformers`` class can hold (:func:`family`)."""
    gpt2 = family(cfg) == "gpt2"
    if gpt2 and cfg.kv_heads != cfg.n_heads:
        raise TokenloomError(f"model.n_kv_heads={cfg.n_kv_heads} (grouped-query attention) has no GPT2LMHeadModel "
                             "form: GPT-2 has one head count; export a llama model for GQA")
    if gpt2 and not cfg.use_bias:
        raise TokenloomError("model.bias=false has no GPT2LMHeadModel form: GPT-2's linears and LayerNorms always "
                             "have biases")
    if cfg.num_experts is not None:
        if gpt2:
            raise TokenloomError("model.num_experts on a GPT-2 model has no transformers form; export a llama model "
                                 "(MixtralForCausalLM)")
        if cfg.moe_layer_freq != 1 or cfg.use_bias:
            raise TokenloomError(f"model.moe_layer_freq={cfg.moe_layer_freq} / model.bias={cfg.use_bias} has no "
                                 "MixtralForCausalLM form: every Mixtral block is mixture-of-experts, without biases")
    if gpt2 and not cfg.norm_bias:
        raise TokenloomError("model.norm_bias=false has no GPT2LMHeadModel form: GPT-2's LayerNorms always have "
                             "biases")


def to_hf(cfg: GPTConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors (contiguous fp32 copies, padded vocabulary rows dropped, no tied duplicate) from
    the one-process ``tensors`` of a model of ``cfg``."""
    check_expressible(cfg)
    out: dict[str, torch.Tensor] = {}
    for ours, hf in _outer_map(cfg):
        w = tensors[ours]
        out[hf] = w[: cfg.vocab_size] if ours in ("tok_emb.weight", "lm_head.weight") else w
    for i in range(cfg.n_layers):
        for ours, hf, there, _ in _block_map(cfg, i):
            out[hf] = there(tensors[ours])
        if family(cfg) == "llama":
            for ours, parts, sizes in _fused(cfg, i):
                out.update(zip(parts, tensors[ours].split(sizes, dim=0), strict=True))
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def hf_config(cfg: GPTConfig, eod: int | None, bos: int | None) -> dict[str, Any]:
    """``config.json`` of a model of ``cfg`` (``eod`` / ``bos``: the tokenizer's ids)."""
    kind = family(cfg)
    common = {"architectures": [ARCHS[kind]], "model_type": kind, "vocab_size": cfg.vocab_size,
              "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32", "initializer_range": cfg.init_std,
              "eos_token_id": eod, "bos_token_id": bos if bos is not None else eod, "use_cache": True}
    if kind == "gpt2":
        return {**common, "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layers,
                "n_head": cfg.n_heads, "n_inner": cfg.ffn_size, "activation_function": "gelu_new",
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "layer_norm_epsilon": cfg.norm_eps, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    if cfg.num_experts is not None:  # Mixtral: softmax, top-k, renormalised = our top-k softmax
        return {**common, "architectures": [MIXTRAL], "model_type": "mixtral", "hidden_size": cfg.d_model,
                "intermediate_size": cfg.moe_ffn_size, "num_hidden_layers": cfg.n_layers,
                "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
                "router_aux_loss_coef": cfg.moe_aux_loss_coeff, "output_router_logits": False,
                "sliding_window": None, "attention_dropout": cfg.dropout}
    return {**common, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_size,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": cfg.use_bias, "mlp_bias": cfg.use_bias, "attention_dropout": cfg.dropout}


# --------------------------------------------------------------------------- export


@dataclass(kw_only=True)
class ExportConfig:
    """What to export where."""

    checkpoint: str
    """A checkpoint directory, or a checkpoint root (its latest complete checkpoint is used)."""
    output: str
    """The transformers folder to write; it must not exist, or be empty."""
    tokenizer: str | None = None
    """Tokenizer path to write into the folder; default: the one the run stored."""


def export(cfg: ExportConfig) -> Path:
    """Write the checkpoint as a ``transformers`` folder at ``cfg.output`` and return its path.

    Published atomically: written into a temporary sibling (each file fsynced), then renamed
    onto ``output`` (an empty ``output`` is replaced) and the parent fsynced."""
    out = Path(cfg.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TokenloomError(f"--output {out} already exists and is not an empty directory; choose a new path")
    path = checkpoint.resolve(cfg.checkpoint, cfg.checkpoint, flag="--checkpoint")
    assert path is not None  # resolve returns None for "auto" only
    state = checkpoint.read_state(path)
    model = config_from_dict(GPTConfig, state["config"]["model"], "model.")
    check_expressible(model)
    tok_name = cfg.tokenizer or state["config"].get("tokenizer")
    if not tok_name:
        raise TokenloomError(f"{path} was trained without a tokenizer; pass --tokenizer PATH (the folder needs one)")
    tok = open_tokenizer(tok_name)
    check_tokenizer(tok, f"--tokenizer {tok_name}")
    if tok.vocab_size > model.vocab_size:
        raise TokenloomError(f"--tokenizer {tok_name} has {tok.vocab_size} ids, the model {model.vocab_size}")
    tensors = to_hf(model, model_tensors(path, state))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        _write_json(tmp / "config.json", hf_config(model, tok.eod, tok.bos))
        os.chmod(tmp / WEIGHTS, (tmp / "config.json").stat().st_mode)  # safetensors' own file is owner-only
        write_tokenizer(tok, tmp, model.seq_len)
        _write_json(tmp / "generation_config.json", {
            "bos_token_id": tok.bos if tok.bos is not None else tok.eod, "eos_token_id": tok.eod,
            "pad_token_id": tok.pad})
        for f in tmp.iterdir():
            _fsync(f)
        fsync_dir(tmp / WEIGHTS)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
        fsync_dir(out)
    except OSError as exc:  # a full disk, an I/O or permission error: one line, nothing left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise TokenloomError(f"{os_error_message(exc, tmp)}; {out} was not written") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_tokenizer(tok: Tokenizer, where: str) -> None:
    """Refuse, in one line naming ``where``, a tokenizer :func:`write_tokenizer` has no form for."""
    if getattr(tok, "tk", None) is None and not isinstance(tok, (SentencePieceTokenizer, TiktokenTokenizer)):
        raise TokenloomError(f"{where}: a {tok.kind} tokenizer has no transformers form this export writes "
                             "(tokenizer.json, vocab/merges, vocab.txt, a tiktoken rank file or a SentencePiece "
                             ".model)")


def write_tokenizer(tok: Tokenizer, folder: Path, max_length: int) -> list[str]:
    """Write ``tok`` into ``folder`` as ``AutoTokenizer`` loads it; returns the names written.

    Contract: ``AutoTokenizer.from_pretrained(folder)(text)["input_ids"]`` is ``tok.encode(text)``
    with or without ``add_special_tokens`` (no BOS/EOS added; ``bos``/``eos``/``pad`` name ours).
    SentencePiece goes as ``tokenizer.model`` with ``SentencePieceBackend`` (encodes with
    ``sentencepiece`` itself), not ``LlamaTokenizer``, whose BPE conversion changes ids for runs of
    spaces; ``split_special_tokens`` keeps ``"<s>"`` plain text. Trade-off: its ``decode`` ignores
    byte pieces (``<0x0A>``), ours does not. No ``tokenizer.json``, so it reloads as SentencePiece.
    """
    tk = getattr(tok, "tk", None)
    roles: dict[str, int | None] = {"eos_token": tok.eod, "bos_token": tok.bos, "pad_token": tok.pad}
    common: dict[str, Any] = {"model_max_length": max_length, "add_bos_token": False, "add_eos_token": False,
                              "clean_up_tokenization_spaces": False}
    if isinstance(tok, TiktokenTokenizer):
        tk = tok.to_tokenizers()
        for name, i in tok.id_options()["special_tokens"].items():
            if tk.token_to_id(name) != i:
                raise TokenloomError(f"tokenizer {tok.rank_path}: special token {name!r} would take id "
                                     f"{tk.token_to_id(name)} in tokenizer.json, not its id {i}")
        common["split_special_tokens"] = True  # encode_ordinary: a special token's text is plain text
    if tk is not None:
        tk.save(str(folder / "tokenizer.json"))
        tokens = {role: None if i is None else tk.id_to_token(i) for role, i in roles.items()}
        _write_json(folder / "tokenizer_config.json",
                    {**common, **tokens, "tokenizer_class": "PreTrainedTokenizerFast"})
        return ["tokenizer.json", "tokenizer_config.json"]
    check_tokenizer(tok, f"tokenizer {tok.spec.path or tok.kind}")
    assert isinstance(tok, SentencePieceTokenizer)  # the one kind check_tokenizer admits without tk
    sp = tok.sp
    with naming(folder / "tokenizer.model"):
        shutil.copyfile(tok.model_path, folder / "tokenizer.model")
    roles["unk_token"] = sp.unk_id() if sp.unk_id() >= 0 else None
    tokens = {role: None if i is None else sp.id_to_piece(i) for role, i in roles.items()}
    _write_json(folder / "tokenizer_config.json", {**common, **tokens, "tokenizer_class": "SentencePieceBackend",
                                                   "legacy": True, "split_special_tokens": True})
    return ["tokenizer.model", "tokenizer_config.json"]


def _write_json(path: Path, data: dict) -> None:
    with naming(path):  # a failed write names the file
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- import


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    """The folder's ``config.json``, checked to be a GPT-2 or Llama model; one-line errors."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenloomError(f"--init-from-hf {folder} is not a directory; pass a local transformers model folder")
    path = folder / "config.json"
    if not path.is_file():
        raise TokenloomError(f"{path} does not exist; --init-from-hf needs a transformers model folder")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenloomError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict) or hf.get("model_type") not in ARCHS:
        kind = hf.get("model_type") if isinstance(hf, dict) else None
        raise TokenloomError(f"{path}: model_type {kind!r} is not supported; --init-from-hf reads "
                             f"{' or '.join(ARCHS)} models")
    return hf


HF_KEYS = {
    "gpt2": dict(vocab_size="vocab_size", n_layers="n_layer", n_heads="n_head", d_model="n_embd",
                 ffn_hidden_size="n_inner", tie_embeddings="tie_word_embeddings", norm_eps="layer_norm_epsilon"),
    "llama": dict(vocab_size="vocab_size", n_layers="num_hidden_layers", n_heads="num_attention_heads",
                  n_kv_heads="num_key_value_heads", d_model="hidden_size", ffn_hidden_size="intermediate_size",
                  bias="attention_bias", tie_embeddings="tie_word_embeddings", norm_eps="rms_norm_eps",
                  rope_theta="rope_theta"),
}
"""Our model field -> the ``config.json`` key it comes from, per arch (for error messages)."""


def model_fields(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """The :class:`GPTConfig` shape fields a ``config.json`` (``hf``) sets, refusing, with the
    field's name, what our model cannot express."""

    def refuse(key: str, why: str) -> TokenloomError:
        return TokenloomError(f"{where}: {key}={json.dumps(hf.get(key))} {why}")

    if hf["model_type"] == "gpt2":
        if hf.get("activation_function", "gelu_new") not in TANH_GELU:
            raise refuse("activation_function", f"is not the tanh GELU ({', '.join(TANH_GELU)}) our gpt2 runs")
        for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            if hf.get(key):
                raise refuse(key, "has no form in our gpt2 model")
        if hf.get("scale_attn_weights") is False:
            raise refuse("scale_attn_weights", "has no form in our gpt2 model (attention scaled by 1/sqrt(head_dim))")
        d = hf.get("n_embd", 768)
        return ARCH_FEATURES["gpt2"] | dict(
                    arch="gpt2", vocab_size=hf.get("vocab_size", 50257), n_layers=hf.get("n_layer", 12),
                    n_heads=hf.get("n_head", 12), n_kv_heads=None, d_model=d,
                    ffn_hidden_size=hf.get("n_inner") or 4 * d,
                    tie_embeddings=hf.get("tie_word_embeddings", True), norm_eps=hf.get("layer_norm_epsilon", 1e-5))
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "is not the SiLU of our llama's SwiGLU")
    if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
        raise refuse("mlp_bias", f"differs from attention_bias={json.dumps(hf.get('attention_bias'))}: our model "
                     "has biases in every linear or in none")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise refuse("rope_parameters" if rope else "rope_scaling", "scales RoPE, which our llama does not")
    d, heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    if hf.get("head_dim") not in (None, d // heads):
        raise refuse("head_dim", f"is not hidden_size / num_attention_heads = {d // heads}")
    return ARCH_FEATURES["llama"] | dict(
                arch="llama", vocab_size=hf.get("vocab_size", 32000), n_layers=hf.get("num_hidden_layers", 32),
                n_heads=heads, n_kv_heads=hf.get("num_key_value_heads") or heads, d_model=d,
                ffn_hidden_size=hf.get("intermediate_size", 11008), bias=bool(hf.get("attention_bias", False)),
                tie_embeddings=hf.get("tie_word_embeddings", False), norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))))


def max_positions(hf: dict[str, Any]) -> int:
    return hf.get("n_positions", 1024) if hf["model_type"] == "gpt2" else hf.get("max_position_embeddings", 2048)


def resolve_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the model shape and tokenizer of its ``init_from_hf`` folder (unchanged without
    one; idempotent). A configured value that is not the default and differs from the folder's is
    refused naming both; ``seq_len`` may be shorter than the folder's positions, not longer."""
    if cfg.init_from_hf is None:
        return cfg
    folder = Path(cfg.init_from_hf)
    hf = read_config(folder)
    where = folder / "config.json"
    fields = model_fields(hf, where)
    defaults = GPTConfig()
    for key, value in fields.items():
        mine = getattr(cfg.model, key)
        if key == "n_kv_heads":
            mine, value = cfg.model.kv_heads, value or fields["n_heads"]
            if cfg.model.n_kv_heads is None:
                continue
        elif key == "ffn_hidden_size" and mine is None:
            continue
        if mine != getattr(defaults, key) and mine != value:
            theirs = HF_KEYS[fields["arch"]].get(key, "model_type" if key in ("arch", *FEATURE_VALUES) else key)
            raise TokenloomError(f"model.{key}={json.dumps(mine)} conflicts with {theirs}={json.dumps(value)} in {where} "
                                 "(--init-from-hf takes the model shape from there); drop the flag or --set")
    limit = max_positions(hf)
    if cfg.model.seq_len > limit:
        raise TokenloomError(f"model.seq_len={cfg.model.seq_len} exceeds the {limit} positions of {where}")
    if cfg.tokenizer is not None and Path(cfg.tokenizer).resolve() != folder.resolve():
        raise TokenloomError(f"tokenizer={cfg.tokenizer} conflicts with --init-from-hf {folder}, whose tokenizer "
                             "the run uses; drop --tokenizer")
    try:
        model = dataclasses.replace(cfg.model, **fields)
    except TokenloomError as e:
        raise TokenloomError(f"{where}: {e}") from None
    check_expressible(model)
    from_hf(model, folder, read=False)  # names and shapes, before any rank starts
    return dataclasses.replace(cfg, model=model, tokenizer=str(folder))


class _Weights:
    """The folder's safetensors, memory-mapped: one file or an index's shards, read by name."""

    def __init__(self, folder: Path) -> None:
        index, single = folder / INDEX, folder / WEIGHTS
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise TokenloomError(f"{index}: not a safetensors index (no weight_map: {e})") from None
            self.files: dict[str, Path] | None = {name: folder / f for name, f in weight_map.items()}
        elif single.is_file():
            self.files = None
            self.single = single
        else:
            pickled = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
            if pickled:
                raise TokenloomError(f"{folder / pickled[0]}: pickled PyTorch weights are not read (no unpickling); "
                                     f"convert the model to {WEIGHTS} (save_pretrained(safe_serialization=True))")
            raise TokenloomError(f"{folder}: no {WEIGHTS} or {INDEX}")
        self.open: dict[Path, Any] = {}

    def file_of(self, name: str) -> Path | None:
        if self.files is None:
            return self.single if name in self._handle(self.single).keys() else None
        return self.files.get(name)

    def _handle(self, path: Path) -> Any:
        if path not in self.open:
            if not path.is_file():
                raise TokenloomError(f"{path} does not exist (named by {INDEX})")
            self.open[path] = safe_open(str(path), framework="pt", device="cpu")
        return self.open[path]

    def get(self, name: str, shape: tuple[int, ...], folder: Path, read: bool) -> torch.Tensor:
        """Tensor ``name`` as fp32, refused unless it has ``shape``; ``read=False``: only the
        header is read and a ``meta`` tensor of that shape returned."""
        path = self.file_of(name)
        if path is None:
            raise TokenloomError(f"{folder}: the weights have no tensor {name}, which config.json implies")
        found = tuple(self._handle(path).get_slice(name).get_shape())
        if found != tuple(shape):
            raise TokenloomError(f"{path}: {name} has shape {list(found)}, config.json implies {list(shape)}")
        if not read:
            return torch.empty(shape, device="meta")
        return self._handle(path).get_tensor(name).to(torch.float32)


def from_hf(cfg: GPTConfig, folder: str | os.PathLike, read: bool = True,
            names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """One-process tensors by our names, shape-checked against ``cfg`` (padded vocabulary rows from a
    fresh model, GPT-2 positions cut to ``seq_len``); only ``names`` when given; ``read=False``
    checks the headers only (``meta`` tensors)."""
    folder = Path(folder)
    positions = max_positions(read_config(folder))
    weights = _Weights(folder)
    get = functools.partial(weights.get, folder=folder, read=read)
    shapes = {n: tuple(p.shape) for n, p in GPT(cfg, device="meta").named_parameters(remove_duplicate=False)}
    wanted = set(shapes) if names is None else set(names)
    if cfg.tie_embeddings and "lm_head.weight" in wanted:
        wanted.add("tok_emb.weight")  # the tied head is the embedding's table
    vocab_rows = {"tok_emb.weight", "lm_head.weight"}
    out: dict[str, torch.Tensor] = {}
    for ours, hf in _outer_map(cfg):
        shape = shapes[ours]
        if ours not in wanted:
            continue
        if ours in vocab_rows:
            out[ours] = get(hf, (cfg.vocab_size, *shape[1:]))
        elif ours == "pos_emb.weight":
            out[ours] = get(hf, (positions, *shape[1:]))[: cfg.seq_len]
        else:
            out[ours] = get(hf, shape)
    for i in range(cfg.n_layers):
        for ours, hf, _, back in _block_map(cfg, i):
            shape = shapes[ours]
            if ours in wanted:
                out[ours] = back(get(hf, shape[::-1] if back is not _same else shape))
        for ours, parts, sizes in _fused(cfg, i) if family(cfg) == "llama" else []:
            rest = shapes[ours][1:]
            if ours in wanted:
                out[ours] = torch.cat([get(p, (n, *rest)) for p, n in zip(parts, sizes, strict=True)])
    if read and cfg.padded_vocab_size > cfg.vocab_size and vocab_rows & set(out):
        fresh = GPT(dataclasses.replace(cfg, kernels="reference"), layers=[], device="cpu")  # draws as a fresh model
        for name in vocab_rows & set(out):
            out[name] = torch.cat([out[name], getattr(fresh, name.split(".")[0]).weight[cfg.vocab_size:]])
    if cfg.tie_embeddings and "tok_emb.weight" in out:
        out["lm_head.weight"] = out["tok_emb.weight"]
    return out


def init_from_hf(run, folder: str | os.PathLike) -> None:
    """Set ``run``'s parameters (a :class:`~tokenloom.train.strategy.Strategy` of any layout, built
    from :func:`resolve_config`'s config) from the folder's weights; the optimizer keeps its fresh
    state (ZeRO-1: its master shards are cut from the loaded parameters)."""
    run.finish_param_sync()
    names = {name for chunk in run.chunks for name, _ in chunk.named_parameters(remove_duplicate=False)}
    load_params(run, from_hf(run.cfg.model, folder, names=names), {}, str(folder))
