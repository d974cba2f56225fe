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
import importlib.util
import inspect
import re
import textwrap
from typing import cast


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings of the dataclass fields of ``cls`` (and its dataclass bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            source = ast.parse(textwrap.dedent(inspect.getsource(klass)))
            docs.update(_body_docs(cast(ast.ClassDef, source.body[0]).body))
    return docs


def _body_docs(body: list) -> dict[str, str]:
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def source_field_docs(class_path: str) -> dict[str, str]:
    """:func:`field_docs` of ``"package.module:Class"`` read from its source, not imported (the CLI's
    help would otherwise import torch for every command). Reads only the class's own body, so it
    serves classes inheriting no fields (a test holds it equal to :func:`field_docs`)."""
    module, name = class_path.split(":")
    spec = importlib.util.find_spec(module)  # imports the parent packages only
    if spec is None or not spec.origin:
        raise LookupError(f"no source for {module}")
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    # only the class's lines are parsed (up to the next top-level line; the whole module if a string
    # in it reaches column 0): parsing whole modules slows every CLI start
    found = re.search(rf"^class {re.escape(name)}\b.*?(?=^\S|\Z)", source, re.MULTILINE | re.DOTALL)
    try:
        tree = ast.parse(found.group(0) if found else "", spec.origin)
    except SyntaxError:
        tree = ast.parse(source, spec.origin)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return _body_docs(node.body)
    raise LookupError(f"no class {name} in {spec.origin}")
