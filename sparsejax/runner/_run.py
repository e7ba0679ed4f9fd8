"""The jobs behind `sparsejax train`: build a run from its config (resuming from its
latest checkpoint) and train it with `sparsejax.train.fit`, writing the run directory
(`_run_dir`: which config it belongs to, what may change on resume).
"""

from __future__ import annotations

import dataclasses
import math
import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from ..checkpoint import Checkpointer
from ..data import Loader, resplit_stream_positions
from ..sharding import allgather_json, broadcast_text
from ..train import ProfileWindow, Trainer, TrainState, candidate_eval, fit
from ._config import ConfigError, to_dict
from ._data import DataBundle, build_data, first_train_batch
from ._knobs import build_trainer, run_knobs
from ._lock import LOCK_NAME, RunLock, RunLockedError
from ._model import model_warnings
from ._publish import PublishHook
from ._report import (
    Console,
    MetricsLog,
    plain,
    plot_curves,
    tensorboard_log,
    write_summary,
)
from ._run_dir import (
    _checkpoint_steps_in,
    _first_missing,
    _no_new_checkpoint,
    _prepare_run_dir,
    _record_start,
    _remove_new,
    _RunLogFile,
    config_hash,
    resolved_config,
)
from ._schema import RunConfig


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
    log_window: list = dataclasses.field(default_factory=list)
    """The losses since the last log record of the restored checkpoint (`fit`'s
    `log_window`)."""

    @property
    def total_steps(self) -> int:
        if self.cfg.steps is not None:
            return self.cfg.steps
        if self.data.steps_per_epoch is None:
            raise ConfigError("`epochs` needs file data; use `steps` for generators")
        return self.cfg.epochs * self.data.steps_per_epoch


def build_run(cfg: RunConfig, *, log: Callable[[str], None] = print) -> Run:
    """Data, model, trainer and the initial (or resumed) state of a run.

    Resuming reads the newest readable checkpoint: an unreadable newer one (truncated,
    corrupt) is named in a warning and moved to `RUN/checkpoints_unreadable/`.
    """
    os.makedirs(cfg.run_dir, exist_ok=True)
    data = build_data(cfg)
    if data.report:
        log(f"data: {data.report}")
    for line in model_warnings(cfg, data):
        log(f"warning: {line}")
    if not data.eval_batches:
        raise ConfigError(
            "the eval split is empty: every run evaluates (during training and at the end);"
            " give data.eval files or a split with eval rows"
        )
    model, trainer = build_trainer(cfg, data, log=log)  # knobs, mesh, plan: runner/_knobs.py
    first = first_train_batch(data)
    ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    # resuming: the tables only described (a restore template), never held twice
    resume = cfg.resume and bool(_checkpoint_steps_in(ckpt_dir))
    state = trainer.init(jax.random.key(cfg.seed), first, tables=not resume)  # makes .host
    ckpt = Checkpointer(
        ckpt_dir,
        trainer.layouts,  # each layer's store on the trainer's mesh
        max_to_keep=cfg.keep_checkpoints,
        host=trainer.host,
        full_every=cfg.checkpoint_full_every,
    )
    position: dict = {"epoch": 0, "batch": 0}
    log_window: list = []
    if resume:
        state, meta, skipped = ckpt.restore_readable(state, warn=lambda m: log(f"warning: {m}"))
        if jax.process_index() == 0:  # the run directory is process 0's
            for s in skipped:  # out of the way of this run's next save of that step
                log(f"warning: moved unreadable checkpoint {s} to {ckpt.set_aside(s)}")
        if skipped and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("sparsejax: unreadable checkpoints set aside")
        state = trainer.put_state(state)
        position = _own_position(meta["data_position"])
        log_window = list((meta.get("extra") or {}).get("log_window", []))
        log(f"resumed from {ckpt.directory}/{int(state.step)} (data position {position})")
    return Run(cfg, data, model, trainer, state, ckpt, position, log_window)


