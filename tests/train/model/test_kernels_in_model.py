"""GPT with ``model.kernels``: compiled kernels match the eager reference in training.

The 20-step runs compile (inductor C++ on CPU, 10-30 s on the 2-core box), so this file
is the slow part of the kernel tests. Speed is measured in bench/kernels_bench.py (whole
20-step runs in fresh processes, taken in turn), never asserted here; the wall times are
printed (``pytest -s``).
"""

from __future__ import annotations

import copy
import pickle
import time
from pathlib import Path

import pytest
import torch

from tokenloom.errors import TokenloomError
from tokenloom.train.config import TrainConfig
from tokenloom.train.data import DataConfig, MockDataConfig
from tokenloom.train.kernels import cross_entropy
from tokenloom.train.kernels.compiled import compile_available, force_compiled
from tokenloom.train.loop import run
from tokenloom.train.metrics import read_metrics
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT, masked_mean

needs_compile = pytest.mark.skipif(not compile_available("cpu"), reason="no C++ compiler for inductor")

ARCHS = {"gpt2": {}, "llama": dict(arch="llama", n_kv_heads=1),
         "gpt2_rope_swiglu": dict(positions="rope", mlp="swiglu"),
         "llama_layernorm_gelu_bias": dict(arch="llama", norm="layernorm", mlp="gelu", bias=True)}


def small(kernels: str, **kw) -> GPTConfig:
    base = dict(vocab_size=100, seq_len=16, n_layers=2, n_heads=2, d_model=32, kernels=kernels)
    base.update(kw)
    return GPTConfig(**base)


def test_default_is_reference_and_bad_mode_is_a_user_error():
    assert GPTConfig().kernels == "reference"
    with pytest.raises(TokenloomError, match="kernels"):
        GPTConfig(kernels="fast")


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_and_pickle_are_mode_neutral(arch):
    ref, comp = GPT(small("reference", **ARCHS[arch])), GPT(small("compiled", **ARCHS[arch]))
    assert list(ref.state_dict()) == list(comp.state_dict())
    comp.load_state_dict(ref.state_dict())  # checkpoints load across modes
    tokens = torch.randint(0, 100, (2, 16))
    comp(tokens[:, :4], tokens[:, :4]) if compile_available("cpu") else None
    assert pickle.loads(pickle.dumps(comp)).blocks["0"].mlp.ops.sources == comp.ops.sources  # rebuilt from its recipe
    copy.deepcopy(comp)
    assert list(comp.state_dict()) == list(ref.state_dict())


@needs_compile
def test_kernels_are_chosen_once_at_build_never_in_forward(monkeypatch):
    from tokenloom.train.model import gpt as model_module

    gpt = GPT(small("compiled", arch="llama", n_kv_heads=1))
    held = [m.ops for m in gpt.modules() if hasattr(m, "ops")]
    assert len(held) == 12 and all(ops is gpt.ops for ops in held) and gpt.ops.mode == "compiled"  # one spec, shared by every block, norm and the head

    def no_lookup(*args, **kwargs):
        raise AssertionError("select_kernels called after the model was built")

    monkeypatch.setattr(model_module, "select_kernels", no_lookup)
    tokens = torch.randint(0, 100, (2, 16))
    gpt(tokens, tokens).backward()
    assert GPT(small("reference")).ops is None and GPT(small("compiled"), device="meta").ops is None


@needs_compile
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_backward_compiled_matches_reference(arch):
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (2, 16))
    labels = torch.randint(0, 100, (2, 16))
    mask = (torch.rand(2, 16) > 0.3).float()
    grads, losses, logits = [], [], []
    for mode in ("reference", "compiled"):
        model = GPT(small(mode, recompute_layers=(1,), **ARCHS[arch]))
        with force_compiled():  # small shapes: otherwise the size switch keeps them eager
            loss = model(tokens, labels, mask)
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad for n, p in model.named_parameters()})
            with torch.no_grad():
                logits.append(model(tokens))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["reference", pytest.param("compiled", marks=needs_compile)])
def test_token_losses_average_to_the_loss_with_its_gradients(mode, monkeypatch):
    """``token_losses=True`` (losses per source): per-token losses [batch, seq] whose masked mean
    is the scalar loss, with the same gradients; "compiled" through the chunked kernel's
    per-token path against its fused gradients-in-forward (full logits are below its size switch
    otherwise)."""
    monkeypatch.setattr(cross_entropy, "FULL_LOGITS_BELOW", 0)
    tokens, labels = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    mask = (torch.rand(2, 16) > 0.3).float()
    losses, grads = [], []
    for per_token in (False, True):
        torch.manual_seed(0)
        model = GPT(small(mode))
        with force_compiled():
            out = model(tokens, labels, mask, token_losses=per_token)
            if per_token:
                assert out.shape == (2, 16)
                out = masked_mean(out.reshape(-1), mask)
            out.backward()
        losses.append(out.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


def _train(tmp: Path, kernels: str) -> tuple[list[float], float, float]:
    cfg = TrainConfig(
        model=GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2, n_heads=2,
                        d_model=32, kernels=kernels),
        data=DataConfig(mock=MockDataConfig(num_sequences=300, max_length=200)),
        micro_batch_size=2, global_batch_size=4, train_iters=20, eval_interval=0, log_interval=1,
        save_interval=None, output_dir=str(tmp), progress=False, plot=False, seed=1234,
    )
    start = time.perf_counter()
    with force_compiled():  # the compiled kernels at every size, not only past the size switch
        run(cfg)
    wall = time.perf_counter() - start
    records = [r for r in read_metrics(tmp / "metrics.jsonl") if "train_loss" in r]
    steady = sum(r["step_time_s"] for r in records[1:])  # the first step (compile) is timed alone
    return [r["train_loss"] for r in records], wall, steady


@needs_compile
def test_twenty_step_training_compiled_matches_reference(tmp_path):
    ref, ref_wall, ref_step = _train(tmp_path / "ref", "reference")
    comp, comp_wall, comp_step = _train(tmp_path / "comp", "compiled")
    print(f"\nreference: wall {ref_wall:.2f} s, steps 2-20 {ref_step:.2f} s, losses {ref}")
    print(f"compiled:  wall {comp_wall:.2f} s, steps 2-20 {comp_step:.2f} s, losses {comp}")
    print(f"max |loss diff| {max(abs(a - b) for a, b in zip(ref, comp, strict=True)):.3e}")
    assert len(ref) == len(comp) == 20
    for step, (a, b) in enumerate(zip(ref, comp, strict=True), 1):
        assert abs(a - b) <= 1e-4, (step, a, b)
