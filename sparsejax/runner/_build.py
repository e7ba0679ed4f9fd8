"""Building a run from its config: the data (read or generated, split, labeled, joined,
capped, id-mapped, with the table and feature specs derived from it), the model and the
optimizers.

File data goes through these steps (each configured in `data`, see `DataConfig`):

1. files: `train` / `eval` / `test` (a path, glob or list each; or `path`), relative
   paths looked up in the working directory, then in `$SPARSEJAX_DATA_DIR`;
2. read with the format's reader (labels mapped and checked as `data.label` says);
3. split one source into train / eval / test (`data.split`, or the old `train_rows`);
4. column transforms on raw ids (`sparsejax.data.ColumnTransform`): indicator bags,
   side-table joins, `max_ids` caps;
5. id mappings fitted on train, one per table (columns sharing a table share it); a
   dynamic table's columns keep their raw ids as int64 keys (`RawIdMapping`);
6. one `TableSpec` per table and one `FeatureSpec` per sparse column, with the `tables`
   section's options (dim, hash buckets, dynamic vocabularies, device caches sized by a
   fraction of the distinct train ids; `apply_tables`).

`check_data_config` validates a `DataConfig` when it is built (at config load, before any
data is read): every problem is one line naming the key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import glob
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import data as sd
from ..data import BatchPacker, Examples, Loader, SparseBatch
from ..data import _transforms as tf
from ..data._files import delimited_header, first_line, open_file, starts_with_header
from ..data._labels import LabelRule
from ..data._text import stable_hash_bytes
from ..embedding import Composition, FeatureSpec, TableSpec, uniform_init
from ..embedding._compose import stored_values
from ..embedding._spec import (
    MISSING_KEY,
    BloomAdmission,
    CountAdmission,
    DynamicVocab,
    Eviction,
    HostCache,
)
from ..nn import MODELS
from ._config import ConfigError, from_dict, to_dict
from ._schema import (
    DATA_DIR_ENV,
    GENERATORS,
    AdmissionConfig,
    DataConfig,
    FeatureConfig,
    RunConfig,
    SplitConfig,
    TableConfig,
    check_range,
    sparse_optimizer,
    typed_options,
)

FILE_KINDS = ("criteo", "delimited", "libsvm", "parquet", "events")
"""Kinds read from files (the others generate their data)."""
_SCHEMA_KINDS = ("delimited", "parquet")
"""Kinds whose columns a `data.schema` names."""


# ---------------------------------------------------------------------------------------
# Config checks (run by DataConfig.__post_init__)


def _schema_or_error(d: dict | None, key: str):
    try:
        return sd.TableSchema.from_dict(d or {}) if d is not None else None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from None


def _unknown(key: str, value: str, valid) -> ConfigError:
    close = difflib.get_close_matches(value, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{key}: {value!r} is not a sparse column{hint} (columns: {sorted(valid)})")


def _bags(value, key: str) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping {{bag: [column, ...]}}, got {value!r}")
    out = {}
    for bag, cols in value.items():
        if (
            not isinstance(cols, (list, tuple))
            or not cols
            or not all(isinstance(c, str) for c in cols)
        ):
            raise ConfigError(
                f"{key}.{bag}: expected a non-empty list of column names, got {cols!r}"
            )
        out[str(bag)] = tuple(cols)
    return out


def _side_schema_dict(join, main_schema, key: str) -> dict:
    """The side table's read schema: the join's, with int_ids defaulting to the data's,
    the key read as a categorical and indicator columns as dense."""
    s = dict(join.schema)
    if "label" in s and s["label"] is not None:
        raise ConfigError(f"{key}.schema: a side table has no label (remove `label`)")
    if "int_ids" not in s and main_schema is not None:
        s["int_ids"] = main_schema.int_ids
    roles = [*s.get("categorical", ()), *s.get("multi_hot", ()), *s.get("sequence", ())]
    if join.key not in roles:
        s["categorical"] = [join.key, *s.get("categorical", ())]
    dense = list(s.get("dense", ()))
    for cols in join.indicator_bags.values():
        dense += [c for c in cols if c not in dense]
    s["dense"] = dense
    return s


def _check_generator_options(d: DataConfig) -> None:
    """`data.synthetic_options` must be fields of the generator `data.kind` names, of
    their types, which the generator accepts (it checks its values)."""
    cls, fixed = GENERATORS[d.kind]
    options = typed_options("data.synthetic_options.", cls, d.synthetic_options, fixed)
    object.__setattr__(d, "synthetic_options", options)
    try:
        cls(**options)
    except ValueError as e:
        raise ConfigError(f"data.synthetic_options: {e}") from None


def check_data_config(d: DataConfig) -> None:
    """Validate (and normalize in place) a `DataConfig`: each problem is a `ConfigError`
    naming the key. Runs when the config is built, before any data is read."""
    # per-column options: {column: FeatureConfig}
    if not isinstance(d.features, dict):
        raise ConfigError(
            f"data.features: expected a mapping {{column: options}}, got {d.features!r}"
        )
    feats = {}
    for col, opts in d.features.items():
        if isinstance(opts, FeatureConfig):
            feats[str(col)] = opts
        elif opts is None:
            feats[str(col)] = FeatureConfig()
        elif isinstance(opts, dict):
            feats[str(col)] = from_dict(FeatureConfig, opts, prefix=f"data.features.{col}.")
        else:
            raise ConfigError(f"data.features.{col}: expected a mapping of options, got {opts!r}")
    object.__setattr__(d, "features", feats)
    object.__setattr__(d, "indicator_bags", _bags(d.indicator_bags, "data.indicator_bags"))
    for i, j in enumerate(d.joins):
        object.__setattr__(
            j, "indicator_bags", _bags(j.indicator_bags, f"data.joins[{i}].indicator_bags")
        )

    for f in ("batch_size", "eval_batches", "min_count", "max_vocab", "prefetch"):
        if getattr(d, f) < 1:
            raise ConfigError(f"data.{f} must be >= 1, got {getattr(d, f)}")
    if d.eval_batch_size is not None and d.eval_batch_size < 1:
        raise ConfigError(f"data.eval_batch_size must be >= 1, got {d.eval_batch_size}")
    if d.hash_buckets < 2:
        raise ConfigError(f"data.hash_buckets must be >= 2, got {d.hash_buckets}")
    for col, fc in feats.items():
        for f in ("dim", "max_ids", "min_count"):
            v = getattr(fc, f)
            if v is not None and v < 1:
                raise ConfigError(f"data.features.{col}.{f} must be >= 1, got {v}")
        if fc.hash_buckets is not None and fc.hash_buckets < 2:
            raise ConfigError(
                f"data.features.{col}.hash_buckets must be >= 2, got {fc.hash_buckets}"
            )

    file_keys = [k for k in ("path", "train", "eval", "test") if getattr(d, k) is not None]
    file_opts = [
        k
        for k in ("split", "train_rows", "label", "eval_header", "test_header")
        if getattr(d, k) is not None
    ]
    file_opts += [
        k for k in ("features", "joins", "indicator_bags", "field_map", "stream") if getattr(d, k)
    ]
    if d.kind not in FILE_KINDS:
        _check_generator_options(d)
        if file_keys or file_opts:
            raise ConfigError(
                f"data.{(file_keys + file_opts)[0]} is for file data (data.kind one of "
                f"{list(FILE_KINDS)}); data.kind={d.kind!r} generates its data"
            )
        return
    if d.kind == "events":
        _check_events(d)
        return
    if d.events is not None:
        raise ConfigError(f"data.events is for data.kind='events', not {d.kind!r}")
    if d.path is not None and d.train is not None:
        raise ConfigError("data.path and data.train both name the training data; keep data.train")
    if d.path is None and d.train is None and (d.eval is not None or d.test is not None):
        raise ConfigError("data.eval/data.test need data.train (the training files)")
    if d.train_rows is not None:
        if d.split is not None:
            raise ConfigError("data.train_rows and data.split both split the data; keep data.split")
        if d.train_rows < 1:
            raise ConfigError(f"data.train_rows must be >= 1, got {d.train_rows}")
    if d.stream:
        if d.eval is None:
            raise ConfigError(
                "data.stream needs data.eval files (a stream is read once, in order, and "
                "cannot be split)"
            )
        if d.id_mapping != "hash" or any(fc.min_count is not None for fc in feats.values()):
            raise ConfigError(
                "data.stream needs data.id_mapping: hash (a vocabulary is fitted on all the "
                "train rows, which a stream does not hold)"
            )
    if d.shuffle_buffer < 1:
        raise ConfigError(f"data.shuffle_buffer must be >= 1, got {d.shuffle_buffer}")
    for split in ("eval", "test"):
        if getattr(d, f"{split}_header") is None:
            continue
        if d.kind != "delimited":
            raise ConfigError(
                f"data.{split}_header is for data.kind='delimited' (criteo and libsvm files "
                f"have no header line, parquet names its columns), not {d.kind!r}"
            )
        if getattr(d, split) is None:
            raise ConfigError(f"data.{split}_header needs data.{split} files")
    if d.split is not None and d.eval is not None:
        raise ConfigError(
            "data.split divides one source, but data.eval names eval files; remove one"
        )
    _check_split(d.split, d)

    schema = None
    if d.kind in _SCHEMA_KINDS:
        if d.schema is None:
            raise ConfigError(f"data.kind={d.kind!r} needs data.schema (its columns)")
        schema = _schema_or_error(d.schema, "data.schema")
    elif d.schema is not None:
        raise ConfigError(f"data.schema is for kinds {list(_SCHEMA_KINDS)}, not {d.kind!r}")
    if d.label is not None:
        if d.label.threshold is not None and d.label.check == "unit":
            pass  # a threshold gives 0/1, which is in [0, 1]
        if d.label.column is not None and d.kind not in _SCHEMA_KINDS:
            raise ConfigError(f"data.label.column is for kinds {list(_SCHEMA_KINDS)}")
        if (
            schema is not None
            and schema.label is not None
            and d.label.column is not None
            and d.label.column != schema.label
        ):
            raise ConfigError(
                f"data.label.column={d.label.column!r} and data.schema.label={schema.label!r}"
                f" disagree; name the label column once"
            )
    if (d.indicator_bags or d.joins) and d.kind not in _SCHEMA_KINDS:
        what = "data.joins" if d.joins else "data.indicator_bags"
        raise ConfigError(f"{what} need named columns (data.kind {list(_SCHEMA_KINDS)})")

    # the sparse columns the run will have, where the config says them
    if d.field_map and d.kind != "libsvm":
        raise ConfigError(f"data.field_map is for data.kind='libsvm', not {d.kind!r}")
    names = _file_columns(d, schema)
    if names is not None:
        for col in feats:
            if col not in names:
                raise _unknown(f"data.features.{col}", col, names)
    _table_options(feats)


def _file_columns(d: DataConfig, schema) -> set[str] | None:
    """The sparse columns of file data as its config says them (the joins checked), or
    None where only the data tells."""
    names = None
    if d.kind == "criteo":
        names = set(sd.CATEGORICAL_NAMES)
    elif d.kind == "libsvm":
        names = {str(v) for v in d.field_map.values()} or {"features"}
    elif schema is not None:
        names = set(schema.sparse_columns) | set(d.indicator_bags)
    for i, j in enumerate(d.joins):
        key = f"data.joins[{i}]"
        side = _schema_or_error(_side_schema_dict(j, schema, key), f"{key}.schema")
        if names is not None and j.key not in names:
            raise ConfigError(
                f"{key}.key={j.key!r} must be a categorical column of the data "
                f"(sparse columns: {sorted(names)})"
            )
        attached = [c for c in (*side.sparse_columns, *side.dense) if c != j.key]
        attached = [
            c for c in attached if c not in {x for v in j.indicator_bags.values() for x in v}
        ]
        attached += list(j.indicator_bags)
        if j.columns is not None:
            for c in j.columns:
                if c not in attached:
                    raise ConfigError(
                        f"{key}.columns: {c!r} is not read from the side table "
                        f"(columns read: {attached})"
                    )
            attached = list(j.columns)
        if names is not None:
            clash = set(attached) & (names | set(schema.dense if schema else ()))
            if clash:
                raise ConfigError(f"{key}: columns {sorted(clash)} are already columns of the data")
            names |= {c for c in attached if c not in side.dense}
    return names


def _check_events(d: DataConfig) -> None:
    """kind=events: one log (`train` or `path`) and `events`; the log's own options do
    the rest (split, negatives, candidate sets)."""
    if d.path is not None and d.train is not None:
        raise ConfigError("data.path and data.train both name the event log; keep data.train")
    if d.events is None:
        raise ConfigError(
            "data.kind='events' needs data.events (the log's columns, history_length, "
            "split, negatives, eval_negatives; see sparsejax.data.SequenceConfig)"
        )
    held_out = ("eval", "test", "eval_header", "test_header")
    for k in (*held_out, "split", "train_rows", "label", "schema"):
        if getattr(d, k) is not None:
            raise ConfigError(
                f"data.{k} does not apply to data.kind='events': the event log's split, "
                f"labels and columns are set in data.events"
            )
    for k in ("joins", "indicator_bags", "field_map"):
        if getattr(d, k):
            raise ConfigError(f"data.{k} does not apply to data.kind='events'")
    names = {"user", "item", "history"}
    for col, fc in d.features.items():
        if col not in names:
            raise _unknown(f"data.features.{col}", col, names)
        if any(
            getattr(fc, f) is not None
            for f in ("max_ids", "min_count", "hash_buckets", "table", "combiner")
        ):
            raise ConfigError(
                f"data.features.{col}: kind=events takes only `dim` (history_length, the "
                f"item table shared by item and history, and the ids are set by the log)"
            )
    _table_options(
        {
            c: fc if c != "history" else dataclasses.replace(fc, table="item")
            for c, fc in d.features.items()
        }
    )


def _check_split(s: SplitConfig | None, d: DataConfig) -> None:
    if s is None:
        return
    if s.by == "rows":
        for f in ("train", "eval"):
            v = getattr(s, f)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"data.split.{f} must be a row count >= 1 for by=rows, got {v!r}")
    elif s.by in ("fraction", "random"):
        for f in ("train", "eval"):
            v = getattr(s, f)
            if v is not None and not 0 < v < 1:
                raise ConfigError(
                    f"data.split.{f} must be a share in (0, 1) for by={s.by}, got {v!r}"
                )
        if s.eval is not None and s.train + s.eval >= 1:
            raise ConfigError(
                f"data.split: train {s.train} + eval {s.eval} leave no test rows; set eval: null"
                f" to evaluate on all the rest"
            )
    elif s.by == "time":
        if s.column is None:
            raise ConfigError("data.split.by=time needs data.split.column (the time column)")
        if d.kind not in _SCHEMA_KINDS:
            raise ConfigError(
                f"data.split.by=time needs named columns (data.kind {list(_SCHEMA_KINDS)})"
            )
        if s.eval is not None and s.eval <= s.train:
            raise ConfigError(
                f"data.split.eval={s.eval} must be later than data.split.train={s.train}"
            )
    if s.column is not None and s.by != "time":
        raise ConfigError(f"data.split.column is for by=time, not by={s.by}")
    if s.seed is not None and s.by != "random":
        raise ConfigError(f"data.split.seed is for by=random, not by={s.by}")
    if s.eval is not None and d.test is not None:
        raise ConfigError(
            "data.split.eval leaves the rest as the test split, but data.test names test"
            " files; remove one"
        )


def _table_options(feats: dict[str, FeatureConfig]) -> dict[str, dict]:
    """Per table: the options its columns set (dim, min_count, hash_buckets); two columns
    of one table that disagree are an error."""
    tables: dict[str, dict] = {}
    who: dict[tuple[str, str], str] = {}
    for col, fc in feats.items():
        t = fc.table or col
        opts = tables.setdefault(t, {})
        for f in ("dim", "min_count", "hash_buckets"):
            v = getattr(fc, f)
            if v is None:
                continue
            if f in opts and opts[f] != v:
                raise ConfigError(
                    f"data.features: {who[t, f]} and {col} share table {t!r} but set "
                    f"{f} {opts[f]} and {v}; set it on one of them"
                )
            opts[f], who[t, f] = v, col
    return tables


# ---------------------------------------------------------------------------------------
# Tables (the `tables` section): validated at load, made into TableSpec options at build

_DYNAMIC_ONLY = ("max_rows", "admission", "eviction", "when_full", "default_row")
"""`TableConfig` fields that only a dynamic table takes."""
_CACHE_ONLY = ("cache_policy", "ram_bytes", "disk_dir")
"""`TableConfig` fields that only a table with a device cache takes."""
_HASHED_KINDS = ("criteo", "delimited", "libsvm", "parquet")
"""File data kinds whose ids the runner maps (vocabulary, hash buckets or raw keys)."""
_DYNAMIC_KINDS = ("synthetic", *_HASHED_KINDS)
"""Data kinds whose tables may be dynamic (raw ids as keys)."""
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
    import re

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


def _cache_rows_value(value, key: str) -> int | float | None:
    """`cache_rows` keeps its YAML type: an int is rows (>= 0), a float a fraction in
    (0, 1] (so `1.0` is the whole table and `1` one row)."""
    if value is None:
        return None
    if isinstance(value, str):
        from ._config import _number

        value = _number(value.strip())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"config key {key!r}: expected rows (an int) or a fraction in (0, 1] of the "
            f"table's distinct train IDs (a float), got {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"config key {key!r} must be >= 0 rows, got {value}")
        return value
    if not 0 < value <= 1:
        raise ConfigError(
            f"config key {key!r}: a float is a fraction in (0, 1] of the table's distinct "
            f"train IDs, got {value!r} (write an int for a row count)"
        )
    return float(value)


def _table_config(opts, prefix: str) -> TableConfig:
    """One `tables` entry (a mapping) as a checked `TableConfig`; errors name the key."""
    if isinstance(opts, TableConfig):
        opts = to_dict(opts)
    if opts is None:
        opts = {}
    if not isinstance(opts, Mapping):
        raise ConfigError(f"{prefix}: expected a mapping of table options, got {opts!r}")
    opts = dict(opts)
    cache_rows = _cache_rows_value(opts.pop("cache_rows", None), f"{prefix}.cache_rows")
    tc = from_dict(TableConfig, opts, prefix=prefix + ".")
    positive = {
        "dim": (tc.dim, 1),
        "vocab_size": (tc.vocab_size, 2),
        "max_rows": (tc.max_rows, 1),
    }
    if tc.admission is not None:
        positive["admission.min_count"] = (tc.admission.min_count, 1)
        if tc.admission.bloom is not None:
            positive["admission.bloom.counters"] = (tc.admission.bloom.counters, 1)
            positive["admission.bloom.hashes"] = (tc.admission.bloom.hashes, 1)
            if (tc.admission.min_count or 0) > 255:
                raise ConfigError(
                    f"{prefix}.admission.min_count must be <= 255 with bloom (one-byte "
                    f"counters), got {tc.admission.min_count}"
                )
    if tc.eviction is not None:
        positive["eviction.ttl_steps"] = (tc.eviction.ttl_steps, 1)
        positive["eviction.every_steps"] = (tc.eviction.every_steps, 1)
        if tc.eviction.min_norm is not None and not tc.eviction.min_norm >= 0:
            raise ConfigError(
                f"{prefix}.eviction.min_norm must be >= 0, got {tc.eviction.min_norm!r}"
            )
    for k, (v, lo) in positive.items():
        if v is not None and v < lo:
            raise ConfigError(f"{prefix}.{k} must be >= {lo}, got {v}")
    if tc.compose is not None:
        for k, rule in (("rows", ">=1"), ("fraction", "(0,1]"), ("hashes", ">=1")):
            check_range(f"{prefix}.compose.{k}", getattr(tc.compose, k), rule)
    ram = None if tc.ram_bytes is None else parse_bytes(tc.ram_bytes, f"{prefix}.ram_bytes")
    return dataclasses.replace(tc, cache_rows=cache_rows, ram_bytes=ram)


def _merge_options(star, own):
    """`own` over `star`, key by key (nested sections too); None is unset."""
    if star is None or own is None:
        return own if star is None else star
    if not dataclasses.is_dataclass(own):
        return own
    out = {}
    for f in dataclasses.fields(own):
        a, b = getattr(star, f.name), getattr(own, f.name)
        out[f.name] = (
            _merge_options(a, b) if dataclasses.is_dataclass(b) else (a if b is None else b)
        )
    return type(own)(**out)


def resolve_table(tables: Mapping[str, TableConfig], name: str) -> TableConfig:
    """The options of table `name`: its own entry over `"*"`, key by key, with the `"*"`
    options that do not apply to it dropped. A table's own entry setting an option that
    does not apply (or a `"*"` entry inconsistent in itself) is a `ConfigError` naming
    the key."""
    own = tables.get(name)
    star = None if name == "*" else tables.get("*")
    tc = _merge_options(star, own) or TableConfig()

    def mine(key: str) -> bool:
        return own is not None and getattr(own, key) is not None

    def where(key: str) -> str:
        return f"tables.{name if mine(key) else '*'}.{key}"

    dynamic, cached = bool(tc.dynamic), bool(tc.cache_rows)
    drop: dict = {}
    for keys, applies, need in (
        (_DYNAMIC_ONLY, dynamic, ("a dynamic table", "dynamic: true")),
        (_CACHE_ONLY, cached, ("a table with a device cache", "cache_rows")),
    ):
        for k in keys:
            if getattr(tc, k) is None or applies:
                continue
            if mine(k):
                raise ConfigError(f"{where(k)} is for {need[0]}; set tables.{name}.{need[1]}")
            drop[k] = None
    if dynamic and tc.vocab_size is not None:
        if mine("vocab_size"):
            raise ConfigError(
                f"tables.{name}.vocab_size: table {name!r} is dynamic ({where('dynamic')}) "
                f"and has no vocabulary; bound it with max_rows, or set dynamic: false"
            )
        drop["vocab_size"] = None
    if tc.compose is not None and (dynamic or cached):
        if mine("compose"):
            raise ConfigError(
                f"tables.{name}.compose: a dynamic or host-cached table cannot be composed "
                f"(its ids are raw keys); set dynamic: false and cache_rows: 0, or drop compose"
            )
        drop["compose"] = None
    if dynamic and not cached and tc.max_rows is None:
        raise ConfigError(
            f"tables.{name}: a dynamic table needs a device size: set tables.{name}.cache_rows"
            f" (rows, or a fraction of its distinct train IDs) or tables.{name}.max_rows"
        )
    tc = dataclasses.replace(tc, **drop)
    if dynamic:
        _dynamic_vocab(tc, name)  # the spec's own checks, at load
    return tc


def _dynamic_vocab(tc: TableConfig, name: str) -> DynamicVocab:
    """The `DynamicVocab` of a resolved dynamic table's options (unset options: the
    spec's defaults); the spec's own errors name the table."""
    adm = tc.admission or AdmissionConfig()
    try:
        if adm.bloom is not None:
            kw = {"min_count": adm.min_count, **dataclasses.asdict(adm.bloom)}
            admission = BloomAdmission(**{k: v for k, v in kw.items() if v is not None})
        else:
            kw = {"min_count": adm.min_count}
            admission = CountAdmission(**{k: v for k, v in kw.items() if v is not None})
        eviction = None
        if tc.eviction is not None:
            kw = dataclasses.asdict(tc.eviction)
            eviction = Eviction(**{k: v for k, v in kw.items() if v is not None})
        kw = {"when_full": tc.when_full, "default_row": tc.default_row, "max_rows": tc.max_rows}
        return DynamicVocab(
            admission=admission,
            eviction=eviction,
            **{k: v for k, v in kw.items() if v is not None},
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"tables.{name}: {e}") from None


def _config_table_names(d: DataConfig) -> set[str] | None:
    """The table names of the run as its config says them (None where only the data
    tells)."""
    if d.kind == "synthetic":
        sizes = d.synthetic_options.get("vocab_sizes")
        n = len(sd.KAGGLE_CARDINALITIES) if sizes is None else len(sizes)
        return {f"C{i + 1}" for i in range(n)}
    if d.kind == "behavior":
        return {"user", "item", "category"}
    if d.kind == "events":
        return {"user", "item"}
    schema = _schema_or_error(d.schema, "data.schema") if d.schema is not None else None
    cols = _file_columns(d, schema)
    return None if cols is None else {_table_of(d, c) for c in cols}


def _unknown_table(name: str, names) -> ConfigError:
    close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(
        f"config key 'tables.{name}': the run has no table {name!r}{hint} "
        f"(tables: {sorted(names)}, or '*' for every table)"
    )


def _check_id_space_tables(d: DataConfig, tables: Mapping[str, TableConfig]) -> None:
    """`data.synthetic_options.id_space` makes the ids raw keys of a huge space: every
    table must be dynamic (a `ConfigError` naming the first static one)."""
    names = sorted(_config_table_names(d), key=lambda n: (len(n), n))
    static = [n for n in names if not resolve_table(tables, n).dynamic]
    if static:
        raise ConfigError(
            f"data.synthetic_options.id_space={d.synthetic_options['id_space']}: the ids are "
            f"raw keys for dynamic tables, but table {static[0]!r} is static; set "
            f"tables.'*'.dynamic: true (with cache_rows)"
        )


def check_tables_config(cfg: RunConfig) -> None:
    """Validate (and normalize in place) `cfg.tables`: entries become `TableConfig`s
    (`ram_bytes` in bytes), unknown keys and table names, options that do not apply,
    and what the data kind cannot give are `ConfigError`s naming the key."""
    if not isinstance(cfg.tables, Mapping):
        raise ConfigError(
            f"config key 'tables': expected a mapping {{table: options}}, got {cfg.tables!r}"
        )
    tables = {str(k): _table_config(v, f"tables.{k}") for k, v in cfg.tables.items()}
    object.__setattr__(cfg, "tables", tables)
    if cfg.data.kind == "synthetic" and cfg.data.synthetic_options.get("id_space") is not None:
        _check_id_space_tables(cfg.data, tables)
    if not tables:
        return
    d = cfg.data
    names = _config_table_names(d)
    if names is not None:
        for name in tables:
            if name != "*" and name not in names:
                raise _unknown_table(name, names)
    for name, tc in tables.items():  # what the data kind cannot give, where it is set
        if tc.dynamic and d.kind not in _DYNAMIC_KINDS:
            raise ConfigError(
                f"tables.{name}.dynamic: dynamic tables need data.kind one of "
                f"{list(_DYNAMIC_KINDS)}, not {d.kind!r}"
            )
        if tc.vocab_size is not None and d.kind not in _HASHED_KINDS:
            raise ConfigError(
                f"tables.{name}.vocab_size: hash buckets are for file data; data.kind="
                f"{d.kind!r} sets its own vocabularies"
                + (" (data.max_vocab, data.synthetic_options)" if d.kind == "synthetic" else "")
            )
        if isinstance(tc.cache_rows, float) and (d.kind not in _HASHED_KINDS or d.stream):
            what = "data.stream" if d.stream else f"data.kind={d.kind!r}"
            raise ConfigError(
                f"tables.{name}.cache_rows={tc.cache_rows}: a fraction of the distinct train "
                f"IDs needs file data read into memory ({what}); give a row count (an int)"
            )
    check = sorted(names) if names is not None and "*" in tables else []
    check += [n for n in tables if n not in check]
    feats = _table_options(d.features) if d.kind != "events" else {}
    for name in check:
        tc = resolve_table(tables, name)
        if name == "*":
            continue  # checked in itself; every table it applies to is checked below
        own = tables.get(name) or TableConfig()
        for key, old in (("dim", "dim"), ("vocab_size", "hash_buckets")):
            a, b = getattr(own, key), feats.get(name, {}).get(old)
            if a is not None and b is not None and a != b:
                raise ConfigError(
                    f"tables.{name}.{key}={a} and data.features (table {name!r}) {old}={b} "
                    f"disagree; set it once (tables.{name}.{key})"
                )
        if tc.dynamic and feats.get(name, {}).get("hash_buckets") is not None:
            col = next(
                c
                for c, fc in d.features.items()
                if _table_of(d, c) == name and fc.hash_buckets is not None
            )
            raise ConfigError(
                f"data.features.{col}.hash_buckets: table {name!r} is dynamic (raw IDs as "
                f"keys, no hashing); remove it"
            )


def table_dim(cfg: RunConfig, name: str, data_dim: int | None = None) -> int:
    """Row width of table `name`: `tables.<name>.dim`, else the one its columns set
    (`data.features.<column>.dim`, `data_dim`), else `tables."*".dim`, else
    `model.embedding_dim`."""
    own, star = cfg.tables.get(name), cfg.tables.get("*")
    for v in (own and own.dim, data_dim, star and star.dim):
        if v:
            return v
    return cfg.model.embedding_dim


def _hash_buckets(cfg: RunConfig, name: str, data_buckets: int | None) -> int | None:
    """Hash buckets of static table `name` (`tables.<name>.vocab_size`, else its
    columns' `hash_buckets`, else `tables."*".vocab_size`), or None (`data.id_mapping`)."""
    tc = resolve_table(cfg.tables, name)
    own = cfg.tables.get(name)
    if tc.dynamic:
        return None
    for v in (own and own.vocab_size, data_buckets, tc.vocab_size):
        if v:
            return v
    return None


def is_dynamic(cfg: RunConfig, name: str) -> bool:
    """Whether the `tables` section makes table `name` dynamic."""
    return bool(cfg.tables) and bool(resolve_table(cfg.tables, name).dynamic)


def _table_names_check(cfg: RunConfig, tables: Sequence[TableSpec]) -> None:
    """Every table the `tables` section names exists (the data's own tables)."""
    names = {t.name for t in tables}
    for name in cfg.tables:
        if name != "*" and name not in names:
            raise _unknown_table(name, names)


def _batch_ids(cfg: RunConfig, features: Sequence[FeatureSpec], table: str) -> int:
    """Ids one batch (train or eval) can hold for `table`: a cache this size or the
    table's distinct ids, whichever is fewer, fits every batch."""
    b = max(cfg.data.batch_size, cfg.data.eval_batch_size or 0)
    return sum(f.capacity_for(b) for f in features if f.table == table)


def _distinct(values: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids, their counts) of a table's columns."""
    if not values:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.unique(np.concatenate([np.asarray(v) for v in values]), return_counts=True)


def composed_table(cfg: RunConfig, spec: TableSpec) -> TableSpec:
    """`spec` with `tables.<name>.compose` applied (a ConfigError naming the key when
    its parts would not fit in the full table, or the options are inconsistent)."""
    tc = resolve_table(cfg.tables, spec.name)
    if tc.compose is None or spec.is_tiered:
        return spec
    opts = {k: v for k, v in dataclasses.asdict(tc.compose).items() if v is not None}
    own = cfg.tables.get(spec.name)
    mine = own is not None and own.compose is not None
    try:
        comp = Composition(**opts)
        if not mine:  # from "*": a table it cannot shrink stays whole
            try:
                smaller = stored_values(spec, comp)
            except ValueError:
                return spec
            if smaller >= spec.vocab_size * spec.dim:
                return spec
        return dataclasses.replace(spec, compose=comp)
    except ValueError as e:
        raise ConfigError(f"tables.{spec.name if mine else '*'}.compose: {e}") from None


def tiered_options(
    cfg: RunConfig,
    spec: TableSpec,
    features: Sequence[FeatureSpec],
    *,
    train_ids: Sequence[np.ndarray] | None = None,
    vocab_rows: int | None = None,
    min_count: int = 1,
) -> tuple[TableSpec, str | None]:
    """`spec` (a static table built from the data) with the `tables` section's dynamic
    and cache options applied, and the initializer scale of a tiered table. `train_ids`: the
    table's train ids (after the id mapping; raw keys for a dynamic table) when the data
    is in memory; `vocab_rows`: the rows of the data's static table (generated data).
    Returns (spec, a short note for the run's log or None)."""
    if not cfg.tables:
        return spec, None
    name = spec.name
    tc = resolve_table(cfg.tables, name)
    kw: dict = {}
    if not tc.dynamic and not tc.cache_rows:
        return spec, None
    uniq = counts = None
    if train_ids is not None:
        uniq, counts = _distinct(train_ids)
    n_init = spec.vocab_size
    if tc.dynamic:
        kw["dynamic"] = _dynamic_vocab(tc, name)
        kw["vocab_size"] = None
        if uniq is not None:  # the rows a vocabulary of the train ids would have
            n_init = int(((counts >= min_count) & (uniq != MISSING_KEY)).sum()) + 1
        elif vocab_rows is not None:
            n_init = vocab_rows
        else:
            n_init = tc.max_rows or (tc.cache_rows if isinstance(tc.cache_rows, int) else None)
    note = None
    if tc.cache_rows:
        rows = tc.cache_rows
        if isinstance(rows, float):
            distinct = int(uniq.shape[0])
            rows = max(math.ceil(rows * distinct), min(distinct, _batch_ids(cfg, features, name)))
            rows = max(1, min(rows, tc.max_rows or rows))
            note = f"{name} {rows:,}/{distinct:,}"
        disk_dir = tc.disk_dir
        if disk_dir is None and tc.ram_bytes is not None:
            disk_dir = "host_rows"
        if disk_dir is not None:
            disk_dir = os.path.join(os.path.abspath(cfg.run_dir), disk_dir)
        cache = {"policy": tc.cache_policy, "ram_bytes": tc.ram_bytes, "disk_dir": disk_dir}
        kw["cache"] = HostCache(rows=rows, **{k: v for k, v in cache.items() if v is not None})
        if n_init is None:
            n_init = rows
    if spec.initializer == uniform_init() and n_init:  # the scale of the static table
        kw["initializer"] = uniform_init(math.sqrt(1.0 / n_init))
    try:
        return dataclasses.replace(spec, **kw), note
    except (TypeError, ValueError) as e:
        raise ConfigError(f"tables.{name}: {e}") from None


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


def _read_side_tables(d: DataConfig, main_schema) -> tuple[list[tf.Join], list]:
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
            ex, names = tf.indicator_bag(ex, names, bag, cols)
        source = ", ".join(os.path.basename(f) for f in files)
        try:
            side = tf.SideTable.build(
                ex,
                names,
                j.key,
                columns=j.columns,
                source=source,
                dense_missing=side_schema.dense_missing,
            )
        except ValueError as e:
            raise ValueError(f"{key} ({files[0]}): {e}") from None
        joins.append(tf.Join(side=side, on_missing=j.on_missing, label=f"join {source}"))
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


# ---------------------------------------------------------------------------------------
# Many processes: each packs its share of every global batch


def _rows(col, lo: int, hi: int):
    """Rows [lo, hi) of one feature of a host batch (`JaggedIds` or ids[B] / ids[B, k])."""
    if not isinstance(col, sd.JaggedIds):
        return np.asarray(col)[lo:hi]
    lengths = np.asarray(col.lengths)
    off = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=off[1:])
    a, b = int(off[lo]), int(off[hi])
    weights = None if col.weights is None else np.asarray(col.weights)[a:b]
    return sd.JaggedIds(lengths=lengths[lo:hi], values=np.asarray(col.values)[a:b], weights=weights)