def _own_position(position: dict | None) -> dict | None:
    """This process's data position from a checkpoint's: per process when the train
    source is split by process (streamed files; `_data_position`), else shared. Saved
    by another number of processes, the rest of the epoch is re-split
    (`sparsejax.data.resplit_stream_positions`: each old process's remaining share goes
    whole to one new process; docs/data.md)."""
    if isinstance(position, Mapping) and "processes" in position:
        mine = position["processes"]
        if len(mine) != jax.process_count():
            try:
                mine = resplit_stream_positions(mine, jax.process_count())
            except ValueError as e:
                raise ConfigError(f"the checkpoint's data position: {e}") from None
        return mine[jax.process_index()]
    return position


def _data_position(loader: Loader) -> Callable[[], dict]:
    """What a checkpoint records of the data: the loader's position; with many
    processes streaming their own files, every process's (a collective: all call it)."""
    if jax.process_count() == 1 or not loader.streaming:
        return lambda: loader.position.to_dict()

    def gathered() -> dict:
        return {"processes": allgather_json(loader.position.to_dict())}

    return gathered


def table_stats(trainer: Trainer) -> dict | None:
    """Per table with host work ("layer/table") its host side's stats (rows live,
    admitted, rejected, evicted, lookups, cache hit rate...), for summary.json; None
    without host work."""
    return _jsonable(trainer.host.stats()) or None


def _tables_line(stats: Mapping[str, Mapping]) -> str:
    """The host-side stats in one line (all of them are in summary.json): the tiered
    tables (those with host rows), their rows live and cache hit rates."""
    rows = {k: s for k, s in stats.items() if "rows_live" in s}
    live = sum(int(s["rows_live"]) for s in rows.values())
    text = f"tables: {len(rows)} tiered, {live:,} rows live"
    hits = {k: s["cache_hit_rate"] for k, s in stats.items() if s.get("cache_hit_rate") is not None}
    if hits:
        low = min(hits, key=hits.get)
        text += (
            f", cache hit rate {sum(hits.values()) / len(hits):.3f} on average "
            f"(lowest {low.split('/')[-1]} {hits[low]:.3f})"
        )
    return text + " (per table: summary.json)"


def _jsonable(tree: Any) -> Any:
    """Nested stats as JSON values (numpy scalars and 0-d arrays as Python numbers)."""
    if isinstance(tree, Mapping):
        return {str(k): _jsonable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_jsonable(v) for v in tree]
    if isinstance(tree, (np.ndarray, jax.Array)):
        return _jsonable(np.asarray(tree).tolist())
    if isinstance(tree, np.generic):
        return tree.item()
    return tree


