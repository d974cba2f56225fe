"""Issue 17, blends that change on resume, through the trainer ``cli.py train`` runs (``launch``).

A 20-step run on two .bin/.idx sources at 0.5/0.5 stops at step 10; it resumes with new
weights and a third source until step 15; then resumes again at another data-parallel
size (2 gloo ranks under torchrun, and 1 process). The samples each run draws are recorded
in-process (which source, which position of that source's own order).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from blend_helpers import config, drawn_by, sources, train_losses

from tokenloom.errors import TokenloomError
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.launch import launch

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = 80  # per source


def test_changed_weights_and_an_added_source_continue_each_source_exactly(tmp_path, monkeypatch):
    src, cache, run = sources(tmp_path, DOCUMENTS), tmp_path / "cache", tmp_path / "run"
    first = [(0.5, src["a"]), (0.5, src["b"])]
    second = [(0.2, src["a"]), (0.5, src["b"]), (0.3, src["c"])]

    # steps 1-10 at 0.5/0.5: megatron-core's order (the blend build's own arrays)
    part1 = drawn_by(config(run, first, cache, exit_interval=10), monkeypatch)
    assert len(part1) == 40
    from tokenloom.blending.build import BuildConfig, build

    megatron = build(BuildConfig(data=first, split="90,9,1", seq_length=32, num_samples=(80, 0, 0), seed=1234,
                                 cache_dir=str(cache))).train
    assert part1 == [("ab"[d], k) for d, k in (megatron.locate(i) for i in range(40))]

    # steps 11-15 with new weights and a new source
    part2 = drawn_by(config(run, second, cache, exit_interval=15), monkeypatch)
    assert len(part2) == 20
    state = checkpoint.read_state(checkpoint.find_latest(run / "checkpoints"))
    assert [s["start"] for s in state["data_history"]["segments"]] == [0, 40]

    # steps 16-20 at another dp size: 2 gloo ranks and 1 process from the same checkpoint
    twin = tmp_path / "twin"
    shutil.copytree(run, twin)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launch(config(run, second, cache), nproc_per_node=2)
    part3 = drawn_by(config(twin, second, cache), monkeypatch)
    assert len(part3) == 20
    ddp, single = train_losses(run), train_losses(twin)
    assert [i for i, _ in ddp] == [i for i, _ in single] == list(range(1, 21))
    assert max(abs(a - b) for (_, a), (_, b) in zip(ddp, single, strict=True)) < 1e-5
    states = [checkpoint.read_state(checkpoint.find_latest(d / "checkpoints")) for d in (run, twin)]
    assert states[0]["data_consumed"] == states[1]["data_consumed"] and states[0]["world_size"] == 2

    # nothing twice, nothing skipped: each source's positions are a prefix of its order
    every = part1 + part2 + part3
    assert len(set(every)) == len(every) == 80
    for name in "abc":
        positions = sorted(k for s, k in every if s == name)
        assert positions == list(range(len(positions))), name
    consumed = {Path(c["prefix"]).name: c["samples"] for c in states[1]["data_consumed"]}
    assert consumed == {name: sum(s == name for s, _ in every) for name in "abc"}
    # after the change the shares follow the new weights (within the greedy blend's one sample)
    after = part2 + part3
    for w, prefix in second:
        assert abs(sum(s == Path(prefix).name for s, _ in after) - w * len(after)) <= 1, (prefix, after)


def test_only_weights_and_sources_may_change(tmp_path, monkeypatch):
    src, cache, run = sources(tmp_path, DOCUMENTS), tmp_path / "cache", tmp_path / "run"
    launch(config(run, [(0.5, src["a"]), (0.5, src["b"])], cache, train_iters=4, exit_interval=2))
    cfg = config(run, [(0.5, src["a"]), (0.5, src["b"])], cache, train_iters=4)
    cfg.data.blend.split = "80,19,1"
    with pytest.raises(TokenloomError, match="was trained on other data"):
        launch(cfg)  # the launcher's check
    from tokenloom.train.loop import run as run_ranks

    with pytest.raises(TokenloomError, match=r"other data settings \(data\.blend\.split '90,9,1' -> '80,19,1'\)"):
        run_ranks(cfg)  # the ranks' own check (a launch that skipped the launcher)
    # a checkpoint written before data histories existed keeps the old rule
    state_path = checkpoint.find_latest(run / "checkpoints") / "state.json"
    text = state_path.read_text()
    state_path.write_text(json.dumps({k: v for k, v in json.loads(text).items() if k != "data_history"}))
    with pytest.raises(TokenloomError, match="saved before blends could change on resume"):
        run_ranks(config(run, [(0.2, src["a"]), (0.8, src["b"])], cache, train_iters=4))
    state_path.write_text(text)
    # a source whose content changed under its prefix cannot be continued
    shutil.copy(src["c"] + ".idx", src["a"] + ".idx")
    shutil.copy(src["c"] + ".bin", src["a"] + ".bin")
    with pytest.raises(TokenloomError, match=r"a changed since .* drew samples from it"):
        launch(config(run, [(0.5, src["a"]), (0.5, src["b"])], cache, train_iters=4))