class ProcessSharePacker:
    """A `BatchPacker` of the global batch that packs process `rank`'s share of it.

    `batch_size` is the global batch size B, so a `Loader` (or `pack_examples`) reads
    exactly the examples one process would; `pack` keeps rows `[rank * B / P,
    (rank + 1) * B / P)` of them and packs those into a batch of B / P. Put side by
    side in process order, the P shares are the single-process batch, padding included
    (a short last batch leaves the high processes' rows padded). Every other attribute
    is the global packer's.
    """

    def __init__(self, packer: BatchPacker, rank: int, num_processes: int):
        if packer.batch_size % num_processes:
            raise ValueError(
                f"a batch of {packer.batch_size} does not split over {num_processes} processes"
            )
        self.whole = packer
        self.rank, self.num_processes = rank, num_processes
        self.local = copy.copy(packer)
        self.local.batch_size = packer.batch_size // num_processes

    @property
    def batch_size(self) -> int:
        return self.whole.batch_size

    def __getattr__(self, name: str):
        return getattr(self.whole, name)

    def pack(self, sparse, *, labels, dense=None, mask=None, first_example: int = 0):
        b = self.local.batch_size
        n = int(np.shape(labels)[0])
        lo, hi = min(self.rank * b, n), min((self.rank + 1) * b, n)
        return self.local.pack(
            {k: _rows(v, lo, hi) for k, v in sparse.items()},
            labels=np.asarray(labels)[lo:hi],
            dense=None if dense is None else np.asarray(dense)[lo:hi],
            mask=None if mask is None else np.asarray(mask)[lo:hi],
            first_example=first_example + lo,
        )


