"""The cleaning stage between reading and tokenizing, run by preprocess (``--dedup``,
``--filters``): ``normalize`` (the text a comparison sees), ``keys`` (the bucket keys dedup
matches on), ``stage`` (a worker's filters and keys for a chunk), ``buckets`` (the run's side
files on disk and the decision: the first document of each cluster in input order is kept),
``removed`` (``PREFIX.removed.jsonl``), ``filters`` and ``words`` (datatrove's quality filters).

It imports only base modules and the contracts layer (``corpus``, ``indexed``); nothing here
tokenizes or writes ``.bin/.idx``.
"""
