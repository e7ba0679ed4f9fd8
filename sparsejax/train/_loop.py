"""`fit`: the training loop (steps, evals, checkpoints, NaN stop) and the `Hook`s
through which logging, progress bars, profilers or a host-cache exchange take part."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ._trainer import Trainer, TrainState


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; training stopped."""


class Hook:
    """Takes part in `fit`; every method is optional (the defaults do nothing).

    Methods are called in this order at each step: `before_step` (before the batch is
    fed), then, after the step, `after_step`, `on_log` (on logging steps) and `on_eval`
    (on eval steps, with the eval metrics); `on_end` once after the last step and its
    final eval. A hook stops training by returning True from `after_step` (that step
    becomes the last one: logged, evaluated and saved as the end of training) or from
    `on_eval` (that eval's step becomes the last one: logged and saved, not evaluated
    again; e.g. `EarlyStopping`).
    """

    def before_step(self, step: int, batch) -> None:
        """`step` (1-based) is about to run on `batch`."""

    def after_step(self, step: int, state: TrainState, metrics: Mapping) -> bool | None:
        """`step` ran; `metrics["loss"]` is a device scalar (reading it waits for the step).
        Return True to stop training after this step."""

    def on_log(self, step: int, record: Mapping) -> None:
        """Every `log_every` steps and at the end: `{"step", "loss" (mean since the last
        record), "samples_per_s"}`; the loss is known finite."""

    def on_eval(self, step: int, result: Mapping) -> bool | None:
        """Eval metrics of the state after `step` (see `Trainer.evaluate`). Return True
        to stop training after this step (ignored at the final eval)."""

    def on_end(self, step: int, state: TrainState) -> None:
        """Training ended (last step reached or a hook stopped it) at `step`."""


@dataclasses.dataclass
class FitResult:
    """What `fit` returns."""

    state: TrainState
    eval: dict
    """The last eval metrics ({} without eval batches)."""
    samples_per_s: float | None
    """Training throughput, compilation (the first step), evals and saves excluded; None
    under 2 steps."""


def _check_finite(step: int, loss, checkpointer) -> float:
    value = float(loss)
    if not math.isfinite(value):
        last = None if checkpointer is None else checkpointer.latest_step()
        where = (
            f"the last good checkpoint is step {last} in {checkpointer.directory}"
            if last is not None
            else "no checkpoint was written before it"
        )
        raise NonFiniteLossError(
            f"training loss is {value} at step {step}; stopped ({where}). "
            f"Lower the learning rates or check the data."
        )
    return value