def process_share() -> tuple[int, int, int]:
    """(this process's index, processes, local devices) of the job (1 process: (0, 1, n))."""
    import jax

    return jax.process_index(), jax.process_count(), jax.local_device_count()


def _packers(
    d: DataConfig, tables, features, *, num_dense: int = 0, sharded_source: bool = False
) -> tuple[Any, Any]:
    """(train packer, eval packer). In many processes they pack this process's share of
    each global batch (`ProcessSharePacker`); `data.batch_size` and
    `data.eval_batch_size` stay global and must divide by processes x local devices.
    `sharded_source`: the train source already gives each process its own examples
    (`FileSource(rank=...)`): its packer takes B / P of them."""
    eval_b = d.eval_batch_size or d.batch_size
    rank, count, local = process_share()
    if count > 1:
        for key, b in (("data.batch_size", d.batch_size), ("data.eval_batch_size", eval_b)):
            if b % (count * local):
                raise ConfigError(
                    f"{key}={b} (the global batch) does not divide over {count} processes x "
                    f"{local} devices = {count * local}; use a multiple of {count * local}"
                )
    packer = BatchPacker(tables, features, batch_size=d.batch_size, num_dense=num_dense)
    eval_packer = BatchPacker(tables, features, batch_size=eval_b, num_dense=num_dense)
    if count == 1:
        return packer, eval_packer
    eval_packer = ProcessSharePacker(eval_packer, rank, count)
    if sharded_source:
        packer = ProcessSharePacker(packer, rank, count).local
    else:
        packer = ProcessSharePacker(packer, rank, count)
    return packer, eval_packer


