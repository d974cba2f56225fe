"""launch(): in-process from a config file, torchrun command line, failing ranks -> one error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tokenloom.errors import TokenloomError
from tokenloom.train import launch as launch_module
from tokenloom.train.config import TrainConfig
from tokenloom.train.launch import (
    Nodes,
    RankWatch,
    launch,
    megatron_swiglu_width,
    parse_nnodes,
    torchrun_command,
    without_error_lines,
)
from tokenloom.train.metrics import read_metrics
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.flops import flops_per_token
from tokenloom.train.model.gpt import GPT

REPO = Path(__file__).resolve().parents[2]
MODEL = dict(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2, n_heads=2, d_model=32)


def write_config(path: Path, out: Path, **overrides) -> Path:
    cfg = {"model": MODEL, "data": {"mock": {"num_sequences": 200, "max_length": 100}},
           "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 4, "eval_interval": 0,
           "log_interval": 2, "output_dir": str(out), "progress": False, "plot": False, **overrides}
    path.write_text(json.dumps(cfg))
    return path


def test_in_process_from_a_config_file_with_known_peak(tmp_path):
    path = write_config(tmp_path / "c.json", tmp_path / "run", peak_flops=1e12)
    summary = launch(path)
    assert summary["iteration"] == 4 and summary["checkpoint"].endswith("iter_0000004")
    record = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train_loss" in r][-1]
    fpt = flops_per_token(GPT(GPTConfig(**MODEL)))
    assert record["mfu"] == pytest.approx(fpt * record["tokens_per_s"] / 1e12)


def test_torchrun_command_line():
    cmd = torchrun_command("cfg.json", 4)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == ["--standalone", "--nproc-per-node", "4", "-m", "tokenloom.train.loop", "--config",
                       "cfg.json"]
    cmd = torchrun_command("cfg.json", 2, Nodes(nnodes=2, node_rank=1, master_addr="10.0.0.1"), log_dir="L")
    assert cmd[3:] == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500",
                       "--nproc-per-node", "2", "-m", "tokenloom.train.launch", "--config", "cfg.json", "--log-dir",
                       "L"]
    cmd = torchrun_command("cfg.json", 8, Nodes(nnodes=4, rdzv_endpoint="h:29400"))
    assert cmd[3:11] == ["--nnodes", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--rdzv-id",
                         "tokenloom"]
    with pytest.raises(TokenloomError, match="--node-rank 2 must be in 0..1"):
        Nodes(nnodes=2, node_rank=2)
    elastic = Nodes(nnodes=4, min_nodes=2, rdzv_endpoint="h:29400", rdzv_id="j", rdzv_conf="last_call_timeout=5")
    assert torchrun_command("cfg.json", 8, elastic)[3:13] == [
        "--nnodes", "2:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--rdzv-id", "j", "--rdzv-conf",
        "last_call_timeout=5"]
    assert elastic.elastic and not Nodes(nnodes=2, min_nodes=2, rdzv_endpoint="h:1").elastic
    assert launch_module.torchrun_env(1, elastic)[launch_module.ELASTIC_ENV] == "2:4"
    assert launch_module.ELASTIC_ENV not in launch_module.torchrun_env(1, Nodes(nnodes=2, rdzv_endpoint="h:1"))
    assert parse_nnodes("3") == (None, 3) and parse_nnodes("1:4") == (1, 4)
    with pytest.raises(TokenloomError, match="--nnodes 1-4: give a number of nodes N or MIN:MAX"):
        parse_nnodes("1-4")
    with pytest.raises(TokenloomError, match="--nnodes 3:2: MIN must be in 1..MAX"):
        Nodes(nnodes=2, min_nodes=3, rdzv_endpoint="h:1")
    with pytest.raises(TokenloomError, match="--nnodes 1:2 needs --rdzv-endpoint"):
        Nodes(nnodes=2, min_nodes=1, master_addr="10.0.0.1")


def test_an_elastic_launch_is_refused_where_a_world_it_may_reach_cannot_train(tmp_path):
    path = write_config(tmp_path / "c.json", tmp_path / "run", micro_batch_size=1)
    nodes = Nodes(nnodes=3, min_nodes=1, rdzv_endpoint="127.0.0.1:1")
    with pytest.raises(TokenloomError, match=r"--nnodes 1:3: with 3 node\(s\) \(6 ranks\): --global-batch-size 4 is "
                       "not a multiple of --micro-batch-size 1 x 6"):
        launch(path, nproc_per_node=2, nodes=nodes, max_restarts=1)
    with pytest.raises(TokenloomError, match="--nnodes 1:3 goes on after a lost node by a restart"):
        launch(path, nproc_per_node=1, nodes=nodes)
    resumed = write_config(tmp_path / "r.json", tmp_path / "run", micro_batch_size=1, resume=str(tmp_path))
    with pytest.raises(TokenloomError, match=f"--resume {tmp_path} with --nnodes 1:3: an elastic job's ranks resume"):
        launch(resumed, nproc_per_node=1, nodes=nodes, max_restarts=1)
    assert not (tmp_path / "run").exists()


def test_a_restart_records_the_world_sizes_and_a_membership_change_starts_a_new_group(tmp_path):
    """An elastic node's watch: attempt 0 (world 4) fails, attempt 1 runs at world 2 (the record says
    4 -> 2); a new group of the same attempt (torchrun's membership change, no restart counted)
    replaces the ranks without a record."""
    gone = 2**22 + 12345

    def start(rank: int, attempt: int, pid: int, world: int, log: str = "") -> None:
        (tmp_path / f"rank{rank}.attempt").write_text(f"{attempt} {pid} {world} h:{world}")  # a round per world
        rank_files(tmp_path, rank, log, pid)

    start(0, 0, gone, 4, "error: rank 0: all_reduce failed (x); another rank has probably died or stalled\n")
    start(1, 0, gone + 1, 4, "error: rank 1: all_reduce failed (x); another rank has probably died or stalled\n")
    watch = RankWatch(tmp_path, max_restarts=1)
    watch.poll()
    assert watch.world == 4 and watch.failure() is not None
    start(0, 1, gone + 2, 2)
    watch.poll()
    (record,) = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert (record["restart"], record["world_size"], record["new_world_size"]) == (1, 4, 2)
    assert watch.attempt == 1 and watch.world == 2 and set(watch.ranks) == {0}
    start(1, 1, gone + 3, 2)
    watch.poll()
    start(0, 1, gone + 4, 4)  # the world grew back: the agent started a new group, same restart count
    watch.poll()
    assert watch.world == 4 and watch.ranks[0].pid == gone + 4 and set(watch.ranks) == {0}
    assert len((tmp_path / "restarts.jsonl").read_text().splitlines()) == 1


def test_bad_configs_fail_before_torchrun_starts(tmp_path):
    path = write_config(tmp_path / "c.json", tmp_path / "run", micro_batch_size=4)
    with pytest.raises(TokenloomError, match="--global-batch-size 4 is not a multiple of --micro-batch-size 4 x 2"):
        launch(path, nproc_per_node=2)
    assert not (tmp_path / "run").exists()
    with pytest.raises(TokenloomError, match="--nproc-per-node must be >= 1"):
        launch(path, nproc_per_node=0)


def rank_files(log_dir: Path, rank: int, log: str, pid: int, done: bool = False) -> None:
    (log_dir / f"rank{rank}.pid").write_text(str(pid))
    (log_dir / f"rank{rank}.log").write_text(log)
    if done:
        (log_dir / f"rank{rank}.done").write_text("0")


def test_a_peers_error_outranks_the_broken_collective_it_caused(tmp_path, monkeypatch, capfd):
    """rank 1's disk fills while rank 0 waits in a barrier: rank 0's 'barrier failed' is seen first
    (or in the same poll), but the line names rank 1's error; rank 0's error line is not relayed."""
    gone = 2**22 + 12345
    monkeypatch.setattr(launch_module.time, "monotonic", iter(range(100)).__next__)
    rank_files(tmp_path, 0, "warning: x\nerror: rank 0: checkpoint barrier failed (RuntimeError: reset); another "
               "rank has probably died or stalled past the collective timeout\n", gone)
    watch = RankWatch(tmp_path)
    watch.poll()
    rank_files(tmp_path, 1, "error: no space left on device writing ckpt\n", gone + 1)
    watch.poll()
    assert watch.first_failure(1) == "rank 1: no space left on device writing ckpt"
    assert capfd.readouterr().err == "warning: x\n"


def test_relayed_logs_leave_out_error_lines_and_hold_only_what_may_become_one():
    assert without_error_lines(b"", b"a\nerror: x\nb\n") == (b"a\nb\n", b"")
    assert without_error_lines(b"", b" 10%|#\r 20%|##") == (b" 10%|#\r 20%|##", b"")  # a bar shows as drawn
    assert without_error_lines(b"", b"ok\nerr") == (b"ok\n", b"err")
    assert without_error_lines(b"err", b"or: gone\nnext\n") == (b"next\n", b"")
    assert without_error_lines(b"err", b"atic\n") == (b"erratic\n", b"")
    assert without_error_lines(b"", b"progress\rerror: rank 0: boom\n") == (b"progress\r", b"")


def test_an_unexpected_rank_exception_leaves_its_traceback_in_the_log_and_one_line_on_the_terminal(tmp_path):
    """What rank 0 does with, e.g., the embedding's IndexError (issue 39): its log keeps the
    traceback, the relay to the terminal shows none of it, and the launcher's line names it."""
    import subprocess

    log = tmp_path / "rank0.log"
    code = ("import sys\nfrom pathlib import Path\nfrom tokenloom.train.launch import report_unexpected\n"
            "print('step 1', file=sys.stderr)\n"
            "try:\n    [][3]\nexcept IndexError as e:\n    report_unexpected(e, 0, Path(sys.argv[1]))\n")
    with open(log, "wb") as f:
        done = subprocess.run([sys.executable, "-c", code, str(log)], stderr=f, cwd=REPO)
    assert done.returncode == 1
    text = log.read_bytes()
    assert b"traceback: Traceback (most recent call last):" in text and b"traceback: IndexError: list index" in text
    assert without_error_lines(b"", text) == (b"step 1\n", b"")
    assert launch_module.rank_error(log, 0) == f"rank 0: IndexError: list index out of range (traceback in {log})"


def test_the_first_failing_rank_is_named(tmp_path, monkeypatch, capfd):
    gone = 2**22 + 12345  # above the default pid_max: no such process
    monkeypatch.setattr(launch_module.time, "monotonic", iter(range(100)).__next__)
    # rank 1 dies without a word; rank 0 reports the broken collective in the same poll
    a = tmp_path / "a"
    a.mkdir()
    rank_files(a, 0, "progress\rerror: rank 0: all_reduce failed (x); another rank has probably died\n", gone)
    rank_files(a, 1, "", gone + 1)
    (a / "torchrun.log").write_text(f"  exitcode  : -9 (pid: {gone + 1})\n")
    watch = RankWatch(a)
    watch.poll()
    assert watch.first_failure(1) == (f"rank 1: its process (pid {gone + 1}) died without an error message (killed "
                                      "by SIGKILL; a kill, the OOM killer or a crash in native code)")
    assert capfd.readouterr().err.startswith("progress")  # rank 0's log is relayed
    # rank 1 fails with an error first; rank 0, stopped by torchrun afterwards, is not a failure
    b = tmp_path / "b"
    b.mkdir()
    rank_files(b, 1, "error: rank 1: data went missing\n", gone)
    watch = RankWatch(b)
    watch.poll()
    rank_files(b, 0, "", gone + 2)
    (b / "torchrun.log").write_text(f"Sending process {gone + 2} closing signal SIGTERM\n")
    watch.poll()
    assert watch.first_failure(1) == "rank 1: data went missing"
    # a finished rank is no failure; a traceback gives its last line; nothing at all: torchrun's last line
    c = tmp_path / "c"
    c.mkdir()
    rank_files(c, 0, "", gone, done=True)
    rank_files(c, 1, "Traceback (most recent call last):\n  ...\nValueError: bug\n", gone + 1)
    watch = RankWatch(c)
    watch.poll()
    assert watch.first_failure(1) == "rank 1: ValueError: bug"
    d = tmp_path / "d"
    d.mkdir()
    (d / "torchrun.log").write_text("RuntimeError: address already in use\n")
    assert RankWatch(d).first_failure(1) == ("torchrun failed (exit status 1) before any rank reported an error: "
                                             "RuntimeError: address already in use")


def test_a_blend_file_gives_train_its_sources_and_their_names(tmp_path):
    """``train --blend-file`` takes build's blend files: the weighted prefixes, and the names an
    entry may give (losses per source); with --data too, or with a blend per split, it is refused."""
    from tokenloom.train.config import load_config

    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps({"data": [[0.3, "s3://bucket/web"], {"weight": 0.7, "prefix": "data/code",
                                                                      "name": "code"}]}))
    cfg = load_config(None, launch_module.flag_overrides(blend_file=str(blend)))
    assert cfg.data.mock is None and cfg.data.blend is not None
    assert [list(p) for p in cfg.data.blend.prefixes] == [[0.3, "s3://bucket/web"], [0.7, "data/code"]]
    assert cfg.data.blend.names == [None, "code"]
    with pytest.raises(TokenloomError, match="either as --data or as --blend-file"):
        launch_module.flag_overrides(blend_file=str(blend), data=["1", "a"])
    per_split = tmp_path / "split.json"
    per_split.write_text(json.dumps({"train": [[1, "a"]], "valid": [[1, "b"]]}))
    with pytest.raises(TokenloomError, match=rf"--blend-file {per_split}: train takes one blend"):
        launch_module.flag_overrides(blend_file=str(per_split))


