"""``cli.py train``'s layout flags against the one-process run.

The numbers of every layout are proven in-process by ``parallel/test_compose.py`` (losses, grad
norms, validation loss, checkpoint parameters and pipeline bubbles against the one-process run);
what is left for the command is that each flag spelling (Megatron's and ours) reaches that same
config and launch size, checked here without launching, and that a launch through torchrun
reaches the loop. The best-fit packing runs below launch ranks for real (dp 2, tp 2 with sequence
parallelism, pp 4 and cp 2, documents masked: samples of several documents and padding, documents
across cp's chunks) and must equal the one-process best-fit run, itself stopped mid-epoch and
finished by ``--resume auto``; the GPU checks do the layouts on NCCL."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent / "parallel"))
from compose_helpers import (  # noqa: E402
    PARAM_TOL,
    STEPS,
    checkpoint_params,
    read_bubbles,
    read_losses,
    read_norms,
    tiny_cfg,
)
from tl_testing import cli_env, run_cli  # noqa: E402

from tokenloom import cli  # noqa: E402
from tokenloom.train import launch as launch_module  # noqa: E402
from tokenloom.train.checkpoint import commit as checkpoint  # noqa: E402
from tokenloom.train.config import config_to_dict  # noqa: E402
from tokenloom.train.data import TrainData  # noqa: E402

TOL = 1e-5
# a test's setup may run the module's one-process CLI runs (two) before its own: each up to a minute here
pytestmark = pytest.mark.timeout(2400)

# name -> (ranks, CLI flags, the config fields they set); each is a layout of test_compose.py
# (dp2 alone: test_loop_dist.py), every flag spelling at least once
LAYOUTS = {
    "dp2_tp1_pp1": (2, [], {}),
    "dp1_tp2_pp1": (2, ["--tensor-model-parallel-size", "2"], dict(tp=2)),  # the Megatron spelling of --tp
    "dp1_tp2_pp1_sp": (2, ["--tp", "2", "--sp"], dict(tp=2, sp=True)),
    "dp1_tp1_pp2": (2, ["--pipeline-model-parallel-size", "2"], dict(pp=2)),
    "dp1_tp1_pp2_vpp2": (2, ["--pp", "2", "--vpp", "2"], dict(pp=2, vpp=2)),
    "dp1_tp1_pp2_vpp2_megatron": (2, ["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                                  dict(pp=2, vpp=2)),
    "dp2_tp1_pp1_zero1": (2, ["--use-distributed-optimizer"], dict(zero1=True)),
    "dp2_tp1_pp1_zero1_muon": (2, ["--zero1", "--optimizer", "muon", "--muon-momentum", "0.9", "--muon-num-ns-steps",
                                   "4", "--muon-tp-mode", "blockwise"],
                               dict(zero1=True, optim=dict(name="muon", muon_momentum=0.9, muon_ns_steps=4,
                                                           muon_tp_mode="blockwise"))),
    "dp2_tp1_pp1_fsdp": (2, ["--fsdp"], dict(fsdp=True)),  # the fsdp layouts: parallel/test_fsdp.py
    "dp2_tp2_pp1_fsdp_megatron": (4, ["--tp", "2", "--use-megatron-fsdp"], dict(tp=2, fsdp=True)),
    "cp2": (2, ["--cp", "2"], dict(cp=2)),  # the cp layouts: parallel/test_context.py
    "cp2_tp2_sp_megatron": (4, ["--context-parallel-size", "2", "--tp", "2", "--sp"], dict(cp=2, tp=2, sp=True)),
    "dp1_tp1_pp2_vpp2_compile": (2, ["--pp", "2", "--vpp", "2", "--set", "compile=true"],
                                 dict(pp=2, vpp=2, compile=True)),
    "dp1_tp1_pp2_first1": (2, ["--pp", "2", "--decoder-first-pipeline-num-layers", "1"],
                           dict(pp=2, num_layers_in_first_pipeline_stage=1)),  # 1 + 3 layers
}


def write_config(tmp_path: Path, name: str, moe: bool = False) -> tuple[Path, Path]:
    config, out = tmp_path / f"{name}.json", tmp_path / name
    config.write_text(json.dumps(config_to_dict(tiny_cfg(out, save_interval=None, moe=moe))))
    return config, out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_flags_reach_the_config_and_the_launch(tmp_path, monkeypatch, name):
    ranks, flags, fields = LAYOUTS[name]
    config, out = write_config(tmp_path, name)
    launched = []
    monkeypatch.setattr(launch_module, "launch", lambda cfg, nproc, **kw: launched.append((cfg, nproc)))
    monkeypatch.setattr(launch_module, "stdout_outlives_its_reader", lambda: None)
    done = CliRunner().invoke(cli.main, ["train", "--config", str(config), "--nproc-per-node", str(ranks), *flags])
    assert done.exit_code == 0, done.output
    [(cfg, nproc)] = launched
    assert nproc == ranks
    assert config_to_dict(cfg) == config_to_dict(tiny_cfg(out, save_interval=None, **fields))


def train(tmp_path: Path, name: str, ranks: int | None, flags: list[str], env: dict | None = None,
          device: str | None = None, moe: bool = False) -> Path:
    """Run ``cli.py train`` on the tiny config (``moe``: its mixture-of-experts form); ``device``:
    the start-up summary must name it."""
    config, out = write_config(tmp_path, name, moe)
    launch = ["--nproc-per-node", str(ranks)] if ranks else []
    done = run_cli("train", "--config", config, *launch, *flags, timeout=1500, env=env)  # pp4: 300 s in a slow box's suite
    assert done.returncode == 0, done.stderr[-3000:]
    assert device is None or f"rank(s) on {device}" in done.stdout, done.stdout[:2000]
    return out


# best-fit packing of documents of 1-11 tokens into samples of 17, documents masked (best-fit's default,
# but the tiny config's file, written from a concat config, says false); ITERS steps
ITERS = 10
PACKED = ["--set", "data.packing=best-fit", "--set", "data.inter_document_masking=true", "--set",
          "data.mock.max_length=12", "--set", f"train_iters={ITERS}"]
STOP = 7  # the one-process run stops here (mid-epoch) and resumes with --resume auto


def run_record(out: Path) -> dict:
    """A run's logged losses and grad norms, and its final checkpoint's full parameters."""
    metrics = out / "metrics.jsonl"
    return {"losses": read_losses(metrics), "norms": read_norms(metrics),
            "params": checkpoint_params(checkpoint.find_latest(out / "checkpoints"))}


def test_best_fit_flags_pack_the_runs_data(tmp_path, monkeypatch):
    """PACKED reaches the config (best-fit, documents masked) and packs the runs' train samples:
    several documents in most, padding in some, documents across the boundaries of cp2's chunks
    (every seq / 4 tokens) in most; the runs reach a second epoch and the resume at STOP lies
    inside one."""
    config, out = write_config(tmp_path, "packed")
    launched = []
    monkeypatch.setattr(launch_module, "launch", lambda cfg, nproc, **kw: launched.append((cfg, nproc)))
    monkeypatch.setattr(launch_module, "stdout_outlives_its_reader", lambda: None)
    done = CliRunner().invoke(cli.main, ["train", "--config", str(config), "--nproc-per-node", "2", "--cp", "2",
                                         *PACKED])
    assert done.exit_code == 0, done.output
    [(cfg, _)] = launched
    assert (cfg.data.packing, cfg.data.inter_document_masking, cfg.data.mock.max_length, cfg.train_iters) == \
        ("best-fit", True, 12, ITERS)
    gbs, seq = cfg.global_batch_size, cfg.model.seq_len
    samples = cfg.train_iters * gbs
    train_set = TrainData(cfg.data, seq_len=seq, vocab_size=cfg.model.vocab_size, sizes=(samples, 0, 0),
                          global_batch_size=gbs).train
    read = [train_set.documents_of(k) for k in range(samples)]
    padded = [int(tokens[-1] == -1) for tokens, _ in read]  # the pad id (GPTDatasetConfig.pad_id)
    documents = [lengths[: len(lengths) - pad] for (_, lengths), pad in zip(read, padded, strict=True)]
    assert sum(len(d) >= 2 for d in documents) > samples // 2 and any(padded)
    chunk = seq // 4
    crossing = [d for d in documents
                if any(s // chunk != (e - 1) // chunk for s, e in zip(np.cumsum(d) - d, np.cumsum(d), strict=True)
                       if e <= seq)]
    assert len(crossing) > samples // 2
    # no document is cut (1-11 tokens), so each epoch is one part per document: epochs start where
    # sample_index is a multiple of them
    starts = np.flatnonzero(np.asarray(train_set.indices.sample_index) % len(train_set.documents) == 0).tolist()
    assert starts[1] < STOP * gbs < starts[2] and samples < starts[2], starts  # inside the second epoch


@pytest.fixture(scope="module")
def packed_reference(tmp_path_factory):
    """The one-process best-fit run: STOP steps (exit_interval), then ``--resume auto`` to the end."""
    tmp = tmp_path_factory.mktemp("packed_ref")
    first = train(tmp, "ref", None, [*PACKED, "--set", f"exit_interval={STOP}"])
    assert len(read_losses(first / "metrics.jsonl")) == STOP
    out = train(tmp, "ref", None, [*PACKED, "--resume", "auto"])
    resumed = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "resumed_from" in r]
    assert len(resumed) == 1 and resumed[0]["resumed_from"].endswith(f"iter_{STOP:07d}"), resumed
    return run_record(out)


@pytest.mark.slow
@pytest.mark.parametrize("name,ranks,flags", [("dp2", 2, []),
                                             ("tp2_sp", 2, ["--tp", "2", "--set", "sp=true"]),
                                             ("pp4", 4, ["--pp", "4"]),  # middle stages, which read no batch
                                             ("cp2", 2, ["--cp", "2"])])  # documents split over cp ranks
def test_best_fit_packing_through_the_cli_equals_one_process(tmp_path, packed_reference, name, ranks, flags):
    """Best-fit packed data in each layout, launched through torchrun, equals the one-process run
    that stopped at STOP and resumed: every loss and grad norm within TOL, the final parameters within
    PARAM_TOL. (The one-process
    run carries the resume: an inexact one fails every layout from STOP on.)"""
    out = train(tmp_path, name, ranks, [*flags, *PACKED])
    got, ref = run_record(out), packed_reference
    assert len(got["losses"]) == len(ref["losses"]) == ITERS
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)) < TOL
    assert max(abs(a - b) for a, b in zip(got["norms"], ref["norms"], strict=True)) < TOL
    assert sorted(got["params"]) == sorted(ref["params"])
    assert max((got["params"][n] - t).abs().max().item() for n, t in ref["params"].items()) < PARAM_TOL
    bubbles = read_bubbles(out / "metrics.jsonl")
    assert all(0 < b < 1 for b in bubbles) if name == "pp4" else bubbles == [None] * ITERS, bubbles


@pytest.mark.slow
def test_expert_parallel_with_zero1_through_the_cli_equals_one_process(tmp_path):
    """Megatron's flag spellings of ep 2 with the distributed optimizer (world 2: dp 2 carved into
    ep 2), launched through torchrun, log the one-process MoE run's losses (balance and z losses
    included); ep with tp + sp and pp, their parameters and gradients are proven in-process by
    parallel/test_expert_parallel.py and the meta suite."""
    one = read_losses(train(tmp_path, "moe_ref", None, [], moe=True) / "metrics.jsonl")
    flags = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    losses = read_losses(train(tmp_path, "ep2_zero1", 2, flags, moe=True) / "metrics.jsonl")
    assert len(losses) == len(one) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, one, strict=True)) < TOL


@pytest.mark.slow
@pytest.mark.timeout(900)  # two cli.py runs (one process, then two ranks), each within run_cli's 280 s
def test_muon_with_zero1_through_the_cli_equals_one_process(tmp_path):
    """--optimizer muon with the distributed optimizer (dp 2: Muon's whole-tensor state sharding),
    launched through torchrun, logs the one-process Muon run's losses (Newton-Schulz in fp32, so
    the dp reduction's rounding cannot flip a bf16 rounding); both runs' configs say muon. The
    other Muon layouts are proven in-process by optim/test_muon_layouts.py."""
    fp32 = ["--optimizer", "muon", "--set", "optim.muon_ns_dtype=fp32"]
    ref = train(tmp_path, "muon_ref", None, fp32)
    out = train(tmp_path, "muon_zero1", 2, ["--use-distributed-optimizer", *fp32])
    one, losses = read_losses(ref / "metrics.jsonl"), read_losses(out / "metrics.jsonl")
    assert all(json.loads((d / "config.json").read_text())["optim"]["name"] == "muon" for d in (ref, out))
    assert len(losses) == len(one) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, one, strict=True)) < TOL


# On CUDA (scripts/gpu-check.sh): every layout on NCCL, one GPU per rank, fp32 (bf16 would
# hide a wrong reduction inside its rounding), against the one-process run on one GPU.
GPU_LAYOUTS = {
    "dp2": (2, []), "tp2": (2, ["--tp", "2"]), "tp2_sp": (2, ["--tp", "2", "--set", "sp=true"]),
    "pp2": (2, ["--pp", "2"]), "pp2_vpp2": (2, ["--pp", "2", "--vpp", "2"]), "dp2_zero1": (2, ["--zero1"]),
    "dp2_tp2": (4, ["--tp", "2"]), "dp2_pp2": (4, ["--pp", "2"]),
    "dp2_fsdp": (2, ["--fsdp"]), "dp2_tp2_fsdp": (4, ["--tp", "2", "--fsdp"]),
    "cp2": (2, ["--cp", "2"]), "cp2_dp2": (4, ["--cp", "2"]),
    # compiled blocks: tensor-parallel collectives captured in the graphs; pipeline stages of compiled blocks
    "tp2_sp_compile": (2, ["--tp", "2", "--set", "sp=true", "--set", "compile=true"]),
    "pp2_vpp2_compile": (2, ["--pp", "2", "--vpp", "2", "--set", "compile=true"]),
}
GPU_TOL = 1e-4  # NCCL's reduction order differs from one process's sums
BF16_TOL = 0.05  # bf16 against fp32 over the tiny model's steps


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_LAYOUTS))
def test_layout_on_nccl_equals_one_gpu(tmp_path, name):
    ranks, flags = GPU_LAYOUTS[name]
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs a CUDA device per rank ({ranks}); {torch.cuda.device_count()} visible")
    fp32 = ["--set", "precision=fp32"]
    ref = read_losses(train(tmp_path, "one_gpu", None, fp32) / "metrics.jsonl")
    losses = read_losses(train(tmp_path, name, ranks, [*flags, *fp32]) / "metrics.jsonl")
    assert len(losses) == len(ref) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < GPU_TOL


# On one GPU (scripts/gpu-check.sh): what a user with one GPU runs, through cli.py, fp32, against
# the eager one-process run of the same model on the CPU (CUDA hidden); the tiny config
# evaluates at step 10 and at the end. name -> (ranks, GPU flags, the CPU run's flags)
COMPILE = ["--set", "compile=true"]
DOCS = ["--set", "data.inter_document_masking=true", "--set", "model.n_heads=2"]  # head dim 16: flex's least
# compose_helpers' MoE learning rate: no token's top-k sits on a near-tie that the CPU's and the GPU's
# different summation orders could flip
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--set", "optim.lr=0.003"]
ONE_GPU_RUNS = {
    "plain": (None, [], []),
    "compile": (None, COMPILE, []),
    "documents": (None, DOCS, DOCS),  # flex attention with the document BlockMask; SDPA's dense mask on CPU
    "compile_documents": (None, [*COMPILE, *DOCS], DOCS),  # flex captured inside the compiled blocks
    # head dim 8, below flex's least: SDPA with the dense mask on CUDA too (flex's lowering raised)
    "documents_narrow_heads": (None, DOCS[:2], DOCS[:2]),
    "torchrun_zero1": (1, ["--zero1"], []),  # a one-rank NCCL group: every collective gets CUDA tensors
    # fully_shard over a one-rank NCCL group: gathers and reduce-scatters on CUDA, eager and compiled
    "torchrun_fsdp": (1, ["--fsdp"], []),
    "torchrun_fsdp_compile": (1, ["--fsdp", *COMPILE], []),
    # mixture of experts: fp32 takes the loop over experts (grouped GEMM is bf16-only on CUDA)
    "moe": (None, MOE, MOE),
    "moe_compile": (None, [*COMPILE, *MOE], MOE),
}


@pytest.fixture(scope="module")
def cpu_losses(tmp_path_factory):
    """The eager fp32 run's losses on the CPU (CUDA hidden) for a flag set, run once per module
    (per xdist worker) and flag set."""
    runs: dict[tuple[str, ...], list[float]] = {}

    def losses(flags: list[str]) -> list[float]:
        if tuple(flags) not in runs:
            out = train(tmp_path_factory.mktemp("cpu"), "cpu", None, [*flags, "--set", "precision=fp32"],
                        env=dict(cli_env(), CUDA_VISIBLE_DEVICES=""), device="cpu")
            runs[tuple(flags)] = read_losses(out / "metrics.jsonl")
        return runs[tuple(flags)]
    return losses


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ONE_GPU_RUNS))
def test_one_gpu_run_equals_the_cpu_run(tmp_path, cpu_losses, name):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ranks, flags, cpu_flags = ONE_GPU_RUNS[name]
    gpu = train(tmp_path, name, ranks, [*flags, "--set", "precision=fp32"], device="cuda")
    cpu_losses, gpu_losses = cpu_losses(cpu_flags), read_losses(gpu / "metrics.jsonl")
    assert len(gpu_losses) == len(cpu_losses) == STEPS
    assert max(abs(a - b) for a, b in zip(gpu_losses, cpu_losses, strict=True)) < GPU_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("name,flags", [("moe", MOE), ("fsdp", ["--fsdp"])])
def test_one_gpu_run_with_no_performance_flag_follows_the_cpu_run(tmp_path, cpu_losses, name, flags):
    """What a one-GPU user runs: the defaults (bf16, compile and kernels as chosen for the device;
    for MoE the experts as one grouped GEMM), launched as one process and, for fsdp, through torchrun
    on a one-rank NCCL group. bf16 rounding keeps it from equalling the fp32 CPU run exactly: its
    losses stay within bf16's reach of them."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gpu = train(tmp_path, name, 1 if name == "fsdp" else None, flags, device="cuda")
    cpu_losses, gpu_losses = cpu_losses(flags if name == "moe" else []), read_losses(gpu / "metrics.jsonl")
    assert len(gpu_losses) == len(cpu_losses) == STEPS and all(map(math.isfinite, gpu_losses)), gpu_losses
    assert max(abs(a - b) for a, b in zip(gpu_losses, cpu_losses, strict=True)) < BF16_TOL, (gpu_losses, cpu_losses)
