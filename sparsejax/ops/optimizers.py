"""Row-sparse optimizers for embedding tables.

Each optimizer updates only the rows a batch touched ("lazy" semantics, as in
FBGEMM's TBE and TF's LazyAdam). The math lives in one place, `update_rows`, a pure
jnp function on a block of rows that every implementation shares: the XLA path calls
it on gathered rows, the Pallas kernel traces it inside the kernel, and the C++ CPU
kernel mirrors it line by line (`csrc/sparsejax_cpu.cc`, same hyperparameter order).

Hyperparameters travel as a small f32 vector (`hparams()`), so a learning-rate
schedule never recompiles a kernel. Slots are stored in f32 whatever the table dtype.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .._hashing import mix32

__all__ = [
    "SparseOptimizer",
    "store_rows",
    "SGD",
    "Adagrad",
    "RowWiseAdagrad",
    "LazyAdam",
    "FTRL",
    "AdagradDecay",
    "SlotSpec",
    "OPTIMIZERS_BY_CODE",
    "num_slots_by_code",
]

OPTIMIZERS_BY_CODE: dict[int, type[SparseOptimizer]] = {}
"""Kernel code -> optimizer class; every subclass with a `code` registers itself. The
one Python source of the codes and slot counts the C++ kernel is built against."""


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """One optimizer slot: per-element (`[V, D]`) or per-row (`[V]`)."""

    name: str
    per_row: bool
    init: float = 0.0
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseOptimizer:
    """Base class. Subclasses define `slots`, `hparams` and `update_rows`."""

    learning_rate: float
    """Step size; may be overridden per step by `sparse_apply(learning_rate=...)`."""
    stochastic_rounding: bool = False
    """A bf16 table: round each updated value up or down at random, with the chance
    that makes the rounding unbiased, instead of to nearest (an update smaller than
    half a bf16 step then still moves the row, on average). The noise is a hash of
    (row, column, step), so every implementation writes the same bits. f32 tables:
    no effect."""

    code: ClassVar[int]
    """Kernel id shared with the C++ CPU kernel."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is not None:
            if code in OPTIMIZERS_BY_CODE:
                raise ValueError(
                    f"optimizer code {code} of {cls.__name__} is already used by "
                    f"{OPTIMIZERS_BY_CODE[code].__name__}"
                )
            OPTIMIZERS_BY_CODE[code] = cls

    @classmethod
    def num_slots(cls) -> int:
        """How many slot arrays the optimizer keeps (the same for every instance)."""
        return len(cls(learning_rate=1.0).slots())

    def slots(self) -> tuple[SlotSpec, ...]:
        return ()

    def hparams(self, learning_rate: jax.Array | float | None = None) -> jax.Array:
        """f32[8]: learning rate first, then optimizer-specific constants, zero-padded."""
        lr = self.learning_rate if learning_rate is None else learning_rate
        extra = [float(x) for x in self._extra_hparams()]
        return jnp.concatenate(
            [
                jnp.reshape(jnp.asarray(lr, jnp.float32), (1,)),
                jnp.asarray(extra + [0.0] * (7 - len(extra)), jnp.float32),
            ]
        )

    def _extra_hparams(self) -> tuple[float, ...]:
        return ()

    def init_slots(self, num_rows: int, dim: int) -> dict[str, jax.Array]:
        """Fresh slot arrays for a `[num_rows, dim]` table."""
        return {
            s.name: jnp.full((num_rows,) if s.per_row else (num_rows, dim), s.init, s.dtype)
            for s in self.slots()
        }

    def update_rows(self, hp, rows, slots, grads, step, *, dim):
        """New (rows, slots) for a block of unique touched rows.

        Args:
          hp: f32[8] from `hparams()`.
          rows: f32[R, Dp] current weights (Dp >= dim; columns past `dim` are padding
            and have zero gradient).
          slots: dict name -> f32[R, Dp] or [R] (per-row slots), the rows' state.
          grads: f32[R, Dp] summed gradient of each row (duplicates already reduced).
          step: i32 scalar, 1-based number of this update (bias correction, decay).
          dim: the true embedding dim, for row-wise means.
        """
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGD(SparseOptimizer):
    """w -= lr * g."""

    code: ClassVar[int] = 0

    def update_rows(self, hp, rows, slots, grads, step, *, dim):
        return rows - hp[0] * grads, slots


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adagrad(SparseOptimizer):
    """Element-wise Adagrad; matches `optax.adagrad` on touched rows."""

    initial_accumulator_value: float = 0.1
    """Starting value of every squared-gradient accumulator."""
    eps: float = 1e-7
    """Added to the accumulator inside the square root."""
    code: ClassVar[int] = 1

    def slots(self):
        return (SlotSpec("accumulator", per_row=False, init=self.initial_accumulator_value),)

    def _extra_hparams(self):
        return (self.eps,)

    def update_rows(self, hp, rows, slots, grads, step, *, dim):
        acc = slots["accumulator"] + grads * grads
        scale = jnp.where(acc > 0, jax.lax.rsqrt(acc + hp[1]), 0.0)
        return rows - hp[0] * scale * grads, {"accumulator": acc}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowWiseAdagrad(SparseOptimizer):
    """One accumulator per row (FBGEMM EXACT_ROWWISE_ADAGRAD).

    acc += mean(g^2); w -= lr * g / (sqrt(acc) + eps).
    """

    initial_accumulator_value: float = 0.0
    """Starting value of every row's accumulator."""
    eps: float = 1e-8
    """Added to the accumulator's square root."""
    code: ClassVar[int] = 2

    def slots(self):
        return (SlotSpec("accumulator", per_row=True, init=self.initial_accumulator_value),)

    def _extra_hparams(self):
        return (self.eps,)

    def update_rows(self, hp, rows, slots, grads, step, *, dim):
        acc = slots["accumulator"] + jnp.sum(grads * grads, axis=-1) / dim
        mult = hp[0] / (jnp.sqrt(acc) + hp[1])
        return rows - mult[:, None] * grads, {"accumulator": acc}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LazyAdam(SparseOptimizer):
    """Adam on touched rows only, with global-step bias correction (TF LazyAdam).

    Equals `optax.adam` on rows that are touched every step.
    """

    b1: float = 0.9
    """Decay of the first moment (the gradient's running mean)."""
    b2: float = 0.999
    """Decay of the second moment (the squared gradient's running mean)."""
    eps: float = 1e-8
    """Added to the second moment's square root."""
    code: ClassVar[int] = 3

    def slots(self):
        return (SlotSpec("mu", per_row=False), SlotSpec("nu", per_row=False))

    def _extra_hparams(self):
        return (self.b1, self.b2, self.eps)

    def update_rows(self, hp, rows, slots, grads, step, *, dim):
        b1, b2, eps = hp[1], hp[2], hp[3]
        t = step.astype(jnp.float32)
        mu = b1 * slots["mu"] + (1.0 - b1) * grads
        nu = b2 * slots["nu"] + (1.0 - b2) * (grads * grads)
        mu_hat = mu / (1.0 - b1**t)
        nu_hat = nu / (1.0 - b2**t)
        return rows - hp[0] * mu_hat / (jnp.sqrt(nu_hat) + eps), {"mu": mu, "nu": nu}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FTRL(SparseOptimizer):
    """FTRL-proximal (McMahan et al. 2013; TF `FtrlOptimizer` with lr_power=-0.5)."""

    l1: float = 0.0
    """L1 regularization strength (weights with |z| <= l1 are exactly 0)."""
    l2: float = 0.0
    """L2 regularization strength."""
    beta: float = 0.0
    """FTRL's beta, added to the accumulator's square root in the per-coordinate rate."""
    initial_accumulator_value: float = 0.1
    """Starting value of every squared-gradient accumulator."""
    code: ClassVar[int] = 4

    def slots(self):
        return (
            SlotSpec("accumulator", per_row=False, init=self.initial_accumulator_value),
            SlotSpec("linear", per_row=False),
        )

    def _extra_hparams(self):
        return (self.l1, self.l2, self.beta)

    def update_rows(self, hp, rows, slots, grads, step, *, dim):
        lr, l1, l2, beta = hp[0], hp[1], hp[2], hp[3]
        n = slots["accumulator"]
        n_new = n + grads * grads
        sigma = (jnp.sqrt(n_new) - jnp.sqrt(n)) / lr
        z = slots["linear"] + grads - sigma * rows
        quadratic = (beta + jnp.sqrt(n_new)) / lr + 2.0 * l2
        w = jnp.where(jnp.abs(z) > l1, (jnp.sign(z) * l1 - z) / quadratic, 0.0)
        return w, {"accumulator": n_new, "linear": z}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdagradDecay(SparseOptimizer):
    """DeepRec's AdagradDecay: Adagrad whose accumulator decays every
    `accumulator_decay_step` global steps, never below `initial_accumulator_value`.

    Decay is applied lazily when a row is next touched, once per elapsed period
    (`acc = max(acc * rate**periods, baseline)`), which equals decaying every row at
    every period boundary.
    """

    initial_accumulator_value: float = 0.1
    """Starting value of every accumulator, and the floor its decay stops at (> 0)."""
    accumulator_decay_step: int = 100_000
    """Global steps per decay period."""
    accumulator_decay_rate: float = 0.9
    """Factor the accumulator is multiplied by per elapsed period."""
    code: ClassVar[int] = 5

    def __post_init__(self):
        if self.initial_accumulator_value <= 0:
            raise ValueError(
                "AdagradDecay: initial_accumulator_value must be > 0, got "
                f"{self.initial_accumulator_value}"
            )
        if not 0 < self.accumulator_decay_step < 2**24:
            raise ValueError(
                "AdagradDecay: accumulator_decay_step must be in [1, 2**24), "
                f"got {self.accumulator_decay_step}"
            )

    def slots(self):
        return (
            SlotSpec("accumulator", per_row=False, init=self.initial_accumulator_value),
            SlotSpec("decay_power", per_row=True, dtype="int32"),
        )

    def _extra_hparams(self):
        return (
            self.accumulator_decay_rate,
            self.initial_accumulator_value,
            float(self.accumulator_decay_step),
        )

    def update_rows(self, hp, rows, slots, grads, step, *, dim):
        lr, rate, baseline, period_len = hp[0], hp[1], hp[2], hp[3]
        period = step // period_len.astype(jnp.int32)
        power = slots["decay_power"]
        elapsed = (period - power).astype(jnp.float32)
        decayed = jnp.maximum(slots["accumulator"] * rate ** elapsed[:, None], baseline)
        acc = jnp.where((elapsed > 0)[:, None], decayed, slots["accumulator"])
        acc = acc + grads * grads
        new_rows = rows - lr * grads * jax.lax.rsqrt(acc)
        return new_rows, {"accumulator": acc, "decay_power": jnp.maximum(power, period)}


