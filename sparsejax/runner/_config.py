"""Typed, layered experiment configs: the machinery (the schema is `_schema.py`).

A config is a tree of frozen dataclasses (`RunConfig`). It is read
from YAML files layered left to right (a file may name its own `base:` file, relative to
itself), then `key.sub=value` overrides (values parsed as YAML). Validation turns the
merged dict into the dataclasses: an unknown key is an error naming it and the closest
valid key, a value of the wrong type names the key, the expected type and the value.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file, key or value is invalid; the message names it."""


def _closest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(valid)}"


def unknown_key_error(where: str, key: str, valid) -> ConfigError:
    return ConfigError(f"unknown config key {where + key!r}{_closest(key, valid)}")


def merge(base: Mapping, over: Mapping) -> dict:
    """Deep merge: mappings merge key by key, anything else in `over` replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = (
            merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
        )
    return out


def load_yaml(path: str | os.PathLike, _seen: tuple = ()) -> dict:
    """One config file with its `base:` chain resolved (bases first)."""
    path = os.path.abspath(path)
    if path in _seen:
        raise ConfigError(f"config {path} includes itself through `base:`")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return dict(data)
    bases = [base] if isinstance(base, str) else list(base)
    merged: dict = {}
    for b in bases:
        merged = merge(merged, load_yaml(os.path.join(os.path.dirname(path), b), (*_seen, path)))
    return merge(merged, data)


def parse_override(text: str) -> dict:
    """`a.b.c=value` -> {"a": {"b": {"c": value}}} with `value` parsed as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from None
    out: Any = parsed
    for part in reversed(key.strip().split(".")):
        out = {part: out}
    return out


def layered(files: Sequence[str | os.PathLike], overrides: Sequence[str] = ()) -> dict:
    """Merge config files left to right, then the overrides."""
    merged: dict = {}
    for f in files:
        merged = merge(merged, load_yaml(f))
    for o in overrides:
        merged = merge(merged, parse_override(o))
    return merged


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _number(text: str):
    try:
        x = float(text)
    except ValueError:
        return text
    return int(x) if x.is_integer() and "." not in text and "e" not in text.lower() else x


def convert(tp, value, key: str):
    """Check / convert `value` to the annotated type `tp`; errors name `key`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own message is the clearest
            return convert(options[0], value, key)
        for a in options:
            try:
                return convert(a, value, key)
            except ConfigError:
                pass
        raise ConfigError(f"config key {key!r}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r} must be a mapping, got {value!r}")
        return from_dict(tp, value, prefix=key + ".")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(
                f"config key {key!r}: {value!r} is not one of {list(typing.get_args(tp))}"
            )
        return value
    if origin in (tuple, list, Sequence) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key!r}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        return tuple(convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping) or tp in (dict,):
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r}: expected true/false, got {value!r}")
        return value
    if isinstance(value, str) and tp in (int, float):
        value = _number(value)  # YAML 1.1 reads 1e-3 as a string
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"config key {key!r}: expected an int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {key!r}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key {key!r}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls, data: Mapping, *, prefix: str = ""):
    """Build dataclass `cls` from a mapping, recursively, validating every key."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for k in data:
        if k not in fields:
            raise unknown_key_error(prefix, str(k), fields)
    kwargs = {k: convert(hints[k], v, prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config section {prefix.rstrip('.') or '<root>'}: {e}") from None


def to_dict(obj) -> Any:
    """Dataclass tree -> plain YAML-able dict (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string right after each field)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs, body = {}, tree.body[0].body
    for a, b in zip(body, body[1:], strict=False):
        if (
            isinstance(a, ast.AnnAssign)
            and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr)
            and isinstance(getattr(b, "value", None), ast.Constant)
        ):
            docs[a.target.id] = str(b.value.value).strip()
    return docs
