"""tokenloom: raw text to a trained GPT, with Megatron-LM's file formats.

Stages are sub-packages (``tokenizers``, ``preprocess``, ``indexed``, ``blending``, ``train``);
``tokenloom.cli`` exposes them as one command."""

__version__ = "0.1.0"
