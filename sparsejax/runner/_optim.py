"""The `optimizer` section and the optimizers it builds: the tables' sparse optimizer
(`sparse_optimizer`) and the dense parameters' optax transformation (`dense_optimizer`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from ..ops import optimizers as sparse_optimizers
from ..train import Schedule
from ._config import ConfigError
from ._options import check_range, typed_options


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