def num_slots_by_code() -> dict[int, int]:
    """Kernel code -> number of slots, for every registered optimizer."""
    return {code: cls.num_slots() for code, cls in sorted(OPTIMIZERS_BY_CODE.items())}


def store_rows(optimizer: SparseOptimizer, rows, row_ids, step, dtype):
    """Updated f32 `rows` [R, D] (of table rows `row_ids` [R]) in the table's `dtype`:
    to nearest, or for a bf16 table with `optimizer.stochastic_rounding`, up or down
    with noise = mix32(row * 0x9E3779B1 + col * 0x85EBCA77 + step * 0xC2B2AE3D) &
    0xFFFF added to the f32 bits before truncation (csrc/sparse_apply.cc does the same;
    inf and NaN as rounding to nearest)."""
    dtype = jnp.dtype(dtype)
    if not optimizer.stochastic_rounding or dtype != jnp.bfloat16:
        return rows.astype(dtype)
    rows = rows.astype(jnp.float32)
    cols = jax.lax.broadcasted_iota(jnp.int32, rows.shape, rows.ndim - 1).astype(jnp.uint32)
    r = jnp.asarray(row_ids).astype(jnp.uint32)[:, None]
    t = jnp.asarray(step).astype(jnp.uint32)
    key = r * jnp.uint32(0x9E3779B1) + cols * jnp.uint32(0x85EBCA77) + t * jnp.uint32(0xC2B2AE3D)
    noise = mix32(key) & jnp.uint32(0xFFFF)
    bits = jax.lax.bitcast_convert_type(rows, jnp.uint32)
    finite = (bits & jnp.uint32(0x7FFFFFFF)) < jnp.uint32(0x7F800000)
    bits = jnp.where(finite, (bits + noise) & jnp.uint32(0xFFFF0000), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)
