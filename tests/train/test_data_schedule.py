"""Issue 53, data schedules (``data.schedule``), through the trainer ``cli.py train`` runs (``launch``).

An 8-step run on three .bin/.idx sources: phase 1 (a, b at 0.5/0.5) until iteration 4, then
phase 2 (a 0.2, b 0.5, c 0.3). It must draw and train exactly as phase 1's blend stopped at
4 and resumed with phase 2's blend (the blend-change-on-resume machinery, planned ahead), and
a resume in the middle of phase 2 must continue it exactly; resumed in phase 1 on two gloo ranks
(torchrun), it must train as the one process did. The samples each in-process run draws are
recorded (which source, which position of that source's own order).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import blend_helpers
import pytest
from blend_helpers import drawn_by, sources, train_losses
from click.testing import CliRunner

from tokenloom.cli import main
from tokenloom.errors import TokenloomError
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.config import TrainConfig, load_config
from tokenloom.train.data import BlendDataConfig, DataConfig, SchedulePhase
from tokenloom.train.launch import launch
from tokenloom.train.metrics import loss_figure, read_metrics

# the module fixture: four in-process launches (2-8 tiny CPU steps each, a few small .bin/.idx
# blends) and one of 2 gloo ranks under torchrun (6 steps), 27 s on this machine at load 6 and 41 s at
# load 12: 900 s keeps it under 0.1 loaded
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = 60  # per source
ITERS = 8


def config(out: Path, blend: list[tuple[float, str]], cache: Path, schedule=None, **kw) -> TrainConfig:
    """:func:`blend_helpers.config` at this module's run length."""
    return blend_helpers.config(out, blend, cache, schedule, **{"train_iters": ITERS} | kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A: the schedule, 8 steps at once (checkpoints every 2: at 6, mid phase 2); run B: phase
    1's blend to 4, resumed with phase 2's; run C: A's checkpoint at 6 resumed with the schedule;
    run D: A's checkpoint at 2 resumed with the schedule on 2 gloo ranks (torchrun), through the
    phase change at 4."""
    tmp = tmp_path_factory.mktemp("schedule")
    src, cache = sources(tmp, DOCUMENTS), tmp / "cache"
    first = [(0.5, src["a"]), (0.5, src["b"])]
    second = [(0.2, src["a"]), (0.5, src["b"]), (0.3, src["c"])]
    every = [(1.0, src["a"]), (1.0, src["b"]), (1.0, src["c"])]
    schedule = [SchedulePhase(start_iter=0, blend=[(0.5, "a"), (0.5, src["b"])]),  # by name or by prefix
                SchedulePhase(start_iter=4, blend=[(0.2, "a"), (0.5, "b"), (0.3, "c")])]
    mp = pytest.MonkeyPatch()
    try:
        out = {"src": src}
        out["A"] = drawn_by(config(tmp / "A", every, cache, schedule, save_interval=2), mp)
        out["B"] = (drawn_by(config(tmp / "B", first, cache, exit_interval=4), mp)
                    + drawn_by(config(tmp / "B", second, cache), mp))
        for run, kept in (("C", 6), ("D", 2)):  # each writes its own later checkpoints
            shutil.copytree(tmp / "A", tmp / run)
            for later in range(kept + 2, ITERS + 1, 2):
                shutil.rmtree(tmp / run / "checkpoints" / f"iter_{later:07d}")
        out["C"] = drawn_by(config(tmp / "C", every, cache, schedule,
                                   resume=str(tmp / "C" / "checkpoints" / "iter_0000006")), mp)
        mp.setenv("PYTHONPATH", str(REPO))
        mp.setenv("OMP_NUM_THREADS", "1")
        launch(config(tmp / "D", every, cache, schedule, resume=str(tmp / "D" / "checkpoints" / "iter_0000002")),
               nproc_per_node=2)
    finally:
        mp.undo()
    out["dirs"] = {k: tmp / k for k in "ABCD"}
    return out


def test_a_two_phase_schedule_trains_as_a_resume_with_the_next_blend(runs):
    a, b = runs["A"], runs["B"]
    assert len(a) == len(b) == 32
    assert a == b  # the same samples, each source continuing after what it served
    for name in "abc":  # nothing twice, nothing skipped
        positions = sorted(k for s, k in a if s == name)
        assert positions == list(range(len(positions))), name
    assert {s for s, _ in a[:16]} == {"a", "b"} and "c" in {s for s, _ in a[16:]}
    la, lb = train_losses(runs["dirs"]["A"]), train_losses(runs["dirs"]["B"])
    assert [i for i, _ in la] == [i for i, _ in lb] == list(range(1, 9))
    assert max(abs(x - y) for (_, x), (_, y) in zip(la, lb, strict=True)) < 1e-6
    state = checkpoint.read_state(checkpoint.find_latest(runs["dirs"]["A"] / "checkpoints"))
    assert [s["start"] for s in state["data_history"]["segments"]] == [0, 16]


def test_a_resume_mid_phase_continues_exactly(runs):
    assert runs["C"] == runs["A"][24:]  # the last 2 steps' samples
    la, lc = train_losses(runs["dirs"]["A"]), train_losses(runs["dirs"]["C"])
    assert [i for i, _ in lc] == list(range(1, 9))
    assert max(abs(x - y) for (_, x), (_, y) in zip(la, lc, strict=True)) < 1e-6
    records = read_metrics(runs["dirs"]["C"] / "metrics.jsonl")
    assert [(r["iter"], r["schedule_phase"]) for r in records if "schedule_phase" in r] == [(4, 1)]
    assert [r["blend_changed"] for r in records if "resumed_from" in r] == [False]  # planned, not a change
    fig = loss_figure(records)
    assert "data schedule phase" in fig.axes[0].get_legend_handles_labels()[1]
    import matplotlib.pyplot as plt  # lazy: matplotlib only for this check

    plt.close(fig)
    b = read_metrics(runs["dirs"]["B"] / "metrics.jsonl")
    assert [r["blend_changed"] for r in b if "resumed_from" in r] == [True]


def test_the_plan_prints_each_phase(runs, tmp_path):
    from tokenloom.train.data import TrainData

    src = runs["src"]
    cfg = DataConfig(blend=BlendDataConfig(prefixes=[(1.0, src["a"]), (1.0, src["b"])], split="90,9,1"),
                     schedule=[SchedulePhase(start_iter=0, blend=[(1.0, "a")]),
                               SchedulePhase(start_iter=3, blend=[(0.5, "a"), (0.5, "b")])])
    data = TrainData(cfg, seq_len=32, vocab_size=96, sizes=(24, 4, 0), global_batch_size=4)
    assert data.plan.startswith("data.blend (validation):\nsplit")
    assert "data.schedule[0]: from iteration 0 (sample 0)" in data.plan
    assert "data.schedule[1]: from iteration 3 (sample 12)" in data.plan
    assert data.switches == {12: 1} and data.source_names == ["a", "b"]
    assert {data.train.source_of(i) for i in range(12)} == {0}
    with pytest.raises(TokenloomError, match=r"data.schedule\[1\].start_iter 6 is not before train_iters 6"):
        cfg.schedule[1].start_iter = 6
        TrainData(cfg, seq_len=32, vocab_size=96, sizes=(24, 4, 0), global_batch_size=4)


def test_a_schedule_on_two_ranks_trains_as_on_one(runs):
    """Resumed at iteration 2 on two data-parallel ranks, the schedule switches blend at 4 as the
    one-process run did: the same losses, the same segments and consumption in the final state."""
    la, ld = train_losses(runs["dirs"]["A"]), train_losses(runs["dirs"]["D"])
    assert [i for i, _ in ld] == list(range(1, ITERS + 1))
    assert max(abs(x - y) for (_, x), (_, y) in zip(la, ld, strict=True)) < 1e-5
    a, d = (checkpoint.read_state(checkpoint.find_latest(runs["dirs"][k] / "checkpoints")) for k in "AD")
    assert d["world_size"] == 2 and d["iteration"] == ITERS
    assert d["data_history"] == a["data_history"] and d["data_consumed"] == a["data_consumed"]


@pytest.mark.parametrize(("phases", "match"), [
    ([{"start_iter": 2, "blend": [[1, "a"]]}], r"data.schedule\[0\].start_iter is 2: the first phase starts at 0"),
    ([{"start_iter": 0, "blend": [[1, "a"]]}, {"start_iter": 0, "blend": [[1, "b"]]}],
     r"data.schedule\[1\].start_iter 0 does not follow data.schedule\[0\].start_iter 0"),
    ([{"start_iter": 0, "blend": [[1, "z"]]}], r"data.schedule\[0\].blend: unknown source 'z'"),
    ([{"start_iter": 0, "blend": [[0, "a"]]}], r"data.schedule\[0\].blend: the weight 0 of a is not > 0"),
    ([{"start_iter": 0, "blend": [[-1, "a"]]}], r"the weight -1 of a is not > 0"),
    ([{"start_iter": 0, "blend": []}], r"data.schedule\[0\].blend is empty"),
    ([], r"data.schedule is empty"),
    ([{"start_iter": 0}], r"config section data.schedule\[0\]: blend missing"),
    ([{"start_iter": 0, "blend": [[1, "a"]], "weights": 1}], r"data.schedule\[0\]: unknown key weights"),
    ([{"start_iter": 0, "blend": [[1, "a"], [2, "d/a"]]}], r"data.schedule\[0\].blend lists a source twice"),
    ([{"start_iter": 0, "blend": [[1, "a"]]}, {"start_iter": 4, "blend": [[1, "a"]]}],
     r"data.schedule\[1\].blend is data.schedule\[0\]'s"),
])
def test_a_bad_schedule_is_one_line_naming_the_phase(tmp_path, phases, match):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"data": {"blend": {"prefixes": [[1, "d/a"], [1, "d/b"]]}, "schedule": phases}}))
    with pytest.raises(TokenloomError, match=match):
        load_config(path)


def test_cli_documents_and_refuses(tmp_path, monkeypatch):
    """``config show`` documents data.schedule; ``train`` refuses a bad one in one line, exit non-zero."""
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(main, ["config", "show"])
    assert shown.exit_code == 0 and "data.schedule = " in shown.stdout
    assert "Phases of the train blend by iteration" in shown.stdout
    blend = tmp_path / "blend.yaml"
    blend.write_text("data: [[1, d/a], [1, d/b]]\nschedule:\n  - {start_iter: 0, blend: [[1, a]]}\n"
                     "  - {start_iter: 5, blend: [[1, q]]}\n")
    bad = CliRunner().invoke(main, ["train", "--blend-file", str(blend), "--train-iters", "10", "--num-layers", "1",
                                    "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32"])
    assert bad.exit_code != 0
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{blend}: schedule[1].blend: unknown source 'q'" in lines[0], bad.output


def test_build_builds_each_phase_of_a_blend_file_schedule(tmp_path):
    src = sources(tmp_path, DOCUMENTS)
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps({"data": [[1, src["a"]], [1, src["b"]]],
                                 "schedule": [{"start_iter": 0, "blend": [[1, "a"]]},
                                              {"start_iter": 3, "blend": [[0.5, "a"], [0.5, "b"]]}]}))
    args = ["build", "--blend-file", str(blend), "--seq-length", "32", "--split", "90,9,1"]
    done = CliRunner().invoke(main, [*args, "--num-samples", "24", "--json"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    assert [(p["phase"], p["start_iter"]) for p in doc["schedule"]] == [(0, 0), (1, 3)]
    assert [{r["split"] for r in p["plan"]} for p in doc["schedule"]] == [{"train"}, {"train"}]
    assert sum(r["samples"] for r in doc["schedule"][1]["plan"]) >= 24
    text = CliRunner().invoke(main, [*args, "--num-samples", "24"])
    assert "schedule[1]: from iteration 3" in text.stdout
    short = CliRunner().invoke(main, args)
    assert short.exit_code != 0 and "give --num-samples TRAIN" in short.stderr
