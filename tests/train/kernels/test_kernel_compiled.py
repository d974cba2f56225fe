"""``compiled`` implementations (torch.compile of the references, ATen's own kernel for
fp32 LayerNorm and for GELU without a bias) match the references.

Tolerances, outputs and input gradients (inductor reorders fp32 arithmetic and fuses
the casts): float32 rtol 1e-5 / atol 1e-5; bfloat16 rtol 2e-2 / atol 2e-2 (a couple of
bf16 ulps, since fp32 intermediates can round to a neighbouring bf16 value).
First compile in a process costs 10-30 s on the shared dev box, hence ``slow``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from tl_testing import limit_s

from tokenloom.train.kernels import compiled as compiled_mod
from tokenloom.train.kernels import select_kernels
from tokenloom.train.kernels.compiled import compile_available, compiled_above, force_compiled

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not compile_available("cpu"), reason="torch.compile needs a C++ compiler on CPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_matches_reference(op_case, dtype):
    kernels = select_kernels("compiled", "cpu")
    assert kernels.sources[op_case.op] == "compiled"
    with force_compiled():  # these shapes are small: the compiled kernels would not be used
        out, grads = op_case.run(getattr(kernels, op_case.op), dtype)
    for truth in (op_case.reference, op_case.independent):
        ref_out, ref_grads = op_case.run(truth, dtype)
        assert out.dtype == ref_out.dtype
        torch.testing.assert_close(out, ref_out, **TOL[dtype])
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, **TOL[dtype])


def test_compiled_dropout_drops_and_rescales():
    """Inductor's RNG differs from eager's, so check the semantics, not the mask."""
    bda = select_kernels("compiled", "cpu").bias_dropout_add
    x = torch.randn(64, 128, requires_grad=True)
    bias, residual = torch.randn(128), torch.randn(64, 128)
    with force_compiled():
        out = bda(x, bias, residual, 0.25, True)
    kept = (out - residual).abs() > 1e-6
    torch.testing.assert_close((out - residual)[kept], ((x + bias) / 0.75)[kept], rtol=1e-5, atol=1e-5)
    assert 0.2 < 1 - kept.float().mean().item() < 0.3
    (grad,) = torch.autograd.grad(out.sum(), x)  # gradient uses the same mask as the output
    torch.testing.assert_close(grad, kept.float() / 0.75)


def test_new_shapes_do_not_recompile_endlessly():
    """Automatic dynamic shapes: at most two graphs serve any number of row counts."""
    from tokenloom.train.kernels.compiled import compiled
    from tokenloom.train.kernels.rms_norm import rms_norm_reference

    def fresh_rms_norm(x, w):  # a new code object, so earlier tests' graphs do not count
        return rms_norm_reference(x, w)

    fn, w = compiled(fresh_rms_norm), torch.ones(8)
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        for rows in range(1, 7):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(fn(x, w), rms_norm_reference(x, w), **TOL[torch.float32])


def test_small_cpu_inputs_run_eager_large_ones_compiled(monkeypatch):
    """The size switch: below the op's threshold the eager function runs (bit-identical,
    nothing compiled); at or above it, and under force_compiled, the compiled one."""
    from tokenloom.train.kernels.rms_norm import rms_norm_reference

    def fresh_rms_norm(x, w):  # a new function, so no other test has compiled it
        return rms_norm_reference(x, w)

    monkeypatch.setitem(compiled_mod.CPU_MIN_NUMEL, "rms_norm", 64)
    fn, w = compiled_above(fresh_rms_norm, "rms_norm"), torch.rand(8) + 0.5
    small = torch.randn(7, 8)  # 56 elements
    assert torch.equal(fn(small, w), fresh_rms_norm(small, w))
    assert fresh_rms_norm not in compiled_mod._CACHE
    with force_compiled():
        torch.testing.assert_close(fn(small, w), fresh_rms_norm(small, w), **TOL[torch.float32])
    assert fresh_rms_norm in compiled_mod._CACHE
    large = torch.randn(8, 8)
    torch.testing.assert_close(fn(large, w), fresh_rms_norm(large, w), **TOL[torch.float32])
    monkeypatch.setitem(compiled_mod.CPU_MIN_NUMEL, "rms_norm", None)  # None: never on CPU
    assert torch.equal(fn(large, w), fresh_rms_norm(large, w))


def test_a_small_model_never_starts_the_compiler():
    """A GPT whose tensors all stay below the thresholds runs forward and backward in
    ``compiled`` mode without compiling anything (fresh interpreter: nothing compiled before)."""
    code = textwrap.dedent("""
        import torch
        from tokenloom.train.kernels import compiled
        from tokenloom.train.model.gpt import GPT
        from tokenloom.train.model.config import GPTConfig
        model = GPT(GPTConfig(arch="llama", vocab_size=96, seq_len=16, n_layers=2, n_heads=2, d_model=32,
                              kernels="compiled"))  # llama: rms_norm, rope, swiglu switch on size
        tokens = torch.randint(0, 96, (2, 16))
        model(tokens, tokens).backward()
        print(len(compiled._CACHE), torch._dynamo.utils.counters["stats"]["calls_captured"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit_s(300), check=True)
    assert out.stdout.split() == ["0", "0"], out.stdout + out.stderr
