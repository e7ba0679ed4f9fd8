"""Deprecated aliases of renamed public names, kept for one release."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping


def alias_getattr(module: str, aliases: Mapping[str, object]) -> Callable[[str], object]:
    """A module `__getattr__` serving `aliases` (old name -> new object) with a
    DeprecationWarning that names the replacement."""

    def __getattr__(name: str):
        if name in aliases:
            new = aliases[name]
            warnings.warn(
                f"{module}.{name} is deprecated; use {module}.{new.__name__}",
                DeprecationWarning,
                stacklevel=2,
            )
            return new
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