# ---------------------------------------------------------------------------------------
# The data bundle


@dataclasses.dataclass
class DataBundle:
    """What a run trains and evaluates on."""

    tables: tuple[TableSpec, ...]
    features: tuple[FeatureSpec, ...]
    packer: BatchPacker
    train_source: Any  # Examples or a generator with batch(index, batch_size)
    eval_batches: list[SparseBatch]
    report: str | None = None  # parse summary of file data
    test_batches: list[SparseBatch] | None = None
    """The test split's batches (file data with a test split), never used in training."""
    eval_examples: Examples | None = None
    """File data: the eval split's examples (ids mapped), in batch order."""
    test_examples: Examples | None = None
    mappings: dict | None = None
    """File data: the id mapping of each sparse feature (shared by a table's features)."""
    transform: Any = None
    """File data: the `sparsejax.data.ColumnTransform` applied to raw rows (for readers
    that stream chunks)."""
    ranking: dict | None = None
    """kind=events: the candidate sets (`sparsejax.data.CandidateSets`) of the "eval" and
    "test" splits (held-out item + `eval_negatives` per user), for HR@k / NDCG@k
    (`sparsejax.train.evaluate_ranking` with `packer`); `eval_batches` hold the eval
    sets' rows as binary examples (AUC, logloss)."""
    sequences: Any = None
    """kind=events: the `sparsejax.data.SequenceData` (id maps, report)."""

    @property
    def steps_per_epoch(self) -> int | None:
        if isinstance(self.train_source, Examples):
            return math.ceil(len(self.train_source) / self.packer.batch_size)
        return None


