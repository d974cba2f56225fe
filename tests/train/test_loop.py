"""The training loop on mock data: loss falls, accumulation equivalence, exact resume, configs, schedule."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tl_testing import limit_s

from tokenloom.errors import TokenloomError
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.checkpoint import format as ckpt_format
from tokenloom.train.config import TrainConfig, config_to_dict, load_config
from tokenloom.train.data import BlendDataConfig, DataConfig, MockDataConfig
from tokenloom.train.loop import run, start_run
from tokenloom.train.metrics import read_metrics
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.optim.adamw import OptimConfig, param_groups
from tokenloom.train.optim.schedule import lr_at

REPO = Path(__file__).resolve().parents[2]


def tiny(tmp: Path, **overrides) -> TrainConfig:
    """A 2-layer, d_model 32, seq 32 GPT on 300 mock documents; every step logged."""
    kw = dict(
        model=GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2, n_heads=2,
                        d_model=32),
        data=DataConfig(mock=MockDataConfig(num_sequences=300, max_length=200)),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=3),
        micro_batch_size=2, global_batch_size=4, train_iters=20, eval_interval=5, eval_iters=2,
        log_interval=1, save_interval=None, output_dir=str(tmp), progress=False, plot=False,
    )
    kw.update(overrides)
    return TrainConfig(**kw)


def losses(out_dir: Path, key: str = "train_loss") -> list[tuple[int, float]]:
    return [(r["iter"], r[key]) for r in read_metrics(out_dir / "metrics.jsonl") if key in r]


def final_params(out_dir: Path) -> dict[str, torch.Tensor]:
    path = checkpoint.find_latest(out_dir / "checkpoints")
    return ckpt_format.model_tensors(path, checkpoint.read_state(path))


def run_subprocess(cfg: TrainConfig, path: Path) -> subprocess.CompletedProcess:
    path.write_text(json.dumps(config_to_dict(cfg)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "tokenloom.train.loop", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=limit_s(240))


def test_loss_falls_and_outputs_are_written(tmp_path):
    cfg = tiny(tmp_path, train_iters=30, log_interval=5, plot=True)
    summary = run(cfg)
    train = losses(tmp_path)
    assert [i for i, _ in train] == [5, 10, 15, 20, 25, 30]
    assert train[-1][1] < train[0][1] - 0.8, train  # ramp content is learnable
    val = losses(tmp_path, "val_loss")
    assert val[0][0] == 0  # the curve starts before the first step
    assert summary["iteration"] == 30 and summary["val_loss"] < val[0][1]
    record = next(r for r in read_metrics(tmp_path / "metrics.jsonl") if "lr" in r)
    assert {"lr", "grad_norm", "tokens_per_s", "step_time_s", "consumed_samples", "mfu"} <= set(record)
    assert record["mfu"] is None and record["tokens_per_s"] > 0  # no known peak on CPU
    firsts = [r["iter"] for r in read_metrics(tmp_path / "metrics.jsonl") if "first_step_s" in r]
    assert firsts == [5]  # the record whose interval held the first step
    assert summary["first_step_s"] > 0 and summary["tokens_per_s"] > 0
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert checkpoint.find_latest(tmp_path / "checkpoints").name == "iter_0000030"
    assert json.loads((tmp_path / "config.json").read_text())["train_iters"] == 30


def test_stepping_the_run_equals_run(tmp_path):
    """start_run(cfg).steps() one step at a time, then finish(): the same metrics, summary and
    checkpoint as run(cfg); and a layout the world cannot hold is refused."""
    summary = run(tiny(tmp_path / "a", train_iters=8))
    r = start_run(tiny(tmp_path / "b", train_iters=8))
    assert list(r.steps()) == list(range(1, 9))
    timing = ("tokens_per_s", "first_step_s", "data_wait_share", "saves")  # wall-clock, differs between runs
    done = r.finish()
    assert [s["iter"] for s in done["saves"]] == [s["iter"] for s in summary["saves"]] == [8]
    stepped = {k: v for k, v in done.items() if k not in timing}
    assert stepped == {**{k: v for k, v in summary.items() if k not in timing},
                       "checkpoint": summary["checkpoint"].replace(str(tmp_path / "a"), str(tmp_path / "b"))}
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    for name, tensor in final_params(tmp_path / "a").items():
        assert torch.equal(tensor, final_params(tmp_path / "b")[name]), name
    with pytest.raises(TokenloomError, match="does not divide the 1 ranks"):
        start_run(tiny(tmp_path / "c", tp=2))


def test_manual_gc_during_the_run(tmp_path):
    """Automatic GC is off while the run steps and back on after (also after an error);
    gc_interval=0 leaves it alone; a negative interval is refused."""
    import gc

    assert gc.isenabled()
    r = start_run(tiny(tmp_path / "a", train_iters=3, eval_interval=0))
    states = [gc.isenabled() for _ in r.steps()]
    r.finish()
    assert states == [False, False, False] and gc.isenabled()
    r = start_run(tiny(tmp_path / "b", train_iters=2, eval_interval=0, gc_interval=0))
    assert [gc.isenabled() for _ in r.steps()] == [True, True]
    steps = start_run(tiny(tmp_path / "c", train_iters=5, eval_interval=0)).steps()
    next(steps)
    assert not gc.isenabled()
    steps.close()  # an abandoned or failed run (GeneratorExit) restores it too
    assert gc.isenabled()
    with pytest.raises(TokenloomError, match="gc_interval"):
        tiny(tmp_path, gc_interval=-1)


def test_grad_accumulation_equals_one_big_micro_batch(tmp_path):
    run(tiny(tmp_path / "big", micro_batch_size=4, train_iters=8, eval_interval=0))
    run(tiny(tmp_path / "accum", micro_batch_size=1, train_iters=8, eval_interval=0))
    big, accum = losses(tmp_path / "big"), losses(tmp_path / "accum")
    assert [i for i, _ in big] == [i for i, _ in accum] == list(range(1, 9))
    for (_, a), (_, b) in zip(big, accum, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    pa, pb = final_params(tmp_path / "big"), final_params(tmp_path / "accum")
    assert max((pa[k] - pb[k]).abs().max().item() for k in pa) < 1e-5


def test_resume_in_a_fresh_process_is_exact(tmp_path):
    """20 steps straight == 10 steps, checkpoint, new process, resume=auto, 10 more (bit for bit).

    Dropout is on, so the restored RNG state matters too."""
    model = GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2, n_heads=2,
                      d_model=32, dropout=0.1)
    straight = tiny(tmp_path / "straight", model=model)
    split = tiny(tmp_path / "split", model=model, exit_interval=10, resume="auto")
    first = run_subprocess(straight, tmp_path / "straight.json")
    assert first.returncode == 0, first.stderr
    part1 = run_subprocess(split, tmp_path / "split.json")
    assert part1.returncode == 0, part1.stderr
    assert json.loads(part1.stdout.splitlines()[-1])["exited"] is True
    assert checkpoint.find_latest(tmp_path / "split" / "checkpoints").name == "iter_0000010"
    part2 = run_subprocess(split, tmp_path / "split.json")
    assert part2.returncode == 0, part2.stderr
    assert "resumed from" in part2.stderr and "iter_0000010" in part2.stderr
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")  # exact equality, all 20 steps
    assert losses(tmp_path / "split", "val_loss") == losses(tmp_path / "straight", "val_loss")
    assert len(losses(tmp_path / "split")) == 20
    pa, pb = final_params(tmp_path / "straight"), final_params(tmp_path / "split")
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_resume_on_different_data_needs_force(tmp_path):
    run(tiny(tmp_path, train_iters=4, eval_interval=0))
    other = DataConfig(mock=MockDataConfig(num_sequences=300, max_length=200, seed=7))
    with pytest.raises(TokenloomError, match="different data"):
        run(tiny(tmp_path, train_iters=6, eval_interval=0, resume="auto", data=other,
                 override_opt_param_scheduler=True))
    summary = run(tiny(tmp_path, train_iters=6, eval_interval=0, resume="auto", data=other, force_data=True,
                       override_opt_param_scheduler=True))
    assert summary["iteration"] == 6
    assert [i for i, _ in losses(tmp_path)] == list(range(1, 7))  # metrics cut back to the resume point


def test_a_resume_with_another_schedule_is_refused_unless_overridden(tmp_path):
    """Megatron's rule: a longer train_iters (or another lr, min lr, warmup, decay) on resume is refused
    in one line naming old and new values; with override_opt_param_scheduler the run continues and
    each step's learning rate is the new schedule's from the resume step."""
    run(tiny(tmp_path, train_iters=4, eval_interval=0))
    longer = tiny(tmp_path, train_iters=8, eval_interval=0, resume="auto", optim=OptimConfig(
        lr=3e-3, min_lr=1e-4, warmup_iters=3))
    with pytest.raises(TokenloomError) as refused:
        run(longer)
    assert "another learning-rate schedule (train_iters 4 -> 8; optim.min_lr 0.0003 -> 0.0001)" in str(refused.value)
    assert "--override-opt_param-scheduler" in str(refused.value)
    assert checkpoint.find_latest(tmp_path / "checkpoints").name == "iter_0000004"
    summary = run(dataclasses.replace(longer, override_opt_param_scheduler=True))
    assert summary["iteration"] == 8
    lrs = [(r["iter"], r["lr"]) for r in read_metrics(tmp_path / "metrics.jsonl") if "lr" in r]
    old, new = tiny(tmp_path, train_iters=4).optim, longer.optim
    assert lrs == [(i + 1, lr_at(i, old, 4)) for i in range(4)] + [(i + 1, lr_at(i, new, 8)) for i in range(4, 8)]


def test_a_run_you_can_watch(tmp_path, capsys):
    """Validation losses and checkpoint saves as one line each; time and memory in the records; a
    resume leaves a record (a mark in loss.png, which gets a learning-rate panel)."""
    run(tiny(tmp_path, train_iters=4, eval_interval=2, save_interval=2, plot=True))
    err = capsys.readouterr().err
    for it in (0, 2, 4):
        assert f"iteration {it}: validation loss " in err
    for it in (2, 4):
        assert f"iteration {it}: saved checkpoint {tmp_path / 'checkpoints' / f'iter_{it:07d}'} (the loop waited " in err
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert all(isinstance(r["time"], float) for r in records)
    train = [r for r in records if "train_loss" in r]
    assert all(0 < r["host_rss_gib"] <= r["host_rss_peak_gib"] for r in train)
    on_gpu = torch.cuda.is_available()  # the run's device: a peak of allocated memory there, none on CPU
    assert all((r["device_mem_peak_gib"] > 0) if on_gpu else (r["device_mem_peak_gib"] is None) for r in train)
    run(tiny(tmp_path, train_iters=6, eval_interval=2, save_interval=2, plot=True, resume="auto",
             override_opt_param_scheduler=True))
    resumed = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "resumed_from" in r]
    assert [(r["iter"], r["resumed_from"], r["blend_changed"]) for r in resumed] == [
        (4, str(tmp_path / "checkpoints" / "iter_0000004"), False)]
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_resume_auto_skips_checkpoints_without_marker(tmp_path):
    run(tiny(tmp_path, train_iters=6, eval_interval=0, save_interval=3))
    root = tmp_path / "checkpoints"
    (root / "iter_0000006" / checkpoint.COMPLETE).unlink()  # as if the save died before the marker
    (root / "iter_0000009.tmp").mkdir()  # a save that died earlier still
    assert checkpoint.find_latest(root).name == "iter_0000003"
    summary = run(tiny(tmp_path, train_iters=6, eval_interval=0, save_interval=3, resume="auto"))
    assert summary["iteration"] == 6
    assert [i for i, _ in losses(tmp_path)] == list(range(1, 7))
    assert checkpoint.find_latest(root).name == "iter_0000006"
    assert (root / checkpoint.LATEST).read_text().strip() == "iter_0000006"
    with pytest.raises(TokenloomError, match="not a complete checkpoint"):
        checkpoint.read_state(root / "iter_0000009.tmp")
    # Resuming a finished run trains nothing and points at its checkpoint.
    again = run(tiny(tmp_path, train_iters=6, eval_interval=0, resume="auto"))
    assert again["iteration"] == 6 and again["checkpoint"].endswith("iter_0000006")
    other_model = GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2, n_heads=4,
                            d_model=32)
    with pytest.raises(TokenloomError, match=r"different model \(model.n_heads 2 -> 4\)"):
        run(tiny(tmp_path, model=other_model, train_iters=8, resume="auto"))


def test_fresh_run_without_checkpoints_and_resume_auto_starts_at_zero(tmp_path):
    summary = run(tiny(tmp_path, train_iters=2, eval_interval=0, resume="auto"))
    assert summary["iteration"] == 2
    with pytest.raises(TokenloomError, match="does not exist"):
        run(tiny(tmp_path / "x", train_iters=2, resume=str(tmp_path / "nowhere")))


def test_config_files_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {vocab_size: 96, n_layers: 2, recompute_layers: [1]}\n"
                    "data: {mock: {num_sequences: 50}}\noptim: {lr: 6e-4}\n")
    cfg = load_config(path, ["optim.min_lr=1e-5", "train_iters=7"])
    assert cfg.model.n_layers == 2 and cfg.model.recompute_layers == (1,)
    assert cfg.optim.lr == 6e-4 and cfg.optim.min_lr == 1e-5 and cfg.train_iters == 7
    assert cfg.data.mock.num_sequences == 50 and cfg.data.blend is None
    blend = load_config(None, ['data={blend: {prefixes: [[0.3, a], [0.7, b]]}}'])
    assert blend.data.blend.prefixes == [(0.3, "a"), (0.7, "b")] and blend.data.mock is None
    with pytest.raises(TokenloomError, match="unknown config key"):
        load_config(None, ["optim.learning_rate=1"])
    with pytest.raises(TokenloomError, match="not a multiple"):
        run(tiny(tmp_path, micro_batch_size=3))


def test_blend_data_trains_from_bin_idx(tmp_path):
    """The blend branch end to end on two tiny .bin/.idx files written with the indexed writer."""
    from tokenloom.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    prefixes = []
    for name in ("a", "b"):
        with IndexedDatasetWriter(tmp_path / name, vocab_size=96) as writer:
            for _ in range(80):
                writer.add_document(rng.integers(0, 95, size=int(rng.integers(20, 120))).tolist() + [95])
        prefixes.append(str(tmp_path / name))
    blend = BlendDataConfig(prefixes=[(0.4, prefixes[0]), (0.6, prefixes[1])], split="90,9,1",
                            cache_dir=str(tmp_path / "cache"))
    cfg = tiny(tmp_path / "run", train_iters=4, eval_interval=2, eval_iters=1, data=DataConfig(blend=blend))
    summary = run(cfg)
    assert summary["iteration"] == 4 and math.isfinite(summary["val_loss"])
    state = checkpoint.read_state(summary["checkpoint"])
    assert state["data_description"]["kind"] == "blend" and len(state["data_description"]["indices"]) == 64
    assert any((tmp_path / "cache").glob("*/meta.json"))  # the indices went through the build cache


def test_lr_schedule_and_no_decay_groups():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_iters=4)
    assert [lr_at(i, cfg, 20) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg, 20) == 1.0 and lr_at(12, cfg, 20) == pytest.approx(0.55)
    assert lr_at(20, cfg, 20) == pytest.approx(0.1) and lr_at(50, cfg, 20) == 0.1
    assert math.isclose(lr_at(19, cfg, 20), 0.1 + 0.45 * (1 + math.cos(math.pi * 15 / 16)))
    linear = OptimConfig(lr=1.0, min_lr=0.1, warmup_iters=4, decay_style="linear")
    assert lr_at(3, linear, 20) == 1.0 and lr_at(12, linear, 20) == pytest.approx(0.55)
    assert lr_at(16, linear, 20) == pytest.approx(0.325) and lr_at(25, linear, 20) == 0.1
    constant = OptimConfig(lr=1.0, min_lr=0.1, warmup_iters=4, decay_style="constant")
    assert [lr_at(i, constant, 20) for i in (0, 3, 4, 19, 50)] == [0.25, 1.0, 1.0, 1.0, 1.0]
    # WSD: lr until the last 8 steps before 20, then down to min_lr (Megatron's shapes)
    for shape, mid in [("linear", 0.55), ("cosine", 0.55), ("exponential", 0.1 + 0.9 * (2 * 0.5 ** 0.5 - 1)),
                       ("minus_sqrt", 0.1 + 0.9 * (1 - 0.5 ** 0.5))]:
        wsd = OptimConfig(lr=1.0, min_lr=0.1, warmup_iters=4, decay_style="WSD", wsd_decay_iters=8,
                          wsd_decay_style=shape)
        assert [lr_at(i, wsd, 20) for i in (3, 4, 11, 12)] == [1.0, 1.0, 1.0, 1.0], shape
        assert lr_at(16, wsd, 20) == pytest.approx(mid) and lr_at(20, wsd, 20) == 0.1, shape
    isr = OptimConfig(lr=1.0, min_lr=0.1, warmup_iters=4, decay_style="inverse-square-root")
    assert lr_at(4, isr, 200) == 1.0 and lr_at(16, isr, 200) == 0.5 and lr_at(150, isr, 200) == pytest.approx(
        math.sqrt(4 / 150))
    assert lr_at(199, isr, 1000) == pytest.approx(math.sqrt(4 / 199)) and lr_at(500, isr, 1000) == 0.1  # floor
    assert lr_at(200, isr, 200) == 0.1  # min_lr from lr_decay_iters on
    with pytest.raises(TokenloomError, match="optim.decay_style must be one of cosine, linear, constant, WSD"):
        OptimConfig(decay_style="exp")  # type: ignore[arg-type]
    with pytest.raises(TokenloomError, match="optim.decay_style WSD needs optim.wsd_decay_iters >= 1"):
        OptimConfig(decay_style="WSD")
    model = GPT(GPTConfig(vocab_size=96, seq_len=16, n_layers=1, n_heads=2, d_model=16))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == sorted(
        ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.fc.weight",
         "blocks.0.mlp.proj.weight"])
    assert "tok_emb.weight" in {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_resume_across_kernel_modes_and_from_older_checkpoints(tmp_path):
    """kernels may change on resume; a checkpoint saved before a model field existed uses its default."""
    run(tiny(tmp_path, train_iters=4, save_interval=4, eval_interval=0))
    ckpt = checkpoint.find_latest(tmp_path / "checkpoints")
    state_path = ckpt / "state.json"
    state = json.loads(state_path.read_text())
    for key in ("kernels", "norm", "mlp", "positions"):  # as written before these GPTConfig fields existed
        del state["config"]["model"][key]
    state_path.write_text(json.dumps(state))
    summary = run(tiny(tmp_path, train_iters=6, eval_interval=0, resume="auto", override_opt_param_scheduler=True))
    assert summary["iteration"] == 6
    with pytest.raises(TokenloomError, match="model.d_model "):
        run(tiny(tmp_path, train_iters=8, eval_interval=0, resume="auto",
                 model=GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2,
                                 n_heads=2, d_model=64)))
    with pytest.raises(TokenloomError, match='model.norm "layernorm" -> "rmsnorm"'):  # a feature is the model
        run(tiny(tmp_path, train_iters=8, eval_interval=0, resume="auto",
                 model=GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2,
                                 n_heads=2, d_model=32, norm="rmsnorm")))
