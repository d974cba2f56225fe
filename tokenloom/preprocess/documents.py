"""Plain iteration over the documents of preprocess inputs, for stages that need text, not tokens.

``tokenizer train`` reads its corpus through this, so it accepts exactly the inputs
``preprocess`` accepts (same formats, same validation, same ``file:line`` errors).
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenloom.errors import TokenloomError
from tokenloom.preprocess.readers import ChunkReader, discover
from tokenloom.preprocess.worker import decode_chunk


def iter_documents(inputs: list[str], key: str = "text", txt_unit: str = "file") -> Iterator[str]:
    """Each document's text in input order (a list-of-sentences value is joined with newlines).

    The first bad record raises :class:`TokenloomError` naming its file and line.
    """
    found = discover(inputs)
    for chunk in ChunkReader(found, [key], txt_unit=txt_unit).chunks():
        good, bad = decode_chunk(chunk, (key,))
        if bad:
            number, reason, _ = bad[0]
            raise TokenloomError(f"{found[chunk.input].path}:{number}: {reason}")
        for _, texts in good:
            yield "\n".join(texts[key])
