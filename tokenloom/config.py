"""Config dataclasses whose field docstrings are the single source of ``--help`` text.

A field is documented by the string literal right below it (as litgpt and
jsonargparse read them)::

    @dataclass
    class Cfg:
        workers: int = 4
        \"\"\"Worker processes.\"\"\"

:func:`field_docs` returns ``{"workers": "Worker processes."}`` and the CLI passes
those strings to click, so help text cannot drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings of the dataclass fields of ``cls`` (and its dataclass bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def help_for(cls: type, name: str) -> str:
    """The help text of field ``name``; a missing docstring is a bug caught by the CLI tests."""
    return field_docs(cls)[name]