def train(cfg: RunConfig, *, restart: bool = False, log: Callable[[str], None] = print) -> dict:
    """Train (or resume) a run to `cfg.steps`, evaluating and checkpointing on the way.

    The run directory is locked for the duration, and checked before any data is read:
    a run of a different config there is refused naming the keys that differ (only the
    `RESUMABLE_KEYS` may change on resume); `restart=True` moves the old run aside to
    `RUN.replaced-<time>` and starts over. Everything logged goes to `RUN/run.log` too,
    with the traceback of an error that ends the run (its path in the exception's
    `run_log` attribute). A start refused before it trains (a config or data error)
    removes what it created: the run directory when it made it, else the entries it
    added (a previous run's files stay; its run.log keeps the refused attempt).

    In many processes (`sparsejax launch`, `jax.distributed`) every process calls this
    with the same config: process 0 locks and checks the run directory and writes its
    files (run.json, config.yaml, run.log, metrics.jsonl, tensorboard/, summary.json,
    curves.png, the console), then tells the others whether the run starts (they raise
    its error when it does not); every process builds the same run, feeds its share of
    each global batch and takes part in every checkpoint save.

    Returns the summary, as summary.json: `step`, `last_eval` and `best_eval` (each
    with its step; the best also by which metric, and where it was kept), throughput. Raises
    `NonFiniteLossError` naming the step when the loss becomes NaN/inf; the run
    directory keeps the last good checkpoint. `RunLockedError` when another process
    trains in the run directory; `ConfigError` for the config problems above.
    """
    cfg = resolved_config(cfg)
    primary = jax.process_index() == 0
    lock = RunLock(cfg.run_dir, log=log) if primary else None
    notes, entry, failure = [], {}, None
    made, before = _first_missing(cfg.run_dir), set()  # what a refused start removes
    if lock is not None:  # process 0 owns the run directory
        try:
            lock.acquire()
            notes, entry = _prepare_run_dir(cfg, restart=restart)
            before = set(os.listdir(cfg.run_dir)) - {LOCK_NAME} if made is None else set()
        except Exception as e:
            lock.release()
            failure = e
    _agree_on_start(failure)  # the others learn process 0's outcome (and raise its error)
    if failure is not None:
        raise failure
    run_log = _RunLogFile(os.path.join(cfg.run_dir, "run.log")) if primary else None
    run = None
    try:
        if run_log is not None:
            log = run_log.tee(log)
        many = jax.process_count()
        log(
            f"sparsejax train: pid {os.getpid()}, config sha256 {config_hash(cfg)[:12]}"
            + (f", process {jax.process_index()} of {many}" if many > 1 else "")
        )
        for line in notes:
            log(line)
        run = build_run(cfg, log=log)
        if primary:
            _record_start(cfg, {**entry, "processes": many} if many > 1 else entry)
        try:
            return train_run(run, log=log)
        finally:
            run.checkpointer.close()
    except BaseException as e:
        if run_log is not None:
            try:
                run_log.write("".join(traceback.format_exception(e)))
                e.run_log = run_log.path  # type: ignore[attr-defined]
            except OSError:  # e.g. the disk is full: the error may be that one; keep it
                pass
        # refused (a config or data error) before it trained, as opposed to a failure
        # in training or a bug, whose traceback stays in run.log
        refused = isinstance(e, ValueError) and (run is None or isinstance(e, ConfigError))
        if primary and refused and _no_new_checkpoint(cfg, entry):
            _remove_new(cfg.run_dir, made, before)
            if made is not None:
                e.run_log = None  # type: ignore[attr-defined]  # removed with the run
        raise
    finally:
        if lock is not None:
            lock.release()


def _agree_on_start(failure: BaseException | None) -> None:
    """Many processes: process 0 (which locks and checks the run directory) tells the
    others whether the run starts; when it does not, they raise the same error (a
    `RunLockedError` or `ConfigError` with process 0's message), so no process waits
    for a run that never comes. One process: nothing."""
    if jax.process_count() == 1:
        return
    text = None
    if failure is not None:
        text = f"{type(failure).__name__}\n{' '.join(str(failure).split())}"
    got = broadcast_text(text)
    if got is None or jax.process_index() == 0:
        return
    kind, _, message = got.partition("\n")
    if kind == "RunLockedError":
        raise RunLockedError(message)
    if kind in ("ConfigError", "ValueError"):
        raise ConfigError(message)
    raise RuntimeError(f"process 0 could not start the run: {kind}: {message}")


def run_evaluator(run: Run) -> Callable[[TrainState], dict]:
    """What the evals during training compute: the trainer's metrics on the eval batches;
    on the eval split's candidate sets when the data has them, hr@k/ndcg@k/mrr/gauc (k
    from `eval_ks`; early stopping can watch them) and only those row metrics that mean
    something on sampled candidates (`sparsejax.train._ranking.candidate_eval`)."""
    sets = (getattr(run.data, "ranking", None) or {}).get("eval")

    def evaluate(state: TrainState) -> dict:
        if sets is None:
            return run.trainer.evaluate(state, run.data.eval_batches)
        return candidate_eval(
            run.trainer, state, sets, run.data.packer, run.data.eval_batches, ks=run.cfg.eval_ks
        )

    return evaluate


def train_loader(run: Run, *, epochs: int | None, position: dict | None = None) -> Loader:
    """The run's train batches as its config says (shuffle, prefetch, workers), from
    `position`."""
    cfg = run.cfg
    return Loader(
        run.data.train_source,
        run.data.packer,
        shuffle=cfg.data.shuffle,
        seed=cfg.seed,
        epochs=epochs,
        prefetch=cfg.data.prefetch,
        shuffle_buffer=cfg.data.shuffle_buffer,
        workers=cfg.data.workers,
        # tiered tables: the host maps the raw int64 ids to cache slots first;
        # host-executed tables: the host looks their ids up; tables placed on a mesh:
        # the trainer splits the host batch per device
        device_put=not run.trainer.host.maps_batches and not run.trainer.shards_batch,
        position=position,
    )


