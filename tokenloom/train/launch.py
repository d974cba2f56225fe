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
from pathlib import Path

from tokenloom.errors import TokenloomError
from tokenloom.train.loop import TrainConfig, config_to_dict, load_config, run


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
