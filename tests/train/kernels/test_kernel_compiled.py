"""``compiled`` implementations (torch.compile of the references, ATen's own kernel for
fp32 LayerNorm and for GELU without a bias) match the references.

Tolerances, outputs and input gradients (inductor reorders fp32 arithmetic and fuses
the casts): float32 rtol 1e-5 / atol 1e-5; bfloat16 rtol 2e-2 / atol 2e-2 (a couple of
bf16 ulps, since fp32 intermediates can round to a neighbouring bf16 value).
First compile in a process costs 10-30 s on the shared dev box, hence ``slow``.
"""

from __future__ import annotations

import pytest
import torch

from tokenloom.train.kernels import select_kernels
from tokenloom.train.kernels.compiled import compile_available

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not compile_available("cpu"), reason="torch.compile needs a C++ compiler on CPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_matches_reference(op_case, dtype):
    kernels = select_kernels("compiled", "cpu")
    assert kernels.sources[op_case.op] == "compiled"
    out, grads = op_case.run(getattr(kernels, op_case.op), dtype)
    ref_out, ref_grads = op_case.run(op_case.reference, dtype)
    assert out.dtype == ref_out.dtype
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL[dtype])


def test_compiled_dropout_drops_and_rescales():
    """Inductor's RNG differs from eager's, so check the semantics, not the mask."""
    bda = select_kernels("compiled", "cpu").bias_dropout_add
    x = torch.randn(64, 128, requires_grad=True)
    bias, residual = torch.randn(128), torch.randn(64, 128)
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
