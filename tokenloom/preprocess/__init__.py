"""Corpora -> Megatron ``.bin/.idx`` + manifest (``tokenloom preprocess``)."""

from tokenloom.preprocess.pipeline import PreprocessConfig, run

__all__ = ["PreprocessConfig", "run"]
