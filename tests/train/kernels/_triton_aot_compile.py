"""Compile every Triton kernel ahead of time for a CUDA target, no GPU needed.

Usage: ``python _triton_aot_compile.py [ARCH]`` (default 90 = H100) with
``TRITON_INTERPRET`` unset. Runs Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX ->
cubin via the bundled ptxas) for fp32 and bf16 pointers and every constexpr branch,
catching what the NumPy interpreter cannot (typing, unsupported ops, lowering). Prints
one line per kernel variant and ``ALL OK`` at the end.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenloom.train.kernels import _triton_kernels as K


def _variants(p: str):
    """(kernel, signature, constexprs) for pointer type ``p`` of the activations."""
    f32 = "*fp32"
    norm_bwd = {"n_rows": "i32", "N": "i32", "rows_per_program": "i32", "BLOCK": "constexpr"}
    yield K.rms_norm_fwd, dict(X=p, W=p, Y=p, RSTD=f32, N="i32", eps="fp32", BLOCK="constexpr"), {"BLOCK": 64}
    yield K.rms_norm_bwd, dict(DY=p, X=p, W=p, RSTD=f32, DX=p, DW_PARTIAL=f32, **norm_bwd), {"BLOCK": 64}
    for has_bias in (True, False):
        sig = dict(
            X=p,
            W=p,
            B=p,
            Y=p,
            MEAN=f32,
            RSTD=f32,
            N="i32",
            eps="fp32",
            HAS_BIAS="constexpr",
            BLOCK="constexpr",
        )
        yield K.layer_norm_fwd, sig, {"HAS_BIAS": has_bias, "BLOCK": 64}
    sig = dict(DY=p, X=p, W=p, MEAN=f32, RSTD=f32, DX=p, DW_PARTIAL=f32, DB_PARTIAL=f32, **norm_bwd)
    yield K.layer_norm_bwd, sig, {"BLOCK": 64}
    yield K.swiglu_fwd, dict(G=p, U=p, Y=p, numel="i32", BLOCK="constexpr"), {"BLOCK": 1024}
    yield K.swiglu_bwd, dict(DY=p, G=p, U=p, DG=p, DU=p, numel="i32", BLOCK="constexpr"), {"BLOCK": 1024}
    flags = dict(HAS_BIAS="constexpr", TANH="constexpr", BLOCK="constexpr")
    for has_bias in (True, False):
        for tanh in (True, False):
            consts = {"HAS_BIAS": has_bias, "TANH": tanh, "BLOCK": 1024}
            yield K.bias_gelu_fwd, dict(X=p, B=p, Y=p, numel="i32", N="i32", **flags), consts
            yield K.bias_gelu_bwd, dict(DY=p, X=p, B=p, DX=p, numel="i32", N="i32", **flags), consts
    for backward in (False, True):
        sig = dict(
            X=p,
            COS=f32,
            SIN=f32,
            Y=p,
            seq_len="i32",
            HALF="constexpr",
            BLOCK="constexpr",
            BACKWARD="constexpr",
        )
        yield K.rope_fwd_bwd, sig, {"HALF": 32, "BLOCK": 32, "BACKWARD": backward}


def main() -> None:
    target = GPUTarget("cuda", int(sys.argv[1]) if len(sys.argv) > 1 else 90, 32)
    for p in ("*fp32", "*bf16"):
        for fn, sig, consts in _variants(p):
            kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
            assert "cubin" in kernel.asm, fn.__name__
            print(f"{fn.__name__} {p} {consts}: ok")
    print("ALL OK")


if __name__ == "__main__":
    main()
