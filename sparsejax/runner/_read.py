"""Reading a run's data files: the files a config names (relative paths looked up in
the working directory, then in `$SPARSEJAX_DATA_DIR`), read with the format's reader
(labels mapped and checked as `data.label` says), one source split into train / eval /
test (`data.split`), and the side tables of `data.joins`."""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Sequence

import numpy as np

from .. import data as sd
from ..data import (
    Examples,
    LabelRule,
    delimited_header,
    first_line,
    open_file,
    stable_hash_bytes,
    starts_with_header,
)
from ._config import ConfigError
from ._data_config import (
    _SCHEMA_KINDS,
    DATA_DIR_ENV,
    DataConfig,
    SplitConfig,
    _schema_or_error,
    _side_schema_dict,
)
from ._schema import RunConfig

# ---------------------------------------------------------------------------------------
# Files


def resolve_data_path(path: str | os.PathLike, key: str = "data.path") -> str:
    """The file `path` names: as given if absolute; else in the working directory, then
    in `$SPARSEJAX_DATA_DIR`. A missing file (or a directory) is a `ConfigError` naming
    `key`, the path and where it looked."""
    path = os.fspath(path)
    places = _places(path)
    for p in places:
        if os.path.isfile(p):
            return p
    folder = next((p for p in places if os.path.isdir(p)), None)
    if folder is not None:
        raise ConfigError(
            f"{key}={path!r}: {folder} is a directory, not a file; name its files with a "
            f"glob ({os.path.join(path, '*.csv')!r}) or a list"
        )
    raise ConfigError(
        f"{key}={path!r}: no such file (looked for {', '.join(places)}){_unset(path)}"
    )


def resolve_data_dir(path: str | os.PathLike, key: str = "data.path") -> str:
    """The directory `path` names, looked up as `resolve_data_path` looks up a file."""
    path = os.fspath(path)
    places = _places(path)
    found = next((p for p in places if os.path.isdir(p)), None)
    if found is None:
        raise ConfigError(
            f"{key}={path!r}: no such directory (looked for {', '.join(places)}){_unset(path)}"
        )
    return os.path.abspath(found)


def _places(path: str) -> list[str]:
    places = [path] if os.path.isabs(path) else [os.path.abspath(path)]
    data_dir = os.environ.get(DATA_DIR_ENV)
    if not os.path.isabs(path) and data_dir:
        places.append(os.path.abspath(os.path.join(data_dir, path)))
    return places


def _unset(path: str) -> str:
    if os.path.isabs(path) or os.environ.get(DATA_DIR_ENV):
        return ""
    return f"; ${DATA_DIR_ENV} is not set"


def resolve_files(spec: str | Sequence[str], key: str) -> list[str]:
    """The files a config value names: a path, a glob (`*`, `?`, `[`) or a list of
    either, each looked up like `resolve_data_path` (a glob matches in the first place
    where it matches anything; its files sorted). A missing file or a glob matching
    nothing is a `ConfigError` naming `key` and the value."""
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not items:
        raise ConfigError(f"{key}: an empty list of files")
    out = []
    for i, item in enumerate(items):
        k = key if isinstance(spec, (str, os.PathLike)) else f"{key}[{i}]"
        item = os.fspath(item)
        if not glob.has_magic(item):
            out.append(resolve_data_path(item, k))
            continue
        places = _places(item)
        for p in places:
            found = sorted(f for f in glob.glob(p) if os.path.isfile(f))
            if found:
                out += found
                break
        else:
            raise ConfigError(
                f"{k}={item!r}: the glob matches no file (looked for {', '.join(places)})"
                f"{_unset(item)}"
            )
    return out


def absolute_data_paths(d: DataConfig) -> DataConfig:
    """`d` with every data file resolved to an absolute path (globs and lists expanded
    to their files), so a saved config reads the same data from any directory."""

    def files(v, key):
        if v is None:
            return None
        f = resolve_files(v, key)
        return f[0] if isinstance(v, str) and not glob.has_magic(v) else tuple(f)

    joins = tuple(
        dataclasses.replace(j, path=files(j.path, f"data.joins[{i}].path"))
        for i, j in enumerate(d.joins)
    )
    if d.kind == "prepared":  # one directory
        return dataclasses.replace(d, path=resolve_data_dir(d.path, "data.path"))
    return dataclasses.replace(
        d,
        path=files(d.path, "data.path"),
        train=files(d.train, "data.train"),
        eval=files(d.eval, "data.eval"),
        test=files(d.test, "data.test"),
        joins=joins,
    )


# ---------------------------------------------------------------------------------------
# Reading


def _label_rule(d: DataConfig):
    """`data.label` as the readers' `sparsejax.data.LabelRule`. Unset, labels must be 0 or
    1 in every format: a Criteo file with -1/1 labels stops naming file:line:value instead
    of dropping its -1 lines as malformed and training on the positives."""
    if d.label is None:
        return LabelRule()
    return LabelRule(
        column=d.label.column,
        map=dict(d.label.map) or None,
        threshold=d.label.threshold,
        check=d.label.check,
    )


