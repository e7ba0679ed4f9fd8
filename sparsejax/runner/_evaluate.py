"""`sparsejax eval`: a run directory's checkpoint restored and evaluated on a split of
its data, optionally writing one prediction per example."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ..checkpoint import Checkpointer
from ..train import Trainer, TrainState, candidate_eval
from ..train import write_predictions as write_columns
from ._config import ConfigError
from ._data import DataBundle, build_data
from ._knobs import BEST_DIR, build_trainer
from ._report import format_metrics, plain
from ._run_dir import _checkpoint_steps_in
from ._schema import RunConfig, load_config


def evaluate_run(
    run_dir: str,
    *,
    step: int | str | None = None,
    split: str = "eval",
    predictions: str | os.PathLike | None = None,
    ks: Sequence[int] = (10,),
    overrides: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> dict:
    """Evaluate a run directory's checkpoint on a split of its data.

    Args:
      run_dir: the run directory (its config.yaml names the data by absolute paths,
        so this works from any directory).
      step: a checkpoint step, "last" / None (the newest readable checkpoint; an
        unreadable newer one is skipped with a warning), or "best" (the best eval's
        state, kept by `early_stopping`).
      split: "eval" (the split evaluated during training) or "test".
      predictions: also write one row per example (`row`: its index in the split,
        `label`, `score`: the predicted probability, or a retrieval model's score of
        the example's own item) to this `.parquet` (needs pyarrow), `.csv` or `.tsv`
        file (`.gz`: compressed).
      ks: the k of HR@k / NDCG@k, for data with candidate sets (data.kind=events).
      overrides: `key=value` config overrides (e.g. `data.eval_batch_size=4096`).

    Returns:
      `{"step", "split", metrics...}` (and `"predictions"`: the file written).
    """
    if split not in ("eval", "test"):
        raise ConfigError(f"--split {split!r}: expected eval or test")
    if predictions is not None:
        _check_predictions_path(os.fspath(predictions))
    cfg, data, trainer, state = restore_run(run_dir, step=step, overrides=overrides, log=log)
    batches = data.eval_batches if split == "eval" else data.test_batches
    if not batches:
        raise ConfigError(
            f"--split {split}: the run's data has no {split} split"
            + (
                " (set data.test, or data.split with an eval part that leaves a test part)"
                if split == "test"
                else ""
            )
        )
    sets = (getattr(data, "ranking", None) or {}).get(split)
    if sets is not None:  # candidate sets: HR@k, NDCG@k, MRR, GAUC
        result = candidate_eval(trainer, state, sets, data.packer, batches, ks=tuple(ks))
    else:
        result = trainer.evaluate(state, batches)
    label = f"{split} of {run_dir} @ step {int(state.step)}" + (" (best)" if step == "best" else "")
    log(f"{label}: {format_metrics(result)}")
    out = {"step": int(state.step), "split": split, **plain(result)}
    if predictions is not None:
        rows = getattr(data, f"{split}_rows", None)
        n = write_predictions(os.fspath(predictions), trainer, state, batches, rows=rows)
        log(f"wrote {n:,} predictions to {predictions}")
        out["predictions"] = os.path.abspath(predictions)
    return out


def restore_run(
    run_dir: str,
    *,
    step: int | str | None = None,
    overrides: Sequence[str] = (),
    log: Callable[[str], None] = print,
    check: Callable[[DataBundle], None] | None = None,
) -> tuple[RunConfig, DataBundle, Trainer, TrainState]:
    """A run directory's config, data, trainer and a checkpoint's state (placed): what
    `evaluate_run` and `export_run` (`sparsejax export`) start from. `step`: a checkpoint
    step, "last" / None (the newest readable one; an unreadable newer one is skipped
    with a warning) or "best" (kept by `early_stopping`). `check` sees the data (its
    tables and features) before anything is restored, to refuse early."""
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(cfg_path):
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    best_dir = os.path.join(run_dir, BEST_DIR)  # kept by early_stopping
    if step == "best" and not _checkpoint_steps_in(best_dir):
        raise ConfigError(
            f"--step best: {run_dir} has no best checkpoint ({best_dir} is empty or missing; "
            f"it is kept by early_stopping with keep_best: true)"
        )
    where = best_dir if step == "best" else os.path.join(run_dir, "checkpoints")
    if not _checkpoint_steps_in(where):
        raise ConfigError(f"{run_dir} has no checkpoint yet ({where} is empty or missing)")
    cfg = load_config([cfg_path], [*overrides, "resume=false"])
    data = build_data(cfg)
    if check is not None:
        check(data)
    _, trainer = build_trainer(cfg, data, log=log)  # knobs, mesh, plan: runner/_knobs.py
    template = trainer.init(jax.random.key(cfg.seed), data.eval_batches[0], tables=False)
    ckpt = Checkpointer(where, trainer.layouts, host=trainer.host)
    try:
        if step in (None, "last", "best"):
            state, _, _ = ckpt.restore_readable(template, warn=lambda m: log(f"warning: {m}"))
        else:
            state, _ = ckpt.restore(template, int(step))
    finally:
        ckpt.close()
    return cfg, data, trainer, trainer.put_state(state)


def _check_predictions_path(path: str) -> None:
    """Before any work: a file name `sparsejax.train.write_predictions` can write."""
    base = path.removesuffix(".gz")
    if base.endswith(".parquet"):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"--predictions {path}: writing Parquet needs pyarrow (pip install pyarrow);"
                f" or give a .csv path"
            ) from None
    elif not base.endswith((".csv", ".tsv")):
        raise ConfigError(f"--predictions {path}: expected a .parquet, .csv or .tsv file name")


def predictions(trainer: Trainer, state: TrainState, batches, rows=None) -> dict[str, np.ndarray]:
    """Per-example `row` (index in the split, or `rows[i]`), `label` and `score` (the
    probability of a binary model; a retrieval model's score of the example's own item,
    the diagonal of its in-batch scores) over `batches`, padded rows left out."""
    labels, scores = [], []
    for batch in batches:
        out = np.asarray(trainer.eval_step(state, batch), np.float64)
        mask = np.asarray(batch.mask) > 0
        if trainer.task == "binary":
            score = 1.0 / (1.0 + np.exp(-out.reshape(len(mask))))
        else:
            score = np.diagonal(out)
        labels.append(np.asarray(batch.labels, np.float64).reshape(len(mask))[mask])
        scores.append(score[mask])
    label, score = np.concatenate(labels), np.concatenate(scores)
    row = np.arange(len(label)) if rows is None else np.asarray(rows)[: len(label)]
    return {"row": row.astype(np.int64), "label": label.astype(np.float32), "score": score}


def write_predictions(path: str, trainer: Trainer, state: TrainState, batches, *, rows=None) -> int:
    """Write `predictions(...)` with `sparsejax.train.write_predictions` (Parquet, CSV or
    TSV by the file's extension); returns the number of rows."""
    cols = predictions(trainer, state, batches, rows)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_columns(path, cols)
    return len(cols["row"])
