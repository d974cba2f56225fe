"""The start-up summary: what it says, the warnings for regrettable settings, and that a run
prints it once on rank 0 before its first step."""

from __future__ import annotations

import dataclasses

from test_loop import tiny

from tokenloom.train import runtime, summary
from tokenloom.train.config import TrainConfig
from tokenloom.train.data import BlendDataConfig, DataConfig
from tokenloom.train.loop import start_run
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.optim.adamw import OptimConfig
from tokenloom.train.summary import RunFacts, choices, data_wait_warning, regrets, startup_summary


def facts(**kw) -> RunFacts:
    base = dict(world_size=4, dp=2, accumulation=4, device="cpu", precision="float32", parameters=124_000_000,
                train_samples=1_000_000, data_plan="plan line 1\nplan line 2")
    return RunFacts(**{**base, **kw})


def test_summary_states_the_run(tmp_path):
    cfg = TrainConfig(tp=2, global_batch_size=32, micro_batch_size=4, train_iters=1000, eval_interval=100,
                      eval_iters=10, output_dir=str(tmp_path))
    text = startup_summary(cfg, facts())
    assert "12 layers x 768 wide, 12 heads (12 kv), vocab 50257 (padded 50304), seq 1024; 124.0M parameters" in text
    assert "124.0M parameters (embedding 39.4M, blocks 85.1M, head 1.5k)\n          GPT-2-style: LayerNorm, " \
        "GELU MLP 3072 wide, learned positions, biases, tied embeddings\n" in text
    assert "4 rank(s) on cpu: dp 2 x tp 2 x pp 1; float32" in text
    assert "data      plan line 1\n          plan line 2" in text
    assert "speed     kernels reference (model.kernels reference); blocks eager (compile auto: off on cpu)" in text
    assert "blocks compiled (compile true)" in startup_summary(TrainConfig(tp=2, compile=True,
                                                                           output_dir=str(tmp_path)), facts())
    assert "layers per pipeline" not in text
    uneven = startup_summary(TrainConfig(pp=2, vpp=2, num_layers_in_last_pipeline_stage=4, output_dir=str(tmp_path)),
                             facts())
    assert "dp 2 x tp 1 x pp 2 (vpp 2), layers per pipeline rank 4+4/2+2; float32" in uneven
    assert "global 32 = micro 4 x dp 2 x accumulation 4; 32.8k tokens/step, 1000 steps = 32.8M tokens" in text
    assert "linear warmup 100 steps, cosine to 6e-05 at step 1000" in text
    # evaluations at 0, 100, ..., 1000: 11 (the end is a multiple of the interval)
    assert "10 global batches (320 samples) every 100 steps, at the end and before the first step: 11 evaluations" \
        in text
    resumed = startup_summary(TrainConfig(train_iters=1050, eval_interval=100, output_dir=str(tmp_path)),
                              facts(resumed_at=500))
    assert ": 6 evaluations" in resumed and "resume    from iteration 500" in resumed  # 600..1000, 1050


def test_summary_shows_the_whole_model_and_its_schedule(tmp_path):
    """Features, whatever the arch preset: the style they make, norm, MLP kind and width, positions
    and RoPE base, biases, tying, kv heads and where the parameters are; the decay style."""
    model = GPTConfig(vocab_size=1000, make_vocab_size_divisible_by=8, seq_len=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, d_model=64, ffn_hidden_size=172, norm="rmsnorm", mlp="swiglu", positions="rope",
                      rope_theta=500000, bias=False, tie_embeddings=False)
    cfg = TrainConfig(model=model, optim=OptimConfig(decay_style="linear"), output_dir=str(tmp_path))
    lines = startup_summary(cfg, facts()).splitlines()
    assert lines[0].startswith("model     gpt2: 2 layers x 64 wide, 4 heads (2 kv), vocab 1000 (padded 1000), seq 64")
    # blocks: 2 x (qkv 64 x 128 + proj 64 x 64 + SwiGLU 3 x 64 x 172 + norms 2 x 64)
    assert lines[0].endswith("(embedding 64.0k, blocks 90.9k, head 64.1k)")
    assert lines[1] == "          Llama-style: RMSNorm, SwiGLU MLP 172 wide, RoPE (base 500000), no biases, untied embeddings"
    assert "linear warmup 100 steps, linear to 6e-05 at step 1000" in startup_summary(cfg, facts())
    mixed = TrainConfig(model=GPTConfig(arch="llama", norm="layernorm", mlp="gelu", positions="learned"),
                        optim=OptimConfig(decay_style="constant"), output_dir=str(tmp_path))
    text = startup_summary(mixed, facts())
    assert "\n          custom (llama preset changed): LayerNorm, GELU MLP 3072 wide, learned positions, no biases, " \
        "tied embeddings\n" in text
    assert "linear warmup 100 steps, then constant; weight decay" in text
    wsd = TrainConfig(optim=OptimConfig(decay_style="WSD", wsd_decay_iters=200), output_dir=str(tmp_path))
    assert "linear warmup 100 steps, WSD: constant to step 800, then exponential to 6e-05 at step 1000; " in \
        startup_summary(wsd, facts())


def test_summary_says_what_was_chosen_on_cuda_and_why(monkeypatch):
    from tokenloom.train.kernels import selector

    monkeypatch.setattr(selector, "compile_available", lambda device_type: True)  # a CUDA host with Triton
    cfg = TrainConfig(model=GPTConfig(kernels="auto"))
    assert choices(cfg, "cuda") == ("kernels reference (model.kernels auto: on CUDA inductor fuses the plain ops "
                                    "faster than our kernels); blocks compiled (compile auto: fastest on CUDA)")
    assert choices(TrainConfig(compile=False), "cuda") == "kernels reference (model.kernels reference); blocks eager " \
        "(compile false)"
    assert choices(cfg, "cpu") == "kernels compiled (model.kernels auto: torch.compile works on cpu); blocks eager " \
        "(compile auto: off on cpu)"


