"""tokenloom: raw text to a trained GPT, with Megatron-LM's file formats.

Stages live in sub-packages: ``tokenizers``, ``preprocess``, ``indexed``,
``blending`` and ``train``; ``tokenloom.cli`` exposes them as one command.
"""

__version__ = "0.1.0"