def _read(kind: str, files: list[str], *, schema, label, strict: bool, key: str, field_map=None):
    """Read `files` of one format into raw-id `Examples` and their `ParseReport`s with
    `sparsejax.data.FileSource` (lists of files, header on the first file only, label
    rules naming file and line)."""
    kw = {"schema": schema, "label": label, "strict": strict, "key": key}
    if field_map:
        kw["field_map"] = dict(field_map)
    ex, rep = sd.FileSource(files, format=kind, **kw).read()
    return ex, [rep]


def _read_split(d: DataConfig, files: list[str], schema, label, key: str, train_files=()):
    """Read the files of one split into raw-id `Examples` and their `ParseReport`s; an
    eval or test split (`train_files` given) with the header its `<split>_header` says."""
    if train_files and schema is not None and d.kind == "delimited":
        schema = _held_out_schema(schema, files, key, getattr(d, f"{key[5:]}_header"), train_files)
    return _read(
        d.kind, files, schema=schema, label=label, strict=d.strict, key=key, field_map=d.field_map
    )


def _held_out_schema(schema, files: list[str], key: str, header: bool | None, train_files):
    """The schema of eval or test files read apart from the train files: with a header
    line (their own column names) or without (`schema.columns`, else the train files'
    header); `header` None decides by their line 1 (see `DataConfig.eval_header`)."""
    delim, names = schema.delimiter, None
    if schema.header:
        names = first_line(train_files[0]).decode(errors="replace").split(delim)
    if header is None:
        header = names is not None and starts_with_header(files[0], names, delimiter=delim)
    if header == schema.header:
        out = schema
    elif header:
        out = dataclasses.replace(schema, header=True)
    else:
        return dataclasses.replace(schema, header=False, columns=schema.columns or tuple(names))
    if out.header and out.columns is None:
        try:
            out.check_columns(first_line(files[0]).decode(errors="replace").split(delim))
        except ValueError as e:
            raise ConfigError(
                f"{key}: {files[0]}: {e} (line 1 is read as its header; {key}_header=false "
                f"reads it as data, with the train files' columns)"
            ) from None
    return out


def _read_schema(d: DataConfig):
    """The schema the reader gets: the configured one plus the label column, the split's
    time column and the indicator bags' columns (read as dense). Returns (schema,
    dense columns to drop after the split)."""
    if d.kind not in _SCHEMA_KINDS or d.schema is None:
        return None, ()
    s = dict(d.schema)
    if d.label is not None and d.label.column is not None:
        s["label"] = d.label.column
    dense = list(s.get("dense", ()))
    drop = []
    if d.split is not None and d.split.by == "time" and d.split.column not in dense:
        dense.append(d.split.column)
        drop.append(d.split.column)
    for cols in d.indicator_bags.values():
        dense += [c for c in cols if c not in dense]
    s["dense"] = dense
    return _schema_or_error(s, "data.schema"), tuple(drop)


def _dense_names(d: DataConfig, schema, ex: Examples) -> tuple[str, ...]:
    if schema is not None:
        return tuple(schema.dense)
    if d.kind == "criteo":
        return tuple(sd.DENSE_NAMES)
    return tuple(f"dense{i}" for i in range(ex.num_dense))


def _take(ex: Examples, idx: np.ndarray) -> Examples:
    sparse, labels, dense = ex.take(idx)
    return Examples(labels=labels, dense=dense, sparse=sparse)


def _split(ex: Examples, s: SplitConfig, times: np.ndarray | None, seed: int):
    """(train, eval, test or None) of one source by the rule `s`."""
    n = len(ex)
    if s.by == "time":
        # the column was read as float32: compare with the thresholds rounded alike, so
        # a time equal to a threshold falls after it
        t = np.asarray(times, np.float32)
        a = np.float32(s.train)
        parts = [t < a]
        if s.eval is None:
            parts.append(t >= a)
        else:
            b = np.float32(s.eval)
            parts += [(t >= a) & (t < b), t >= b]
        return [*(_take(ex, np.flatnonzero(m)) for m in parts), None][:3]
    if s.by == "rows":
        a = s.train
        b = None if s.eval is None else a + s.eval
    else:
        a = int(round(s.train * n))
        b = None if s.eval is None else int(round((s.train + s.eval) * n))
    bounds = [a] if b is None else [a, b]
    if s.by == "random":
        perm = np.random.default_rng(seed).permutation(n)
        cuts = np.split(perm, [min(x, n) for x in bounds])
        out = [_take(ex, np.sort(c)) for c in cuts]
    else:
        out, lo = [], 0
        for hi in [*bounds, n]:
            hi = min(hi, n)
            out.append(ex[lo:hi])
            lo = max(lo, hi)
    return [*out, None][:3]


