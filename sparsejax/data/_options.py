"""Options dataclasses built from plain dicts (YAML config sections)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping


def options_from_dict(cls, d: Mapping, *, where: str, error: type[Exception] = ValueError):
    """`cls(**d)`; a key that is not a field of `cls` raises `error` naming `where`, the
    key and the closest valid key."""
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in d:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise error(f"{where}: unknown key {key!r}{hint} (valid keys: {', '.join(valid)})")
    return cls(**d)
