"""The eager references against independent formulations, and float64 gradcheck.

Tolerances: float64 comparisons use torch's float64 defaults (rtol 1e-7, atol 1e-7);
float32 ones use rtol 1.3e-6, atol 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

from tokenloom.errors import TokenloomError
from tokenloom.train.kernels import (
    attention_reference,
    attention_sdpa,
    bias_dropout_add_reference,
    bias_gelu_reference,
    layer_norm_reference,
    rms_norm_reference,
    rope_reference,
    swiglu_reference,
)
from tokenloom.train.model.blocks import rope_tables
from tokenloom.train.model.config import GPTConfig


def _rope(seq, dim, theta=10000.0):
    return rope_tables(GPTConfig(arch="llama", seq_len=seq, d_model=dim, n_heads=1, rope_theta=theta))


def _f64(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()


def test_norms_match_torch_modules():
    x, w, b = _f64(3, 5, 16), _f64(16, seed=1), _f64(16, seed=2)
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-5), F.rms_norm(x, (16,), w, 1e-5))
    torch.testing.assert_close(layer_norm_reference(x, w, b, 1e-5), F.layer_norm(x, (16,), w, b, 1e-5))
    torch.testing.assert_close(layer_norm_reference(x, w, None), F.layer_norm(x, (16,), w, None, 1e-5))


def test_gelu_formulas():
    x, b = _f64(4, 8), _f64(8, seed=1)
    z = x + b
    tanh = 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    exact = 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
    torch.testing.assert_close(bias_gelu_reference(x, b, "tanh"), tanh)
    torch.testing.assert_close(bias_gelu_reference(x, b, "none"), exact)
    torch.testing.assert_close(bias_gelu_reference(z, None, "none"), exact)


def test_swiglu_formula():
    g, u = _f64(4, 8), _f64(4, 8, seed=1)
    torch.testing.assert_close(swiglu_reference(g, u), g * torch.sigmoid(g) * u)


def test_rope_is_a_complex_rotation_of_half_pairs():
    """Pair (x[i], x[i + d/2]) rotates by angle pos * theta^(-2i/d): an independent formulation."""
    batch, heads, seq, dim = 2, 3, 5, 8
    x = _f64(batch, heads, seq, dim)
    cos, sin = _rope(seq, dim, theta=10000.0)
    pairs = torch.complex(x[..., : dim // 2], x[..., dim // 2 :])
    freqs = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * freqs
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)
    expected = torch.cat([rotated.real, rotated.imag], dim=-1)
    torch.testing.assert_close(rope_reference(x, cos.double(), sin.double()), expected)
    # fp32 tables (as stored) stay within fp32 precision of the exact rotation
    torch.testing.assert_close(rope_reference(x.float(), cos, sin), expected.float(), rtol=1.3e-6, atol=1e-5)


def test_rope_rejects_odd_head_dim():
    with pytest.raises(TokenloomError, match="even head dimension"):
        GPTConfig(arch="llama", d_model=21, n_heads=3)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_sdpa_matches_naive_attention(kv_heads):
    q, k, v = _f64(2, 4, 6, 8), _f64(2, kv_heads, 6, 8, seed=1), _f64(2, kv_heads, 6, 8, seed=2)
    for causal in (True, False):
        torch.testing.assert_close(attention_sdpa(q, k, v, causal), attention_reference(q, k, v, causal))
        gq, gk, gv = torch.autograd.grad(attention_sdpa(q, k, v, causal).sum(), (q, k, v))
        rq, rk, rv = torch.autograd.grad(attention_reference(q, k, v, causal).sum(), (q, k, v))
        for a, b in ((gq, rq), (gk, rk), (gv, rv)):
            torch.testing.assert_close(a, b)


def test_attention_rejects_bad_gqa():
    with pytest.raises(ValueError, match="multiple"):
        attention_sdpa(_f64(1, 4, 2, 8), _f64(1, 3, 2, 8), _f64(1, 3, 2, 8))


def test_bias_dropout_add_semantics():
    x, b, r = _f64(64, 32), _f64(32, seed=1), _f64(64, 32, seed=2)
    torch.testing.assert_close(bias_dropout_add_reference(x, b, r, 0.5, training=False), r + x + b)
    torch.testing.assert_close(bias_dropout_add_reference(x, None, r, 0.0), r + x)
    out = bias_dropout_add_reference(x, b, r, 0.25, training=True)
    kept = (out - r) != 0
    torch.testing.assert_close((out - r)[kept], ((x + b) / 0.75)[kept])
    assert 0.15 < 1 - kept.double().mean().item() < 0.35


GRADCHECK_CASES = {
    "rms_norm": lambda: (rms_norm_reference, (_f64(3, 8), _f64(8, seed=1))),
    "layer_norm": lambda: (layer_norm_reference, (_f64(3, 8), _f64(8, seed=1), _f64(8, seed=2))),
    "swiglu": lambda: (swiglu_reference, (_f64(3, 8), _f64(3, 8, seed=1))),
    "bias_gelu_tanh": lambda: (lambda x, b: bias_gelu_reference(x, b, "tanh"), (_f64(3, 8), _f64(8, seed=1))),
    "bias_gelu_exact": lambda: (
        lambda x, b: bias_gelu_reference(x, b, "none"),
        (_f64(3, 8), _f64(8, seed=1)),
    ),
    "rope": lambda: (
        lambda x: rope_reference(x, *(t.double() for t in _rope(4, 8))),
        (_f64(1, 2, 4, 8),),
    ),
    "attention": lambda: (
        attention_sdpa,
        (_f64(1, 2, 4, 8), _f64(1, 2, 4, 8, seed=1), _f64(1, 2, 4, 8, seed=2)),
    ),
}


@pytest.mark.parametrize("name", sorted(GRADCHECK_CASES))
def test_reference_gradcheck_float64(name):
    fn, inputs = GRADCHECK_CASES[name]()
    assert gradcheck(fn, inputs)
