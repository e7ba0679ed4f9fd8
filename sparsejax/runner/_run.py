"""The jobs behind `sparsejax train` and `sparsejax eval`: build a run from its config
(resuming from its latest checkpoint), train it with `sparsejax.train.fit`, evaluate a
run directory's checkpoint."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import yaml

from ..checkpoint import Checkpointer, embedding_layouts
from ..data import Loader
from ..train import Trainer, TrainState, fit
from ._build import DataBundle, build_data, build_model, first_train_batch
from ._config import ConfigError, to_dict
from ._report import (
    Console,
    MetricsLog,
    format_metrics,
    plain,
    plot_curves,
    write_summary,
)
from ._schema import RunConfig, dense_optimizer, load_config


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
            raise ConfigError("`epochs` needs file data; use `steps` for generators")
        return self.cfg.epochs * self.data.steps_per_epoch


def build_run(cfg: RunConfig, *, log: Callable[[str], None] = print) -> Run:
    """Data, model, trainer and the initial (or resumed) state of a run."""
    os.makedirs(cfg.run_dir, exist_ok=True)
    data = build_data(cfg)
    if data.report:
        log(f"data: {data.report}")
    model = build_model(cfg, data.tables, data.features)
    trainer = Trainer(model, dense_optimizer(cfg.optimizer))
    first = first_train_batch(data)
    ckpt = Checkpointer(
        os.path.join(cfg.run_dir, "checkpoints"),
        embedding_layouts(model, first),
        max_to_keep=cfg.keep_checkpoints,
    )
    state = trainer.init(jax.random.key(cfg.seed), first)
    position: dict = {"epoch": 0, "batch": 0}
    if cfg.resume and ckpt.latest_step() is not None:
        state, meta = ckpt.restore(state)
        state = trainer.put_state(state)
        position = meta["data_position"]
        log(f"resumed from {ckpt.directory}/{int(state.step)} (data position {position})")
    return Run(cfg, data, model, trainer, state, ckpt, position)


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
        raise ConfigError(
            f"{cfg.run_dir} already holds checkpoints (latest step {existing}) and resume=false;"
            f" choose another name= or out_dir=, or resume=true to continue that run"
        )
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    try:
        return train_run(run, log=log)
    finally:
        run.checkpointer.close()


def train_run(run: Run, *, log: Callable[[str], None] = print) -> dict:
    """Train a built `Run` to its total steps with `sparsejax.train.fit`, writing the run
    directory's metrics, curves and summary (see `train`); returns the summary."""
    cfg = run.cfg
    total, start = run.total_steps, int(run.state.step)
    metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
    log(
        f"training {cfg.model.name} for {total} steps (from step {start}), batch "
        f"{run.data.packer.batch_size}, {len(run.data.features)} sparse features, "
        f"{sum(t.vocab_size for t in run.data.tables):,} table rows, run dir {cfg.run_dir}"
    )
    epochs = (
        None
        if run.data.steps_per_epoch is None
        else math.ceil(total / run.data.steps_per_epoch) + 1
    )
    loader = Loader(
        run.data.train_source,
        run.data.packer,
        shuffle=cfg.data.shuffle,
        seed=cfg.seed,
        epochs=epochs,
        prefetch=cfg.data.prefetch,
        device_put=True,
        position=run.position,
    )
    console = Console(log, progress=cfg.progress, total=total, start=start)
    try:
        result = fit(
            run.trainer,
            run.state,
            loader,
            steps=total,
            eval_batches=run.data.eval_batches,
            eval_every=cfg.eval_every,
            checkpointer=run.checkpointer,
            checkpoint_every=cfg.checkpoint_every,
            data_position=lambda: loader.position.to_dict(),
            checkpoint_extra={"config": to_dict(cfg)},
            log_every=cfg.log_every,
            hooks=[MetricsLog(metrics_path, start), console],
        )
    finally:
        loader.close()
        console.close()
    run.state = result.state
    summary = {
        "step": int(result.state.step),
        "eval": plain(result.eval),
        "train_samples_per_s": result.samples_per_s,
        "run_dir": os.path.abspath(cfg.run_dir),
    }
    write_summary(os.path.join(cfg.run_dir, "summary.json"), summary)
    plot_curves(metrics_path, os.path.join(cfg.run_dir, "curves.png"))
    log(
        f"done: step {summary['step']}, run dir {cfg.run_dir} (metrics.jsonl, curves.png, "
        f"checkpoints/)"
    )
    return summary


def evaluate_run(
    run_dir: str,
    *,
    step: int | None = None,
    overrides: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> dict:
    """Evaluate a run's checkpoint (default: latest) on its eval split."""
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(cfg_path):
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = load_config([cfg_path], [*overrides, "resume=false"])
    data = build_data(cfg)
    model = build_model(cfg, data.tables, data.features)
    trainer = Trainer(model, dense_optimizer(cfg.optimizer))
    example = data.eval_batches[0]
    template = trainer.init(jax.random.key(cfg.seed), example)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), embedding_layouts(model, example))
    try:
        state, _ = ckpt.restore(template, step)
    finally:
        ckpt.close()
    result = trainer.evaluate(trainer.put_state(state), data.eval_batches)
    log(f"eval of {run_dir} @ step {int(state.step)}: {format_metrics(result)}")
    return {"step": int(state.step), **plain(result)}
