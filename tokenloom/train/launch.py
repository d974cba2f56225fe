"""Start training in this process, or under torchrun with N ranks on this node.

``launch(cfg)`` runs :func:`tokenloom.train.loop.run` here (which joins a torchrun /
Slurm job if the environment describes one). ``launch(cfg, nproc_per_node=N)`` writes
the resolved config to ``OUTPUT_DIR/launch_config.json`` and starts::

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m tokenloom.train.loop --config OUTPUT_DIR/launch_config.json

``--standalone`` means one node with a local rendezvous on a free port (no
``MASTER_ADDR`` to set); multi-node jobs should call torchrun or srun themselves with
the same ``-m tokenloom.train.loop --config`` entry point. Torchrun's output streams
through unchanged; a failed rank makes torchrun stop the others, and launch raises a
one-line :class:`TokenloomError` with the exit status. torchrun sets
``OMP_NUM_THREADS=1`` per rank unless it is set already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing
from pathlib import Path

from tokenloom.errors import TokenloomError
from tokenloom.train.config import TrainConfig, config_to_dict, load_config
from tokenloom.train.loop import run


def torchrun_command(config_path: str | os.PathLike, nproc_per_node: int) -> list[str]:
    """The command line that :func:`launch` runs for ``nproc_per_node`` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc_per_node), "-m", "tokenloom.train.loop", "--config", str(config_path)]


def launch(cfg: TrainConfig | str | os.PathLike, nproc_per_node: int | None = None) -> dict | None:
    """Train from a config object or file; in-process without ``nproc_per_node``, else via torchrun.

    Returns the run summary in-process, None after a successful torchrun launch.
    """
    if nproc_per_node is None:
        return run(cfg if isinstance(cfg, TrainConfig) else load_config(cfg))
    if nproc_per_node < 1:
        raise TokenloomError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    if not isinstance(cfg, TrainConfig):
        cfg = load_config(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "launch_config.json"
    config_path.write_text(json.dumps(config_to_dict(cfg), indent=2))
    code = subprocess.call(torchrun_command(config_path, nproc_per_node))
    if code != 0:
        raise TokenloomError(f"training with {nproc_per_node} ranks failed (torchrun exit status {code}); "
                             "the failing rank's error is printed above")
    return None


def flag_overrides(*, data: typing.Sequence[str] = (), mock_data: bool = False, tokenizer: str | None = None,
                   **fields) -> list[str]:
    """``--set`` overrides for the ``train`` command's convenience flags (None means not given).

    ``data`` holds WEIGHT PREFIX pairs and replaces the data section with that blend;
    ``tokenizer`` also sizes ``model.vocab_size`` to it (an explicit ``--set`` wins, as
    it is applied after these). ``fields`` maps flag names to config keys below.
    """
    keys = {"seq_length": "model.seq_len", "train_iters": "train_iters", "micro_batch_size": "micro_batch_size",
            "global_batch_size": "global_batch_size", "lr": "optim.lr", "output_dir": "output_dir",
            "resume": "resume", "cache_dir": "data.blend.cache_dir", "split": "data.blend.split",
            "tp": "tp", "pp": "pp", "vpp": "vpp", "zero1": "zero1", "kernels": "model.kernels"}
    out: list[str] = []
    if data:
        from tokenloom.blending.build import parse_data_args

        pairs = [[w, p] for w, p in parse_data_args(list(data))]
        out += ["data.mock=null", f"data.blend.prefixes={json.dumps(pairs)}"]
    elif mock_data:
        out += ["data.blend=null", "data.mock={}"]
    if tokenizer is not None:
        from tokenloom.train.data import open_tokenizer

        out += [f"tokenizer={json.dumps(tokenizer)}", f"model.vocab_size={open_tokenizer(tokenizer).vocab_size}"]
    for name, value in fields.items():
        if value is not None:
            out.append(f"{keys[name]}={json.dumps(value)}")
    return out