def test_megatron_model_flags_reach_the_config():
    """The values ``train``'s Megatron flags hand over become the config fields they name."""
    from tokenloom.train.config import load_config

    flags = dict(norm="RMSNorm", mlp="swiglu", positions="rope", rotary_base=500000.0, tie_embeddings=False,
                 bias=False, init_method_std=0.01, adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-6,
                 lr_decay_style="linear", tensorboard_dir="tb", save_on_signal=True, num_query_groups=2)
    cfg = load_config(None, launch_module.flag_overrides(group_query_attention=True, attention_dropout=0.1,
                                                         hidden_dropout=0.1, **flags))
    m, o = cfg.model, cfg.optim
    assert (m.arch, m.norm, m.mlp, m.positions, m.rope_theta, m.tie_embeddings, m.bias) == (
        "gpt2", "rmsnorm", "swiglu", "rope", 500000.0, False, False)
    assert m.norm_bias is True  # --disable-bias-linear: the linears only, as in Megatron
    assert (m.init_std, m.dropout, m.n_kv_heads) == (0.01, 0.1, 2)
    assert (o.beta1, o.beta2, o.eps, o.decay_style) == (0.8, 0.9, 1e-6, "linear")
    assert (cfg.tensorboard_dir, cfg.save_on_signal) == ("tb", True)
    assert load_config(None, launch_module.flag_overrides(hidden_dropout=0.2)).model.dropout == 0.2
    wsd = load_config(None, launch_module.flag_overrides(lr_decay_style="WSD", lr_wsd_decay_iters=50,
                                                         lr_wsd_decay_style="minus_sqrt")).optim
    assert (wsd.decay_style, wsd.wsd_decay_iters, wsd.wsd_decay_style) == ("WSD", 50, "minus_sqrt")
    assert load_config(None, launch_module.flag_overrides(positions="learned_absolute")).model.positions == "learned"
    launch_module.check_max_position_embeddings(cfg, cfg.model.seq_len)  # equal: accepted
    with pytest.raises(TokenloomError, match="--max-position-embeddings 1023 is shorter than the sequence length 1024"):
        launch_module.check_max_position_embeddings(cfg, 1023)


