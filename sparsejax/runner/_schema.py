"""The schema of a run's config: `RunConfig` and its sections, each field documented
(the `data` section in `_data_config.py`, `tables` in `_table_config.py`, `optimizer`
in `_optim.py`; the others here).

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

from ..data import TableSchema
from ..embedding import constant_init, normal_init, truncated_normal_init, uniform_init
from ..nn import MODELS
from ..ops import optimizers as sparse_optimizers
from ._config import ConfigError, field_lines, from_dict, inspect_doc, layered
from ._data_config import GENERATORS, DataConfig
from ._optim import _SPARSE, OptimizerConfig
from ._options import check_range, parse_bytes, typed_options
from ._table_config import TableConfig, check_tables_config


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
            parse_bytes(self.device_memory, "sharding.device_memory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishConfig:
    """Publish the model while it trains, for `sparsejax serve DIR` to follow
    (`publish`): a full model dir into `dir` at the first step and every `full_every_s`
    seconds, and between them a delta every `every_s` seconds: the table rows changed
    since the version before and the dense parameters, which the server applies in
    place (see `sparsejax.serving.Publisher`); a dynamic table's deltas add its new
    keys in spare rows and remove its evicted ones. In a run of several processes, each
    writes the rows it holds of a sharded table, and a share of the rows of a table kept
    on the hosts (tiered or dynamic: its keys and rows are gathered, share by share)."""

    dir: str | None = None
    """The publish folder (required) (`DIR/<v>/` full model dirs, `DIR/<v>.delta/` deltas)."""
    every_s: float = 5.0
    """Seconds between publishes (checked after each step)."""
    full_every_s: float | None = 3600.0
    """Seconds between full model dirs (null: only the first)."""
    quantize: Literal["fp32", "fp16", "bf16", "int8", "int4"] = "fp32"
    """Table storage of the published model (as `sparsejax export --quantize`)."""
    kernels: Literal["xla", "native"] = "xla"
    """As `sparsejax export --kernels`."""
    buckets: tuple[int, ...] = (1, 4, 16, 64, 256)
    """The padded batch sizes the server compiles (as `sparsejax export --buckets`)."""
    key_headroom: float = 0.25
    """Spare rows a full version keeps for a dynamic table's new keys, as a fraction of
    its keys (at least 1,024; at most its max_rows in all). When they run out, the next
    publish is a full one."""

    def __post_init__(self):
        if not self.key_headroom >= 0:
            raise ValueError(f"`key_headroom` must be >= 0, got {self.key_headroom!r}")
        if not self.buckets or min(self.buckets) < 1:
            raise ValueError(f"`buckets` must be batch sizes >= 1, got {list(self.buckets)}")
        if not self.dir:
            raise ValueError("`dir` is required: the folder to publish into, that serve reads")
        if not self.every_s > 0:
            raise ValueError(f"`every_s` must be > 0, got {self.every_s!r}")
        if self.full_every_s is not None and not self.full_every_s > 0:
            raise ValueError(f"`full_every_s` must be > 0 or null, got {self.full_every_s!r}")


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
    keep_checkpoints, checkpoint_full_every, progress, data.prefetch, data.workers, the
    sharding keys
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
    publish: PublishConfig | None = None
    """Publish the model for serving while training (see `PublishConfig`), e.g.
    `{dir: models/ctr, every_s: 5}`; null: off."""

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
        object.__setattr__(self, "tables", check_tables_config(self.tables, self.data))

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
