"""Max pooling on the C++ CPU kernel (target `sparsejax_segment_max`); sum, mean and
sqrtn pooling run `segment_spmm`'s kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _cpu_ffi


def segment_max(values, col_ids, segment_ids, dense, *, num_segments):
    """Max-pooling counterpart of `segment_spmm`.

    Returns (out dense.dtype[S, D], argk i32[S, D]): out[s, d] is the max over valid k
    in segment s of values[k] * dense[col_ids[k], d] (computed in f32; NaN wins),
    argk[s, d] the smallest k attaining it. Empty segments: out 0, argk -1.
    """
    _cpu_ffi.require()
    values, col_ids, segment_ids = _cpu_ffi.entries(values, col_ids, segment_ids)
    dense = _cpu_ffi.float_dense(dense, "dense", "[K, D]")
    shape = (int(num_segments), dense.shape[1])
    outs = (jax.ShapeDtypeStruct(shape, dense.dtype), jax.ShapeDtypeStruct(shape, jnp.int32))
    out, argk = jax.ffi.ffi_call(_cpu_ffi.SEGMENT_MAX_TARGET, outs, vmap_method="sequential")(
        values, col_ids, segment_ids, dense
    )
    return out, argk