def test_the_swiglu_flag_without_a_width_takes_megatrons_width():
    """Megatron's ``--swiglu`` without ``--ffn-hidden-size`` is ``int(4h * 2/3 / 64) * 64`` wide (rounded
    down); ``model.mlp=swiglu`` alone, or a given width, keeps what the config says."""
    cfg = TrainConfig(model=GPTConfig(d_model=4096, n_heads=32, mlp="swiglu"))
    assert megatron_swiglu_width(cfg, True).model.ffn_size == 10880
    assert megatron_swiglu_width(cfg, False).model.ffn_size == cfg.model.ffn_size == 10944
    given = TrainConfig(model=GPTConfig(d_model=4096, n_heads=32, mlp="swiglu", ffn_hidden_size=11008))
    assert megatron_swiglu_width(given, True).model.ffn_size == 11008


def test_megatron_moe_flags_reach_the_config():
    from tokenloom.train.config import load_config

    flags = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96, moe_layer_freq=2,
                 moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
                 moe_grouped_gemm=True, moe_token_dispatcher_type="allgather")
    m = load_config(None, launch_module.flag_overrides(**flags)).model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_size, m.moe_layer_freq, m.moe_router_load_balancing_type,
            m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_grouped_gemm, m.moe_token_dispatcher_type) == (
        8, 2, 96, 2, "seq_aux_loss", 0.01, 0.001, True, "allgather")
    assert [m.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
