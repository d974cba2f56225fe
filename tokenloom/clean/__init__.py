"""The cleaning stage between reading and tokenizing: normalisation, exact and MinHash dedup,
quality filters, the removed-documents list.

Preprocess runs it (``--dedup``, ``--filters``); nothing here tokenizes or writes ``.bin/.idx``.

* :mod:`~tokenloom.clean.normalize`: the text a comparison sees (NFC + whitespace for exact
  dedup; datatrove's simplification for MinHash shingles).
* :mod:`~tokenloom.clean.keys`: per document, the bucket keys dedup matches on (a 128-bit
  digest of the normalised text, or one per MinHash band).
* :mod:`~tokenloom.clean.stage`: what a tokenizing worker runs on a chunk's documents (filters
  first, then the keys of the documents they keep), from a small picklable spec.
* :mod:`~tokenloom.clean.buckets`: the on-disk side files of a run (kept documents' record
  ids, filter removals, sorted run files of keys), written in input order with checkpoints, and
  the decision: runs merged from disk, equal keys joined (union-find), the first document of each
  cluster in input order kept.
* :mod:`~tokenloom.clean.removed`: ``PREFIX.removed.jsonl``, the list of every removed document.
* :mod:`~tokenloom.clean.filters`: the quality filters (their names, ``build_filters``), deciding as
  datatrove's; :mod:`~tokenloom.clean.words`: the spaCy English word and sentence splits they share.

It may import ``tokenloom``'s base modules and the contracts layer (``corpus``, ``indexed``);
``tokenloom.preprocess`` imports it, never the reverse.
"""
