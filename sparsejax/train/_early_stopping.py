"""`EarlyStopping`: model selection on an eval metric, as a `fit` hook (keep the best
state, stop after `patience` evals without improvement)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ._loop import Hook
from ._trainer import TrainState

LOGLOSS_FAR = (0.01, 0.005)
"""(relative, absolute): the best eval's logloss is "far" above the lowest logloss seen
when it exceeds it by more than 1% of it and by more than 0.005 (`logloss_warning`)."""


class EarlyStopping(Hook):
    """Tracks the best eval of `metric`; saves the best state through `checkpointer` (if
    given) and stops training after `patience` evals without improvement.

    An eval improves when its value beats the best by more than `min_delta` (a NaN value
    never does). The best state is saved when its eval happens, so a later divergence
    cannot lose it; give `checkpointer` its own directory (e.g. `Checkpointer(run_dir /
    "checkpoints_best", layouts, max_to_keep=1)`) so the rotation of the regular
    checkpoints never deletes it. Stopping makes the eval's step the last one (`fit`
    logs and saves it as the end of training).

    Args:
      metric: a key of the eval results (`Trainer.evaluate`): "auc", "logloss", "loss",
        "recall@10", ...
      mode: "max" (higher is better) or "min"; None: "min" for metrics whose name ends in
        "loss", "max" otherwise.
      patience: evals without improvement before stopping; None: never stop (track and
        keep the best only).
      min_delta: the margin an eval must beat the best by.
      checkpointer: where the best state is saved (None: not saved).

    Example:
      >>> best = EarlyStopping("auc", patience=3, checkpointer=best_ckpt)
      >>> fit(trainer, state, loader, steps=10_000, eval_batches=held_out,
      ...     eval_every=500, hooks=[best])
      >>> best.best_step, best.best_eval, best.stopped_at
    """

    def __init__(
        self,
        metric: str = "auc",
        *,
        mode: str | None = None,
        patience: int | None = None,
        min_delta: float = 0.0,
        checkpointer=None,
    ):
        if mode is None:
            mode = "min" if metric.endswith("loss") else "max"
        if mode not in ("max", "min"):
            raise ValueError(f"EarlyStopping: `mode` must be 'max' or 'min', got {mode!r}")
        if patience is not None and patience < 1:
            raise ValueError(f"EarlyStopping: `patience` must be >= 1 or None, got {patience!r}")
        if not min_delta >= 0:
            raise ValueError(f"EarlyStopping: `min_delta` must be >= 0, got {min_delta!r}")
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.checkpointer = checkpointer
        self.best_step: int | None = None
        self.best_value: float | None = None
        self.best_eval: dict = {}
        self.best_checkpoint: str | None = None
        """Directory of the best state's checkpoint (None: not saved)."""
        self.wait = 0
        """Evals since the best."""
        self.stopped_at: int | None = None
        """The step training was stopped at (None: it was not stopped)."""
        self.last_step: int | None = None
        self.last_eval: dict = {}
        self.lowest_logloss: tuple[int, float] | None = None
        """(step, value) of the lowest eval logloss seen (None: no eval had one)."""
        self._state: TrainState | None = None

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        if self.mode == "max":
            return value > self.best_value + self.min_delta
        return value < self.best_value - self.min_delta

    def _value(self, result: Mapping) -> float:
        if self.metric not in result:
            raise ValueError(
                f"EarlyStopping: the eval results have no metric {self.metric!r} "
                f"(they have {sorted(k for k in result if k != 'examples')})"
            )
        return float(result[self.metric])

    def replay(self, evals: Iterable[tuple[int, Mapping]]) -> None:
        """Resume: count the `(step, eval results)` of the run so far, in order, as if this
        hook had seen them (the best and the wait); nothing is saved. The best state is
        taken as saved when `checkpointer` holds its step."""
        for step, result in evals:
            self._record(step, result)
        if self.checkpointer is not None and self.best_step in self.checkpointer.steps():
            self.best_checkpoint = os.path.join(self.checkpointer.directory, str(self.best_step))

    def _record(self, step: int, result: Mapping) -> bool:
        """Update the best and the wait; True when `step` is the new best."""
        if step == self.last_step:  # the same eval again (e.g. the end of a resumed run)
            return False
        value = self._value(result)
        self.last_step, self.last_eval = step, dict(result)
        logloss = float(result.get("logloss", math.nan))
        if math.isfinite(logloss) and (
            self.lowest_logloss is None or logloss < self.lowest_logloss[1]
        ):
            self.lowest_logloss = (step, logloss)
        if self._improves(value):
            self.best_step, self.best_value, self.best_eval = step, value, dict(result)
            self.wait = 0
            return True
        self.wait += 1
        return False

    def after_step(self, step: int, state: TrainState, metrics: Mapping) -> None:
        self._state = state  # the state an eval of this step sees

    def on_eval(self, step: int, result: Mapping) -> bool:
        """Returns True (stop training) after `patience` evals without improvement."""
        if self._record(step, result):
            self.best_checkpoint = None  # until this best is saved
            state = self._state
            if self.checkpointer is not None and state is not None and int(state.step) == step:
                for s in self.checkpointer.steps():  # a best of a run this one replaces
                    if s >= step:
                        self.checkpointer.manager.delete(s)
                self.checkpointer.save(
                    state,
                    extra={
                        "best": {
                            "metric": self.metric,
                            "value": self.best_value,
                            "eval": _plain(result),
                        }
                    },
                )
                self.best_checkpoint = os.path.join(self.checkpointer.directory, str(step))
        if self.patience is not None and self.wait >= self.patience:
            self.stopped_at = step
            return True
        return False

    def on_end(self, step: int, state: TrainState) -> None:
        self._state = None

    def logloss_warning(self) -> str | None:
        """A warning when the best eval (by another metric than logloss, e.g. AUC) has a
        logloss far above the lowest seen (`LOGLOSS_FAR`): the model kept for its ranking
        is overfit in its probabilities; None otherwise."""
        kept = self.best_eval.get("logloss")
        if self.metric == "logloss" or kept is None or self.lowest_logloss is None:
            return None
        step, lowest = self.lowest_logloss
        relative, absolute = LOGLOSS_FAR
        if not kept - lowest > max(relative * lowest, absolute):
            return None
        return (
            f"the best {self.metric} (step {self.best_step}) has logloss {kept:.4f}, "
            f"{100 * (kept - lowest) / lowest:.1f}% above the lowest logloss {lowest:.4f} "
            f"(step {step}): its probabilities are overfit; early_stopping.metric=logloss "
            f"keeps the best calibrated state instead"
        )

    def summary(self) -> dict[str, Any]:
        """`{"best_eval": {step, metric, mode, checkpoint, <the eval's metrics>} (None
        before a best), "stopped_at"}` as JSON."""
        best = None
        if self.best_step is not None:
            best = {
                "step": self.best_step,
                "metric": self.metric,
                "mode": self.mode,
                "checkpoint": self.best_checkpoint,
                **_plain(self.best_eval),
            }
        return {"best_eval": best, "stopped_at": self.stopped_at}


def _plain(d: Mapping) -> dict:
    return {k: v if isinstance(v, (int, str)) else float(v) for k, v in d.items()}
