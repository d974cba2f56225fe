"""Every layout through ``cli.py train --distributed-backend gloo`` with all its ranks on one GPU
(scripts/gpu-check.sh; skipped without CUDA) against the one-rank GPU run of the same global
batch: what a user debugging a layout on a workstation runs. The ranks keep their tensors on
``cuda:0`` (the start-up summary names the device) and gloo's missing CUDA collectives go through
:class:`~tokenloom.train.staged_gloo.StagedGloo`'s pinned host buffers.

The CUDA defaults (bf16, compile auto: compiled blocks, except where they hold collectives, tp, cp
and ep, which stay eager over the staged group: staged_gloo.blocks_compile_with) within
:data:`BF16_TOL`; two layouts also in fp32 within :data:`FP32_TOL`. Each flag set's one-rank reference runs once per module (:func:`reference`)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "parallel"))
from compose_helpers import STEPS, read_losses, tiny_cfg  # noqa: E402
from tl_testing import run_cli  # noqa: E402

from tokenloom.train.config import config_to_dict  # noqa: E402

FP32_TOL = 1e-4
"""fp32: the ranks' reduction order differs from one process's sums, nothing more."""
BF16_TOL = 0.05
"""bf16 (autocast, fp32 parameters and gradient reductions): a layout splits the matmuls (tp, cp,
experts over ranks) or the micro-batches' sums differently from the one-rank run, and each split
rounds its bf16 products on its own: a relative 2**-8 per rounding, about 0.016 of a loss near 4;
over the tiny model's steps those stay within a few such steps (the project's bf16 bound,
test_layouts_cli.BF16_TOL), while a wrong reduction (a missing or doubled gradient, a wrong rank's
shard) moves the losses by more within the first steps."""

GLOO = ["--distributed-backend", "gloo"]
DOCS = ["--set", "data.inter_document_masking=true", "--set", "model.n_heads=2"]  # head dim 16: flex's least
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--set", "optim.lr=0.003"]
FP32 = ["--set", "precision=fp32"]

# name -> (ranks, the layout's flags, the flags it shares with its one-rank reference)
LAYOUTS = {
    "dp2": (2, [], []),
    "dp2_zero1": (2, ["--zero1"], []),
    "dp2_fsdp": (2, ["--fsdp"], []),
    "tp2_sp": (2, ["--tp", "2", "--sp"], []),
    "pp2_vpp2": (2, ["--pp", "2", "--vpp", "2"], []),
    "cp2": (2, ["--cp", "2"], []),
    "cp2_documents": (2, ["--cp", "2"], DOCS),
    "ep2_alltoall": (2, ["--ep", "2", "--moe-token-dispatcher-type", "alltoall"], MOE),
    "ep2_allgather": (2, ["--ep", "2", "--moe-token-dispatcher-type", "allgather"], MOE),
    "dp2_fp8": (2, [], ["--fp8"]),
    "dp2_fp32": (2, [], FP32),
    "tp2_sp_fp32": (2, ["--tp", "2", "--sp"], FP32),
}

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]  # a reference and a 2-rank run, each compiling


def _train(tmp: Path, name: str, ranks: int | None, flags: list[str]) -> list[float]:
    config, out = tmp / f"{name}.json", tmp / name
    config.write_text(json.dumps(config_to_dict(tiny_cfg(out, save_interval=None, moe="--num-experts" in flags))))
    launch = ["--nproc-per-node", str(ranks)] if ranks else []
    done = run_cli("train", "--config", config, *launch, *flags, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank(s) on cuda" in done.stdout, done.stdout[:2000]
    return read_losses(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-rank GPU run's losses per shared flag set, each run once."""
    tmp, cache = tmp_path_factory.mktemp("one_rank"), {}

    def losses(flags: list[str]) -> list[float]:
        key = tuple(flags)
        if key not in cache:
            cache[key] = _train(tmp, f"ref{len(cache)}", None, flags)
        return cache[key]

    return losses


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_on_one_gpu_over_gloo_equals_one_rank(tmp_path, reference, name):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ranks, flags, shared = LAYOUTS[name]
    ref = reference(shared)
    losses = _train(tmp_path, name, ranks, [*GLOO, *flags, *shared])
    tol = FP32_TOL if shared == FP32 else BF16_TOL
    assert len(losses) == len(ref) == STEPS and all(map(math.isfinite, losses)), losses
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < tol, (losses, ref)
