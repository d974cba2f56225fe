"""The cleaning stage, between reading documents (``corpus/``) and tokenizing them (``preprocess/``).

What lives here: text normalisation, deduplication, the quality filters (``filters``: Gopher
quality and repetition, C4, FineWeb, with the word and sentence splits they share in ``words``),
and the removed-documents list that says which document each step dropped and why. Each step
works on one document's text and knows nothing of files, workers or tokenizers; it may import
the base layer and ``corpus/`` only (the preprocess stage calls it, not the other way round).
"""
