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
    fed), then, after the step, `on_log` (on logging steps), `on_eval` (on eval steps,
    with the eval metrics) and `after_step`; `on_end` once after the last step. A hook
    stops training by returning True from `after_step`.
    """

    def before_step(self, step: int, batch) -> None:
        """`step` (1-based) is about to run on `batch`."""

    def after_step(self, step: int, state: TrainState, metrics: Mapping) -> bool | None:
        """`step` ran; `metrics["loss"]` is a device scalar (reading it waits for the step).
        Return True to stop training after this step."""

    def on_log(self, step: int, record: Mapping) -> None:
        """Every `log_every` steps and at the end: `{"step", "loss" (mean since the last
        record), "samples_per_s"}`; the loss is known finite."""

    def on_eval(self, step: int, result: Mapping) -> None:
        """Eval metrics of the state after `step` (see `Trainer.evaluate`)."""

    def on_end(self, step: int, state: TrainState) -> None:
        """Training ended (last step reached or a hook stopped it) at `step`."""


@dataclasses.dataclass
class FitResult:
    """What `fit` returns."""

    state: TrainState
    eval: dict
    """The last eval metrics ({} without eval batches)."""
    samples_per_s: float | None
    """Training throughput, compilation (the first step) excluded; None under 2 steps."""


def _check_finite(step: int, loss, checkpointer) -> float:
    value = float(loss)
    if not math.isfinite(value):
        last = None if checkpointer is None else checkpointer.latest_step()
        where = (f"the last good checkpoint is step {last} in {checkpointer.directory}"
                 if last is not None else "no checkpoint was written before it")
        raise NonFiniteLossError(f"training loss is {value} at step {step}; stopped ({where}). "
                                 f"Lower the learning rates or check the data.")
    return value


def fit(trainer: Trainer, state: TrainState, batches: Iterable, *, steps: int,
        eval_batches: Sequence = (), eval_every: int | None = None,
        checkpointer=None, checkpoint_every: int | None = None,
        data_position: Callable[[], Any] | None = None, checkpoint_extra: Mapping | None = None,
        log_every: int | None = None, hooks: Sequence[Hook] = ()) -> FitResult:
    """Train `state` from its step to `steps`, on `batches` (an iterable of batches from
    the data position matching the state's step).

    Every `eval_every` steps it evaluates on `eval_batches` (and at the end, if it
    trained or never evaluated); every `checkpoint_every` steps it saves through
    `checkpointer` (and at the end, if it trained), with `data_position()` and
    `checkpoint_extra` in the checkpoint's record. Each step's loss is checked while the
    next step runs, and before every log, eval and checkpoint: a NaN/inf loss raises
    `NonFiniteLossError` naming the step and the last good checkpoint.

    Example:
      >>> result = fit(trainer, state, loader, steps=1000, eval_batches=held_out,
      ...              eval_every=100, log_every=20, hooks=[MyProfiler()])
    """
    hooks = list(hooks)
    start = int(state.step)
    pending = None  # (step, loss) not yet checked
    window: list[float] = []
    eval_result: dict = {}
    t_start, timed, batch_size = None, 0, 0

    def every(n, step):
        return n is not None and step % n == 0 and step != steps

    def evaluate(step):
        nonlocal eval_result
        eval_result = trainer.evaluate(state, eval_batches)
        for h in hooks:
            h.on_eval(step, eval_result)

    def save():
        checkpointer.save(state, data_position=None if data_position is None
                          else data_position(), extra=checkpoint_extra)

    def rate():  # samples/s since the first step completed
        return timed * batch_size / max(time.perf_counter() - t_start, 1e-9) if timed else 0.0

    step = start
    it = iter(batches)
    for step in range(start + 1, steps + 1):
        batch = next(it)
        for h in hooks:
            h.before_step(step, batch)
        state, metrics = trainer.train_step(state, batch)
        if pending is not None:  # the previous step, checked while this one runs
            window.append(_check_finite(*pending, checkpointer))
        pending = (step, metrics["loss"])
        if t_start is None:
            jax.block_until_ready(metrics["loss"])
            t_start = time.perf_counter()  # compilation excluded from throughput
            batch_size = batch.batch_size
        else:
            timed += 1
        is_eval = bool(eval_batches) and every(eval_every, step)
        is_ckpt = checkpointer is not None and every(checkpoint_every, step)
        is_log = log_every is not None and (step % log_every == 0 or step == steps)
        if is_log or is_eval or is_ckpt or step == steps:
            window.append(_check_finite(*pending, checkpointer))
            pending = None
        if is_log:
            record = {"step": step, "loss": float(np.mean(window)), "samples_per_s": rate()}
            window = []
            for h in hooks:
                h.on_log(step, record)
        if is_eval:
            evaluate(step)
        if is_ckpt:
            save()
        stop = [h.after_step(step, state, metrics) for h in hooks]
        if any(stop):
            break
    if pending is not None:
        window.append(_check_finite(*pending, checkpointer))
    samples_per_s = rate() if timed else None
    if log_every is not None and window:  # stopped by a hook between log steps
        for h in hooks:
            h.on_log(step, {"step": step, "loss": float(np.mean(window)),
                            "samples_per_s": samples_per_s})
    trained = step > start
    if eval_batches and (trained or not eval_result):
        evaluate(step)
    if checkpointer is not None and trained:
        save()
    for h in hooks:
        h.on_end(step, state)
    return FitResult(state=state, eval=eval_result, samples_per_s=samples_per_s)
