"""`segment_spmm` on the C++ CPU kernel (target `sparsejax_spmm`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _cpu_ffi


def segment_spmm(
    values, col_ids, segment_ids, dense, *, num_segments, sorted_segments=True, unit_values=False
) -> jax.Array:
    """out[s] = sum over valid k with segment_ids[k] == s of values[k] * dense[col_ids[k]].

    Args:
      values: f32[N] weights; ignored with `unit_values` (the kernel then gets an f32[0]
        operand, reads no values, and XLA drops their computation altogether).
      col_ids: i32[N] rows of `dense`. segment_ids: i32[N] (any order: the kernel
        checks sortedness itself, so `sorted_segments` is only a hint).
      dense: f32 or bf16 [K, D].
      num_segments: S (static).
    Returns: dense.dtype [S, D]; empty segments are 0.
    """
    del sorted_segments
    _cpu_ffi.require()
    values, col_ids, segment_ids = _cpu_ffi.entries(values, col_ids, segment_ids)
    if unit_values:
        values = jnp.zeros((0,), jnp.float32)
    dense = _cpu_ffi.float_dense(dense, "dense", "[K, D]")
    out = jax.ShapeDtypeStruct((int(num_segments), dense.shape[1]), dense.dtype)
    return jax.ffi.ffi_call(_cpu_ffi.SPMM_TARGET, out, vmap_method="sequential")(
        values, col_ids, segment_ids, dense
    )
