"""``tokenloom train`` from the command line: in-process, the summary is the last stdout line."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tl_testing import REPO, cli_env, limit_s, one_line_error, reaped, run_cli


def test_train_prints_its_summary(tmp_path):
    out = run_cli("train", "--mock-data", "--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "2",
                  "--seq-length", "16", "--output-dir", tmp_path / "run", "--set", "model.n_layers=1",
                  "--set", "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.vocab_size=64",
                  "--set", "data.mock.num_sequences=50", "--set", "data.mock.max_length=40",
                  "--set", "eval_interval=0", "--set", "progress=false", "--set", "plot=false",
                  "--set", "log_interval=1")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert summary["iteration"] == 3 and len(losses) == 3 and summary["train_loss"] == losses[-1]
    # an untrained model is near uniform over the padded vocabulary (64 rounded up to 128, as Megatron)
    assert abs(losses[0] - math.log(128)) < 0.3
    assert summary["tokens_per_s"] > 0 and summary["first_step_s"] > 0

    # the library, given the config the command wrote, trains to the same losses
    from tokenloom.train.config import load_config
    from tokenloom.train.loop import run

    cfg = load_config(tmp_path / "run" / "config.json", [f"output_dir={json.dumps(str(tmp_path / 'lib'))}"])
    assert cfg.train_iters == 3 and cfg.model.n_layers == 1 and cfg.micro_batch_size == 2
    run(cfg)
    lib = [json.loads(line) for line in (tmp_path / "lib" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in lib if "train_loss" in r] == losses


# --------------------------------------------------------------------------- checks before launch

TINY = ["--seq-length", "32", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--set", "model.vocab_size=96", "--set", "model.make_vocab_size_divisible_by=32",
        "--set", "progress=false", "--set", "plot=false", "--eval-interval", "0", "--micro-batch-size", "2",
        "--global-batch-size", "4"]
MOCK = [*TINY, "--mock-data", "--set", "data.mock.num_sequences=300", "--set", "data.mock.max_length=200"]


@pytest.mark.parametrize("launch", [[], ["--nproc-per-node", "2"]], ids=["in-process", "torchrun"])
def test_batch_arithmetic_is_checked_before_launch(tmp_path, launch):
    out = tmp_path / "run"
    ranks = 2 if launch else 1
    done = run_cli("train", *MOCK, "--global-batch-size", "10" if launch else "3", *launch, "--output-dir", out)
    one_line_error(done, f"--global-batch-size {10 if launch else 3} is not a multiple of --micro-batch-size 2 x "
                   f"{ranks} data-parallel")
    assert not (out / "logs").exists() and not (out / "launch_config.json").exists()  # no rank was started


def test_layout_not_dividing_the_world_is_checked_before_launch(tmp_path):
    done = run_cli("train", *MOCK, "--tp", "2", "--pp", "2", "--nproc-per-node", "2", "--output-dir", tmp_path / "r")
    one_line_error(done, "--tp 2 x --pp 2 = 4 does not divide the 2 rank(s)", "--nproc-per-node 4")
    done = run_cli("train", *MOCK, "--tensor-model-parallel-size", "2", "--nproc_per_node", "3", "--output-dir",
                   tmp_path / "r")
    one_line_error(done, "--tp 2 x --pp 1 = 2 does not divide the 3 rank(s)")


def test_missing_prefix_is_checked_before_launch(tmp_path):
    missing = tmp_path / "nothing_here"
    done = run_cli("train", *TINY, "--data-path", "0.5", missing, "0.5", missing, "--nproc-per-node", "2",
                   "--output-dir", tmp_path / "r")
    one_line_error(done, f"--data: {missing}.idx does not exist")


def test_llama2_data_with_the_gpt2_tokenizer_is_refused(tmp_path, shared_data):
    source = tmp_path / "ts.jsonl"
    lines = (shared_data / "tinyshakespeare" / "tinyshakespeare.jsonl").read_text().splitlines()[:300]
    source.write_text("\n".join(lines) + "\n")
    prefix = tmp_path / "ts_llama2"
    done = run_cli("preprocess", "--input", source, "--output-prefix", prefix, "--tokenizer",
                   shared_data / "tokenizers" / "llama2" / "tokenizer.model", "--append-eod", "--no-progress")
    assert done.returncode == 0, done.stderr
    gpt2 = shared_data / "tokenizers" / "gpt2"
    done = run_cli("train", *TINY, "--data", prefix, "--tokenizer", gpt2, "--nproc-per-node", "2", "--output-dir",
                   tmp_path / "r")
    line = one_line_error(done, f"--tokenizer {gpt2}", f"{prefix} was tokenized with sentencepiece")
    assert "vocabulary 32000" in line and "vocabulary 50257" in line, line


@pytest.mark.parametrize("launch", [[], ["--nproc-per-node", "2"]], ids=["in-process", "torchrun"])
def test_a_reader_that_goes_away_does_not_end_the_run(tmp_path, launch):
    """``train ... | head -1``: the run goes on to its last checkpoint and exits 0, no traceback
    (the final JSON line is written after the reader closed the pipe)."""
    out = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, str(REPO / "cli.py"), "train", *MOCK, "--train-iters", "6", *launch,
                             "--output-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env())
    assert proc.stdout.readline().startswith("model ")
    proc.stdout.close()  # the reader goes away
    _, err = proc.communicate(timeout=limit_s(300))
    assert proc.returncode == 0 and "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]
    assert (out / "checkpoints" / "iter_0000006").is_dir()


def test_megatron_flags_that_mean_something_else_are_refused_one_by_one(tmp_path):
    done = run_cli("train", *MOCK, "--fp16", "--output-dir", tmp_path / "r")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "Error: --fp16 (Megatron) is not supported by tokenloom train: fp16 with loss scaling is not implemented; "
        "use --bf16 (or --set precision=bf16)")
    done = run_cli("train", *MOCK, "--lr-wsd-decay-samples", "--output-dir", tmp_path / "r")
    assert "--lr-wsd-decay-samples (Megatron) is not supported" in done.stderr.strip().splitlines()[-1]


def test_expert_parallel_flags_reach_the_config_or_are_refused_in_one_line(tmp_path):
    """--ep and Megatron's --expert-model-parallel-size set ep (checked before any rank starts: MoE at
    tp needs sp, ep refuses cp); --moe-token-dispatcher-type takes alltoall and allgather (the run's
    config.json holds it) and refuses any other."""
    done = run_cli("train", *MOCK, "--expert-model-parallel-size", "2", "--output-dir", tmp_path)
    one_line_error(done, "ep=2 splits the experts of mixture-of-experts layers; set model.num_experts (--num-experts)")
    done = run_cli("train", *MOCK, "--ep", "2", "--num-experts", "4", "--moe-router-topk", "2", "--tp", "2",
                   "--moe-token-dispatcher-type", "alltoall", "--output-dir", tmp_path)
    one_line_error(done, "model.num_experts=4 at tp=2 needs sequence parallelism (sp=true, --sequence-parallel)")
    done = run_cli("train", *MOCK, "--ep", "2", "--num-experts", "4", "--moe-router-topk", "2", "--cp", "2",
                   "--output-dir", tmp_path)
    one_line_error(done, "ep=2 runs with data, tensor (+ sequence) and pipeline parallelism and zero1 only in this version; "
                         "cp=2 is not supported")
    done = run_cli("train", *MOCK, "--num-experts", "4", "--moe-token-dispatcher-type", "allgather", "--train-iters",
                   "1", "--output-dir", tmp_path / "run")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["moe_token_dispatcher_type"] == \
        "allgather"
    done = run_cli("train", *MOCK, "--moe-token-dispatcher-type", "allscatter", "--output-dir", tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "Invalid value for '--moe-token-dispatcher-type'" in done.stderr


def test_megatron_model_flags_that_cannot_hold_are_refused_in_one_line(tmp_path):
    """Checked before any rank starts: the model's one dropout, the positions, GQA's head count."""
    done = run_cli("train", *MOCK, "--attention-dropout", "0.1", "--hidden-dropout", "0.2", "--output-dir", tmp_path)
    one_line_error(done, "--attention-dropout 0.1 and --hidden-dropout 0.2 differ: the model has one dropout")
    done = run_cli("train", *MOCK, "--max-position-embeddings", "16", "--output-dir", tmp_path)
    one_line_error(done, "--max-position-embeddings 16 is shorter than the sequence length 32 (--seq-length)")
    done = run_cli("train", *MOCK, "--group-query-attention", "--output-dir", tmp_path)
    one_line_error(done, "--group-query-attention needs --num-query-groups N")
    done = run_cli("train", *MOCK, "--lr-decay-style", "WSD", "--output-dir", tmp_path)
    one_line_error(done, "optim.decay_style WSD needs optim.wsd_decay_iters >= 1 (--lr-wsd-decay-iters), got None")


def test_every_argument_mistake_is_reported_in_one_run(tmp_path):
    """Three unknown flags, a refused one, a conflicting pair and a misspelled --set key: one run,
    one error line naming all of them, each unknown name with the nearest valid one."""
    done = run_cli("train", *MOCK, "--num-layer", "2", "--hiden-size", "64", "--frobnicate", "--fp16",
                   "--data", "1", "x", "--set", "optim.min_llr=1e-5", "--output-dir", tmp_path / "r")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: 6 problems: "), line
    for part in ("no such option: --num-layer (did you mean --num-layers?)",
                 "no such option: --hiden-size (did you mean --hidden-size?)", "no such option: --frobnicate",
                 "--fp16 (Megatron) is not supported", "--data and --mock-data cannot be given together",
                 "unknown config key in --set: optim.min_llr (did you mean optim.min_lr?)"):
        assert part in line, (part, line)
    assert not (tmp_path / "r").exists()


def test_without_a_shape_train_says_it_builds_a_small_model(tmp_path):
    done = run_cli("train", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "3", "--output-dir",
                   tmp_path / "r")
    warning, error = [line for line in done.stderr.splitlines() if line.strip()]
    assert warning == ("warning: no model shape given: training a small model (model.n_layers=4, model.d_model=256, "
                       "model.n_heads=4, model.seq_len=256); give --num-layers, --hidden-size, --num-attention-heads "
                       "and --seq-length (or model.* in --config) for another")
    assert done.returncode != 0 and error.startswith("error: --global-batch-size 3 is not a multiple")


def test_every_misspelled_config_key_is_reported_in_one_run(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("train_iter: 5\noptim: {lr: 1e-3, warmup: 2}\nmodel: {n_layers: 1}\n")
    done = run_cli("train", "--config", config, "--mock-data", "--output-dir", tmp_path / "r")
    line = one_line_error(done, f"unknown config keys in {config} and --set: ",
                          "train_iter (did you mean train_iters?)", "optim.warmup (did you mean optim.warmup_iters?)")
    assert "model." not in line


# --------------------------------------------------------------------------- failures in ranks


def test_a_killed_rank_ends_the_run_with_one_line_naming_it(tmp_path):
    """kill -9 of rank 1 mid-run (issue 19): non-zero exit, no traceback on the terminal, the last
    line names rank 1 and how it died, and the full logs are in the printed folder."""
    out = tmp_path / "run"
    env = dict(cli_env(), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(REPO / "cli.py"), "train", *MOCK, "--train-iters", "5000",
                             "--log-interval", "1", "--nproc-per-node", "2", "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with reaped(proc):
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        (pid_file,) = (out / "logs").glob("*/rank1.pid")
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=limit_s(120))
    assert proc.returncode != 0
    assert "Traceback" not in stdout + stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1: its process (pid ") and "killed by SIGKILL" in last, last
    assert last.endswith(f"full logs: {pid_file.parent}"), last
    assert f"logs: {pid_file.parent}" in stderr.splitlines()[0]
    assert "ChildFailedError" in (pid_file.parent / "torchrun.log").read_text()  # torchrun's report kept there


# --------------------------------------------------------------------------- Megatron and torchrun spellings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_agents_with_nnodes_2_form_one_job(tmp_path):
    out = tmp_path / "run"
    env = dict(cli_env(), OMP_NUM_THREADS="1")
    common = [sys.executable, str(REPO / "cli.py"), "train", *MOCK, "--train-iters", "6", "--nproc_per_node", "1",
              "--nnodes", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--output-dir",
              str(out)]
    agents = [subprocess.Popen([*common, flag, str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env) for rank, flag in ((1, "--node_rank"), (0, "--node-rank"))]
    try:
        outputs = [a.communicate(timeout=limit_s(240)) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    assert [a.returncode for a in agents] == [0, 0], outputs
    summary = json.loads(outputs[1][0].strip().splitlines()[-1])  # node 0 holds rank 0
    assert summary["iteration"] == 6
    state = json.loads((out / "checkpoints" / "iter_0000006" / "state.json").read_text())
    assert state["world_size"] == 2
    assert sorted(p.name for p in (out / "logs").glob("*/rank*.log")) == ["rank0.log", "rank1.log"]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # one 2-rank run: 178 s in a loaded slow box's suite
def test_a_megatron_argument_list_trains(tmp_path, shared_data):
    """Issue 20's acceptance: pretrain_gpt.py's flags for data, shape, batch and layout, torchrun's
    --nproc_per_node, on GPT-2 tokenized tinyshakespeare and WikiText-2."""
    ref = shared_data / "megatron-reference"
    out = tmp_path / "run"
    done = run_cli("train", "--data-path", "0.7", ref / "tinyshakespeare_gpt2_eod", "0.3", ref / "wikitext-2_gpt2_eod",
                   "--split", "949,50,1", "--seq-length", "128", "--num-layers", "2", "--hidden-size", "64",
                   "--num-attention-heads", "4", "--micro-batch-size", "2", "--global-batch-size", "8",
                   "--train-iters", "10", "--lr", "3e-4", "--tensor-model-parallel-size", "2",
                   "--nproc_per_node", "2", "--data-cache-path", tmp_path / "cache", "--output-dir", out,
                   timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["iteration"] == 10
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["tp"], cfg["model"]["n_layers"], cfg["model"]["d_model"], cfg["model"]["n_heads"]) == (2, 2, 64, 4)
    assert (cfg["data"]["blend"]["split"], cfg["optim"]["lr"], cfg["global_batch_size"]) == ("949,50,1", 3e-4, 8)
    assert "layout    2 rank(s) on cpu: dp 1 x tp 2 x pp 1" in done.stdout


MEGATRON_LLAMA = [  # 39 flags of a small Llama-style pretrain_gpt.py run (torchrun's --nproc_per_node among them)
    "--nproc_per_node", "2", "--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "172",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu",
    "--position-embedding-type", "rope", "--rotary-base", "500000", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--init-method-std", "0.01",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "3e-4", "--min-lr", "3e-5",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--lr-decay-iters", "3",
    "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
    "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--save-interval", "3",
    "--exit-signal-handler", "--mock-data",
]
ARCHITECTURE_FLAGS = {"--normalization": 1, "--swiglu": 0, "--position-embedding-type": 1, "--rotary-base": 1,
                      "--untie-embeddings-and-output-weights": 0, "--disable-bias-linear": 0}
"""The flags (and how many values each takes) that make the list Llama-style rather than Megatron's default GPT."""