def _describe_split(s: SplitConfig) -> str:
    what = {"rows": "rows", "fraction": "share", "random": "random share", "time": "time"}[s.by]
    return f"data.split (by {s.by}: train {what} {s.train}" + (
        f", eval {s.eval})" if s.eval is not None else ")"
    )


@dataclasses.dataclass
class _Splits:
    train: Examples
    eval: Examples
    test: Examples | None
    dense_names: tuple[str, ...]
    reports: list  # parse reports of every file read
    drop: tuple[str, ...]


def _read_splits(cfg: RunConfig, schema, drop) -> _Splits:
    d = cfg.data
    source_key = "data.train" if d.train is not None else "data.path"
    source = d.train if d.train is not None else d.path
    if source is None:
        raise ConfigError(f"data.kind={d.kind!r} needs data.path (or data.train)")
    train_files = resolve_files(source, source_key)
    eval_files = None if d.eval is None else resolve_files(d.eval, "data.eval")
    test_files = None if d.test is None else resolve_files(d.test, "data.test")
    label = _label_rule(d)
    train, reports = _read_split(d, train_files, schema, label, source_key)
    dense_names = _dense_names(d, schema, train)
    test = None
    if eval_files is not None:
        ev, r = _read_split(d, eval_files, schema, label, "data.eval", train_files)
        reports += r
    else:
        s = d.split
        if s is None:
            s = SplitConfig(by="rows", train=d.train_rows) if d.train_rows else SplitConfig()
        times = None
        if s.by == "time":
            times = train.dense[:, list(dense_names).index(s.column)]
        if len(train) == 0:
            summary = "; ".join(r.summary() for r in reports)
            raise ValueError(f"{source_key}: no usable rows to split: {summary}")
        seed = cfg.seed if s.seed is None else s.seed
        train, ev, test = _split(train, s, times, seed)
        for name, part in (("train", train), ("eval", ev), ("test", test)):
            if part is not None and len(part) == 0:
                raise ConfigError(
                    f"{_describe_split(s)} leaves the {name} split empty "
                    f"({len(train) + len(ev) + (len(test) if test else 0)} rows read)"
                )
    if test_files is not None:
        test, r = _read_split(d, test_files, schema, label, "data.test", train_files)
        reports += r
    for name, part in (("train", train), ("eval", ev)):
        if len(part) == 0:
            summary = "; ".join(r.summary() for r in reports)
            raise ValueError(f"data: the {name} split has no usable rows: {summary}")
    return _Splits(train, ev, test, dense_names, reports, drop)


def _read_side_tables(d: DataConfig, main_schema) -> tuple[list[sd.Join], list]:
    joins, reports = [], []
    for i, j in enumerate(d.joins):
        key = f"data.joins[{i}]"
        files = resolve_files(j.path, f"{key}.path")
        side_schema = _schema_or_error(_side_schema_dict(j, main_schema, key), f"{key}.schema")
        ex, reps = _read(
            "delimited", files, schema=side_schema, label=None, strict=d.strict, key=f"{key}.path"
        )
        reports += reps
        names = tuple(side_schema.dense)
        for bag, cols in j.indicator_bags.items():
            ex, names = sd.indicator_bag(ex, names, bag, cols)
        source = ", ".join(os.path.basename(f) for f in files)
        try:
            side = sd.SideTable.build(
                ex,
                names,
                j.key,
                columns=j.columns,
                source=source,
                dense_missing=side_schema.dense_missing,
            )
        except ValueError as e:
            raise ValueError(f"{key} ({files[0]}): {e}") from None
        joins.append(sd.Join(side=side, on_missing=j.on_missing, label=f"join {source}"))
    return joins, reports


def _key_text(d: DataConfig, schema, key: str, raw: int) -> str:
    """Where the raw id `raw` of column `key` first occurs in the data files, as
    "'value' (file:line)" (for error messages; hashed strings are found by hashing)."""
    source = d.train if d.train is not None else d.path
    files = [f for s in (source, d.eval, d.test) if s is not None for f in resolve_files(s, "data")]
    names, skips = delimited_header(files, delimiter=schema.delimiter, header=schema.header)
    names = list(schema.columns) if schema.columns is not None else names
    if key not in names:
        return f"raw id {raw}"
    col, delim = names.index(key), schema.delimiter.encode()
    for f, skip in zip(files, skips, strict=True):
        line_no = 2 if skip else 1
        with open_file(f) as fh:
            fh.skip_to(skip)
            rest = b""
            while True:
                chunk = fh.read(1 << 20)
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop() if chunk else b""
                for line in lines:
                    cells = line.rstrip(b"\r").split(delim)
                    if line and col < len(cells):
                        text = cells[col]
                        if text == b"":
                            value = -1
                        elif schema.int_ids:
                            value = int(text) if text.isdigit() else None
                        else:
                            value = stable_hash_bytes(text)
                        if value == raw:
                            return f"{text.decode(errors='replace')!r} ({f}:{line_no})"
                    line_no += 1
                if not chunk:
                    break
    return f"raw id {raw}"