def test_regrettable_settings_warn():
    cfg = TrainConfig(train_iters=10, optim=OptimConfig(warmup_iters=100))
    found = regrets(cfg, facts(train_samples=10))
    assert any("mock data" in w for w in found)
    assert any("124.0M parameters but the run trains on 10.2k tokens" in w for w in found)
    assert any("warmup (100 steps) is not shorter than the run (10 steps)" in w for w in found)
    one_source = TrainConfig(train_iters=10_000, optim=OptimConfig(warmup_iters=100), log_loss_per_source=True,
                             data=DataConfig(blend=BlendDataConfig(prefixes=[(1.0, "x")])))
    assert regrets(one_source, facts()) == ["log_loss_per_source is ignored: the data has one source, whose loss "
                                            "is train_loss; give a blend of two or more sources"]
    two = dataclasses.replace(one_source, data=DataConfig(blend=BlendDataConfig(prefixes=[(1.0, "x"), (1.0, "y")])))
    assert regrets(two, facts()) == []
    quiet = TrainConfig(train_iters=10_000, optim=OptimConfig(warmup_iters=100),
                        data=DataConfig(blend={"prefixes": [[1.0, "x"]]}, mock=None))
    assert regrets(quiet, facts()) == []


def test_a_run_that_waited_for_data_over_5_percent_ends_with_one_warning():
    assert data_wait_warning(None, 0) is None and data_wait_warning(0.05, 0) is None
    line = data_wait_warning(0.125, 2)
    assert line is not None and "\n" not in line
    assert line.startswith("the steps waited for data 12.5% of the training time") and "data.num_workers, now 2" in line


def test_a_run_prints_the_summary_once_before_training(tmp_path, capfd):
    r = start_run(tiny(tmp_path, train_iters=2, eval_interval=0))
    out = capfd.readouterr().out
    assert out.count("model     gpt2: 2 layers x 32 wide") == 1 and "warning: training on synthetic mock data" in out
    assert r.iteration == 0  # printed at set-up, before the first step
    list(r.steps())
    r.finish()
    assert "model     " not in capfd.readouterr().out


def test_summary_shows_experts_top_k_and_active_parameters(tmp_path):
    model = GPTConfig(arch="llama", vocab_size=1000, make_vocab_size_divisible_by=8, seq_len=64, n_layers=2, n_heads=4,
                      d_model=64, ffn_hidden_size=128, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)
    lines = startup_summary(TrainConfig(model=model, output_dir=str(tmp_path)), facts()).splitlines()
    # blocks 2 x (attention 20.5k + norms 128 + router 64 x 8 + experts 8 x 3 x 64 x 32); a token
    # leaves 6 of 8 experts idle: 196,480 - 2 x 6 x 6144 = 122,752
    assert lines[0].endswith("(embedding 64.0k, blocks 132.4k, head 64; 122.7k active per token)")
    assert "SwiGLU MLP 128 wide (2 of 2 blocks mixture-of-experts: 8 experts 32 wide, top-2)" in lines[1]


def test_summary_shows_expert_parallelism(tmp_path):
    model = GPTConfig(n_layers=2, num_experts=8, moe_router_topk=2)
    text = startup_summary(TrainConfig(model=model, ep=2, output_dir=str(tmp_path)), facts())
    assert "dp 2 x tp 1 x pp 1, expert parallel: ep 2, 4 of 8 experts per rank, tokens by all-to-all; float32" in text
    one = startup_summary(TrainConfig(model=model, output_dir=str(tmp_path)), facts())
    assert "expert parallel" not in one and "tokens by" not in one  # ep 1: no dispatch
    gathered = dataclasses.replace(model, moe_token_dispatcher_type="allgather")
    text = startup_summary(TrainConfig(model=gathered, ep=2, tp=2, sp=True, output_dir=str(tmp_path)),
                           facts(world_size=8))
    assert "dp 2 x tp 2 x pp 1, sequence parallel, expert parallel: ep 2, 4 of 8 experts per rank (whole on each " \
        "tp rank), tokens by all-gather; float32" in text


def test_emulated_bf16_on_cpu_is_named_with_what_fp32_gives(monkeypatch):
    """A CPU without AVX512-BF16 or AMX emulates bf16 matmuls: the summary says so, with the measured
    bf16/fp32 matmul speed here, and how to train in fp32; a CPU with them, or fp32, says nothing."""
    quiet = TrainConfig(train_iters=10_000, optim=OptimConfig(warmup_iters=100),
                        data=DataConfig(blend={"prefixes": [[1.0, "x"]]}, mock=None))
    monkeypatch.setattr(summary, "cpu_bf16_native", lambda: False)
    monkeypatch.setattr(summary, "bf16_over_fp32_speed", lambda: 0.125)
    assert regrets(quiet, facts(precision="bfloat16")) == [
        "bf16 is emulated on this CPU (no AVX512-BF16 or AMX): its matmuls ran at 0.12x fp32's speed here; "
        "--set precision=fp32 (without --bf16) trains faster on it"]
    assert regrets(quiet, facts(precision="float32")) == []
    assert regrets(quiet, facts(precision="bfloat16", device="cuda")) == []
    monkeypatch.setattr(summary, "cpu_bf16_native", lambda: True)
    assert regrets(quiet, facts(precision="bfloat16")) == []


def test_bf16_speed_probe_measures_both_dtypes():
    assert 0 < runtime.bf16_over_fp32_speed(size=32, reps=1) < 1e4
    assert isinstance(runtime.cpu_bf16_native(), bool)
