"""The corpus: input files read as records (``readers``: discovery, streaming, resumable chunks)
and records validated into document texts (``documents``).

The record model shared by every stage reading raw text (``preprocess``, ``tokenizer train``);
it sits in the contracts layer beside :mod:`tokenloom.indexed` and imports only base modules.
Nothing is imported here, so a submodule loads only what it needs.
"""
