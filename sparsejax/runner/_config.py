"""Typed, layered experiment configs: the machinery (the schema is `_schema.py`).

A config is a tree of frozen dataclasses (`RunConfig`). It is read from layers merged in
order: each YAML file given (a file may name its own `base:` files, relative to itself,
which come before it), then the command line's `key.sub=value` overrides, all of them
together one layer (values parsed as YAML). Validation turns the merged dict into the
dataclasses: an unknown key is an error naming it and the closest valid key, a value of
the wrong type names the key, the expected type and the value. Every error is one line.

Merging. A mapping merges key by key into the mapping below it; anything else (a
scalar, a list) replaces. To replace a mapping instead of merging into it:

- in YAML, tag it `!replace`: `sparse_options: !replace {eps: 1.0e-8}`;
- on the command line, write `key!=value`: `optimizer.sparse_options!={}` empties it.

Switching a kind drops the options of the previous one. When a layer changes
`optimizer.sparse` (or `model.name`) from the value an earlier layer set, the
`optimizer.sparse_options` (`model.options`) of the earlier layers are dropped: they
belonged to the previous optimizer (model). Options the switching layer sets itself
are kept. So `optimizer.sparse=lazy_adam` on top of a config with Adagrad's
`initial_accumulator_value` trains LazyAdam with its defaults, and
`optimizer.sparse=lazy_adam optimizer.sparse_options={b1: 0.8}` with b1 = 0.8.
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


class Replace(dict):
    """A mapping that replaces the mapping below it instead of merging into it (the
    `!replace` YAML tag, or `key!=value` on the command line)."""


SWITCHES: dict[str, str] = {
    "optimizer.sparse": "optimizer.sparse_options",
    "model.name": "model.options",
}
"""Kind key -> its options key: a layer that changes the kind (from a value an earlier
layer set) drops the earlier layers' options (its own are kept)."""


class _Loader(yaml.SafeLoader):
    """YAML with the `!replace` tag on mappings."""


def _construct_replace(loader: yaml.SafeLoader, node: yaml.Node) -> Replace:
    if not isinstance(node, yaml.MappingNode):
        raise yaml.constructor.ConstructorError(
            None, None, "!replace applies to a mapping ({...})", node.start_mark
        )
    return Replace(loader.construct_mapping(node, deep=True))


_Loader.add_constructor("!replace", _construct_replace)


