"""The config-driven runner behind `sparsejax train` and `sparsejax eval`.

Everything here is a library function a notebook can call: `load_config` (layered
YAML + overrides -> a validated `RunConfig`), `build_data`, `build_model`, `train`,
`evaluate_run`. The command line only parses arguments and calls them.

A run directory (`run.out_dir/run.name`) holds `config.yaml` (the resolved config),
`metrics.jsonl` (one JSON object per logged step or eval), `checkpoints/`, `curves.png`
and `summary.json`. Running the same config again resumes from the latest checkpoint,
bit-identically to a run that was never interrupted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
import optax
import yaml

from . import _config
from .data import BatchPacker, Examples, Loader, SparseBatch
from .embedding import FeatureSpec, TableSpec
from .nn import MODELS
from .ops import optimizers as sparse_optimizers
from .train import Checkpointer, Trainer, TrainState

# ---------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    kind: Literal["synthetic", "criteo", "delimited", "behavior"] = "synthetic"
    """synthetic: Criteo-shaped Zipf data, no download; criteo: a Kaggle DAC TSV file;
    delimited: any CSV/TSV described by `schema`; behavior: synthetic user histories
    (for DIN and two-tower)."""
    path: str | None = None
    """Data file (criteo, delimited); relative paths are relative to the working dir."""
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
    sparse: Literal["sgd", "adagrad", "rowwise_adagrad", "lazy_adam", "ftrl",
                    "adagrad_decay"] = "rowwise_adagrad"
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


def load_config(files: Sequence[str | os.PathLike] = (), overrides: Sequence[str] = ()
                ) -> RunConfig:
    """Layer YAML files and `key=value` overrides into a validated `RunConfig`."""
    return config_from_dict(_config.layered(files, overrides))


def config_from_dict(data: dict) -> RunConfig:
    cfg = _config.from_dict(RunConfig, data)
    _check_model_options(cfg.model)
    sparse_optimizer(cfg.optimizer)  # validates sparse_options
    return cfg


def _check_model_options(m: ModelConfig) -> None:
    cls = MODELS[m.name]
    settable = {f.name for f in dataclasses.fields(cls) if f.init} - {
        "tables", "features", "dtype", "implementation", "parent", "name"}
    for k in m.options:
        if k not in settable:
            raise _config.unknown_key_error("model.options.", k, settable)


# ---------------------------------------------------------------------------------------
# Data, model, optimizers


@dataclasses.dataclass
class DataBundle:
    """What a run trains and evaluates on."""

    tables: tuple[TableSpec, ...]
    features: tuple[FeatureSpec, ...]
    packer: BatchPacker
    train_source: Any  # Examples or a generator with batch(index, batch_size)
    eval_batches: list[SparseBatch]
    report: str | None = None  # parse summary of file data

    @property
    def steps_per_epoch(self) -> int | None:
        if isinstance(self.train_source, Examples):
            return math.ceil(len(self.train_source) / self.packer.batch_size)
        return None


_SPARSE = {"sgd": sparse_optimizers.SGD, "adagrad": sparse_optimizers.Adagrad,
           "rowwise_adagrad": sparse_optimizers.RowWiseAdagrad,
           "lazy_adam": sparse_optimizers.LazyAdam, "ftrl": sparse_optimizers.FTRL,
           "adagrad_decay": sparse_optimizers.AdagradDecay}
_DENSE = {"adam": optax.adam, "adagrad": optax.adagrad, "sgd": optax.sgd, "adamw": optax.adamw}


def sparse_optimizer(cfg: OptimizerConfig) -> sparse_optimizers.SparseOptimizer:
    cls = _SPARSE[cfg.sparse]
    valid = {f.name for f in dataclasses.fields(cls) if f.init} - {"learning_rate"}
    for k in cfg.sparse_options:
        if k not in valid:
            raise _config.unknown_key_error("optimizer.sparse_options.", k, valid)
    return cls(learning_rate=cfg.sparse_learning_rate, **cfg.sparse_options)


def dense_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    return _DENSE[cfg.dense](cfg.dense_learning_rate)


def build_data(cfg: RunConfig) -> DataBundle:
    """Read or generate the data and derive the table and feature specs from it."""
    from . import data as sd

    d, dim = cfg.data, cfg.model.embedding_dim
    table_kw = dict(dtype=cfg.model.table_dtype, optimizer=sparse_optimizer(cfg.optimizer))
    eval_b = d.eval_batch_size or d.batch_size
    report = None
    if d.kind in ("synthetic", "behavior"):
        if d.kind == "synthetic":
            gen = sd.SyntheticCriteo(max_vocab=d.max_vocab, zipf_exponent=d.zipf, seed=cfg.seed,
                                     **d.synthetic_options)
            num_dense = gen.num_dense
        else:
            gen = sd.SyntheticBehavior(seed=cfg.seed, **d.synthetic_options)
            num_dense = 0
        tables, features = gen.specs(dim=dim, **table_kw)
        train_source = gen
        eval_packer = BatchPacker(tables, features, batch_size=eval_b, num_dense=num_dense)
        eval_batches = []
        for i in range(d.eval_batches):  # numbered from 2**31 - 1 down: never trained on
            sparse, labels, dense = gen.batch(0x7FFFFFFF - i, eval_b)
            eval_batches.append(eval_packer.pack(sparse, labels=labels, dense=dense))
    else:
        if d.path is None:
            raise _config.ConfigError(f"data.kind={d.kind!r} needs data.path")
        if d.kind == "criteo":
            examples, rep = sd.read_criteo(d.path, strict=d.strict)
        else:
            if d.schema is None:
                raise _config.ConfigError("data.kind='delimited' needs data.schema")
            examples, rep = sd.read_delimited(d.path, sd.TableSchema.from_dict(d.schema),
                                              strict=d.strict)
        report = rep.summary()
        n_train = d.train_rows if d.train_rows is not None else int(0.8 * len(examples))
        if not 0 < n_train < len(examples):
            raise _config.ConfigError(f"data.train_rows={n_train} must leave both splits "
                                      f"non-empty ({len(examples)} rows)")
        train, held = examples.split(n_train)
        names = train.feature_names
        if d.id_mapping == "vocab":
            mappings = sd.fit_vocab(train, min_count=d.min_count)
        else:
            mappings = {n: sd.HashMapping(buckets=d.hash_buckets) for n in names}
        train, held = train.map_ids(mappings), held.map_ids(mappings)
        tables, features = _file_specs(d, train, sd.vocab_sizes(mappings), dim, table_kw)
        num_dense = train.num_dense
        train_source = train
        eval_packer = BatchPacker(tables, features, batch_size=eval_b, num_dense=num_dense)
        eval_batches = sd.pack_examples(held, eval_packer)
    packer = BatchPacker(tables, features, batch_size=d.batch_size, num_dense=num_dense)
    return DataBundle(tuple(tables), tuple(features), packer, train_source, eval_batches,
                      report)


def _file_specs(d: DataConfig, train: Examples, vocab: dict, dim: int, table_kw: dict):
    """One table per sparse column; multi-hot columns mean-pooled, sequences unpooled,
    each sized by the longest bag in train."""
    from .data import TableSchema

    schema = TableSchema.from_dict(d.schema) if d.schema else None
    multi = set(getattr(schema, "multi_hot", None) or ())
    seq = set(getattr(schema, "sequence", None) or ())
    tables, features = [], []
    for name in train.feature_names:
        tables.append(TableSpec(name=name, vocab_size=int(vocab[name]), dim=dim, **table_kw))
        longest = int(np.max(train.sparse[name].lengths, initial=1))
        if name in seq:
            features.append(FeatureSpec(name=name, table=name, combiner=None,
                                        max_ids=max(longest, 1)))
        elif name in multi:
            features.append(FeatureSpec(name=name, table=name, combiner="mean",
                                        max_ids=max(longest, 1)))
        else:
            features.append(FeatureSpec(name=name, table=name))
    return tables, features


def build_model(cfg: RunConfig, tables: Sequence[TableSpec], features: Sequence[FeatureSpec]):
    """The configured Flax model over the given specs."""
    m = cfg.model
    cls = MODELS[m.name]
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in m.options.items()}
    if m.name == "dlrm" and "bottom" not in opts:
        opts["bottom"] = (64, m.embedding_dim)
    dtype = None if m.dtype == "float32" else m.dtype
    return cls(tables=tuple(tables), features=tuple(features), dtype=dtype,
               implementation=m.implementation, **opts)


# ---------------------------------------------------------------------------------------
# Training


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; the run stopped."""