def _profile_window(run: Run, log: Callable[[str], None]) -> list:
    """The `profile_steps` hook of a run (process 0's), if set."""
    window = run.cfg.profile_steps
    if window is None or jax.process_index() != 0:
        return []
    if any(t.is_tiered for t in run.data.tables):
        raise ConfigError(
            "profile_steps: a run with dynamic or host-cached tables cannot be traced by "
            "step (its batches are remapped on the host); use `sparsejax profile`"
        )
    first, count = window
    out = os.path.join(run.cfg.run_dir, f"profile_steps_{first}")
    return [ProfileWindow(run.trainer, first, count, out, log=log)]


def train_run(run: Run, *, log: Callable[[str], None] = print) -> dict:
    """Train a built `Run` to its total steps with `sparsejax.train.fit`, writing the run
    directory's metrics, curves and summary (see `train`); returns the summary."""
    cfg = run.cfg
    total, start = run.total_steps, int(run.state.step)
    metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
    tiered = sum(t.is_tiered for t in run.data.tables)
    primary, many = jax.process_index() == 0, jax.process_count()
    log(
        f"training {cfg.model.name} for {total} steps (from step {start}), batch "
        f"{cfg.data.batch_size}"
        + (f" ({cfg.data.batch_size // many} per process)" if many > 1 else "")
        + f", {len(run.data.features)} sparse features, "
        f"{sum(t.device_rows for t in run.data.tables):,} device table rows"
        + (f" ({tiered} tiered tables)" if tiered else "")
        + f", run dir {cfg.run_dir}"
    )
    metrics_log = MetricsLog(metrics_path, start) if primary else None  # past `start` dropped
    if many > 1:  # the others read metrics.jsonl (early stopping's replay) once it is cut
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("sparsejax: metrics.jsonl ready")
    knobs = run_knobs(run, log)  # training knobs (runner/_knobs.py): eval_every, early stop
    epochs = (
        None
        if run.data.steps_per_epoch is None
        else math.ceil(total / run.data.steps_per_epoch) + 1
    )
    loader = train_loader(run, epochs=epochs, position=run.position)
    # the run directory's files and the terminal are process 0's
    console = Console(log, progress=cfg.progress and primary, total=total, start=start)
    board = tensorboard_log(cfg.run_dir, start, log) if primary else None  # RUN/tensorboard/
    reports = [r for r in (metrics_log, board, console) if r is not None] if primary else []
    windows = _profile_window(run, log)
    publish = [PublishHook(run, log)] if cfg.publish is not None else []
    try:
        result = fit(
            run.trainer,
            run.state,
            loader,
            steps=total,
            eval_batches=run.data.eval_batches,
            eval_every=knobs.eval_every,
            checkpointer=run.checkpointer,
            checkpoint_every=cfg.checkpoint_every,
            data_position=_data_position(loader),
            checkpoint_extra={"config": to_dict(cfg), "config_sha256": config_hash(cfg)},
            log_every=cfg.log_every,
            hooks=[*reports, knobs, *windows, *publish],
            evaluate=run_evaluator(run),
            log_window=run.log_window,
        )
    finally:
        loader.close()
        console.close()
        if board is not None:
            board.close()
        knobs.close()
        for w in windows:  # a run that fails inside the window leaves no partial trace
            w.close()
    run.state = result.state
    step = int(result.state.step)
    summary = {
        "step": step,
        **knobs.summary(step, plain(result.eval)),  # last_eval, best_eval (by what metric)
        "train_samples_per_s": result.samples_per_s,
        "run_dir": os.path.abspath(cfg.run_dir),
    }
    stats = table_stats(run.trainer)
    if stats is not None:
        summary["tables"] = stats
        log(_tables_line(stats))
    if primary:
        write_summary(os.path.join(cfg.run_dir, "summary.json"), summary)
        plot_curves(metrics_path, os.path.join(cfg.run_dir, "curves.png"))
    log(
        f"done: step {summary['step']}, run dir {cfg.run_dir} (metrics.jsonl, curves.png, "
        + ("tensorboard/, " if board is not None else "")
        + "checkpoints/)"
    )
    return summary
