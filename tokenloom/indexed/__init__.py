"""Megatron-LM ``.bin``/``.idx`` indexed datasets: the contract between every stage.

``format`` owns the byte layout (writer and reader); ``tools`` verifies, inspects
and merges whole datasets.
"""

from tokenloom.indexed.format import (
    DTYPE_CODES,
    MAGIC,
    IndexedDataset,
    IndexedDatasetWriter,
    optimal_dtype,
    read_header,
)
from tokenloom.indexed.tools import inspect, merge, token_stream_sha256, verify

__all__ = [
    "DTYPE_CODES", "MAGIC", "IndexedDataset", "IndexedDatasetWriter", "optimal_dtype", "read_header",
    "inspect", "merge", "token_stream_sha256", "verify",
]
