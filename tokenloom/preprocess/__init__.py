"""Corpora -> Megatron ``.bin/.idx`` + manifest (``tokenloom preprocess``)."""

from tokenloom.errors import TokenloomError
from tokenloom.preprocess.config import PreprocessConfig
from tokenloom.preprocess.pipeline import run as run_local
from tokenloom.preprocess.ray_executor import run as run_ray

__all__ = ["PreprocessConfig", "run"]


def run(cfg: PreprocessConfig, echo=print) -> dict:
    """Run preprocess with ``cfg.executor``: local processes, or Ray tasks merged into one output."""
    if cfg.executor == "local":
        return run_local(cfg, echo)
    if cfg.executor == "ray":
        return run_ray(cfg, echo)
    raise TokenloomError(f"--executor {cfg.executor!r}: expected local or ray")