@pytest.mark.slow
def test_a_llama_style_megatron_argument_list_builds_its_model(tmp_path, shared_data):
    """Issue 40's first acceptance: the list trains unchanged (2 ranks, tp 2) and the summary shows its model;
    without the architecture flags the same list builds the GPT-2-style model of Megatron's defaults, here
    with Megatron's tokenizer flags (--tokenizer-type GPT2BPETokenizer, --vocab-file, --merge-file)."""
    assert sum(a.startswith("--") for a in MEGATRON_LLAMA) == 39
    small = ["--set", "data.mock.num_sequences=200", "--set", "data.mock.max_length=100", "--set", "progress=false",
             "--set", "plot=false"]  # tokenloom's own: a small mock corpus, no progress bar or plot
    llama = run_cli("train", *MEGATRON_LLAMA, *small, "--output-dir", tmp_path / "llama", timeout=400)
    assert llama.returncode == 0, llama.stderr[-3000:]
    assert "model     gpt2: 2 layers x 64 wide, 4 heads (2 kv), vocab 50257 (padded 50304), seq 32" in llama.stdout
    assert "\n          Llama-style: RMSNorm, SwiGLU MLP 172 wide, RoPE (base 500000), no biases, untied " \
        "embeddings\n" in llama.stdout
    assert "dp 1 x tp 2 x pp 1, ZeRO-1; bfloat16" in llama.stdout
    assert "linear warmup 1 steps, cosine to 3e-05 at step 3" in llama.stdout
    state = json.loads(next((tmp_path / "llama" / "checkpoints").glob("iter_*/state.json")).read_text())
    model, optim = state["config"]["model"], state["config"]["optim"]  # resolved: a resume builds this model
    assert {k: model[k] for k in ("norm", "mlp", "positions", "bias", "tie_embeddings", "n_kv_heads")} == dict(
        norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=False, n_kv_heads=2)
    assert (model["rope_theta"], model["init_std"], model["dropout"]) == (500000.0, 0.01, 0.0)
    assert (optim["beta1"], optim["beta2"], optim["eps"], optim["decay_style"]) == (0.9, 0.95, 1e-8, "cosine")
    assert state["config"]["save_on_signal"] is True and state["config"]["zero1"] is True

    gpt, args = [], iter(MEGATRON_LLAMA)
    for arg in args:
        if arg in ARCHITECTURE_FLAGS:
            for _ in range(ARCHITECTURE_FLAGS[arg]):
                next(args)
        else:
            gpt.append(arg)
    assert sum(a.startswith("--") for a in gpt) == 39 - 6 and "--num-query-groups" in gpt
    gpt2 = shared_data / "tokenizers" / "gpt2"
    gpt += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2 / "gpt2-vocab.json",
            "--merge-file", gpt2 / "gpt2-merges.txt"]
    default = run_cli("train", *gpt, *small, "--output-dir", tmp_path / "gpt", timeout=400)
    assert default.returncode == 0, default.stderr[-3000:]
    state = json.loads(next((tmp_path / "gpt" / "checkpoints").glob("iter_*/state.json")).read_text())
    assert Path(state["config"]["tokenizer"]).resolve() == gpt2.resolve()
    assert "model     gpt2: 2 layers x 64 wide, 4 heads (2 kv)" in default.stdout
    assert "\n          GPT-2-style: LayerNorm, GELU MLP 172 wide, learned positions, biases, tied " \
        "embeddings\n" in default.stdout


