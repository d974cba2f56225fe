"""The corpus: input files read as records, and records validated into document texts.

This is the record model every stage that reads raw text shares, below the stages that
use it: ``preprocess`` tokenizes the documents into ``.bin/.idx``, ``tokenizer train``
learns a vocabulary from the same documents. "corpus" names what the package holds
(the user's text inputs, before any tokenizer touches them), not a stage; it sits in
the contracts layer beside :mod:`tokenloom.indexed` (the token side) and imports nothing
above ``tokenloom``'s base modules.

* :mod:`~tokenloom.corpus.readers`: input discovery and streaming readers (jsonl, parquet,
  HF datasets, txt, local or object store), cut into resumable chunks.
* :mod:`~tokenloom.corpus.documents`: records -> validated texts (``decode_chunk``) and plain
  iteration over the documents of inputs (``iter_documents``).

Nothing is imported here, so importing a submodule loads only what it needs.
"""
