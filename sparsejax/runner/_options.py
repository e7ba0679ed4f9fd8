"""Typed option checks shared by the config's sections: value ranges (`check_range`),
options checked against the fields of the class they configure (`typed_options`), and
byte counts (`parse_bytes`)."""

from __future__ import annotations

import dataclasses
import re
import typing

from ._config import ConfigError, convert, unknown_key_error

_RULES = {
    ">0": (lambda x: x > 0, "> 0"),
    ">=0": (lambda x: x >= 0, ">= 0"),
    ">=1": (lambda x: x >= 1, ">= 1"),
    "[0,1)": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "(0,1]": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "[0,1]": (lambda x: 0 <= x <= 1, "in [0, 1]"),
}


def check_range(key: str, value, rule: str) -> None:
    """`value` (a number, or each number of a list) must satisfy `rule`, a key of
    `_RULES` (">0", ">=0", ">=1", "[0,1)", "(0,1]", "[0,1]"); else a `ConfigError` naming `key`
    and the value. None passes (an unset value)."""
    ok, text = _RULES[rule]
    for x in value if isinstance(value, (list, tuple)) else [value]:
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not ok(x)):
            raise ConfigError(f"config key {key!r} must be {text}, got {value!r}")


OPTION_RULES = {
    "bottom": ">=1",
    "top": ">=1",
    "hidden": ">=1",
    "attention_hidden": ">=1",
    "tower": ">=1",
    "cross_layers": ">=1",
    "rank": ">=1",
    "temperature": ">0",
    "eps": ">=0",
    "initial_accumulator_value": ">=0",
    "b1": "[0,1)",
    "b2": "[0,1)",
    "l1": ">=0",
    "l2": ">=0",
    "beta": ">=0",
    "accumulator_decay_rate": "(0,1]",
    "num_dense": ">=0",
    "focus": "[0,1]",
}
"""The values an option of a model, sparse optimizer or generator may take, by name
(see `check_range`)."""


def option_fields(cls, exclude=()) -> list[dataclasses.Field]:
    """The fields of a model, optimizer or generator class a config's options may set."""
    return [f for f in dataclasses.fields(cls) if f.init and f.name not in exclude]


def typed_options(prefix: str, cls, options: dict, exclude) -> dict:
    """`options` checked against the fields of `cls`: an unknown key names the closest
    one, each value is converted to the field's type and kept in `OPTION_RULES`' range."""
    hints = typing.get_type_hints(cls)
    valid = {f.name for f in option_fields(cls, exclude)}
    out = {}
    for k, v in options.items():
        if k not in valid:
            raise unknown_key_error(prefix, str(k), valid)
        v = convert(hints[k], v, prefix + k)
        v = list(v) if isinstance(v, tuple) else v
        if k in OPTION_RULES:
            check_range(prefix + k, v, OPTION_RULES[k])
        out[k] = v
    return out


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_bytes(value, key: str) -> int:
    """A byte count: an int, or a string such as "8GiB", "500MB", "1.5 GB" (decimal
    units k/M/G/T, binary KiB/MiB/GiB/TiB). Errors name `key`."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(value))
        unit = m and _BYTE_UNITS.get(m.group(2).lower())
        if not m or unit is None:
            raise ConfigError(
                f"config key {key!r}: expected bytes (an int, or e.g. '8GiB', '500MB'), "
                f"got {value!r}"
            )
        n = int(float(m.group(1)) * unit)
    if n < 1:
        raise ConfigError(f"config key {key!r} must be >= 1 byte, got {value!r}")
    return n
