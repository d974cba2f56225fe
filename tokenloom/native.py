"""The compiled helpers (``tokenloom._native``, built from ``csrc/`` at install time).

Native code is an accelerator, never a requirement: every function has a numpy reference with
the same signature, which :func:`pick` returns (one warning per process) without the extension.
Nothing is compiled at run time.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar, overload

try:
    from tokenloom import _native

    _ext: ModuleType | None = _native
    _IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # not built: no compiler at install time
    _ext = None
    _IMPORT_ERROR = exc

_warned = False


def loaded() -> bool:
    """True when the C++ extension imported."""
    return _ext is not None


def describe() -> str:
    if _ext is not None:
        return f"loaded ({_ext.__file__})"
    return f"not loaded, numpy fallback in use ({_IMPORT_ERROR})"


F = TypeVar("F", bound=Callable[..., Any])


@overload
def pick(name: str, reference: F) -> F: ...
@overload
def pick(name: str, reference: None) -> Callable[..., Any] | None: ...
def pick(name: str, reference: Callable | None) -> Callable | None:
    """The native function ``name`` if the extension has it, else ``reference`` (same signature);
    ``reference=None`` marks an optional accelerator whose caller has its own fallback."""
    global _warned
    if _ext is not None and hasattr(_ext, name):
        return getattr(_ext, name)
    if not _warned:
        warnings.warn(
            f"tokenloom native extension unavailable ({describe()}); using numpy references "
            "(slower). Reinstall with a C++ compiler present to build it.",
            RuntimeWarning,
            stacklevel=2,
        )
        _warned = True
    return reference