class _RunLog:
    """metrics.jsonl writer; on resume drops records past the restored step."""

    def __init__(self, path: str, resume_step: int):
        self.path = path
        kept = []
        if resume_step and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if json.loads(line).get("step", 0) <= resume_step]
        with open(path, "w") as f:
            f.writelines(kept)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def plot_curves(metrics_path: str, png_path: str) -> None:
    """Training loss and eval metrics against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval")
    axes[0].set(xlabel="step", ylabel="loss", title="loss")
    axes[0].legend()
    key = next((k for k in ("auc", "recall@10", "recall@1") if evals and k in evals[0]), None)
    if key:
        axes[1].plot([r["step"] for r in evals], [r[key] for r in evals], "o-")
        axes[1].set(xlabel="step", ylabel=key, title=f"eval {key}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


@dataclasses.dataclass
class Run:
    """A built run: config, data, model, trainer and state (for notebooks and tests)."""

    cfg: RunConfig
    data: DataBundle
    model: Any
    trainer: Trainer
    state: TrainState
    checkpointer: Checkpointer
    position: dict

    @property
    def total_steps(self) -> int:
        if self.cfg.steps is not None:
            return self.cfg.steps
        if self.data.steps_per_epoch is None:
            raise _config.ConfigError("`epochs` needs file data; use `steps` for generators")
        return self.cfg.epochs * self.data.steps_per_epoch


def build_run(cfg: RunConfig, *, log: Callable[[str], None] = print) -> Run:
    """Data, model, trainer and the initial (or resumed) state of a run."""
    os.makedirs(cfg.run_dir, exist_ok=True)
    data = build_data(cfg)
    if data.report:
        log(f"data: {data.report}")
    model = build_model(cfg, data.tables, data.features)
    trainer = Trainer(model, dense_optimizer(cfg.optimizer))
    first = _first_train_batch(data)
    state = trainer.init(jax.random.key(cfg.seed), first)
    ckpt = Checkpointer(os.path.join(cfg.run_dir, "checkpoints"),
                        trainer.layouts,
                        max_to_keep=cfg.keep_checkpoints)
    position: dict = {"epoch": 0, "batch": 0}
    if cfg.resume and ckpt.latest_step() is not None:
        state, meta = ckpt.restore(state)
        position = meta["data_position"]
        log(f"resumed from {ckpt.directory}/{int(state.step)} (data position {position})")
    return Run(cfg, data, model, trainer, state, ckpt, position)


def _first_train_batch(data: DataBundle) -> SparseBatch:
    with Loader(data.train_source, data.packer, shuffle=False, epochs=None if not isinstance(
            data.train_source, Examples) else 1, prefetch=1) as loader:
        return next(iter(loader))


def train(cfg: RunConfig, *, log: Callable[[str], None] = print) -> dict:
    """Train (or resume) a run to `cfg.steps`, evaluating and checkpointing on the way.

    Returns the summary (final eval metrics, steps, throughput). Raises
    `NonFiniteLossError` naming the step when the loss becomes NaN/inf; the run
    directory keeps the last good checkpoint.
    """
    run = build_run(cfg, log=log)
    existing = run.checkpointer.latest_step()
    if not cfg.resume and existing is not None:
        run.checkpointer.close()
        raise _config.ConfigError(
            f"{cfg.run_dir} already holds checkpoints (latest step {existing}) and resume=false;"
            f" choose another name= or out_dir=, or resume=true to continue that run")
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(_config.to_dict(cfg), f, sort_keys=False)
    try:
        return fit(run, log=log)
    finally:
        run.checkpointer.close()


def fit(run: Run, *, log: Callable[[str], None] = print) -> dict:
    """The training loop of a built `Run` (see `train`)."""
    cfg, trainer = run.cfg, run.trainer
    total = run.total_steps
    state = run.state
    start = int(state.step)
    metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
    runlog = _RunLog(metrics_path, start)
    b = run.data.packer.batch_size
    model_name = cfg.model.name
    log(f"training {model_name} for {total} steps (from step {start}), batch {b}, "
        f"{len(run.data.features)} sparse features, "
        f"{sum(t.vocab_size for t in run.data.tables):,} table rows, run dir {cfg.run_dir}")

    def evaluate(step):
        result = trainer.evaluate(state, run.data.eval_batches)
        runlog.write({"kind": "eval", "step": step, **_plain(result)})
        log(f"eval @ {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()
                                           if k != "examples"))
        return result

    def save(step, position):
        run.checkpointer.save(state, data_position=position,
                              extra={"config": _config.to_dict(cfg)})

    epochs = None if run.data.steps_per_epoch is None else math.ceil(
        total / run.data.steps_per_epoch) + 1
    loader = Loader(run.data.train_source, run.data.packer, shuffle=cfg.data.shuffle,
                    seed=cfg.seed, epochs=epochs, prefetch=cfg.data.prefetch,
                    device_put=True, position=run.position)
    bar = _progress(cfg.progress, total, start)
    pending: tuple[int, jax.Array] | None = None
    window: list[float] = []
    t_start, t_end, steps_timed = None, None, 0
    eval_result: dict = {}
    try:
        it = iter(loader)
        for step in range(start + 1, total + 1):
            batch = next(it)
            state, m = trainer.train_step(state, batch)
            if pending is not None:  # check the previous step while this one runs
                _check_finite(*pending, run.checkpointer)
                window.append(float(pending[1]))
            pending = (step, m["loss"])
            if t_start is None:
                jax.block_until_ready(m["loss"])
                t_start = time.perf_counter()  # compilation excluded from throughput
            else:
                steps_timed += 1
            if bar is not None:
                bar.update(1)
            if step % cfg.log_every == 0 or step == total:
                _check_finite(*pending, run.checkpointer)
                window.append(float(m["loss"]))
                pending = None
                rate = steps_timed * b / max(time.perf_counter() - t_start, 1e-9)
                loss = float(np.mean(window))
                runlog.write({"kind": "train", "step": step, "loss": loss,
                              "samples_per_s": rate})
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:,.0f}")
                else:
                    log(f"step {step}: loss {loss:.4f}, {rate:,.0f} samples/s")
                window = []
            if cfg.eval_every and step % cfg.eval_every == 0 and step != total:
                eval_result = evaluate(step)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step != total:
                if pending is not None:
                    _check_finite(*pending, run.checkpointer)
                save(step, loader.position.to_dict())
        if pending is not None:
            _check_finite(*pending, run.checkpointer)
        t_end = time.perf_counter()
        end = int(state.step)
        if end > start or not eval_result:
            eval_result = evaluate(end)
        if end > start:
            save(end, loader.position.to_dict())
    finally:
        loader.close()
        if bar is not None:
            bar.close()
        run.state = state
    elapsed = (t_end - t_start) if t_start else 0.0
    summary = {"step": int(state.step), "eval": _plain(eval_result),
               "train_samples_per_s": steps_timed * b / elapsed if elapsed else None,
               "run_dir": os.path.abspath(cfg.run_dir)}
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot_curves(metrics_path, os.path.join(cfg.run_dir, "curves.png"))
    log(f"done: step {summary['step']}, run dir {cfg.run_dir} (metrics.jsonl, curves.png, "
        f"checkpoints/)")
    return summary


def _check_finite(step: int, loss: jax.Array, ckpt: Checkpointer) -> None:
    value = float(loss)
    if not math.isfinite(value):
        last = ckpt.latest_step()
        where = (f"the last good checkpoint is step {last} in {ckpt.directory}"
                 if last is not None else "no checkpoint was written before it")
        raise NonFiniteLossError(f"training loss is {value} at step {step}; stopped ({where}). "
                                 f"Lower the learning rates or check the data.")


def _plain(d: dict) -> dict:
    return {k: (float(v) if isinstance(v, (np.floating, float, np.ndarray, jax.Array))
                and not isinstance(v, int) else v) for k, v in d.items()}


def _progress(enabled: bool, total: int, start: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)


def evaluate_run(run_dir: str, *, step: int | None = None, overrides: Sequence[str] = (),
                 log: Callable[[str], None] = print) -> dict:
    """Evaluate a run's checkpoint (default: latest) on its eval split."""
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(cfg_path):
        raise _config.ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = load_config([cfg_path], [*overrides, "resume=false"])
    data = build_data(cfg)
    model = build_model(cfg, data.tables, data.features)
    trainer = Trainer(model, dense_optimizer(cfg.optimizer))
    template = trainer.init(jax.random.key(cfg.seed), data.eval_batches[0])
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"),
                        trainer.layouts)
    try:
        state, _ = ckpt.restore(template, step)
    finally:
        ckpt.close()
    result = trainer.evaluate(state, data.eval_batches)
    log(f"eval of {run_dir} @ step {int(state.step)}: " + ", ".join(
        f"{k} {v:.4f}" for k, v in result.items() if k != "examples"))
    return {"step": int(state.step), **_plain(result)}