def build_data(cfg: RunConfig) -> DataBundle:
    """Read or generate the data and derive the table and feature specs from it."""
    d, dim = cfg.data, cfg.model.embedding_dim
    table_kw = dict(dtype=cfg.model.table_dtype, optimizer=sparse_optimizer(cfg.optimizer))
    eval_b = d.eval_batch_size or d.batch_size
    if d.kind not in FILE_KINDS:
        if d.kind == "synthetic":
            gen = sd.SyntheticCriteo(
                max_vocab=d.max_vocab, zipf_exponent=d.zipf, seed=cfg.seed, **d.synthetic_options
            )
            num_dense = gen.num_dense
        else:
            gen = sd.SyntheticBehavior(seed=cfg.seed, **d.synthetic_options)
            num_dense = 0
        tables, features = gen.specs(dim=dim, **table_kw)
        tables = [_with_dim(cfg, t) for t in tables]
        tables, note = apply_tables(cfg, tables, features, vocab_rows=getattr(gen, "vocab", None))
        packer, eval_packer = _packers(d, tables, features, num_dense=num_dense)
        eval_batches = []
        for i in range(d.eval_batches):  # numbered from 2**31 - 1 down: never trained on
            sparse, labels, dense = gen.batch(0x7FFFFFFF - i, eval_b)
            eval_batches.append(eval_packer.pack(sparse, labels=labels, dense=dense))
        return DataBundle(tuple(tables), tuple(features), packer, gen, eval_batches, report=note)
    if d.kind == "events":
        return _build_events(cfg, table_kw)
    return _build_file_data(cfg, table_kw)


