"""Losses per source of a blend: validation (always, for two or more sources) and training
(``log_loss_per_source``) equal the loss of each source's samples alone, reach metrics.jsonl,
the progress line and loss.png, and cost no host sync per training step; the data wait."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenloom.blending.args import source_names
from tokenloom.blending.loader import GPTSamples, SampleConfig
from tokenloom.errors import TokenloomError
from tokenloom.indexed import IndexedDatasetWriter
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.config import TrainConfig
from tokenloom.train.data import BlendDataConfig, DataConfig
from tokenloom.train.loop import start_run
from tokenloom.train.metrics import loss_figure, read_metrics
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.optim.adamw import OptimConfig
from tokenloom.train.preflight import check_resume
from tokenloom.train.source_loss import SourceLosses, losses_by_name

NAMES = ("web", "code", "books")


def write_sources(tmp: Path) -> list[str]:
    """Three tiny sources with different token statistics (so their losses differ)."""
    rng = np.random.default_rng(0)
    prefixes = []
    for i, name in enumerate(NAMES):
        with IndexedDatasetWriter(tmp / "data" / name, vocab_size=96) as writer:
            for _ in range(60):
                low = 30 * i
                writer.add_document(rng.integers(low, low + 30, size=int(rng.integers(20, 90))).tolist() + [95])
        prefixes.append(str(tmp / "data" / name))
    return prefixes


def config(tmp: Path, prefixes: list[str], **overrides) -> TrainConfig:
    blend = BlendDataConfig(prefixes=[(0.5, prefixes[0]), (0.3, prefixes[1]), (0.2, prefixes[2])], split="80,20,0",
                            cache_dir=str(tmp / "cache"))
    kw = dict(
        model=GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2, n_heads=2,
                        d_model=32),
        data=DataConfig(blend=blend), optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=2),
        micro_batch_size=2, global_batch_size=4, train_iters=4, eval_interval=2, eval_iters=3,
        log_interval=2, save_interval=None, output_dir=str(tmp / "run"), progress=False, plot=False,
    )
    kw.update(overrides)
    return TrainConfig(**kw)


def losses_alone(model, dataset, samples: range, eod: int | None) -> tuple[dict[int, float], float]:
    """Each source's token-weighted loss over its samples among ``samples`` of ``dataset``, one
    sample at a time (no batching, no loop), and the blended loss as the loop defines it (the mean
    over micro-batches of 2 of their masked means)."""
    items = GPTSamples(dataset, SampleConfig(eod=eod))
    totals: dict[int, list[float]] = {}
    micro = []
    model.eval()
    with torch.no_grad():
        for k in samples:
            item = items[k]
            logits = model(torch.as_tensor(item["tokens"])[None])
            token = F.cross_entropy(logits[0].float(), torch.as_tensor(item["labels"]), reduction="none").double()
            mask = torch.as_tensor(item["loss_mask"]).double()
            total = totals.setdefault(dataset.source_of(k), [0.0, 0.0])
            total[0] += float((token * mask).sum())
            total[1] += float(mask.sum())
            micro.append((float((token * mask).sum()), float(mask.sum())))
    model.train()
    pairs = [micro[i:i + 2] for i in range(0, len(micro), 2)]
    blended = float(np.mean([sum(s for s, _ in p) / sum(n for _, n in p) for p in pairs]))
    return {d: s / n for d, (s, n) in totals.items()}, blended


def test_validation_loss_per_source_is_each_sources_samples_alone(tmp_path, capsys):
    """Through the library ``cli.py train`` calls: every evaluation record holds each source's
    loss, equal (1e-6) to the loss of that source's validation samples alone under the final
    parameters; the blended loss is unchanged by it; the progress line and loss.png show them."""
    pytest.importorskip("matplotlib")
    cfg = config(tmp_path, write_sources(tmp_path), progress=True, plot=True)
    r = start_run(cfg)
    summary = r.train()
    evals = [rec for rec in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in rec]
    assert [rec["iter"] for rec in evals] == [0, 2, 4]
    assert all(list(rec["val_loss_per_source"]) == list(NAMES) for rec in evals)
    per_source, blended = losses_alone(r.strategy.chunks[0], r.data.valid, range(cfg.eval_iters * 4), r.data.eod)
    assert len(per_source) == 3  # every source has validation samples among the 12 read
    final = evals[-1]["val_loss_per_source"]
    for d, name in enumerate(NAMES):
        assert abs(final[name] - per_source[d]) < 1e-6, (name, final[name], per_source[d])
    assert abs(evals[-1]["val_loss"] - blended) < 1e-6
    assert summary["val_loss_per_source"] == final
    err = capsys.readouterr().err
    assert f"iteration 4: validation loss {evals[-1]['val_loss']:.4f} (web {final['web']:.4f}, code " in err
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
    fig = loss_figure(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert {f"val loss {n}" for n in NAMES} <= set(labels)


def no_host_sync_per_step(monkeypatch) -> list[str]:
    """Every way a tensor's value reaches the host (``item``, ``tolist``, ``cpu``, ``numpy``,
    ``float``/``int``/``bool``) appends its name to the returned list while the test runs; on
    a GPU each would wait for the device."""
    calls: list[str] = []
    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def host_reads_per_step(cfg: TrainConfig, monkeypatch) -> tuple[list[tuple[int, int]], dict, object]:
    """(iteration, host reads in it) for every step of a run of ``cfg``, its summary and trainer."""
    r = start_run(cfg)
    calls = no_host_sync_per_step(monkeypatch)
    per_step = []
    for iteration in r.steps():
        per_step.append((iteration, len(calls)))
        calls.clear()
    monkeypatch.undo()
    return per_step, r.finish(), r


def test_training_loss_per_source_costs_no_host_sync_per_step(tmp_path, monkeypatch):
    """``log_loss_per_source``: steps between log intervals read nothing on the host (the first
    step's reads are the DataLoader's start, the same without the option); at each log interval
    ``train_loss_per_source`` holds each source's token-weighted loss, which weighted by the
    interval's samples per source gives the blended train loss (every sample here keeps all its
    tokens). Off, no record has them; both have the data wait in every train record."""
    prefixes = write_sources(tmp_path)
    off = config(tmp_path / "off", prefixes, train_iters=8, log_interval=4, eval_interval=0)
    on = config(tmp_path / "on", prefixes, log_loss_per_source=True, train_iters=8, log_interval=4, eval_interval=0)
    (steps_off, summary_off, _), (steps_on, _, r) = (host_reads_per_step(c, monkeypatch) for c in (off, on))
    between = [(it, n) for it, n in steps_on if it % on.log_interval]
    assert between == [(it, n) for it, n in steps_off if it % off.log_interval]
    assert [n for it, n in between if it > 1] == [0] * 5  # steps 2, 3, 5, 6, 7
    assert all(n > 0 for it, n in steps_on if it % on.log_interval == 0)  # the log reads its sums
    train = [rec for rec in read_metrics(tmp_path / "on" / "run" / "metrics.jsonl") if "train_loss" in rec]
    assert [rec["iter"] for rec in train] == [4, 8]
    for rec in train:
        start = (rec["iter"] - on.log_interval) * on.global_batch_size
        drawn = np.bincount([r.data.train.source_of(i) for i in range(start, rec["iter"] * on.global_batch_size)],
                            minlength=3)
        losses = rec["train_loss_per_source"]
        assert list(losses) == list(NAMES)
        mix = sum(n * losses[name] for n, name in zip(drawn, NAMES, strict=True) if n) / drawn.sum()
        assert abs(mix - rec["train_loss"]) < 1e-5, (mix, rec["train_loss"])
        assert all((losses[name] is None) == (n == 0) for n, name in zip(drawn, NAMES, strict=True))
        assert 0 <= rec["data_wait_s"] and 0 <= rec["data_wait_share"] <= 1
    records_off = [rec for rec in read_metrics(tmp_path / "off" / "run" / "metrics.jsonl") if "train_loss" in rec]
    assert len(records_off) == 2 and all("train_loss_per_source" not in rec for rec in records_off)
    assert 0 <= summary_off["data_wait_share"] <= 1


def test_names_from_the_config_and_refused_duplicates(tmp_path):
    assert source_names(["a/web", "b/code"]) == ["web", "code"]
    assert source_names(["a/web", "b/web", "c/x"]) == ["a/web", "b/web", "x"]  # same basename: the prefix
    assert source_names(["a/web", "b/code"], ["w", None]) == ["w", "code"]
    with pytest.raises(TokenloomError, match=r"^data.blend.names: the source name\(s\) 'x' name more than one"):
        source_names(["a/web", "b/code"], ["x", "x"], "data.blend.names")
    with pytest.raises(TokenloomError, match="2 names for 3 sources"):
        source_names(["a", "b", "c"], ["x", "y"])
    prefixes = write_sources(tmp_path)
    cfg = config(tmp_path, prefixes)
    cfg.data.blend.names = ["w", "c", None]
    assert start_run(cfg).data.source_names == ["w", "c", "books"]
    cfg.data.blend.names = ["w", "w", None]
    with pytest.raises(TokenloomError, match="data.blend.names: the source name"):
        start_run(cfg)


def test_source_losses_sums_on_the_device():
    acc = SourceLosses(3, torch.device("cpu"))
    losses = torch.tensor([[1.0, 2.0], [3.0, 5.0], [7.0, 11.0]])
    acc.add(losses, torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]), torch.tensor([2, 0, -1]))
    acc.add(losses[:1], None, torch.tensor([2]))
    sums = acc.take()
    assert sums.tolist() == [[8.0, 0.0, 4.0], [2.0, 0.0, 3.0]]
    assert acc.sums.abs().sum() == 0
    assert losses_by_name(["a", "b", "c"], sums) == {"a": 4.0, "b": None, "c": pytest.approx(4 / 3)}
    assert math.isfinite(losses_by_name(["a", "b", "c"], sums)["a"])


def test_a_run_whose_steps_wait_for_data_ends_with_one_warning(tmp_path, monkeypatch, capsys):
    """A loader slower than the step: every train record's data wait covers its samples' loading,
    and the run ends with one warning line naming the share and data.num_workers."""
    slow = GPTSamples.__getitem__

    def sleepy(self, k):
        time.sleep(0.25)
        return slow(self, k)

    monkeypatch.setattr(GPTSamples, "__getitem__", sleepy)
    cfg = config(tmp_path, write_sources(tmp_path), train_iters=2, log_interval=1, eval_interval=0)
    summary = start_run(cfg).train()
    train = [rec for rec in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train_loss" in rec]
    assert all(rec["data_wait_s"] >= 4 * 0.25 and rec["data_wait_share"] > 0.05 for rec in train)
    assert summary["data_wait_share"] > 0.05
    warnings = [line for line in capsys.readouterr().err.splitlines() if "waited for data" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: the steps waited for data ")


@pytest.mark.slow  # two ranks per layout, each an interpreter start-up
@pytest.mark.parametrize("layout", [dict(), dict(pp=2), dict(tp=2, sp=True)], ids=["dp2", "pp2", "tp2_sp"])
def test_losses_per_source_in_every_layout_equal_one_process(tmp_path, monkeypatch, layout):
    """2 gloo ranks (dp 2; pp 2, where the loss lives on the last stage; tp 2 with sequence
    parallelism, whose losses come sequence-first) against the one-process run: the validation
    losses per source before the first step within 1e-6 (same parameters), after training and
    the training losses per source within 1e-5."""
    from tokenloom.train.launch import launch

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prefixes = write_sources(tmp_path)
    runs = {}
    for name, fields, ranks in (("two", layout, 2), ("one", {}, None)):
        cfg = config(tmp_path / name, prefixes, train_iters=2, log_interval=2, log_loss_per_source=True, **fields)
        launch(cfg, nproc_per_node=ranks)
        runs[name] = read_metrics(tmp_path / name / "run" / "metrics.jsonl")
    for key, first_tol in (("val_loss_per_source", 1e-6), ("train_loss_per_source", 1e-5)):
        two, one = ([(rec["iter"], rec[key]) for rec in runs[n] if key in rec] for n in ("two", "one"))
        assert [i for i, _ in two] == [i for i, _ in one] and two
        for k, ((_, a), (_, b)) in enumerate(zip(two, one, strict=True)):
            assert list(a) == list(NAMES) == list(b)
            tol = first_tol if k == 0 else 1e-5
            assert all(abs(a[n] - b[n]) < tol for n in NAMES), (key, a, b)


def test_names_are_display_only_a_resume_may_change_them(tmp_path):
    """The preflight's "same data" check leaves ``data.blend.names`` out, also against a
    checkpoint written before the field existed (no ``names`` in its config)."""
    cfg = config(tmp_path, write_sources(tmp_path), train_iters=2, eval_interval=0)
    path = Path(start_run(cfg).train()["checkpoint"])
    cfg.data.blend.names = ["w", "c", "b"]
    cfg.resume = str(path)
    check_resume(cfg)
    state = json.loads((path / "state.json").read_text())
    del state["config"]["data"]["blend"]["names"]
    (path / "state.json").write_text(json.dumps(state))
    assert "names" not in checkpoint.read_state(path)["config"]["data"]["blend"]
    check_resume(cfg)
