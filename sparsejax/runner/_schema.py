"""The schema of a run's config: `RunConfig` and its sections, each field documented.

`load_config` layers YAML files and `key=value` overrides into a validated `RunConfig`
(see `_config.py`); an unknown key is an error naming the closest valid one, and the
model and optimizer options are checked against the classes they configure.

Data files: a relative `data.path` is looked up in the working directory, then in the
directory named by the environment variable `SPARSEJAX_DATA_DIR` (the configs for the
shipped Criteo sample give its path relative to that directory; e.g. run
`SPARSEJAX_DATA_DIR=/path/to/data sparsejax train configs/dlrm_criteo.yaml`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from ..data import SequenceConfig, SyntheticBehavior, SyntheticCriteo, TableSchema
from ..embedding import constant_init, normal_init, truncated_normal_init, uniform_init
from ..nn import MODELS
from ..ops import optimizers as sparse_optimizers
from ..train._schedules import Schedule
from ._config import (
    ConfigError,
    convert,
    field_lines,
    from_dict,
    inspect_doc,
    layered,
    unknown_key_error,
)

DATA_DIR_ENV = "SPARSEJAX_DATA_DIR"
"""Environment variable: where relative `data.path` values are looked up after the
working directory."""


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

    kind: Literal["synthetic", "criteo", "delimited", "libsvm", "parquet", "events", "behavior"] = (
        "synthetic"
    )
    """synthetic: Criteo-shaped Zipf data, no download; criteo: Kaggle DAC TSV files;
    delimited: any CSV/TSV described by `schema`; libsvm: libSVM/libFM text
    (`label idx:val ...`); parquet: Parquet files described by `schema`; events: a
    (user, item, time) event log made into sequence examples as `events` says (DIN,
    two-tower); behavior: synthetic user histories (for DIN and two-tower)."""
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
        from ._build import check_data_config  # the checks live with the code they guard

        check_data_config(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingInitConfig:
    """How the embedding tables start (`model.embedding_init`); every table of the model,
    the first-order (linear) tables of DeepFM and Wide & Deep included."""

    kind: Literal["uniform", "normal", "truncated_normal", "zeros"] = "uniform"
    """uniform: U(-scale, scale); normal: N(0, stddev^2); truncated_normal: N(0,
    stddev^2) redrawn beyond 2 stddev (TensorFlow's truncated_normal); zeros."""
    scale: float | None = None
    """uniform: the bound; null: sqrt(1 / vocab_size) per table (TorchRec's default)."""
    stddev: float | None = None
    """normal, truncated_normal: the standard deviation; null: 1 / sqrt(dim) (TensorFlow's
    embedding_column default)."""

    def __post_init__(self):
        if self.scale is not None and (self.kind != "uniform" or not self.scale > 0):
            raise ValueError(f"`scale` must be > 0 and needs kind uniform, got {self.scale!r}")
        if self.stddev is not None and (
            self.kind not in ("normal", "truncated_normal") or not self.stddev > 0
        ):
            raise ValueError(
                f"`stddev` must be > 0 and needs kind normal or truncated_normal, "
                f"got {self.stddev!r} (another kind replaces the whole mapping: "
                f"model.embedding_init!={{kind: {self.kind}}})"
            )

    def initializer(self):
        """The `TableSpec.initializer` this config describes."""
        if self.kind == "uniform":
            return uniform_init(self.scale)
        if self.kind == "normal":
            return normal_init(self.stddev)
        if self.kind == "truncated_normal":
            return truncated_normal_init(self.stddev)
        return constant_init(0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedDimsConfig:
    """`model.mixed_dims`: which dims the static tables get (`alpha`) and that the
    stacked models project them to `model.embedding_dim`."""

    alpha: float | None = None
    """A table without a dim of its own gets `embedding_dim * (V_min / V) ** alpha`,
    rounded up to a multiple of `multiple`, within [`min_dim`, `embedding_dim`]: V its
    rows, V_min the smallest static table's (larger tables, whose rows are seen less
    often, get narrower rows). null: the dims the tables set."""
    min_dim: int = 4
    multiple: int = 4

    def __post_init__(self):
        if self.alpha is not None and not 0 <= self.alpha <= 1:
            raise ValueError(f"`alpha` must be in [0, 1], got {self.alpha!r}")
        if self.min_dim < 1 or self.multiple < 1:
            raise ValueError(
                f"`min_dim` and `multiple` must be >= 1, got {self.min_dim} and {self.multiple}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: Literal["dlrm", "deepfm", "wide_deep", "dcnv2", "din", "two_tower"] = "dlrm"
    embedding_dim: int = 16
    """Dim of the tables that set none of their own (>= 1)."""
    options: dict = dataclasses.field(default_factory=dict)
    """Model-specific fields (e.g. dlrm: bottom, top; dcnv2: cross_layers, hidden), each
    of the type and range its model takes (see "`model.options` by `model.name`")."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Computation dtype of the dense layers; bfloat16 = mixed precision."""
    table_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage dtype of the embedding tables."""
    implementation: Literal["xla", "cpu_ffi", "pallas"] | None = None
    """Sparse kernel choice; None picks the platform's best."""
    embedding_init: EmbeddingInitConfig = dataclasses.field(
        default_factory=lambda: EmbeddingInitConfig(kind="normal", stddev=0.01)
    )
    """Initializer of the embedding tables: N(0, 0.01^2) unless set (measured on the
    Criteo samples: experiments/RESULTS.md, "Defaults"); `model.embedding_init!={kind:
    uniform}` gives TorchRec's U(+-sqrt(1/vocab_size)), a `TableSpec`'s own default."""
    dropout: float = 0.0
    """Dropout rate after every hidden ReLU of the model's MLPs (two-tower: the towers),
    in training only; evaluation is deterministic."""
    mixed_dims: MixedDimsConfig | None = None
    """Mixed-dimension embeddings (Ginart et al., 2019), e.g. `{alpha: 0.3}`: tables may
    have other dims than `embedding_dim` (their own `tables.<name>.dim`, or with `alpha`
    a power law of their size), and the models that stack the embeddings (dlrm, deepfm,
    wide_deep, dcnv2) project each such feature to `embedding_dim` with a learned
    matrix. null: every stacked table has `embedding_dim`."""

    def __post_init__(self):
        check_range("model.embedding_dim", self.embedding_dim, ">=1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "options", _model_options(self.name, self.options))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    sparse: Literal["sgd", "adagrad", "rowwise_adagrad", "lazy_adam", "ftrl", "adagrad_decay"] = (
        "lazy_adam"
    )
    """Optimizer of the embedding tables (touched rows only). The defaults, lazy_adam at
    1e-3 (and `model.embedding_init` N(0, 0.01^2)), were measured on the Criteo samples
    (experiments/RESULTS.md, "Defaults"): rowwise_adagrad at 0.05 overfit within 1-2
    epochs. rowwise_adagrad keeps one slot value per row instead of two per element."""
    sparse_learning_rate: float = 1e-3
    """Learning rate of the tables' optimizer (> 0)."""
    sparse_options: dict = dataclasses.field(default_factory=dict)
    """Other fields of the sparse optimizer (e.g. eps, initial_accumulator_value; see
    "`optimizer.sparse_options` by `optimizer.sparse`")."""
    dense: Literal["adam", "adagrad", "sgd", "adamw"] = "adam"
    dense_learning_rate: float = 1e-3
    """Learning rate of the dense parameters' optimizer (> 0)."""
    sparse_l2: float = 0.0
    """L2 regularization of the embedding rows a batch touches: the gradient of
    `0.5 * sparse_l2 * ||row||^2` is added once per touched row and step (however often
    the batch looks the row up), before the sparse optimizer. Rows the batch does not
    touch are not decayed; the cost grows with the batch's ids, never the table size."""
    dense_weight_decay: float | None = None
    """Weight decay of the dense weight matrices (parameters of 2+ dims; biases and other
    vectors/scalars are not decayed). adamw: decoupled (AdamW: `lr * wd * w` per step,
    the scheduled lr); adam, adagrad, sgd: `wd * w` added to the gradient (PyTorch's
    `weight_decay`). null: none, except adamw's own default (optax: 1e-4, biases too)."""
    schedule: Schedule = dataclasses.field(default_factory=Schedule)
    """Learning-rate schedule (warmup, then decay), a multiplier of `dense_learning_rate`
    and of `sparse_learning_rate` per step, e.g. `{warmup_steps: 500, decay: cosine,
    final_lr_ratio: 0.1}` (see `sparsejax.train.Schedule`; default: constant)."""
    schedule_on: Literal["both", "dense", "sparse"] = "both"
    """Which optimizers follow `schedule`; the other keeps its constant rate."""

    def __post_init__(self):
        for f in ("sparse_learning_rate", "dense_learning_rate"):
            check_range(f"optimizer.{f}", getattr(self, f), ">0")
        for f in ("sparse_l2", "dense_weight_decay"):
            v = getattr(self, f)
            if v is not None and not v >= 0:
                raise ValueError(f"`{f}` must be >= 0, got {v!r}")
        options = typed_options(
            "optimizer.sparse_options.",
            _SPARSE[self.sparse],
            self.sparse_options,
            {"learning_rate"},
        )
        object.__setattr__(self, "sparse_options", options)
        sparse_optimizer(self)  # the optimizer's own checks


@dataclasses.dataclass(frozen=True, kw_only=True)
class EarlyStoppingConfig:
    """Model selection on an eval metric (`early_stopping`): the best eval is tracked,
    its state kept in RUN/checkpoints_best, and training stops after `patience` evals
    without improvement. summary.json reports `best_eval` and `last_eval` (step, metric
    and metrics); a kept best whose logloss is far (> 1% and > 0.005) above the lowest
    seen is named in a warning. Evals come every `eval_every` steps (or epoch) and at the
    end."""

    metric: str = "auc"
    """The eval metric watched: a key of the eval results (auc, logloss, loss,
    recall@10, ...)."""
    mode: Literal["max", "min"] | None = None
    """max: higher is better; min: lower is better; null: min for metrics whose name
    ends in "loss", max otherwise."""
    patience: int | None = 5
    """Evals without improvement after which training stops (the last of them ends the
    run: logged, saved); null: never stop early, only track (and keep) the best."""
    min_delta: float = 0.0
    """An eval improves on the best only when better by more than this."""
    keep_best: bool = True
    """Save the best eval's state in RUN/checkpoints_best (one checkpoint, apart from the
    rotating checkpoints/; `sparsejax.train.Checkpointer` restores it)."""

    def __post_init__(self):
        if self.patience is not None and self.patience < 1:
            raise ValueError(f"`patience` must be >= 1 or null, got {self.patience!r}")
        if not self.min_delta >= 0:
            raise ValueError(f"`min_delta` must be >= 0, got {self.min_delta!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BloomConfig:
    """A counting Bloom filter for admission (`tables.<name>.admission.bloom`): memory
    bounded by `counters` bytes whatever the ID space; a false positive admits an ID
    early, never late."""

    counters: int | None = None
    """Counters of the filter, one byte each (null: 16777216); ~10x the distinct IDs seen
    keeps false positives rare."""
    hashes: int | None = None
    """Hash functions, counters each ID touches (null: 3)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    """When a new ID of a dynamic table gets a trainable row (`tables.<name>.admission`);
    until then it reads the default row and receives no update."""

    min_count: int | None = None
    """Times an ID must be seen before it gets a row (null: 1, every ID at first sight;
    2 with `bloom`)."""
    bloom: BloomConfig | None = None
    """Count with a counting Bloom filter (bounded memory, for very large ID spaces)
    instead of exact counts, e.g. `{counters: 16777216, hashes: 3}` (`{}`: its defaults);
    null: exact counts."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComposeConfig:
    """A static table stored as smaller ones whose rows combine per id
    (`tables.<name>.compose`; `sparsejax.embedding.Composition`), e.g.
    `{kind: qr, fraction: 0.25}` or `{kind: multihash, hashes: 2, fraction: 0.1}`."""

    kind: Literal["qr", "multihash"]
    """"qr": quotient-remainder, row(id) = Q[id // m] (op) R[id % m], no two ids share
    both rows; "multihash": `hashes` tables indexed by independent hashes of the id
    (`hashes: 1`: the hashing trick)."""
    rows: int | None = None
    """qr: the remainder rows m; multihash: the rows of each hashed table (null: from
    `fraction`; qr without either: ceil(sqrt(V)), the fewest rows)."""
    fraction: float | None = None
    """Memory budget, a fraction of the full table's (qr: the most rows within it, or
    the fewest Q-R allows for a table too small to meet it)."""
    hashes: int | None = None
    """multihash: number of hashed tables (null: 2)."""
    op: Literal["mul", "add", "concat"] | None = None
    """How the parts' rows combine (null: "mul"; "concat" splits the dim over them)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvictionConfig:
    """Which IDs of a dynamic table lose their rows (`tables.<name>.eviction`), their rows
    and optimizer slots reused by new IDs. Runs every `every_steps` and before every
    checkpoint."""

    ttl_steps: int | None = None
    """Evict IDs not seen for this many steps (null: never by age)."""
    min_norm: float | None = None
    """Evict IDs whose row's L2 norm is below this (null: never by norm)."""
    every_steps: int | None = None
    """Steps between runs of the policy (null: 1000)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableConfig:
    """Options of one embedding table (`tables.<name>`, the name of the table: the column's
    own, or the one `data.features.<column>.table` names), or of every table
    (`tables."*"`). A table's own entry wins key by key over `"*"` (null keeps the `"*"`
    value); options of `"*"` that do not apply to a table (dynamic options on a static
    table, cache options without a cache) are ignored for it, while a table's own entry
    that sets them is an error. Supersedes `data.features.<column>.dim` and
    `hash_buckets`, which still work (a table's own entry and its columns' options must
    agree)."""

    dim: int | None = None
    """Row width (null: the columns' `data.features.<column>.dim`, else
    `model.embedding_dim`)."""
    vocab_size: int | None = None
    """Rows of a static table: its columns' raw IDs hashed into that many buckets (row 0
    the missing value; as `data.features.<column>.hash_buckets`); null: as `data.id_mapping`
    says. File data."""
    dynamic: bool | None = None
    """Keyed by raw 64-bit IDs, with no vocabulary and no hash collisions: rows are created
    while training runs (`admission`) and reused after `eviction`. Needs a device size:
    `cache_rows` or `max_rows`. The rows start U(+-sqrt(1/n)), n the rows a vocabulary of
    the train IDs seen `data.min_count` times would have (the static table's scale;
    streams: `max_rows`, else the cache rows); `model.embedding_init` overrides it.
    Synthetic and file data (not events or behavior)."""
    cache_rows: int | float | None = None
    """Rows of the device cache: every row and optimizer slot lives in a host store
    (`ram_bytes`, `disk_dir`), the hot rows on the device. An int is a row count; a float
    in (0, 1] that fraction of the table's distinct train IDs (file data read into
    memory), at least the IDs one batch can hold (or all of them when fewer) so every
    batch fits; 0: no cache (to opt one table out of a `"*"` cache)."""
    max_rows: int | None = None
    """Dynamic: rows at most (null: unbounded, limited by host memory and disk); without a
    cache the device holds this many rows."""
    admission: AdmissionConfig | None = None
    """Dynamic: when a new ID gets a row, e.g. `{min_count: 2}` (null: at first sight)."""
    eviction: EvictionConfig | None = None
    """Dynamic: which IDs lose their rows, e.g. `{ttl_steps: 10000}` (null: none)."""
    when_full: Literal["error", "evict", "default_row"] | None = None
    """Dynamic, a new ID at `max_rows`: "error" (naming the table), "evict" the least
    frequently seen IDs not in the batch, or read the default row (null: "error")."""
    default_row: Literal["zeros", "trainable"] | None = None
    """Dynamic: what IDs without a row read: zeros (never updated) or one shared trainable
    row (null: "zeros")."""
    cache_policy: Literal["lru", "lfu"] | None = None
    """Which cached rows make room for a batch's misses (never a row the batch uses; null:
    "lru")."""
    ram_bytes: int | str | None = None
    """Host RAM for the table's rows and slots, in bytes or as "8GiB" / "500MB"; beyond it
    rows go to memory-mapped files in `disk_dir` (null: unbounded RAM)."""
    disk_dir: str | None = None
    """Directory of the disk tier (beyond `ram_bytes`), relative to the run directory
    unless absolute; each table's files go to a subdirectory of its own (null:
    `host_rows` in the run directory)."""
    placement: (
        Literal[
            "auto", "host", "replicated", "table_wise", "column_wise", "table_row_wise", "row_wise"
        ]
        | None
    ) = None
    """Where the table lives on the run's devices (`sharding`): "auto" (null) lets the
    planner choose; "host" keeps it in host memory, looked up and updated by the host's
    CPU beside the dense network on the devices (pipelined with the device's step; not
    with mesh placements or many processes); the others pin it: "replicated" (a copy
    on every device),
    "table_wise" (whole on one device of each host, i.e. one index of the "model" axis),
    "column_wise" (its columns split over "model"; the dim must divide), "table_row_wise"
    (its rows split over "model"), "row_wise" (its rows split over every device). A run
    with a pinned table shards even on one device. `sparsejax plan CONFIG` prints the
    plan."""
    compose: ComposeConfig | None = None
    """Store a static table as smaller ones (quotient-remainder or multi-hash) to cut its
    memory, e.g. `{kind: qr, fraction: 0.25}` (null: whole). Not with `dynamic` or
    `cache_rows`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """How the run's tables are placed on its devices (`sharding`): a mesh of a "data"
    and a "model" axis, and a planner choosing each table's placement from its memory
    (rows, optimizer slots, cache) and the bytes it moves per step (see
    `sparsejax.sharding._planner`; `tables.<name>.placement` pins one). The run shards
    when it has more than one device or a pinned table; the plan is printed at the start
    of the run, and by `sparsejax plan CONFIG [--devices N | --hosts H
    --devices-per-host D] [--device-memory 80GB]` without training."""

    devices: int | None = None
    """Devices the run trains on, all processes together (the same number from each).
    null: every device; on CPU, one device per process (several CPU devices of one
    process, e.g. from XLA_FLAGS=--xla_force_host_platform_device_count, share one
    memory and one set of cores, so they are used only when asked for), unless
    `sparsejax launch --devices-per-process K` (SPARSEJAX_LOCAL_DEVICES) gives each
    process K."""
    model: int | None = None
    """Size of the mesh's "model" axis, the devices a table-wise, column-wise or
    table-row-wise table is spread over ("data" is the rest); null: the run's devices
    of one process (one host)."""
    device_memory: int | str | None = None
    """Memory of one device, in bytes or as "80GB" / "16GiB"; the tables may fill 90% of
    it (10% is left to the dense parameters, activations and buffers). null: measured,
    the least free memory of the run's devices (CPU: the host's available memory shared
    among them)."""

    def __post_init__(self):
        for f in ("devices", "model"):
            v = getattr(self, f)
            if v is not None and v < 1:
                raise ValueError(f"`{f}` must be >= 1, got {v}")
        if self.device_memory is not None:
            from ._build import parse_bytes

            parse_bytes(self.device_memory, "sharding.device_memory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str = "default"
    """Run directory name under out_dir. A run directory belongs to one config: running
    a different one under the same name is refused (naming the keys that differ) unless
    only resumable keys changed (see `resume`) or `sparsejax train --restart`."""
    out_dir: str = "runs"
    """Where run directories live."""
    seed: int = 0
    """Seeds the model's initialization, the data order and synthetic data."""
    steps: int | None = 300
    """Training steps; or set `epochs` (file data) and leave steps null."""
    epochs: int | None = None
    """Passes over the training data (file data); set steps to null."""
    log_every: int = 20
    """Steps between train records (loss, samples/s) in metrics.jsonl and the console."""
    eval_every: int | Literal["epoch"] | None = 100
    """Steps between evals, or "epoch" (every epoch of file data); null: only at the end."""
    eval_ks: tuple[int, ...] = (10,)
    """Cut-offs k of the ranking metrics (hr@k, ndcg@k) the evals during training report
    when the data has candidate sets (data.kind: events); early_stopping.metric may name
    them, e.g. ndcg@10."""
    eval_users: int | None = None
    """data.kind=events: the eval split's candidate sets are a random sample of this many
    of its users (drawn by `seed`; evals during training and `sparsejax eval --split
    eval`), a cheaper eval of a large log; null: all of them. The test split is always
    evaluated whole."""
    checkpoint_every: int | None = None
    """Steps between checkpoints (default: only at the end)."""
    keep_checkpoints: int = 3
    """Checkpoints kept (>= 1); older ones are deleted."""
    checkpoint_full_every: int = 1
    """Tiered tables (`tables`): every this many checkpoints one holds their full host
    state, the ones between only the rows changed since the previous checkpoint (and the
    IDs evicted since); 1: every checkpoint full. A restore reads the last full one and
    the deltas after it."""
    resume: bool = True
    """Continue from the run directory's latest checkpoint if there is one. The
    resumable keys (steps, epochs, log_every, eval_every, checkpoint_every,
    keep_checkpoints, checkpoint_full_every, progress, data.prefetch, the sharding keys
    (a checkpoint restores on any mesh), a table's placement, and a tiered table's
    cache_rows, cache_policy, ram_bytes, disk_dir) may change between runs of one run
    directory (each change is logged in run.json); any other change is refused."""
    progress: bool = True
    """A progress bar (false: one line per logged step)."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    tables: dict[str, TableConfig] = dataclasses.field(default_factory=dict)
    """Per embedding table options, by table name, or `"*"` for every table (see
    `TableConfig`): dim, vocab_size, dynamic (raw 64-bit IDs, rows created while training),
    cache_rows (a device cache over a host store), max_rows, admission, eviction, when_full,
    default_row, cache_policy, ram_bytes, disk_dir, placement (pinned on the devices). E.g.
    `{"*": {dynamic: true, cache_rows: 0.1, admission: {min_count: 2}}}`."""
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    """The run's devices, the mesh's "model" axis and the memory per device the table
    planner fills (see `ShardingConfig`), e.g. `{model: 8, device_memory: 80GB}`."""
    early_stopping: EarlyStoppingConfig | None = None
    """Early stopping and keep-best on an eval metric (null: off), e.g.
    `{metric: auc, patience: 3}`."""
    profile_steps: list[int] | None = None
    """`[first, count]`: trace steps first..first+count-1 of the run with `jax.profiler`
    and write `RUN/profile_steps_<first>/` (the trace, and summary.txt/json with the
    device time per part, as `sparsejax profile` splits it); null: off. Not with
    dynamic or host-cached tables."""

    def __post_init__(self):
        check_range("seed", self.seed, ">=0")
        ps = self.profile_steps
        if ps is not None and (
            len(ps) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in ps)
        ):
            raise ValueError(f"profile_steps must be [first, count], integers >= 1, got {list(ps)}")
        if self.steps is not None and self.epochs is not None:
            raise ValueError(
                f"set exactly one of `steps` and `epochs` (got steps={self.steps} and "
                f"epochs={self.epochs}): add epochs=null to train {self.steps} steps, or "
                f"steps=null for {self.epochs} epoch{'s' * (self.epochs != 1)}"
            )
        if self.steps is None and self.epochs is None:
            raise ValueError("set exactly one of `steps` and `epochs` (both are null)")
        if self.epochs is not None and self.data.kind in ("synthetic", "behavior"):
            raise ValueError(
                f"`epochs` needs file data (data.kind={self.data.kind!r} has no end); "
                f"set steps=N and epochs=null"
            )
        if self.epochs is not None and self.data.stream:
            raise ValueError(
                "`epochs` with data.stream: a stream's length is not known before it is "
                "read; set steps=N and epochs=null (or data.stream=false to read the files "
                "into memory)"
            )
        if self.eval_every == "epoch" and self.data.stream:
            raise ValueError(
                "eval_every=epoch with data.stream: a stream has no known epoch length; "
                "set eval_every=N steps"
            )
        fields = ("steps", "epochs", "log_every", "eval_every", "checkpoint_every")
        for f in (*fields, "keep_checkpoints", "checkpoint_full_every", "eval_users"):
            v = getattr(self, f)
            if isinstance(v, int) and v < 1:  # eval_every may be "epoch"
                raise ValueError(f"`{f}` must be >= 1, got {v}")
        if not self.eval_ks or min(self.eval_ks) < 1:
            raise ValueError(f"`eval_ks` must be cut-offs >= 1, got {list(self.eval_ks)}")
        if self.eval_users is not None and self.data.kind != "events":
            raise ValueError(
                f"`eval_users` samples the users of candidate sets (data.kind=events); "
                f"data.kind={self.data.kind!r} has none: set eval_users=null"
            )
        from ._build import check_tables_config  # the checks live with the code they guard

        check_tables_config(self)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.out_dir, self.name)


def load_config(
    files: Sequence[str | os.PathLike] = (), overrides: Sequence[str] = ()
) -> RunConfig:
    """Layer YAML files and `key=value` overrides into a validated `RunConfig`."""
    return config_from_dict(layered(files, overrides))


def config_from_dict(data: dict) -> RunConfig:
    """Validate a merged config mapping into a `RunConfig` (errors name the key)."""
    return from_dict(RunConfig, data)


_MODEL_FIELDS = {"tables", "features", "dtype", "implementation", "parent", "name"}
_MODEL_FIELDS |= {"dropout", "embedding_dim"}
"""Model fields that are not `model.options`: the runner sets them (the data's specs,
`model.dtype`, ...), or they are `model.*` keys of their own (`dropout`, `embedding_dim`)."""

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
    import typing

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


GENERATORS = {
    "synthetic": (SyntheticCriteo, {"seed", "max_vocab", "zipf_exponent"}),
    "behavior": (SyntheticBehavior, {"seed"}),
}
"""data.kind -> its generator and the fields the runner sets (`seed`; `data.max_vocab`,
`data.zipf`): `data.synthetic_options` sets the others."""

OPTION_DEFAULTS = {"dlrm": {"bottom": "[64, model.embedding_dim]"}}
"""Model options whose default the runner sets (`build_model`), not the class."""


def options_reference() -> str:
    """Markdown reference of the keys whose fields a class gives: `data.schema`, and per
    kind `model.options`, `optimizer.sparse_options` and `data.synthetic_options`."""
    lines = [
        "## `data.schema` (TableSchema)",
        "",
        inspect_doc(TableSchema),
        "",
        "A side table's `data.joins[].schema` takes the same keys (but `label`).",
        "",
        *field_lines(TableSchema, "data.schema."),
        "",
    ]
    base = sparse_optimizers.SparseOptimizer
    groups = [  # (key, kind key, {kind: (class, fields not options)}, fields every kind has)
        ("model.options", "model.name", {k: (c, _MODEL_FIELDS) for k, c in MODELS.items()}, ""),
        (
            "optimizer.sparse_options",
            "optimizer.sparse",
            {k: (c, {f.name for f in dataclasses.fields(base)}) for k, c in _SPARSE.items()},
            "\n".join(field_lines(base, "optimizer.sparse_options.", exclude={"learning_rate"})),
        ),
        ("data.synthetic_options", "data.kind", GENERATORS, ""),
    ]
    for key, kind, classes, common in groups:
        lines += [
            f"## `{key}` by `{kind}`",
            "",
            f"The fields of the class `{kind}` names; unset, a field keeps its default. "
            f"Values are checked against its type and range when the config loads.",
            "",
        ]
        if common:
            lines += [f"Every `{kind}` takes:", "", common, ""]
        for name, (cls, exclude) in classes.items():
            lines += [f"### `{kind}: {name}` ({cls.__name__})", ""]
            if inspect_doc(cls):
                lines += [inspect_doc(cls), ""]
            own = field_lines(
                cls, f"{key}.", exclude=exclude, defaults=OPTION_DEFAULTS.get(name, {})
            )
            lines += [*(own or ["(no options of its own)"]), ""]
    return "\n".join(lines).rstrip() + "\n"


def _model_options(name: str, options: dict) -> dict:
    """`model.options` of model `name`, typed and in range (see `typed_options`)."""
    out = typed_options("model.options.", MODELS[name], options, _MODEL_FIELDS)
    if name == "dlrm" and out.get("top", [1])[-1:] != [1]:
        raise ConfigError(
            f"config key 'model.options.top' must end with 1 (DLRM's output unit), got {out['top']}"
        )
    if name == "dcnv2" and out.get("structure", "stacked") not in ("stacked", "parallel"):
        raise ConfigError(
            f"config key 'model.options.structure': {out['structure']!r} is not one of "
            f"['stacked', 'parallel']"
        )
    return out


_SPARSE = {
    "sgd": sparse_optimizers.SGD,
    "adagrad": sparse_optimizers.Adagrad,
    "rowwise_adagrad": sparse_optimizers.RowWiseAdagrad,
    "lazy_adam": sparse_optimizers.LazyAdam,
    "ftrl": sparse_optimizers.FTRL,
    "adagrad_decay": sparse_optimizers.AdagradDecay,
}
_DENSE = {"adam": optax.adam, "adagrad": optax.adagrad, "sgd": optax.sgd, "adamw": optax.adamw}


def sparse_optimizer(cfg: OptimizerConfig) -> sparse_optimizers.SparseOptimizer:
    """The tables' optimizer of `optimizer.sparse*` (the options checked by
    `OptimizerConfig`; the optimizer's own checks name the option)."""
    try:
        return _SPARSE[cfg.sparse](learning_rate=cfg.sparse_learning_rate, **cfg.sparse_options)
    except ValueError as e:
        raise ConfigError(f"optimizer.sparse_options: {e}") from None


def dense_optimizer(
    cfg: OptimizerConfig, total_steps: int | None = None
) -> optax.GradientTransformation:
    """The dense parameters' optax optimizer of `optimizer.dense*`, with the learning-rate
    `schedule` (unless `schedule_on: sparse`) and `dense_weight_decay`; `total_steps`
    resolves a schedule whose `decay_steps` is null (the rest of the run)."""
    lr = cfg.dense_learning_rate
    if cfg.schedule_on != "sparse" and not cfg.schedule.is_constant:
        sched, base = cfg.schedule.resolve(total_steps), cfg.dense_learning_rate
        lr = lambda count: base * sched(count)  # noqa: E731 - optax's count == state.step
    if cfg.dense_weight_decay is None:
        return _DENSE[cfg.dense](lr)
    wd = cfg.dense_weight_decay
    matrices = lambda params: jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)  # noqa: E731
    if cfg.dense == "adamw":
        return optax.adamw(lr, weight_decay=wd, mask=matrices)
    return optax.chain(optax.add_decayed_weights(wd, matrices), _DENSE[cfg.dense](lr))
