"""``fp8`` (``--fp8``): where it is refused, in one line, and torchao's conversion of the block
linears on a CPU model (its float8 matmul itself is checked on a GPU by scripts/gpu-check.sh)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_loop import tiny

from tokenloom.errors import TokenloomError
from tokenloom.train.config import TrainConfig
from tokenloom.train.loop import start_run
from tokenloom.train.model import fp8
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.summary import choices

CUDA = torch.device("cuda", 0)
ok = dict(tp=1, precision="auto", kernels="reference", capability=(9, 0))
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="the fp8 extra is not installed")


@pytest.mark.parametrize(("change", "reason"), [
    (dict(device=torch.device("cpu")), "needs a CUDA GPU with float8 tensor cores; this run is on cpu"),
    (dict(capability=(8, 0)), "compute capability >= 8.9: Ada, Hopper or later); this GPU has 8.0"),
    (dict(tp=2), "serves tp = 1 layouts only"),
    (dict(precision="fp32"), "trains under bf16 autocast"),
    (dict(kernels="triton"), "the triton kernels call the matmuls themselves"),
    (dict(recipe="delayed"), "fp8 must be one of tensorwise, rowwise"),
])
def test_refused_in_one_line_where_it_cannot_run(change, reason):
    args = {**ok, "device": CUDA, "recipe": "rowwise", **change}
    why = fp8.refusal(args.pop("recipe"), args.pop("device"), **args)
    assert why is not None and reason in why and "\n" not in why


def test_served_on_hopper_and_ada_and_without_torchao_it_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert fp8.refusal("tensorwise", CUDA, **ok) is None
    assert fp8.refusal("rowwise", CUDA, **{**ok, "capability": (8, 9)}) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert fp8.refusal("tensorwise", CUDA, **ok) == "--fp8 needs torchao: pip install 'tokenloom[fp8]'"


def test_a_cpu_run_is_refused_before_training_and_a_bad_recipe_is_a_config_error(tmp_path):
    with pytest.raises(TokenloomError, match="--fp8 needs a CUDA GPU"):
        start_run(tiny(tmp_path, fp8="tensorwise"))
    with pytest.raises(TokenloomError, match="fp8 must be one of tensorwise, rowwise"):
        TrainConfig(fp8="e5m2")


def test_summary_names_the_recipe():
    assert choices(TrainConfig(fp8="rowwise"), "cuda").endswith("; fp8 rowwise scaling (torchao float8 block linears)")
    assert "fp8" not in choices(TrainConfig(), "cuda")


@needs_torchao
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_conversion_swaps_the_aligned_block_linears_and_keeps_the_parameters(recipe):
    model = GPT(GPTConfig(vocab_size=100, seq_len=16, n_layers=2, n_heads=2, d_model=32, ffn_hidden_size=40))
    params = dict(model.named_parameters())
    names = list(model.state_dict())
    assert fp8.convert([model], recipe) == 4  # the 40-wide MLP's sizes are not multiples of 16: kept
    swapped = sorted(n for n, m in model.named_modules() if fp8.is_float8(m))
    assert swapped == [f"blocks.{i}.attn.{k}" for i in (0, 1) for k in ("proj", "qkv")]
    assert not fp8.is_float8(model.lm_head)  # bf16: maybe tied, and the most precision-sensitive matmul
    assert list(model.state_dict()) == names  # checkpoints load across fp8 settings
    assert all(p is params[n] for n, p in model.named_parameters())  # tags and optimizer views kept
    tokens = torch.randint(0, 100, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torchao's float8 path traces on CPU too
        loss = model(tokens, tokens)
    loss.backward()
    assert torch.isfinite(loss) and model.blocks["0"].attn.qkv.weight.grad is not None