def fit(
    trainer: Trainer,
    state: TrainState,
    batches: Iterable,
    *,
    steps: int,
    eval_batches: Sequence = (),
    eval_every: int | None = None,
    checkpointer=None,
    checkpoint_every: int | None = None,
    data_position: Callable[[], Any] | None = None,
    checkpoint_extra: Mapping | None = None,
    log_every: int | None = None,
    hooks: Sequence[Hook] = (),
    evaluate: Callable[[TrainState], Mapping] | None = None,
    log_window: Sequence[float] = (),
) -> FitResult:
    """Train `state` from its step to `steps`, on `batches` (an iterable of batches from
    the data position matching the state's step; training ends early if it runs out).

    Every `eval_every` steps it evaluates on `eval_batches` (and at the end, if it
    trained or never evaluated); every `checkpoint_every` steps it saves through
    `checkpointer` (and at the end, if it trained), with `data_position()` and
    `checkpoint_extra` in the checkpoint's record, and the losses of the steps since the
    last log record as the record's `extra["log_window"]`: give them back as
    `log_window` when resuming from it, so the first record after a resume averages the
    same steps as an uninterrupted run's. Each step's loss is checked while the
    next step runs, and before every log, eval and checkpoint: a NaN/inf loss raises
    `NonFiniteLossError` naming the step and the last good checkpoint. `evaluate(state)`
    replaces what an eval computes (default `trainer.evaluate(state, eval_batches)`),
    e.g. to add ranking metrics of candidate sets for early stopping. With host-executed
    tables and `batches` that can `peek` (a `Loader`), each step is given the next batch
    to look up while it runs (`Trainer.train_step`'s `next_batch`).

    Example:
      >>> result = fit(trainer, state, loader, steps=1000, eval_batches=held_out,
      ...              eval_every=100, log_every=20, hooks=[MyProfiler()])
    """
    hooks = list(hooks)
    start = int(state.step)
    pending = None  # (step, loss) not yet checked
    window: list[float] = list(log_window) if log_every is not None else []
    eval_result: dict = {}
    t_start, timed, batch_size, paused = None, 0, 0, 0.0

    def due(every, step):
        return every is not None and step % every == 0

    evaluated_at = None

    def run_eval(step) -> bool:  # True: a hook stops training
        nonlocal eval_result, evaluated_at
        if evaluate is None:
            eval_result = trainer.evaluate(state, eval_batches)
        else:
            eval_result = dict(evaluate(state))
        evaluated_at = step
        return any([h.on_eval(step, eval_result) for h in hooks])  # every hook sees it

    def save():
        checkpointer.save(
            state,
            data_position=None if data_position is None else data_position(),
            extra={**(checkpoint_extra or {}), "log_window": window},
        )

    def check(step, loss):  # a step's loss, checked, into the log window
        value = _check_finite(step, loss, checkpointer)
        if log_every is not None:
            window.append(value)

    def rate():  # samples/s of training since the first step (evals and saves excluded)
        elapsed = time.perf_counter() - t_start - paused
        return timed * batch_size / max(elapsed, 1e-9) if timed else 0.0

    def log(step):  # the mean loss of the steps since the last record
        nonlocal window
        record = {"step": step, "loss": float(np.mean(window)), "samples_per_s": rate()}
        window = []
        for h in hooks:
            h.on_log(step, record)

    step = start
    it = iter(batches)
    look_ahead = getattr(it, "peek", None) if trainer.host.looks_ahead else None
    for step in range(start + 1, steps + 1):
        batch = next(it, None)
        if batch is None:  # the data ran out: the previous step was the last
            step -= 1
            break
        for h in hooks:
            h.before_step(step, batch)
        if look_ahead:  # the host side works on the next batch during this step
            state, metrics = trainer.train_step(state, batch, look_ahead())
        else:
            state, metrics = trainer.train_step(state, batch)
        if pending is not None:  # the previous step, checked while this one runs
            check(*pending)
        pending = (step, metrics["loss"])
        if t_start is None:
            jax.block_until_ready(metrics["loss"])
            t_start = time.perf_counter()  # compilation excluded from throughput
            # many processes: each feeds its share (B / P), the rate is the job's
            batch_size = batch.batch_size * jax.process_count()
        else:
            timed += 1
        stop = any([h.after_step(step, state, metrics) for h in hooks])  # every hook sees it
        last = stop or step == steps  # the end evaluates and saves
        is_eval = bool(eval_batches) and due(eval_every, step) and not last
        is_ckpt = checkpointer is not None and due(checkpoint_every, step) and not last
        is_log = log_every is not None and (due(log_every, step) or last)
        if is_log or is_eval or is_ckpt or last:
            check(*pending)
            pending = None
        if is_log:
            log(step)
        if is_eval or is_ckpt:
            t = time.perf_counter()
            if is_eval:
                stop = run_eval(step)
            if is_ckpt and not stop:  # a stop saves after the loop
                save()
            paused += time.perf_counter() - t
            if stop and log_every is not None and not is_log:
                log(step)  # the stop makes this step the last: its partial window
        if stop:
            break
    if pending is not None:  # only when the data ran out
        check(*pending)
        if log_every is not None:
            log(step)
    samples_per_s = rate() if timed else None
    trained = step > start
    if eval_batches and (trained or not eval_result) and evaluated_at != step:
        run_eval(step)
    if checkpointer is not None and trained:
        save()
    for h in hooks:
        h.on_end(step, state)
    return FitResult(state=state, eval=eval_result, samples_per_s=samples_per_s)
