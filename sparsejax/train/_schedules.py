"""Learning-rate schedules: one definition, used by the dense (optax) and the sparse
(table) optimizers alike.

A `Schedule` is a multiplier of a base learning rate as a function of the number of
updates already taken: the update that follows `t` earlier ones (t = 0 for the first,
optax's count convention; training step k runs with t = k - 1) uses
`base_learning_rate * schedule(t)`. It is a pure `jnp` function of `t`, so a traced step
count gives the current value inside a jitted step: the learning rate changes every step
without recompiling anything (the sparse kernels take it in their hyperparameter array).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

DECAYS = ("constant", "linear", "cosine", "exponential", "step")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """Linear warmup, then a decay; a multiplier of the base learning rate.

    With W = `warmup_steps`, D = `decay_steps`, r = `final_lr_ratio`, s = t - W (updates
    since the warmup ended) and p = min(s / D, 1):

    - warmup, t < W: (t + 1) / W (the first update gets 1/W, update W gets the full rate)
    - constant: 1
    - linear: 1 - (1 - r) * p
    - cosine: r + (1 - r) * (1 + cos(pi * p)) / 2
    - exponential: max(r, decay_rate ** (s / D)) (continuous)
    - step: max(r, decay_rate ** floor(s / D)) (drops by `decay_rate` every D updates)

    Example:
      >>> sched = Schedule(warmup_steps=100, decay="cosine", decay_steps=900).resolve(None)
      >>> tx = optax.adam(lambda t: 1e-3 * sched(t))
      >>> trainer = Trainer(model, tx, sparse_schedule=sched)
    """

    warmup_steps: int = 0
    """Updates of linear warmup from base/warmup_steps up to the base learning rate."""
    decay: Literal["constant", "linear", "cosine", "exponential", "step"] = "constant"
    """What follows the warmup (formulas in `sparsejax.train.Schedule`)."""
    decay_steps: int | None = None
    """linear/cosine: updates from the end of the warmup to `final_lr_ratio`; exponential:
    updates per factor `decay_rate`; step: updates between two drops (required). Null:
    the rest of the run (total steps - warmup_steps)."""
    final_lr_ratio: float = 0.0
    """linear/cosine: the multiplier reached at the end of the decay (and kept); exponential/
    step: a floor the multiplier never goes below."""
    decay_rate: float = 0.1
    """exponential/step: the factor applied per `decay_steps` updates."""

    def __post_init__(self):
        if self.decay not in DECAYS:
            raise ValueError(f"Schedule: `decay` must be one of {DECAYS}, got {self.decay!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"Schedule: `warmup_steps` must be >= 0, got {self.warmup_steps!r}")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"Schedule: `decay_steps` must be >= 1, got {self.decay_steps!r}")
        if not 0.0 <= self.final_lr_ratio <= 1.0:
            raise ValueError(
                f"Schedule: `final_lr_ratio` must be in [0, 1], got {self.final_lr_ratio!r}"
            )
        if not 0.0 < self.decay_rate <= 1.0:
            raise ValueError(f"Schedule: `decay_rate` must be in (0, 1], got {self.decay_rate!r}")
        if self.decay == "step" and self.decay_steps is None:
            raise ValueError("Schedule: decay 'step' needs `decay_steps` (updates between drops)")

    @property
    def is_constant(self) -> bool:
        """True when the multiplier is 1 at every update (no warmup, no decay)."""
        return self.warmup_steps == 0 and self.decay == "constant"

    def resolve(self, total_steps: int | None) -> Schedule:
        """The schedule with `decay_steps` filled in for a run of `total_steps` updates
        (null `decay_steps` = the updates after the warmup, at least 1).

        Raises ValueError when `decay_steps` is needed and `total_steps` is None."""
        if self.decay == "constant" or self.decay_steps is not None:
            return self
        if total_steps is None:
            raise ValueError(
                f"Schedule: decay {self.decay!r} with decay_steps=null decays over the rest "
                f"of the run, whose length is unknown here; set `decay_steps`"
            )
        return dataclasses.replace(self, decay_steps=max(1, total_steps - self.warmup_steps))

    def __call__(self, count: jax.Array | int) -> jax.Array:
        """f32 multiplier of the update that follows `count` earlier updates."""
        if self.decay != "constant" and self.decay_steps is None:
            raise ValueError("Schedule: call `resolve(total_steps)` first (decay_steps is null)")
        t = jnp.asarray(count, jnp.float32)
        w = float(self.warmup_steps)
        s = jnp.maximum(t - w, 0.0)
        r = self.final_lr_ratio
        if self.decay == "constant":
            value = jnp.ones_like(t)
        else:
            d = float(self.decay_steps)
            p = jnp.minimum(s / d, 1.0)
            if self.decay == "linear":
                value = 1.0 - (1.0 - r) * p
            elif self.decay == "cosine":
                value = r + (1.0 - r) * 0.5 * (1.0 + jnp.cos(math.pi * p))
            elif self.decay == "exponential":
                value = jnp.maximum(r, self.decay_rate ** (s / d))
            else:  # step
                value = jnp.maximum(r, self.decay_rate ** jnp.floor(s / d))
        if self.warmup_steps:
            value = jnp.where(t < w, (t + 1.0) / w, value)
        return value.astype(jnp.float32)
