"""`sparse_apply` on the C++ CPU kernel (target `sparsejax_sparse_apply`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _cpu_ffi


def sparse_apply(table, *operands, optimizer):
    """Lazy row-sparse optimizer step, in place when `table`/slots are donated.

    For every unique valid id r: g = sum over its entries k of coef[k] * grad[segment_ids[k]]
    (f32), then row r of (table, slots) is updated by the optimizer's `update_rows`
    (sparsejax/ops/optimizers.py; the kernel mirrors it). Untouched rows are
    bit-identical.

    Args:
      table: f32 or bf16 [V, D].
      operands: (*slots, ids, segment_ids, coef, grad, hparams, step): the optimizer's
        slots in `optimizer.slots()` order (f32 [V, D] / [V]; the AdagradDecay
        `decay_power` slot is int32 [V]); ids, segment_ids i32[N]; coef f32[N];
        grad f32[S, D]; hparams f32[8] from `optimizer.hparams()`; step i32 (1-based).
      optimizer: a `SparseOptimizer`; its class's `code` selects the kernel's update.
    Returns: [table, *slots], aliased to the inputs.
    """
    _cpu_ffi.require()
    code = type(optimizer).code
    n_slots = _cpu_ffi.NUM_SLOTS.get(code)
    if n_slots is None:
        raise ValueError(f"unknown optimizer code {code}")
    if len(operands) != n_slots + 6:
        raise ValueError(
            f"{type(optimizer).__name__} (code {code}) takes {n_slots} slots, "
            f"got {len(operands) - 6}"
        )
    slots, (ids, segment_ids, coef, grad, hparams, step) = operands[:n_slots], operands[n_slots:]
    table = _cpu_ffi.float_dense(table, "table", "[V, D]")
    ids, segment_ids = jnp.asarray(ids, jnp.int32), jnp.asarray(segment_ids, jnp.int32)
    coef = jnp.asarray(coef, jnp.float32)
    grad = jnp.asarray(grad, jnp.float32)
    hparams = jnp.asarray(hparams, jnp.float32)
    step = jnp.asarray(step, jnp.int32).reshape(())
    if hparams.shape != (8,):
        raise ValueError(f"hparams must be f32[8], got {hparams.shape}")
    if grad.ndim != 2 or grad.shape[1] != table.shape[1]:
        raise ValueError(f"grad must be [S, {table.shape[1]}], got {grad.shape}")
    state = (table, *slots)
    out_types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state)
    outs = jax.ffi.ffi_call(
        _cpu_ffi.SPARSE_APPLY_TARGET,
        out_types,
        input_output_aliases={i: i for i in range(len(state))},
        vmap_method="sequential",
    )(
        *state,
        ids,
        segment_ids,
        coef,
        grad,
        hparams,
        step,
        optimizer=np.int32(code),
        stochastic_rounding=np.int32(optimizer.stochastic_rounding),
    )
    return list(outs)
