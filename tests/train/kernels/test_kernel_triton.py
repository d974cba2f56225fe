"""Triton kernels match the references.

Without CUDA the kernels run in Triton's NumPy interpreter (``TRITON_INTERPRET=1``, set by
conftest.py): same kernel source, checked for numerics only. With CUDA, the ``gpu`` tests
run them compiled, on the device.

Tolerances, outputs and input/weight gradients (the kernels compute in fp32, reduce in a
different order, and sum weight gradients as per-program fp32 partials):
float32 rtol 1e-5 / atol 1e-5; bfloat16 rtol 2e-2 / atol 2e-2 (a couple of bf16 ulps).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tl_testing import limit_s

from tokenloom.train.kernels import select_kernels
from tokenloom.train.kernels.triton_ops import triton_available

REPO = Path(__file__).resolve().parents[3]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install triton; Linux x86-64/aarch64 wheels only)",
)


def _check(op_case, dtype, device):
    kernels = select_kernels("triton", device)
    assert kernels.sources[op_case.op] == "triton"
    out, grads = op_case.run(getattr(kernels, op_case.op), dtype, device)
    for truth in (op_case.reference, op_case.independent):
        ref_out, ref_grads = op_case.run(truth, dtype, device)
        assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
        torch.testing.assert_close(out, ref_out, **TOL[dtype])
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, **TOL[dtype])


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU check needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_interpreter_matches_reference(triton_case, dtype):
    assert triton_available("cpu")
    _check(triton_case, dtype, "cpu")


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU check needs TRITON_INTERPRET=1")
def test_triton_norm_backward_with_more_rows_than_programs():
    """Each backward program loops over several rows; partial weight grads must add up."""
    kernels = select_kernels("triton", "cpu")
    x = torch.randn(37, 24, requires_grad=True)
    w = (1 + 0.1 * torch.randn(24)).requires_grad_()
    b = torch.randn(24, requires_grad=True)
    for fn, ref, args in (
        (kernels.rms_norm, "rms_norm", (x, w)),
        (kernels.layer_norm, "layer_norm", (x, w, b)),
    ):
        got = torch.autograd.grad(fn(*args).square().sum(), args)
        want = torch.autograd.grad(getattr(select_kernels("reference"), ref)(*args).square().sum(), args)
        for g, r in zip(got, want, strict=True):
            torch.testing.assert_close(g, r, **TOL[torch.float32])


@needs_triton
def test_rope_triton_rejects_untrimmed_tables():
    if not triton_available("cpu") and not torch.cuda.is_available():
        pytest.skip("no device for Triton")
    from tokenloom.train.kernels.triton_ops import rope_triton
    from tokenloom.train.model.blocks import rope_tables
    from tokenloom.train.model.config import GPTConfig

    cos, sin = rope_tables(GPTConfig(arch="llama", seq_len=16, d_model=8, n_heads=1))
    with pytest.raises(ValueError, match="slice the tables"):
        rope_triton(torch.randn(1, 2, 4, 8), cos, sin)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_cuda_matches_reference(triton_case, dtype):
    _check(triton_case, dtype, "cuda")


@needs_triton
@pytest.mark.slow
def test_triton_kernels_compile_for_h100_without_a_gpu():
    """Triton's whole compiler (down to cubin via its bundled ptxas) accepts every kernel variant."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(
        TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    )
    script = Path(__file__).with_name("_triton_aot_compile.py")
    out = subprocess.run(
        [sys.executable, str(script), "90"], capture_output=True, text=True, env=env, timeout=limit_s(300)
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ALL OK"), out.stdout + out.stderr