def _yaml_error(e: yaml.YAMLError) -> str:
    """A YAML error in one line: `line L, column C: problem`."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def _closest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(valid)}"


def unknown_key_error(where: str, key: str, valid) -> ConfigError:
    return ConfigError(f"unknown config key {where + key!r}{_closest(key, valid)}")


def merge(base: Mapping, over: Mapping) -> dict:
    """Deep merge: mappings merge key by key, anything else in `over` replaces, and so
    does a `Replace` mapping."""
    out = Replace(base) if isinstance(base, Replace) else dict(base)
    for k, v in over.items():
        if (
            isinstance(v, Mapping)
            and not isinstance(v, Replace)
            and isinstance(out.get(k), Mapping)
        ):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def _get(tree: Mapping, dotted: str, default: Any = None) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


_UNSET = object()


def merge_layer(below: Mapping, layer: Mapping) -> dict:
    """`merge(below, layer)` after dropping the options of a kind `layer` switches
    (see `SWITCHES` and the module docstring)."""
    below = dict(below)
    for kind, options in SWITCHES.items():
        old, new = _get(below, kind, _UNSET), _get(layer, kind, _UNSET)
        if old is _UNSET or new is _UNSET or old == new:
            continue
        section, key = options.rsplit(".", 1)
        parent = _get(below, section)
        if isinstance(parent, Mapping) and key in parent:
            below[section] = {k: v for k, v in parent.items() if k != key}
    return merge(below, layer)


def plain_tree(tree: Any) -> Any:
    """`tree` with every `Replace` marker turned into a plain dict."""
    if isinstance(tree, Mapping):
        return {k: plain_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [plain_tree(v) for v in tree]
    return tree


def load_yaml(path: str | os.PathLike, _seen: tuple = ()) -> dict:
    """One config file with its `base:` chain resolved (bases first)."""
    path = os.path.abspath(path)
    if path in _seen:
        raise ConfigError(f"config {path} includes itself through `base:`")
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_Loader) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not a text (UTF-8) file: byte {e.object[e.start]:#04x} at "
            f"offset {e.start}; a config is YAML"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML ({_yaml_error(e)})") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return dict(data)
    bases = [base] if isinstance(base, str) else list(base)
    merged: dict = {}
    for b in bases:
        merged = merge_layer(
            merged, load_yaml(os.path.join(os.path.dirname(path), b), (*_seen, path))
        )
    return merge_layer(merged, data)


def parse_override(text: str) -> dict:
    """`a.b.c=value` -> {"a": {"b": {"c": value}}} with `value` parsed as YAML;
    `a.b.c!=value` replaces the mapping `a.b.c` instead of merging into it."""
    key, sep, value = text.partition("=")
    replace = key.endswith("!")
    key = key[:-1] if replace else key
    if not sep or not key.strip() or any(not p for p in key.strip().split(".")):
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    try:
        parsed = yaml.load(value, Loader=_Loader) if value.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override {text!r}: value is not valid YAML ({_yaml_error(e)})"
        ) from None
    if replace and isinstance(parsed, Mapping):
        parsed = Replace(parsed)
    out: Any = parsed
    for part in reversed(key.strip().split(".")):
        out = {part: out}
    return out


def layered(files: Sequence[str | os.PathLike], overrides: Sequence[str] = ()) -> dict:
    """Merge config files left to right, then the overrides (one layer together)."""
    merged: dict = {}
    for f in files:
        merged = merge_layer(merged, load_yaml(f))
    command_line: dict = {}
    for o in overrides:
        command_line = merge(command_line, parse_override(o))
    return plain_tree(merge_layer(merged, command_line))


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
        where = f"config section {prefix.rstrip('.')}: " if prefix else ""
        raise ConfigError(f"{where}{e}") from None


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
    """Attribute docstrings of a dataclass (the string right after each field), its
    base classes' too (a subclass's own win)."""
    import ast
    import inspect
    import textwrap

    docs = {}
    for c in reversed(cls.__mro__):
        if c is object or not dataclasses.is_dataclass(c):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for a, b in zip(body, body[1:], strict=False):
            if (
                isinstance(a, ast.AnnAssign)
                and isinstance(a.target, ast.Name)
                and isinstance(b, ast.Expr)
                and isinstance(getattr(b, "value", None), ast.Constant)
            ):
                docs[a.target.id] = str(b.value.value).strip()
    return docs


def _type_doc(tp) -> str:
    """A type as a config writer reads it: `int | null`, `"a" | "b"`, `list of str`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if dataclasses.is_dataclass(tp):
        return f"mapping ({tp.__name__})"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_doc(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (tuple, list, Sequence) or tp in (tuple, list):
        items = [a for a in args if a is not Ellipsis]
        return f"list of {_type_doc(items[0])}" if items else "list"
    if origin in (dict, Mapping) or tp is dict:
        return "mapping"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(tp, _type_name(tp))


def _section_defaults(cls) -> Any:
    """A section's dataclass with the defaults of its own fields (None: it has required
    fields)."""
    try:
        return cls()
    except TypeError:
        return None


def _default_doc(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value) and value == _section_defaults(type(value)):
        return "its section's defaults"
    text = yaml.safe_dump(to_dict(value), default_flow_style=True, width=1 << 30).strip()
    return "default `" + text.removesuffix("\n...").removesuffix("...").strip() + "`"


def _nested_dataclasses(tp) -> list:
    if dataclasses.is_dataclass(tp):
        return [tp]
    return [c for a in typing.get_args(tp) for c in _nested_dataclasses(a)]


def schema_reference(cls, *, title: str = "Config reference", intro: str = "") -> str:
    """Markdown reference of the config dataclass `cls`: one section per (nested)
    dataclass, one line per field with its type, default and attribute docstring."""
    lines = [f"# {title}", ""]
    if intro:
        lines += [intro.strip(), ""]
    todo, seen = [("", cls)], set()
    while todo:
        prefix, c = todo.pop(0)
        if (prefix, c) in seen:
            continue
        seen.add((prefix, c))
        hints = typing.get_type_hints(c)
        head = f"`{prefix.rstrip('.')}` ({c.__name__})" if prefix else f"Top level ({c.__name__})"
        lines += [f"## {head}", ""]
        class_doc = inspect_doc(c)
        if class_doc:
            lines += [class_doc, ""]
        lines += field_lines(c, prefix)
        for f in dataclasses.fields(c):
            if not f.init or f.name.startswith("_"):
                continue
            tp = hints[f.name]
            is_list = typing.get_origin(tp) in (tuple, list, Sequence)
            is_map = typing.get_origin(tp) in (dict, Mapping)  # {name: section}
            for sub in _nested_dataclasses(tp):
                part = f"{f.name}{'[]' if is_list else ''}{'.<name>' if is_map else ''}"
                todo.append((f"{prefix}{part}.", sub))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def field_lines(cls, prefix: str, *, exclude=(), defaults: Mapping[str, str] = {}) -> list[str]:
    """One markdown line per field of dataclass `cls` but `exclude`: `prefix` + name, its
    type, default (`defaults` overrides the shown one) and attribute docstring."""
    hints, docs, lines = typing.get_type_hints(cls), field_docs(cls), []
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_") or f.name in exclude:
            continue
        doc = " ".join(docs.get(f.name, "").split())
        default = f"default `{defaults[f.name]}`" if f.name in defaults else _default_doc(f)
        line = f"- `{prefix}{f.name}` ({_type_doc(hints[f.name])}; {default})"
        lines.append(f"{line}: {doc}" if doc else line)
    return lines


def inspect_doc(cls) -> str:
    """A dataclass's own docstring as markdown ("" for the generated one): wrapped lines
    joined, paragraphs and `*` / `-` list items kept, `>>>` examples as code."""
    import inspect

    doc = cls.__dict__.get("__doc__") or ""
    if not doc or doc.startswith(f"{cls.__name__}("):
        return ""
    out = []
    for para in inspect.cleandoc(doc).split("\n\n"):
        items: list[str] = []
        for line in para.splitlines():
            line = line.strip()
            if line.startswith(">>>"):  # an example: a code block
                items += ([""] if items and not items[-1].startswith("    ") else []) + [
                    "    " + line
                ]
            elif line.startswith(("* ", "- ")) or not items:
                items.append(line)
            else:
                items[-1] += " " + line
        out.append("\n".join(items))
    return "\n\n".join(out)
