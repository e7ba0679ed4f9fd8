"""The `data` section of a run's config (`DataConfig` and its parts) and its checks.

`check_data_config` validates a `DataConfig` when it is built (at config load, before any
data is read): every problem is one line naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Literal

from .. import data as sd
from ..data import SequenceConfig, SyntheticBehavior, SyntheticCriteo
from ._config import ConfigError, from_dict
from ._options import check_range, typed_options

DATA_DIR_ENV = "SPARSEJAX_DATA_DIR"
"""Environment variable: where relative `data.path` values are looked up after the
working directory."""


FILE_KINDS = ("criteo", "delimited", "libsvm", "parquet", "events")
"""Kinds read from files (the others generate their data)."""


_SCHEMA_KINDS = ("delimited", "parquet")
"""Kinds whose columns a `data.schema` names."""


GENERATORS = {
    "synthetic": (SyntheticCriteo, {"seed", "max_vocab", "zipf_exponent"}),
    "behavior": (SyntheticBehavior, {"seed"}),
}
"""data.kind -> its generator and the fields the runner sets (`seed`; `data.max_vocab`,
`data.zipf`): `data.synthetic_options` sets the others."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitConfig:
    """How one source (`data.train` or `data.path`) splits into train, eval (model
    selection) and, optionally, test. The parts are taken in this order: train, then
    eval, then the rest (test); `eval: null` gives all the rest to eval (no test)."""

    by: Literal["rows", "fraction", "random", "time"] = "fraction"
    """rows: the first `train` rows train; fraction: the first `train` share of the rows;
    random: a random `train` share (rows shuffled with `seed`, each part kept in file
    order); time: rows whose `column` < `train` train."""
    train: int | float = 0.8
    """A row count (rows), a share in (0, 1) (fraction, random) or a time (time)."""
    eval: int | float | None = None
    """The eval part after train: the next `eval` rows (rows), the next `eval` share
    (fraction, random), or the rows with `train` <= `column` < `eval` (time). The rest
    is the test split. None: all the rest evaluates and there is no test split."""
    column: str | None = None
    """time: the time column (delimited/parquet), a number read as float32: a time
    within one float32 step of a threshold (128 s for epoch seconds) counts as equal to
    it, and falls after it."""
    seed: int | None = None
    """random: the shuffle's seed (default: the run's `seed`)."""

    def __post_init__(self):
        check_range("data.split.seed", self.seed, ">=0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LabelConfig:
    """How a file's label becomes the 0/1 (or [0, 1]) training target; a label outside
    the allowed set stops the read with an error naming the file, line and value."""

    column: str | None = None
    """delimited/parquet: the label column (default: `schema.label`)."""
    map: dict = dataclasses.field(default_factory=dict)
    """Value -> value, applied first, e.g. `{-1: 0}` for libFM's -1/1 labels."""
    threshold: float | None = None
    """label = 1 if value >= threshold else 0 (e.g. 4 for "rating >= 4")."""
    check: Literal["binary", "unit", "none"] = "binary"
    """binary: labels must be 0 or 1; unit: in [0, 1]; none: no check."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureConfig:
    """Options of one sparse column (`data.features.<column>`); unset fields keep the
    data-wide defaults."""

    dim: int | None = None
    """Embedding dim of the column's table (default `model.embedding_dim`)."""
    max_ids: int | None = None
    """Ids kept per example: a longer history or bag keeps its last `max_ids` ids (the
    rows cut are counted in the parse report). Default: the longest in the data."""
    min_count: int | None = None
    """vocab: values seen fewer times in train share row 0 (default `data.min_count`)."""
    hash_buckets: int | None = None
    """Hash this column into that many rows instead of a vocabulary."""
    table: str | None = None
    """Table the column reads (default: its own, named after it). Columns naming one
    table share its rows and id mapping, e.g. `history: {table: item}` for DIN."""
    combiner: Literal["sum", "mean", "sqrtn", "max", "sequence"] | None = None
    """Pooling of the column's ids; "sequence" keeps them unpooled (DIN's history).
    Default: one id as is, bags "mean", schema `sequence` columns "sequence"."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JoinConfig:
    """A side table (user or item features) joined to every row by a key column."""

    path: str | tuple[str, ...]
    """The side table's file (path, glob or list), looked up like `data.path`."""
    key: str
    """Key column, in the data and in the side table (one row per key)."""
    schema: dict
    """The side table's columns (a `sparsejax.data.TableSchema`, no label); its
    categorical, multi_hot, sequence and dense columns are attached to each row.
    `int_ids` defaults to the data's."""
    columns: tuple[str, ...] | None = None
    """Attach only these columns (default: every column the schema reads but the key)."""
    indicator_bags: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Like `data.indicator_bags`, over the side table's columns."""
    on_missing: Literal["default", "error"] = "default"
    """A key the side table lacks: "default" attaches the missing-id row (counted in the
    parse report); "error" stops naming the file, key column and value."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the examples come from and how they become batches. File data takes its
    splits from `train` / `eval` / `test` (each a path, a glob or a list of files), or
    from one source (`train` or `path`) and a `split` rule."""

    kind: Literal[
        "synthetic", "criteo", "delimited", "libsvm", "parquet", "events", "behavior", "prepared"
    ] = "synthetic"
    """synthetic: Criteo-shaped Zipf data, no download; criteo: Kaggle DAC TSV files;
    delimited: any CSV/TSV described by `schema`; libsvm: libSVM/libFM text
    (`label idx:val ...`); parquet: Parquet files described by `schema`; events: a
    (user, item, time) event log made into sequence examples as `events` says (DIN,
    two-tower); behavior: synthetic user histories (for DIN and two-tower); prepared:
    the directory `path` that `sparsejax data CONFIG --out DIR` wrote (any of the
    others' data as table rows in memory-mapped columns: the fastest input)."""
    path: str | None = None
    """Data file (one source, split by `split` or `train_rows`); `train` says the same
    and also takes globs and lists. A relative path is looked up in the working
    directory, then in `$SPARSEJAX_DATA_DIR` (e.g. the folder holding the Criteo sample;
    docs/data.md says where to download it)."""
    train: str | tuple[str, ...] | None = None
    """Training files: a path, a glob (`day_*.csv`) or a list; with a headed CSV, only
    the first file needs the header. Without `eval`, `split` divides them."""
    eval: str | tuple[str, ...] | None = None
    """Eval (model selection) files; evaluated during training."""
    test: str | tuple[str, ...] | None = None
    """Test files, kept apart from model selection (`sparsejax eval` on the test split)."""
    eval_header: bool | None = None
    """delimited: whether the eval files start with a header line, when it differs from
    the train files (`schema.header`): false reads line 1 as data, the columns named by
    `schema.columns` or else the train files' header; true reads line 1 as the eval
    files' own header. null: with headed train files, line 1 is a header when it equals
    the train header or looks like one (shares a column name with it, or holds no
    number), else data; with header-less train files, data."""
    test_header: bool | None = None
    """delimited: as `eval_header`, for the `test` files."""
    split: SplitConfig | None = None
    """How one source splits (default: the first 80% train, the rest evaluates)."""
    batch_size: int = 1024
    eval_batch_size: int | None = None
    """Default: batch_size."""
    train_rows: int | None = None
    """Old form of `split: {by: rows, train: N}`: the first `train_rows` rows train."""
    label: LabelConfig | None = None
    """Label column, value map, threshold and check (default: 0/1 labels as read)."""
    features: dict[str, FeatureConfig] = dataclasses.field(default_factory=dict)
    """Per sparse column options: `{column: {dim, max_ids, min_count, hash_buckets,
    table, combiner}}` (see `FeatureConfig`)."""
    joins: tuple[JoinConfig, ...] = ()
    """Side tables joined by a key column (see `JoinConfig`)."""
    indicator_bags: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """One multi-hot bag from 0/1 columns: `{bag: [column, ...]}`, e.g. MovieLens's
    genre columns -> `genres`; the bag holds the index of each nonzero column."""
    id_mapping: Literal["vocab", "hash"] = "vocab"
    """File data: "vocab" gives each value seen >= min_count times in train its own row
    (others share row 0); "hash" maps raw ids into hash_buckets rows (row 0: a missing,
    i.e. empty, value; the others 1 + id % (hash_buckets - 1))."""
    min_count: int = 1
    hash_buckets: int = 1_000_000
    strict: bool = False
    """Fail on the first malformed line instead of counting and skipping it."""
    schema: dict | None = None
    """delimited/parquet: the column schema (see "`data.schema` (TableSchema)")."""
    field_map: dict = dataclasses.field(default_factory=dict)
    """libsvm: field-aware features, `{libFM field id or "lo-hi" index range: feature}`;
    default: all of a line's `idx:val` pairs form one weighted bag, `features`."""
    events: SequenceConfig | None = None
    """events: the log's columns, the histories (`history_length`), the split
    (leave_last_out or time), train negatives and the eval candidate sets (held-out item
    + `eval_negatives`); see `sparsejax.data.SequenceConfig`."""
    max_vocab: int = 100_000
    """synthetic: table sizes follow the Criteo Kaggle cardinalities capped at this."""
    zipf: float = 1.1
    """synthetic: Zipf exponent of the ids."""
    synthetic_options: dict = dataclasses.field(default_factory=dict)
    """Other options of the generator (`SyntheticCriteo` for synthetic, `SyntheticBehavior`
    for behavior: num_users, num_items, max_history, ...; see "`data.synthetic_options`
    by `data.kind`")."""
    eval_batches: int = 8
    """synthetic/behavior: batches in the held-out eval set."""
    shuffle: bool = True
    prefetch: int = 4
    workers: int = 1
    """Threads that make the train batches (generated, in-memory or prepared data; a
    stream is read by one): more where one host thread cannot keep up with the device.
    The batches are the same for any count."""
    stream: bool = False
    """File data: read the train files chunk by chunk while training, in the loader's
    background thread (files larger than memory train with bounded memory; each process
    reads its share). Needs `eval` files (a stream is not split), `id_mapping: hash`, and
    `steps` (a stream's length is unknown); bags keep at most their `max_ids` (default:
    the longest in the eval split) ids, the rows cut counted."""
    shuffle_buffer: int = 1 << 16
    """stream: rows shuffled together (a window of whole chunks); bounds the memory."""

    def __post_init__(self):
        check_range("data.zipf", self.zipf, ">0")
        check_data_config(self)


# ---------------------------------------------------------------------------------------
# Checks (run by DataConfig.__post_init__)


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

    for f in ("batch_size", "eval_batches", "min_count", "max_vocab", "prefetch", "workers"):
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
    if d.kind == "prepared":
        others = [k for k in file_keys + file_opts if k != "path"]
        if d.path is None or others:
            raise ConfigError(
                "data.kind='prepared' reads one directory, data.path (written by `sparsejax "
                "data`)"
                + (f"; data.{others[0]} is for the data it was prepared from" if others else "")
            )
        return
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


def _table_of(d: DataConfig, name: str) -> str:
    fc = d.features.get(name)
    return fc.table if fc is not None and fc.table else name


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
