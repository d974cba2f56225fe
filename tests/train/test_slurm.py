"""Slurm without torchrun: ``srun -n 2 python cli.py train ...`` starts two tasks that see
only Slurm's variables. They must form one job of world 2 (not two jobs of world 1 on
the same output directory), and train exactly as torchrun's dp 2 does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "parallel"))
from compose_helpers import read_losses, tiny_cfg  # noqa: E402
from tl_testing import REPO, limit_s, run_cli  # noqa: E402

from tokenloom.errors import TokenloomError  # noqa: E402
from tokenloom.train.config import config_to_dict  # noqa: E402
from tokenloom.train.dist import first_host, launch_env  # noqa: E402

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def srun_env(task: int, tasks: int, job_id: int) -> dict[str, str]:
    """What ``srun -n TASKS`` on one node sets for one task (the launch-related part)."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    return dict(base, SLURM_JOB_ID=str(job_id), SLURM_STEP_ID="0", SLURM_PROCID=str(task), SLURM_LOCALID=str(task),
                SLURM_NODEID="0", SLURM_NTASKS=str(tasks), SLURM_NPROCS=str(tasks), SLURM_STEP_NUM_TASKS=str(tasks),
                SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost",
                SLURM_STEP_NODELIST="localhost", SLURM_NODELIST="localhost", SLURM_TASKS_PER_NODE=str(tasks),
                SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def job_id_with_free_port() -> int:
    """A job id whose derived rendezvous port (15000 + id % 20000) is free now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if 15000 <= port < 35000:
            return 40000 + port - 15000  # 40000 % 20000 == 0
    pytest.skip("no free port in 15000-35000")


def test_host_list_and_variables():
    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("rack[2-3]-n[5,6]") == "rack2-n5"
    assert first_host("login1,login2") == "login1"
    env = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_STEP_NODELIST": "n[10-11]", "SLURM_JOB_ID": "20001", "SLURM_STEP_ID": "2"}
    assert launch_env(env) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n10",
                               "MASTER_PORT": "15003"}
    # torchrun started by srun (one task per node): torchrun's variables win
    torchrun = dict(env, RANK="5", WORLD_SIZE="16", LOCAL_RANK="5", MASTER_ADDR="a", MASTER_PORT="29500")
    assert launch_env(torchrun) == {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "MASTER_ADDR": "a",
                                    "MASTER_PORT": "29500"}
    assert launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})["WORLD_SIZE"] == "1"


@pytest.mark.parametrize("master", [{}, {"MASTER_ADDR": ""}])
def test_a_task_without_a_node_list_or_master_is_refused(master):
    # an empty MASTER_ADDR counts as none (it used to reach first_host(None) and crash)
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", **master}
    with pytest.raises(TokenloomError, match="SLURM_STEP_NODELIST"):
        launch_env(env)
    assert launch_env(dict(env, MASTER_ADDR="h0"))["MASTER_ADDR"] == "h0"


@pytest.mark.slow
def test_two_srun_tasks_form_one_job_equal_to_torchrun_dp2(tmp_path):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(config_to_dict(tiny_cfg(tmp_path / "unused", save_interval=None,
                                                         train_iters=8))))
    job = job_id_with_free_port()
    slurm_out = tmp_path / "slurm"
    cmd = [sys.executable, str(REPO / "cli.py"), "train", "--config", str(config), "--output-dir", str(slurm_out)]
    procs = [subprocess.Popen(cmd, env=srun_env(t, 2, job), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for t in range(2)]
    start = time.monotonic()
    try:
        outs = [p.communicate(timeout=limit_s(360)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert "2 rank(s)" in outs[0][0] and "dp 2" in outs[0][0]  # the summary of a world-2 job, rank 0 only
    assert "layout" not in outs[1][0]
    assert sorted(p.name for p in slurm_out.glob("metrics*.jsonl")) == ["metrics.jsonl"]
    assert time.monotonic() - start < 240

    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(REPO) + (os.pathsep + env_path if env_path else "")
    try:
        done = run_cli("train", "--config", config, "--output-dir", tmp_path / "torchrun", "--nproc-per-node", 2,
                       timeout=450)
    finally:
        os.environ.pop("PYTHONPATH") if env_path is None else os.environ.__setitem__("PYTHONPATH", env_path)
    assert done.returncode == 0, done.stderr[-2000:]
    slurm, torchrun = read_losses(slurm_out / "metrics.jsonl"), read_losses(tmp_path / "torchrun" / "metrics.jsonl")
    assert len(slurm) == 8 and slurm == torchrun
