"""Request bodies' JSON: `json`'s values and errors at orjson's speed."""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["loads"]

# a body's bytes with each digit as "0" and the rest " ": a run of 19 zeros is a number
# of 19 digits or more, which orjson may not hold as json does (2**63 has 19 digits)
_DIGITS_AS_ZERO = bytes(48 if 48 <= i <= 57 else 32 for i in range(256))
_LONG_NUMBER = b"0" * 19


def loads(raw: bytes) -> Any:
    """`json.loads(raw)`, through orjson where it gives the same value (5x faster: the
    JSON parse was a fifth of a worker's time). What orjson refuses and `json` takes
    (NaN, 1e400, UTF-16 bodies), every error message, and bodies with a run of 19
    digits or more (orjson makes an integer beyond 64 bits a float) are json's."""
    if _LONG_NUMBER not in raw.translate(_DIGITS_AS_ZERO):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)