def _build_events(cfg: RunConfig, table_kw: dict) -> DataBundle:
    """kind=events: the log read and made into sequence examples (`load_sequences`):
    train examples (positives and sampled negatives with their histories), eval and test
    candidate sets; tables user and item, the history reading the item table."""
    d = cfg.data
    _, count, _ = process_share()
    if count > 1:  # score_candidates reads whole eval outputs on the host
        raise ConfigError(
            f"data.kind='events' (HR@k/NDCG@k over candidate sets) trains in one process, "
            f"not {count}; use sparsejax train"
        )
    key = "data.train" if d.train is not None else "data.path"
    source = d.train if d.train is not None else d.path
    if source is None:
        raise ConfigError("data.kind='events' needs data.train (the event log)")
    files = resolve_files(source, key)
    seq, rep = sd.load_sequences(files, d.events, strict=d.strict)
    dims = _table_options(
        {
            c: fc if c != "history" else dataclasses.replace(fc, table="item")
            for c, fc in d.features.items()
        }
    )
    tables, features = seq.specs(dim=cfg.model.embedding_dim, **table_kw)
    tables = [_with_dim(cfg, t, dims.get(t.name, {}).get("dim")) for t in tables]
    _table_names_check(cfg, tables)
    packer, eval_packer = _packers(d, tables, features)
    sets = {"eval": seq.valid, "test": seq.test}
    if cfg.eval_users is not None and seq.valid is not None:  # a sample of the eval users
        sets["eval"] = seq.valid.sample(cfg.eval_users, seed=cfg.seed)
    examples = {k: None if v is None else v.to_examples() for k, v in sets.items()}
    if examples["eval"] is None or len(examples["eval"]) == 0:
        raise ConfigError(
            "data.events gives no validation users (split: time needs valid_time); the run "
            f"evaluates on them: {seq.report.summary()}"
        )
    return DataBundle(
        tuple(tables),
        tuple(features),
        packer,
        seq.train,
        sd.pack_examples(examples["eval"], eval_packer),
        report=f"{rep.summary()}; {seq.report.summary()}",
        test_batches=None
        if examples["test"] is None
        else sd.pack_examples(examples["test"], eval_packer),
        eval_examples=examples["eval"],
        test_examples=examples["test"],
        ranking={k: v for k, v in sets.items() if v is not None},
        sequences=seq,
    )