def test_megatron_spellings_reach_the_config(tmp_path, shared_data):
    # --num-layers-per-virtual-pipeline-stage 1 with 4 layers over --pp 2 is --vpp 2: the check names it
    done = run_cli("train", *MOCK, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                   "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "2", "--nproc_per_node", "2",
                   "--output-dir", tmp_path / "r")
    one_line_error(done, "the interleaved schedule (--vpp 2) needs the 1 micro-batches per step")
    # uneven pipeline splits: Megatron's flags, checked before launch; its layout string is refused
    done = run_cli("train", *MOCK, "--num-layers", "4", "--pp", "2", "--decoder-first-pipeline-num-layers", "3",
                   "--decoder-last-pipeline-num-layers", "2", "--nproc_per_node", "2", "--output-dir", tmp_path / "r")
    one_line_error(done, "the first and last pipeline stages' layers (3 + 2) leave none of model.n_layers 4")
    done = run_cli("train", *MOCK, "--account-for-loss-in-pipeline-split", "--output-dir", tmp_path / "r")
    one_line_error(done, "--account-for-loss-in-pipeline-split split a pipeline: they need --pp >= 2")
    done = run_cli("train", *MOCK, "--num-layers", "4", "--pp", "2", "--decoder-last-pipeline-num-layers", "1",
                   "--num-layers-per-virtual-pipeline-stage", "1", "--output-dir", tmp_path / "r")
    assert done.returncode != 0 and "--num-layers-per-virtual-pipeline-stage assumes an even split" in done.stderr
    done = run_cli("train", *MOCK, "--pipeline-model-parallel-layout", "Et|tL", "--output-dir", tmp_path / "r")
    assert "--pipeline-model-parallel-layout (Megatron) is not supported" in done.stderr.strip().splitlines()[-1]
    done = run_cli("train", *MOCK, "--sequence-parallel", "--output-dir", tmp_path / "r")  # sp=true, tp=1
    one_line_error(done, "sp (sequence parallelism) splits tensor-parallel regions and needs tp >= 2")
    done = run_cli("train", *MOCK, "--overlap-param-gather", "--output-dir", tmp_path / "r")  # without --zero1
    one_line_error(done, "overlap_param_gather applies to zero1 (without it")
    # --vocab-file/--merge-file of one folder are --tokenizer FOLDER, checked against the data's manifest
    gpt2 = shared_data / "tokenizers" / "gpt2"
    done = run_cli("train", *TINY, "--data", tmp_path / "missing", "--vocab-file", gpt2 / "gpt2-vocab.json",
                   "--merge-file", gpt2 / "gpt2-merges.txt", "--output-dir", tmp_path / "r")
    one_line_error(done, f"--data: {tmp_path / 'missing'}.idx does not exist")
    done = run_cli("train", *MOCK, "--vocab-file", gpt2 / "gpt2-vocab.json", "--output-dir", tmp_path / "r")
    assert done.returncode != 0 and "--vocab-file and --merge-file go together" in done.stderr


