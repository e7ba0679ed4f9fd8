"""The training knobs of a run's config, turned into what `sparsejax.train` takes: the
model's dropout and embedding initializer (`model.dropout`, `model.embedding_init`), the
dense optax transformation and the trainer's sparse schedule and L2 (`optimizer.*`), and
the hooks of the training loop (`early_stopping`, `eval_every: epoch`).

`build_trainer` serves every job that builds a trainer (train and eval: the optimizer
state of a checkpoint must have the structure the config gives); `run_knobs` is a
`sparsejax.train.Hook` that `train_run` adds to `fit`, and reports `last_eval` and
`best_eval` for summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..checkpoint import Checkpointer
from ..train import EarlyStopping, Hook, Trainer, candidate_metric_names
from ._config import ConfigError
from ._data import DataBundle
from ._model import configured_model
from ._optim import dense_optimizer
from ._plan import place_tables
from ._schema import RunConfig

BEST_DIR = "checkpoints_best"
"""Where a run keeps its best state (`early_stopping.keep_best`), next to checkpoints/."""


def total_steps(cfg: RunConfig, data: DataBundle) -> int | None:
    """The run's training steps (`steps`, or `epochs` of file data); None if unknown."""
    if cfg.steps is not None:
        return cfg.steps
    per_epoch = data.steps_per_epoch
    return None if per_epoch is None else cfg.epochs * per_epoch


def _schedule(cfg: RunConfig, total: int | None):
    opt = cfg.optimizer
    try:
        return opt.schedule.resolve(total)
    except ValueError as e:
        raise ConfigError(
            f"optimizer.schedule: decay {opt.schedule.decay!r} with decay_steps=null decays "
            f"over the whole run, but the run's length is unknown (epochs of generated "
            f"data); set optimizer.schedule.decay_steps"
        ) from e


def build_trainer(
    cfg: RunConfig, data: DataBundle, *, log: Callable[[str], None] = print, **trainer_kw
) -> tuple[Any, Trainer]:
    """The configured model over `data`'s specs and its `Trainer`: dense optimizer with
    the schedule and weight decay, tables' learning rates following the schedule, L2 on
    touched rows (`trainer_kw` go to the trainer). With more than one device or a pinned
    table (`sharding`, `tables.<name>.placement`), the trainer gets the run's mesh and
    the model is built over its tables with their planned placements, the plan printed
    through `log` (`runner._plan.place_tables`); a `mesh` given in `trainer_kw` is used
    as is."""
    tables = data.tables
    if "mesh" not in trainer_kw:
        tables, mesh = place_tables(cfg, data.tables, data.features, log=log)
        if mesh is not None:
            trainer_kw["mesh"] = mesh
    model = configured_model(cfg, tables, data.features)
    opt, total = cfg.optimizer, total_steps(cfg, data)
    sched = None if opt.schedule.is_constant else _schedule(cfg, total)
    trainer = Trainer(
        model,
        dense_optimizer(dataclasses.replace(opt, schedule=sched) if sched else opt, total),
        sparse_schedule=sched if sched is not None and opt.schedule_on != "dense" else None,
        sparse_l2=opt.sparse_l2,
        **trainer_kw,
    )
    return model, trainer


def eval_every(cfg: RunConfig, data: DataBundle) -> int | None:
    """`eval_every` in steps: "epoch" is the file data's steps per epoch."""
    if cfg.eval_every != "epoch":
        return cfg.eval_every
    if data.steps_per_epoch is None:
        raise ConfigError(
            "eval_every=epoch needs file data (generated data has no epochs); give a "
            "number of steps"
        )
    return data.steps_per_epoch