def _build_file_data(cfg: RunConfig, table_kw: dict) -> DataBundle:
    d = cfg.data
    schema, drop = _read_schema(d)
    main_schema = _schema_or_error(d.schema, "data.schema") if d.schema is not None else None
    joins, side_reports = _read_side_tables(d, main_schema)
    if d.stream:
        return _build_stream(cfg, table_kw, schema, drop, joins, side_reports)
    splits = _read_splits(cfg, schema, drop)
    caps = {c: fc.max_ids for c, fc in d.features.items() if fc.max_ids is not None}
    transform = tf.ColumnTransform(
        splits.dense_names,
        indicator_bags=d.indicator_bags,
        joins=joins,
        drop=drop,
        max_ids=caps,
    )
    parts = {"train": splits.train, "eval": splits.eval, "test": splits.test}
    try:
        parts = {k: None if v is None else transform(v) for k, v in parts.items()}
    except tf.JoinKeyError as e:
        text = _key_text(d, schema, e.key, e.raw_key) if schema is not None else e.raw_key
        raise tf.JoinKeyError(
            f"data.joins: {e.source} has no row with {e.key} = {text} (on_missing: error;"
            f" on_missing: default gives such rows the missing-id row)",
            source=e.source,
            key=e.key,
            raw_key=e.raw_key,
            row=e.row,
        ) from None
    train = parts["train"]
    for col in d.features:
        if col not in train.sparse:
            raise _unknown(f"data.features.{col}", col, train.sparse)
    mappings = _id_mappings(cfg, train)
    mapped = {k: None if v is None else v.map_ids(mappings) for k, v in parts.items()}
    present = [v for v in mapped.values() if v is not None]
    tables, features, note = _file_specs(cfg, mapped["train"], present, mappings, table_kw)
    num_dense = mapped["train"].num_dense
    packer, eval_packer = _packers(d, tables, features, num_dense=num_dense)
    reports = [r.summary() for r in (*splits.reports, *side_reports)]
    if transform.report.summary():
        reports.append(transform.report.summary())
    if note:
        reports.append(note)
    sizes = f"splits: train {len(mapped['train']):,}, eval {len(mapped['eval']):,}" + (
        f", test {len(mapped['test']):,}" if mapped["test"] is not None else ""
    )
    return DataBundle(
        tuple(tables),
        tuple(features),
        packer,
        mapped["train"],
        sd.pack_examples(mapped["eval"], eval_packer),
        report="; ".join([*reports, sizes]),
        test_batches=None
        if mapped["test"] is None
        else sd.pack_examples(mapped["test"], eval_packer),
        eval_examples=mapped["eval"],
        test_examples=mapped["test"],
        mappings=mappings,
        transform=transform,
    )


def _build_stream(cfg: RunConfig, table_kw: dict, schema, drop, joins, side_reports):
    """data.stream: the eval (and test) files in memory, the train files a
    `sparsejax.data.FileSource` whose chunks get the column transforms and the hash
    mappings in the loader's thread. A bag's `max_ids` defaults to the longest in the
    eval split; longer train rows keep their last ids, counted in `transform.report`."""
    import jax

    d = cfg.data
    source = d.train if d.train is not None else d.path
    key = "data.train" if d.train is not None else "data.path"
    if source is None:
        raise ConfigError(f"data.kind={d.kind!r} needs data.train (the files to stream)")
    train_files = resolve_files(source, key)
    label = _label_rule(d)
    eval_files = resolve_files(d.eval, "data.eval")
    ev, reports = _read_split(d, eval_files, schema, label, "data.eval", train_files)
    test = None
    if d.test is not None:
        test_files = resolve_files(d.test, "data.test")
        test, r = _read_split(d, test_files, schema, label, "data.test", train_files)
        reports += r
    dense_names = _dense_names(d, schema, ev)
    plain = tf.ColumnTransform(dense_names, indicator_bags=d.indicator_bags, joins=joins, drop=drop)
    held = [plain(ev)] + ([] if test is None else [plain(test)])
    roles = _roles(d)
    caps = {}
    for name in held[0].feature_names:
        fc = d.features.get(name) or FeatureConfig()
        longest = max(int(np.max(p.sparse[name].lengths, initial=1)) for p in held)
        if fc.max_ids is not None or roles.get(name, "bag" if longest > 1 else "one") != "one":
            caps[name] = fc.max_ids or longest
    transform = tf.ColumnTransform(
        dense_names, indicator_bags=d.indicator_bags, joins=joins, drop=drop, max_ids=caps
    )
    mappings = _id_mappings(cfg, held[0])
    parts = [transform(p).map_ids(mappings) for p in (ev, *([] if test is None else [test]))]

    def chunk(ex: Examples) -> Examples:
        return transform(ex).map_ids(mappings)

    kw = {"schema": schema, "label": label, "strict": d.strict, "key": key}
    if d.field_map:
        kw["field_map"] = dict(d.field_map)
    train_source = sd.FileSource(
        train_files,
        format=d.kind,
        transform=chunk,
        rank=jax.process_index(),
        num_processes=jax.process_count(),
        **kw,
    )
    tables, features, note = _file_specs(
        cfg, parts[0], parts, mappings, table_kw, max_ids=caps, train_known=False
    )
    num_dense = parts[0].num_dense
    packer, eval_packer = _packers(d, tables, features, num_dense=num_dense, sharded_source=True)
    summaries = [r.summary() for r in (*reports, *side_reports)]
    summaries.append(f"train: streaming {train_source!r}")
    if note:
        summaries.append(note)
    return DataBundle(
        tuple(tables),
        tuple(features),
        packer,
        train_source,
        sd.pack_examples(parts[0], eval_packer),
        report="; ".join(summaries),
        test_batches=None if test is None else sd.pack_examples(parts[1], eval_packer),
        eval_examples=parts[0],
        test_examples=None if test is None else parts[1],
        mappings=mappings,
        transform=transform,
    )


def _table_of(d: DataConfig, name: str) -> str:
    fc = d.features.get(name)
    return fc.table if fc is not None and fc.table else name


def _id_mappings(cfg: RunConfig, train: Examples) -> dict:
    """One id mapping per table, fitted on the train values of all its columns: raw
    keys for a dynamic table, hash buckets or a vocabulary for a static one."""
    d = cfg.data
    opts = _table_options(d.features)
    by_table: dict[str, list[str]] = {}
    for name in train.feature_names:
        by_table.setdefault(_table_of(d, name), []).append(name)
    mappings = {}
    for table, cols in by_table.items():
        o = opts.get(table, {})
        buckets = _hash_buckets(cfg, table, o.get("hash_buckets"))
        if is_dynamic(cfg, table):
            m = sd.RawIdMapping()
        elif buckets is not None or d.id_mapping == "hash":
            m = sd.HashMapping(buckets=buckets or d.hash_buckets)
        else:
            values = np.concatenate([np.asarray(train.sparse[c].values) for c in cols])
            m = sd.VocabMapping.fit(values, o.get("min_count") or d.min_count)
        for c in cols:
            mappings[c] = m
    return mappings


def _roles(d: DataConfig) -> dict[str, str]:
    """Role of each named sparse column: "one", "bag" or "sequence"."""
    roles = {}
    schemas = [d.schema] + [j.schema for j in d.joins]
    for s in schemas:
        if not s:
            continue
        for c in s.get("categorical", ()):
            roles[c] = "one"
        for c in s.get("multi_hot", ()):
            roles[c] = "bag"
        for c in s.get("sequence", ()):
            roles[c] = "sequence"
    for bag in d.indicator_bags:
        roles[bag] = "bag"
    for j in d.joins:
        for bag in j.indicator_bags:
            roles[bag] = "bag"
    return roles