def test_resume_with_new_blend_weights_continues_each_source(tmp_path):
    """Issue 17: --resume auto with changed --data weights continues each source after what it
    served (tests/train/test_blend_resume.py checks the samples); other data changes are refused."""
    import numpy as np

    from tokenloom.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        with IndexedDatasetWriter(tmp_path / name, vocab_size=96) as writer:
            for _ in range(60):
                writer.add_document(rng.integers(0, 95, size=int(rng.integers(20, 120))).tolist() + [95])
    common = [*TINY, "--split", "90,9,1", "--cache-dir", tmp_path / "cache", "--train-iters", "6", "--output-dir",
              tmp_path / "run", "--resume", "auto"]
    done = run_cli("train", *common, "--data", "0.5", tmp_path / "a", "0.5", tmp_path / "b", "--set", "exit_interval=3")
    assert done.returncode == 0, done.stderr
    done = run_cli("train", *common, "--data", "0.2", tmp_path / "a", "0.8", tmp_path / "b")
    assert done.returncode == 0, done.stderr
    assert "the blend changed at sample 12 (segment 2): each source continues after the samples it served" \
        in done.stderr
    marks = [(r["iter"], r["blend_changed"]) for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())
             if "resumed_from" in r]
    assert marks == [(3, True)]  # a mark in loss.png
    state = json.loads((tmp_path / "run" / "checkpoints" / "iter_0000006" / "state.json").read_text())
    # 0.5/0.5 of the first 12 samples, then 0.2/0.8 of 12 (2.4 of a: the greedy interleave serves 3)
    assert [c["samples"] for c in state["data_consumed"]] == [6 + 3, 6 + 9]
    one_line_error(run_cli("train", *common, "--split", "80,19,1", "--data", "0.2", tmp_path / "a", "0.8",
                           tmp_path / "b", "--train-iters", "8", "--override-opt_param-scheduler"),
                   "was trained on other data (data.blend {\"split\": \"90,9,1\"} -> {\"split\": \"80,19,1\"})",
                   "--set force_data=true")


def test_distributed_backend_flag_is_checked_in_one_line(tmp_path):
    """--distributed-backend (Megatron's flag): a name that is no backend is refused by the parser, in
    --set before any rank starts, and nccl on a machine without CUDA before any rank starts (CUDA hidden here,
    so the check runs on GPU machines too)."""
    done = run_cli("train", *MOCK, "--distributed-backend", "mpi", "--output-dir", tmp_path / "r")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "'mpi' is not one of 'nccl', 'gloo'" in done.stderr.strip().splitlines()[-1]
    done = run_cli("train", *MOCK, "--set", "distributed_backend=mpi", "--output-dir", tmp_path / "r")
    one_line_error(done, "--distributed-backend 'mpi': not a backend; use one of nccl, gloo")
    done = run_cli("train", *MOCK, "--distributed-backend", "nccl", "--nproc-per-node", "2", "--output-dir",
                   tmp_path / "r", env={**cli_env(), "CUDA_VISIBLE_DEVICES": ""})
    one_line_error(done, "--distributed-backend nccl needs CUDA", "use gloo")
    assert not (tmp_path / "r" / "logs").exists()  # refused before torchrun started
