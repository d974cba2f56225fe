"""Every layout through ``cli.py train --nproc-per-node N`` (torchrun, gloo, fp32) against
the one-process ``cli.py train`` of the same config file: per-step losses equal within
1e-5, one metrics file, and the final checkpoint of each layout holds the one-process
parameters, for six of the eight layouts of issue 15 (every flag spelling; dp2 x tp2 and dp2 x
pp2, 4-rank launches, run only in ``parallel/test_compose.py`` to keep CI within its time) and
for interleaved pp with ``compile: true`` and an uneven pipeline split (Megatron's flag). That
in-process twin of this check, with resharded resume, covers every layout; this one proves the
command's flags and the launcher reach the same loop."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "parallel"))
from compose_helpers import checkpoint_params, read_losses, tiny_cfg  # noqa: E402
from tl_testing import cli_env, run_cli  # noqa: E402

from tokenloom.train.config import config_to_dict  # noqa: E402

pytestmark = pytest.mark.slow
TOL = 1e-5

# name -> (ranks, extra CLI flags)
LAYOUTS = {
    "dp2_tp1_pp1": (2, []),
    "dp1_tp2_pp1": (2, ["--tensor-model-parallel-size", "2"]),  # the Megatron spelling of --tp
    "dp1_tp2_pp1_sp": (2, ["--tp", "2", "--sp"]),
    "dp1_tp1_pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp1_tp1_pp2_vpp2": (2, ["--pp", "2", "--vpp", "2"]),
    "dp2_tp1_pp1_zero1": (2, ["--zero1"]),
    "dp1_tp1_pp2_vpp2_compile": (2, ["--pp", "2", "--vpp", "2", "--set", "compile=true"]),  # vs the eager run
    "dp1_tp1_pp2_first1": (2, ["--pp", "2", "--decoder-first-pipeline-num-layers", "1"]),  # 1 + 3 layers
}


def train(tmp_path: Path, name: str, ranks: int | None, flags: list[str], env: dict | None = None,
          device: str | None = None) -> Path:
    """Run ``cli.py train`` on the tiny config; ``device``: the start-up summary must name it."""
    config = tmp_path / f"{name}.json"
    out = tmp_path / name
    config.write_text(json.dumps(config_to_dict(tiny_cfg(out, save_interval=None))))
    launch = ["--nproc-per-node", str(ranks)] if ranks else []
    done = run_cli("train", "--config", config, *launch, *flags, timeout=280, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert device is None or f"rank(s) on {device}" in done.stdout, done.stdout[:2000]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = train(tmp_path_factory.mktemp("ref"), "ref", None, [])
    return read_losses(out / "metrics.jsonl"), checkpoint_params(out / "checkpoints" / "iter_0000020")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_through_the_cli_equals_one_process(tmp_path, reference, name):
    ranks, flags = LAYOUTS[name]
    out = train(tmp_path, name, ranks, flags)
    losses = read_losses(out / "metrics.jsonl")
    ref_losses, ref_params = reference
    assert len(losses) == len(ref_losses) == 20
    # with a pipeline, each train record carries the measured bubble of its interval
    bubbles = [r.get("pipeline_bubble") for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if "train_loss" in r]
    assert all(0 < b < 1 for b in bubbles) if "pp2" in name else bubbles == [None] * 20, bubbles
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOL
    params = checkpoint_params(out / "checkpoints" / "iter_0000020")
    assert sorted(params) == sorted(ref_params)
    assert max((params[n] - t).abs().max().item() for n, t in ref_params.items()) < TOL
    assert all(torch.isfinite(t).all() for t in params.values())
    if name.endswith("first1"):
        assert json.loads((out / "config.json").read_text())["num_layers_in_first_pipeline_stage"] == 1


@pytest.mark.parametrize("name,ranks,flags", [("pp4", 4, ["--pp", "4"]),  # middle stages need boundaries too
                                             ("tp2_sp", 2, ["--tp", "2", "--set", "sp=true"])])
def test_document_masking_through_the_cli_equals_one_process(tmp_path, reference, name, ranks, flags):
    """data.inter_document_masking in a pipeline and a sequence-parallel layout equals the
    one-process run with it, and differs from the run without it (the masks are used)."""
    docs = ["--set", "data.inter_document_masking=true"]
    one = read_losses(train(tmp_path, "one_docs", None, docs) / "metrics.jsonl")
    losses = read_losses(train(tmp_path, name, ranks, [*flags, *docs]) / "metrics.jsonl")
    assert len(losses) == len(one) == 20
    assert max(abs(a - b) for a, b in zip(losses, one, strict=True)) < TOL
    assert max(abs(a - b) for a, b in zip(one, reference[0], strict=True)) > 1e-3


# On CUDA (scripts/gpu-check.sh): every layout on NCCL, one GPU per rank, fp32 (bf16 would
# hide a wrong reduction inside its rounding), against the one-process run on one GPU.
GPU_LAYOUTS = {
    "dp2": (2, []), "tp2": (2, ["--tp", "2"]), "tp2_sp": (2, ["--tp", "2", "--set", "sp=true"]),
    "pp2": (2, ["--pp", "2"]), "pp2_vpp2": (2, ["--pp", "2", "--vpp", "2"]), "dp2_zero1": (2, ["--zero1"]),
    "dp2_tp2": (4, ["--tp", "2"]), "dp2_pp2": (4, ["--pp", "2"]),
    # compiled blocks: tensor-parallel collectives captured in the graphs; pipeline stages of compiled blocks
    "tp2_sp_compile": (2, ["--tp", "2", "--set", "sp=true", "--set", "compile=true"]),
    "pp2_vpp2_compile": (2, ["--pp", "2", "--vpp", "2", "--set", "compile=true"]),
}
GPU_TOL = 1e-4  # NCCL's reduction order differs from one process's sums


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_LAYOUTS))
def test_layout_on_nccl_equals_one_gpu(tmp_path, name):
    ranks, flags = GPU_LAYOUTS[name]
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs a CUDA device per rank ({ranks}); {torch.cuda.device_count()} visible")
    fp32 = ["--set", "precision=fp32"]
    ref = read_losses(train(tmp_path, "one_gpu", None, fp32) / "metrics.jsonl")
    losses = read_losses(train(tmp_path, name, ranks, [*flags, *fp32]) / "metrics.jsonl")
    assert len(losses) == len(ref) == 20
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < GPU_TOL


# On one GPU (scripts/gpu-check.sh): what a user with one GPU runs, through cli.py, fp32, against
# the eager one-process run of the same model on the CPU (CUDA hidden); the tiny config
# evaluates at step 10 and at the end. name -> (ranks, GPU flags, the CPU run's flags)
COMPILE = ["--set", "compile=true"]
DOCS = ["--set", "data.inter_document_masking=true", "--set", "model.n_heads=2"]  # head dim 16: flex's least
ONE_GPU_RUNS = {
    "plain": (None, [], []),
    "compile": (None, COMPILE, []),
    "documents": (None, DOCS, DOCS),  # flex attention with the document BlockMask; SDPA's dense mask on CPU
    "compile_documents": (None, [*COMPILE, *DOCS], DOCS),  # flex captured inside the compiled blocks
    # head dim 8, below flex's least: SDPA with the dense mask on CUDA too (flex's lowering raised)
    "documents_narrow_heads": (None, DOCS[:2], DOCS[:2]),
    "torchrun_zero1": (1, ["--zero1"], []),  # a one-rank NCCL group: every collective gets CUDA tensors
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ONE_GPU_RUNS))
def test_one_gpu_run_equals_the_cpu_run(tmp_path, name):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ranks, flags, cpu_flags = ONE_GPU_RUNS[name]
    fp32 = ["--set", "precision=fp32"]
    cpu = train(tmp_path, "cpu", None, [*cpu_flags, *fp32], env=dict(cli_env(), CUDA_VISIBLE_DEVICES=""), device="cpu")
    gpu = train(tmp_path, name, ranks, [*flags, *fp32], device="cuda")
    cpu_losses, gpu_losses = read_losses(cpu / "metrics.jsonl"), read_losses(gpu / "metrics.jsonl")
    assert len(gpu_losses) == len(cpu_losses) == 20
    assert max(abs(a - b) for a, b in zip(gpu_losses, cpu_losses, strict=True)) < GPU_TOL
