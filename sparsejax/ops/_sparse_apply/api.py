"""`sparse_apply`: pooling backward + duplicate-id reduction + optimizer, on touched rows.

Given the gradient of the pooled output `[S, D]`, each lookup k's row gradient is
`coef[k] * grad[segment_ids[k]]` (coef from the combiner and weights). Rows looked up
several times have their gradients summed (sort-based), then the optimizer updates
only those rows. Inside `jit` with the table and slots donated, the update is in
place: the cost grows with the lookups, never with the table size. Untouched rows
(and their slots) come back bit-identical, whatever NaNs the gradient holds.

max pooling routes each output element's gradient to the lookup that won it (the
forward's argmax), so its per-lookup gradients are materialized `[N, D]` and reduced
with the same machinery (one segment per lookup).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _checks
from .._embedding_bag import pooling_coefficients, segment_max_p, validate_bag
from .._primitive import define_primitive
from .._segment_spmm import valid_entries
from ..optimizers import SparseOptimizer
from . import base, cpu_ffi

__all__ = ["sparse_apply", "sparse_apply_p"]


def sparse_apply(
    table: jax.Array,  # f[V, D]
    slots: dict[str, jax.Array],
    ids: jax.Array,  # i32[N]
    segment_ids: jax.Array,  # i32[N]
    grad: jax.Array,  # f[S, D], gradient of the pooled output
    *,
    optimizer: SparseOptimizer,
    step: jax.Array | int,
    weights: jax.Array | None = None,
    combiner: str = "sum",
    learning_rate: jax.Array | float | None = None,
    implementation: str | None = None,
    name: str = "table",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One sparse optimizer step on the rows that `ids` touched.

    Args:
      table: `[V, D]` weights (f32 or bf16). Donate it (and `slots`) at the `jit`
        boundary for an in-place update.
      slots: optimizer state, as made by `optimizer.init_slots(V, D)`.
      ids, segment_ids, weights, combiner: the lookups of the forward `embedding_bag`
        whose pooled output had gradient `grad`.
      grad: `[num_segments, D]` gradient w.r.t. the pooled output.
      optimizer: a `sparsejax.ops.optimizers.SparseOptimizer`.
      step: 1-based update count (Adam bias correction, AdagradDecay periods).
      learning_rate: overrides `optimizer.learning_rate` (e.g. a schedule's value).
      implementation: "xla", "cpu_ffi", "pallas" or None (platform's best).

    Returns:
      (new table, new slots).
    """
    op = "sparse_apply"
    if not isinstance(optimizer, SparseOptimizer):
        raise TypeError(
            f"sparsejax.ops.{op}: `optimizer` must be a SparseOptimizer, "
            f"got {type(optimizer).__name__}"
        )
    _checks.check_array(op, "grad", grad, ndim=2, kind="float")
    num_segments = validate_bag(
        op, table, ids, segment_ids, grad.shape[0], weights, combiner, implementation
    )
    if grad.shape[1] != table.shape[1]:
        raise ValueError(
            f"sparsejax.ops.{op}: `grad` has dim {grad.shape[1]} but `table` "
            f"has dim {table.shape[1]}"
        )
    slots = _check_slots(op, optimizer, slots, table.shape)
    table = _checks.check_unsharded(op, name, table)
    _checks.check_lookups(op, name, table.shape[0], num_segments, ids, segment_ids, weights)
    if num_segments == 0 or ids.shape[0] == 0:
        return table, slots  # nothing was looked up
    vocab = table.shape[0]
    ids = jnp.asarray(ids, jnp.int32)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    coef = pooling_coefficients(ids, segment_ids, num_segments, vocab, weights, combiner)
    grad = grad.astype(jnp.float32)
    if combiner == "max":
        ids, segment_ids, coef, grad = _max_row_gradients(
            table, ids, segment_ids, coef, grad, implementation
        )
    names = [s.name for s in optimizer.slots()]
    outs = sparse_apply_p.bind(
        table,
        *(slots[n] for n in names),
        ids,
        segment_ids,
        coef,
        grad,
        optimizer.hparams(learning_rate),
        jnp.asarray(step, jnp.int32),
        optimizer=optimizer,
        implementation=implementation,
    )
    return outs[0], dict(zip(names, outs[1:], strict=True))


def _check_slots(op, optimizer, slots, table_shape):
    slots = dict(slots or {})
    expected = {s.name: s for s in optimizer.slots()}
    if set(slots) != set(expected):
        raise ValueError(
            f"sparsejax.ops.{op}: {type(optimizer).__name__} needs slots "
            f"{sorted(expected)}, got {sorted(slots)}"
        )
    for n, spec in expected.items():
        shape = table_shape[:1] if spec.per_row else table_shape
        if tuple(slots[n].shape) != tuple(shape) or slots[n].dtype != jnp.dtype(spec.dtype):
            raise ValueError(
                f"sparsejax.ops.{op}: slot {n!r} must be {spec.dtype}{list(shape)}, "
                f"got {slots[n].dtype}{list(slots[n].shape)}"
            )
    return slots


def _max_row_gradients(table, ids, segment_ids, coef, grad, implementation):
    """Per-lookup gradients of max pooling: lookup k gets grad[s, d] where it won (s, d)."""
    s = grad.shape[0]
    _, argk = segment_max_p.bind(
        coef, ids, segment_ids, table, num_segments=s, implementation=implementation
    )
    seg = jnp.clip(segment_ids, 0, s - 1)
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    won = argk[seg] == positions[:, None]
    row_grads = jnp.where(won, grad[seg] * coef[:, None], 0.0)
    valid = valid_entries(ids, segment_ids, table.shape[0], s)
    # One segment per lookup; the coefficient is already folded into row_grads.
    return ids, positions, valid.astype(jnp.float32), row_grads


# ---------------------------------------------------------------- primitive
# Operands (table, *slots, ids, segment_ids, coef, grad, hparams, step); results
# [table, *slots]. Params: optimizer (hashable, static), implementation. vmap runs
# the updates one after the other (the default batching rule).
def _abstract_eval(table, *operands, optimizer, implementation):
    del implementation
    state = (table, *operands[: optimizer.num_slots()])
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in state]


sparse_apply_p = define_primitive(
    "sparse_apply",
    abstract_eval=_abstract_eval,
    implementations={
        "xla": base.sparse_apply,
        "cpu_ffi": cpu_ffi.sparse_apply,
        "pallas": f"{__package__}.pallas_triton:sparse_apply",
    },
    multiple_results=True,
)