def _past_evals(metrics_path: str, upto: int) -> list[tuple[int, dict]]:
    """The eval records of `metrics.jsonl` up to step `upto` (what a resumed run saw)."""
    if upto <= 0 or not os.path.exists(metrics_path):
        return []
    out = []
    with open(metrics_path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "eval" and r.get("step", 0) <= upto:
                out.append((r["step"], {k: v for k, v in r.items() if k not in ("kind", "step")}))
    return out


class RunKnobs(Hook):
    """The hooks a run's knobs add to `fit` (early stopping and keep-best), the resolved
    `eval_every`, and the `last_eval` / `best_eval` entries of summary.json. Without
    `early_stopping`, `early` only tracks the best eval (never stops, keeps nothing)."""

    def __init__(self, eval_every: int | None, early: EarlyStopping | None, log: Callable):
        self.eval_every = eval_every
        self.early = early
        self.log = log

    def after_step(self, step, state, metrics) -> None:
        if self.early is not None:
            self.early.after_step(step, state, metrics)

    def on_eval(self, step, result) -> bool:
        return bool(self.early is not None and self.early.on_eval(step, result))

    def on_end(self, step, state) -> None:
        if self.early is None:
            return
        self.early.on_end(step, state)
        e = self.early
        if e.stopped_at is not None:
            self.log(
                f"early stopping at step {e.stopped_at}: no {e.metric} improvement in "
                f"{e.patience} evals"
            )
        if e.best_step is not None:
            where = f" (saved in {e.best_checkpoint})" if e.best_checkpoint else ""
            self.log(f"best {e.metric} {e.best_value:.4f} at step {e.best_step}{where}")
        warning = e.logloss_warning() if e.best_checkpoint else None  # the kept model's
        if warning:
            self.log(f"warning: {warning}")
        self.close()

    def close(self) -> None:
        if self.early is not None and self.early.checkpointer is not None:
            self.early.checkpointer.close()
            self.early.checkpointer = None

    def summary(self, step: int, last: Mapping) -> dict:
        """summary.json's evals: `last_eval` (its step and metrics: `last`, the eval of
        the state after `step`), `best_eval` (step, metric, mode, checkpoint: where it was
        kept or null, and its metrics; by `early_stopping.metric`, else by auc, or loss
        for models without auc) and `stopped_at` (null: not stopped early)."""
        out: dict = {"last_eval": {"step": step, **last}}
        if self.early is not None:
            out |= self.early.summary()
        return out


def run_knobs(run, log: Callable[[str], None] = print) -> RunKnobs:
    """The knobs of a built `Run` (`sparsejax.runner.build_run`) for its `fit`: resolves
    `eval_every`, and with `early_stopping` builds the `EarlyStopping` hook (its best
    state in RUN/checkpoints_best when `keep_best`), without it one that only tracks the
    best eval (auc; loss for models without auc), either resumed from the evals the run
    directory's metrics.jsonl records up to the state's step."""
    cfg = run.cfg
    every = eval_every(cfg, run.data)
    es = cfg.early_stopping
    # without early_stopping: the best eval is tracked (summary.json's best_eval) only
    early = EarlyStopping("auc" if run.trainer.task == "binary" else "loss")
    if es is not None:
        if not run.data.eval_batches:
            raise ConfigError("early_stopping needs eval data (data.eval_batches > 0)")
        ckpt = None
        if es.keep_best:
            ckpt = Checkpointer(  # host rows saved full, leaving the run's deltas complete
                os.path.join(cfg.run_dir, BEST_DIR),
                run.checkpointer.layouts,
                max_to_keep=1,
                host=run.trainer.host,
                tracks_changes=False,
            )
        early = EarlyStopping(
            es.metric,
            mode=es.mode,
            patience=es.patience,
            min_delta=es.min_delta,
            checkpointer=ckpt,
        )
        # the metric's name is checked now (one eval batch), not after the first eval
        ranked = (getattr(run.data, "ranking", None) or {}).get("eval") is not None
        if ranked:
            names = candidate_metric_names(run.trainer.task, cfg.eval_ks)
        else:
            names = set(run.trainer.evaluate(run.state, run.data.eval_batches[:1]))
        if es.metric not in names:
            if ckpt is not None:
                ckpt.close()
            name, at, k = es.metric.partition("@")
            hint = (
                f"; add {k} to eval_ks (eval_ks=[{', '.join(map(str, (*cfg.eval_ks, k)))}])"
                if ranked and at and name in ("hr", "ndcg") and k.isdigit()
                else ""
            )
            raise ConfigError(
                f"early_stopping.metric={es.metric!r} is not an eval metric of "
                f"{cfg.model.name} (they are {sorted(k for k in names if k != 'examples')})" + hint
            )
    early.replay(_past_evals(os.path.join(cfg.run_dir, "metrics.jsonl"), int(run.state.step)))
    return RunKnobs(every, early, log)
