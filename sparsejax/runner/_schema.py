"""The schema of a run's config: `RunConfig` and its sections, each field documented.

`load_config` layers YAML files and `key=value` overrides into a validated `RunConfig`
(see `_config.py`); an unknown key is an error naming the closest valid one, and the
model and optimizer options are checked against the classes they configure.

Data files: a relative `data.path` is looked up in the working directory, then in the
directory named by the environment variable `SPARSEJAX_DATA_DIR` (the configs for the
shipped Criteo sample give its path relative to that directory; e.g. run
`SPARSEJAX_DATA_DIR=../shared/data sparsejax train configs/dlrm_criteo.yaml`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Literal

import optax

from ..nn import MODELS
from ..ops import optimizers as sparse_optimizers
from ._config import from_dict, layered, unknown_key_error

DATA_DIR_ENV = "SPARSEJAX_DATA_DIR"
"""Environment variable: where relative `data.path` values are looked up after the
working directory."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    kind: Literal["synthetic", "criteo", "delimited", "behavior"] = "synthetic"
    """synthetic: Criteo-shaped Zipf data, no download; criteo: a Kaggle DAC TSV file;
    delimited: any CSV/TSV described by `schema`; behavior: synthetic user histories
    (for DIN and two-tower)."""
    path: str | None = None
    """Data file (criteo, delimited). A relative path is looked up in the working
    directory, then in `$SPARSEJAX_DATA_DIR` (e.g. `SPARSEJAX_DATA_DIR=../shared/data`
    for the shipped Criteo sample next to the repository)."""
    batch_size: int = 1024
    eval_batch_size: int | None = None
    """Default: batch_size."""
    train_rows: int | None = None
    """File data: the first `train_rows` rows train, the rest evaluate (default 80%)."""
    id_mapping: Literal["vocab", "hash"] = "vocab"
    """File data: "vocab" gives each value seen >= min_count times in train its own row
    (others share row 0); "hash" maps raw ids into hash_buckets rows."""
    min_count: int = 1
    hash_buckets: int = 1_000_000
    strict: bool = False
    """Fail on the first malformed line instead of counting and skipping it."""
    schema: dict | None = None
    """delimited: the column schema (see `sparsejax.data.TableSchema`)."""
    max_vocab: int = 100_000
    """synthetic: table sizes follow the Criteo Kaggle cardinalities capped at this."""
    zipf: float = 1.1
    """synthetic: Zipf exponent of the ids."""
    synthetic_options: dict = dataclasses.field(default_factory=dict)
    """Other options of the generator (`SyntheticCriteo` for synthetic, `SyntheticBehavior`
    for behavior: num_users, num_items, max_history, ...)."""
    eval_batches: int = 8
    """synthetic/behavior: batches in the held-out eval set."""
    shuffle: bool = True
    prefetch: int = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: Literal["dlrm", "deepfm", "wide_deep", "dcnv2", "din", "two_tower"] = "dlrm"
    embedding_dim: int = 16
    options: dict = dataclasses.field(default_factory=dict)
    """Model-specific fields (e.g. dlrm: bottom, top; dcnv2: cross_layers, hidden)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Computation dtype of the dense layers; bfloat16 = mixed precision."""
    table_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage dtype of the embedding tables."""
    implementation: Literal["xla", "cpu_ffi", "pallas"] | None = None
    """Sparse kernel choice; None picks the platform's best."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    sparse: Literal["sgd", "adagrad", "rowwise_adagrad", "lazy_adam", "ftrl", "adagrad_decay"] = (
        "rowwise_adagrad"
    )
    """Optimizer of the embedding tables (touched rows only)."""
    sparse_learning_rate: float = 0.05
    sparse_options: dict = dataclasses.field(default_factory=dict)
    """Other fields of the sparse optimizer (e.g. eps, initial_accumulator_value)."""
    dense: Literal["adam", "adagrad", "sgd", "adamw"] = "adam"
    dense_learning_rate: float = 1e-3


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str = "default"
    """Run directory name under out_dir."""
    out_dir: str = "runs"
    seed: int = 0
    steps: int | None = 300
    """Training steps; or set `epochs` (file data) and leave steps null."""
    epochs: int | None = None
    log_every: int = 20
    eval_every: int | None = 100
    """Steps between evals (null: only at the end)."""
    checkpoint_every: int | None = None
    """Steps between checkpoints (default: only at the end)."""
    keep_checkpoints: int = 3
    resume: bool = True
    """Continue from the run directory's latest checkpoint if there is one."""
    progress: bool = True
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)

    def __post_init__(self):
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of `steps` and `epochs`")
        for f in ("steps", "epochs", "log_every", "eval_every", "checkpoint_every"):
            v = getattr(self, f)
            if v is not None and v < 1:
                raise ValueError(f"`{f}` must be >= 1, got {v}")

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
    cfg = from_dict(RunConfig, data)
    _check_model_options(cfg.model)
    sparse_optimizer(cfg.optimizer)  # validates sparse_options
    return cfg


def _check_model_options(m: ModelConfig) -> None:
    cls = MODELS[m.name]
    settable = {f.name for f in dataclasses.fields(cls) if f.init} - {
        "tables",
        "features",
        "dtype",
        "implementation",
        "parent",
        "name",
    }
    for k in m.options:
        if k not in settable:
            raise unknown_key_error("model.options.", k, settable)


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
    """The tables' optimizer of `optimizer.sparse*`; unknown options name the key."""
    cls = _SPARSE[cfg.sparse]
    valid = {f.name for f in dataclasses.fields(cls) if f.init} - {"learning_rate"}
    for k in cfg.sparse_options:
        if k not in valid:
            raise unknown_key_error("optimizer.sparse_options.", k, valid)
    return cls(learning_rate=cfg.sparse_learning_rate, **cfg.sparse_options)


def dense_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """The dense parameters' optax optimizer of `optimizer.dense*`."""
    return _DENSE[cfg.dense](cfg.dense_learning_rate)
