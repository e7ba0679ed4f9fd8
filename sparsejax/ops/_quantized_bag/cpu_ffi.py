"""The quantized bag on the C++ CPU kernel (`csrc/quantized_bag.cc`, target
`sparsejax_quantized_bag`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _cpu_ffi


@functools.cache
def _built() -> bool:
    from sparsejax import _cpu_ext

    return _cpu_ffi.QUANTIZED_BAG_TARGET in _cpu_ext.registrations()


def quantized_bag(
    coef,
    ids,
    segment_ids,
    data,
    scale,
    zero_point,
    *,
    num_segments,
    bits,
    dim,
    combiner,
    unit_values=False,
) -> jax.Array:
    """f32[S, D]: per bag, the sum ("sum") or elementwise max ("max") of coef[k] times
    row ids[k] dequantized (float32(scale) * (q - zero_point)) over its valid lookups.

    Args:
      coef: f32[N]; ignored with `unit_values` (the kernel then gets an f32[0] operand).
      ids, segment_ids: i32[N]; lookup k is valid when 0 <= ids[k] < V and
        0 <= segment_ids[k] < S. Valid segment ids in CSR order run on every thread;
        any other order runs on one (the result is the same).
      data: u8[V, W] codes (W = D for bits=8, ceil(D/2) for bits=4); scale f16[V];
        zero_point u8[V].
    Returns: f32[S, D]; an empty bag is 0.
    """
    _cpu_ffi.require()
    if not _built():
        raise RuntimeError(
            f"the C++ extension has no {_cpu_ffi.QUANTIZED_BAG_TARGET!r} kernel (built before it "
            "existed): rebuild it with `pip install -e .`, or use implementation='xla'"
        )
    coef, ids, segment_ids = _cpu_ffi.entries(coef, ids, segment_ids)
    if unit_values:
        coef = jnp.zeros((0,), jnp.float32)
    out = jax.ShapeDtypeStruct((int(num_segments), int(dim)), jnp.float32)
    return jax.ffi.ffi_call(_cpu_ffi.QUANTIZED_BAG_TARGET, out, vmap_method="sequential")(
        coef, ids, segment_ids, data, scale, zero_point, bits=np.int32(bits), combiner=combiner
    )