def _file_specs(
    cfg: RunConfig,
    train: Examples,
    parts: list[Examples],
    mappings,
    table_kw,
    max_ids=None,
    *,
    train_known: bool = True,
):
    """One table per table name (a column's own, or the one it shares) and one feature
    per sparse column: one-id columns as they are, bags mean-pooled (weighted bags
    summed), sequences unpooled (or as `data.features` says), each bag sized by its
    `max_ids` or the longest in the data; the `tables` section applied (`apply_tables`;
    `train` holds the train split's mapped ids when `train_known`). Returns (tables,
    features, a note for the run's log or None)."""
    d = cfg.data
    opts = _table_options(d.features)
    roles = _roles(d)
    tables: dict[str, TableSpec] = {}
    features = []
    for name in train.feature_names:
        t = _table_of(d, name)
        if t not in tables:
            vocab = mappings[name].vocab_size
            tables[t] = TableSpec(
                name=t,
                vocab_size=1 if vocab is None else int(vocab),  # dynamic: apply_tables
                dim=table_dim(cfg, t, opts.get(t, {}).get("dim")),
                **table_kw,
            )
        fc = d.features.get(name) or FeatureConfig()
        longest = max(int(np.max(p.sparse[name].lengths, initial=1)) for p in parts)
        weighted = train.sparse[name].weights is not None
        role = roles.get(name) or ("one" if longest <= 1 else "bag")
        # a weighted bag (libSVM idx:val) is summed: the weights carry the values
        combiner = {"one": "sum", "bag": "sum" if weighted else "mean", "sequence": None}[role]
        if fc.combiner is not None:
            combiner = None if fc.combiner == "sequence" else fc.combiner
        cap = fc.max_ids or (max_ids or {}).get(name)
        max_ids_ = cap or max(longest, 1)
        features.append(
            FeatureSpec(name=name, table=t, combiner=combiner, max_ids=max_ids_, weighted=weighted)
        )
    min_counts = {t: opts.get(t, {}).get("min_count") or d.min_count for t in tables}
    specs, note = apply_tables(
        cfg,
        list(tables.values()),
        features,
        train=train if train_known else None,
        min_counts=min_counts,
    )
    return specs, features, note


def _with_dim(cfg: RunConfig, spec: TableSpec, data_dim: int | None = None) -> TableSpec:
    dim = table_dim(cfg, spec.name, data_dim)
    return spec if dim == spec.dim else dataclasses.replace(spec, dim=dim)


def mixed_dims(cfg: RunConfig, tables: Sequence[TableSpec]) -> list[TableSpec]:
    """`tables` with `model.mixed_dims.alpha` applied: each static table without a dim
    of its own (`tables.<name>.dim`, `data.features.<column>.dim`) gets
    `embedding_dim * (V_min / V) ** alpha`, a multiple of `multiple` within
    [`min_dim`, `embedding_dim`]."""
    md = cfg.model.mixed_dims
    if md is None or md.alpha is None:
        return list(tables)
    d = cfg.model.embedding_dim
    own = {n for n, tc in cfg.tables.items() if tc.dim is not None}
    sized = {t.name for t in tables if t.vocab_size is not None and t.dim == d} - own
    if not sized:
        return list(tables)
    v_min = min(t.vocab_size for t in tables if t.vocab_size is not None)
    out = []
    for t in tables:
        if t.name in sized:
            dim = d * (v_min / t.vocab_size) ** md.alpha
            dim = md.multiple * math.ceil(dim / md.multiple)
            t = dataclasses.replace(t, dim=int(min(d, max(md.min_dim, dim))))
        out.append(t)
    return out


def apply_tables(
    cfg: RunConfig,
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    *,
    train: Examples | None = None,
    vocab_rows: Mapping[str, int] | None = None,
    min_counts: Mapping[str, int] | None = None,
) -> tuple[list[TableSpec], str | None]:
    """The data's table specs with the `tables` section's dynamic and cache options
    (`tiered_options`): `train` holds the train split's mapped ids (file data in memory),
    `vocab_rows` the generator's rows per table. Returns (tables, a note for the run's
    log: the tiered tables and their cache rows, or None)."""
    tables = mixed_dims(cfg, tables)
    if not cfg.tables:
        return list(tables), None
    _table_names_check(cfg, tables)
    cols: dict[str, list[str]] = {}
    for f in features:
        cols.setdefault(f.table, []).append(f.name)
    out, notes, dynamic, cached = [], [], 0, 0
    for t in tables:
        t = composed_table(cfg, t)
        ids = None if train is None else [train.sparse[c].values for c in cols.get(t.name, ())]
        spec, note = tiered_options(
            cfg,
            t,
            features,
            train_ids=ids,
            vocab_rows=None if vocab_rows is None else vocab_rows.get(t.name),
            min_count=(min_counts or {}).get(t.name, 1),
        )
        out.append(spec)
        dynamic += spec.dynamic is not None
        cached += spec.cache is not None
        if note:
            notes.append(note)
    lines = []
    composed = [t for t in out if t.compose is not None]
    if composed:
        full = sum(t.vocab_size * t.dim for t in out if not t.is_tiered)
        stored = sum(stored_values(t) for t in out if not t.is_tiered)
        kinds = ", ".join(sorted({t.compose.kind for t in composed}))
        lines.append(
            f"tables: {len(composed)} composed ({kinds}): static tables store {stored:,} "
            f"values, {100 * stored / full:.1f}% of {full:,} whole"
        )
    if dynamic or cached:
        text = f"tables: {dynamic} dynamic, {cached} with a device cache"
        if notes:
            text += " (cache rows/distinct train ids: " + ", ".join(notes) + ")"
        lines.append(text)
    return out, "; ".join(lines) or None


_STACKED_MODELS = ("dlrm", "deepfm", "wide_deep", "dcnv2")
"""Models that stack the pooled embeddings (`[B, F, D]`): one dim for every table."""


def build_model(cfg: RunConfig, tables: Sequence[TableSpec], features: Sequence[FeatureSpec]):
    """The configured Flax model over the given specs."""
    m = cfg.model
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in m.options.items()}
    if m.name in _STACKED_MODELS:
        dims = {t.name: t.dim for t in tables}
        pooled = {f.table for f in features if not f.is_sequence}
        odd = sorted(t for t in pooled if dims[t] != m.embedding_dim)
        if odd and m.mixed_dims is None:
            raise ConfigError(
                f"model.name={m.name!r} stacks the embeddings, so every table needs dim "
                f"model.embedding_dim={m.embedding_dim}, but table {odd[0]!r} has dim "
                f"{dims[odd[0]]} (data.features.*.dim); set model.mixed_dims to project "
                f"it (din and two_tower take mixed dims as they are)"
            )
        if m.mixed_dims is not None:
            opts["embedding_dim"] = m.embedding_dim
    cls = MODELS[m.name]
    if m.name == "dlrm" and "bottom" not in opts:  # as _schema.OPTION_DEFAULTS says
        opts["bottom"] = (64, m.embedding_dim)
    dtype = None if m.dtype == "float32" else m.dtype
    return cls(
        tables=tuple(tables),
        features=tuple(features),
        dtype=dtype,
        implementation=m.implementation,
        **opts,
    )


def model_warnings(cfg: RunConfig, data: DataBundle) -> list[str]:
    """Options the configured model will ignore on `data` (one line each, for the log):
    DLRM's `bottom` MLP reads the dense features, so without any it is unused."""
    bottom = cfg.model.options.get("bottom")
    if cfg.model.name == "dlrm" and bottom is not None and data.packer.num_dense == 0:
        return [
            f"model.options.bottom={list(bottom)} is ignored: the data has no dense "
            f"columns, which DLRM's bottom MLP reads (the top MLP takes the embeddings' "
            f"dot products alone, or the one embedding itself)"
        ]
    return []


def first_train_batch(data: DataBundle) -> SparseBatch:
    """The first training batch, in order (fixes the shapes of a model's init)."""
    with Loader(
        data.train_source,
        data.packer,
        shuffle=False,
        epochs=None if not isinstance(data.train_source, Examples) else 1,
        prefetch=1,
    ) as loader:
        return next(iter(loader))
