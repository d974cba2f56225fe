"""Triton kernels (imported only through :mod:`.triton_ops`, which checks for Triton).

fp32 arithmetic; stores cast to the output's dtype. Norm kernels hold a row per block (hidden <=
65536); their backward writes one fp32 weight-grad partial per program, summed by the caller: no
atomics, so results are deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd(X, W, Y, RSTD, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * N + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_bwd(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, N, rows_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 loop index: row * N may exceed 2^31
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        offs = row * N + cols
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        wdy = w * dy
        c = tl.sum(xhat * wdy, axis=0) / N
        tl.store(DX + offs, ((wdy - xhat * c) * rstd).to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)


@triton.jit
def layer_norm_fwd(X, W, B, Y, MEAN, RSTD, N, eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_bwd(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, n_rows, N, rows_per_program, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 loop index: row * N may exceed 2^31
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        offs = row * N + cols
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        c2 = tl.sum(wdy, axis=0) / N
        tl.store(DX + offs, ((wdy - (xhat * c1 + c2)) * rstd).to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)
    tl.store(DB_PARTIAL + pid * N + cols, db, mask=mask)


@triton.jit
def swiglu_fwd(G, U, Y, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd(DY, G, U, DG, DU, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DG + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * g * s).to(DU.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_and_grad(z, TANH: tl.constexpr):
    if TANH:
        k0 = 0.7978845608028654  # sqrt(2 / pi)
        inner = k0 * (z + 0.044715 * z * z * z)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner)
        y = 0.5 * z * (1.0 + t)
        dy_dz = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k0 * (1.0 + 3.0 * 0.044715 * z * z)
    else:
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        y = z * cdf
        dy_dz = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327  # 1 / sqrt(2 pi)
    return y, dy_dz


@triton.jit
def bias_gelu_fwd(X, B, Y, numel, N, HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
    y, _ = _gelu_and_grad(z, TANH)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def bias_gelu_bwd(DY, X, B, DX, numel, N, HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
    _, dy_dz = _gelu_and_grad(z, TANH)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + offs, (dy * dy_dz).to(DX.dtype.element_ty), mask=mask)


@triton.jit
def rope_fwd_bwd(X, COS, SIN, Y, seq_len, HALF: tl.constexpr, BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
    """One program per row of X viewed as [batch * heads * seq, 2 * HALF]; position = row % seq."""
    row = tl.program_id(0).to(tl.int64)
    pos = row % seq_len
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    x1 = tl.load(X + row * 2 * HALF + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + row * 2 * HALF + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + pos * 2 * HALF + cols, mask=mask, other=0.0)
    c2 = tl.load(COS + pos * 2 * HALF + HALF + cols, mask=mask, other=0.0)
    s1 = tl.load(SIN + pos * 2 * HALF + cols, mask=mask, other=0.0)
    s2 = tl.load(SIN + pos * 2 * HALF + HALF + cols, mask=mask, other=0.0)
    if BACKWARD:  # transpose of the forward rotation
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + row * 2 * HALF + cols, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + row * 2 * HALF + HALF + cols, y2.to(Y.dtype.element_ty), mask=mask)
