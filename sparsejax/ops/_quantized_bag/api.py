"""Embedding bags over row-wise quantized tables (inference).

`quantized_embedding_bag(table, ...)` is `embedding_bag(dequantize_rows(table), ...)`
without ever building the float table: the kernels gather a row's codes, its scale and
its zero point, and dequantize them as they accumulate. A row costs D (int8) or
ceil(D/2) (int4) bytes plus 3, against 4 D for float32, and a lookup reads that much.

The semantics are embedding_bag's (its docstring is the contract): ids < 0 are padding,
ids >= V contribute nothing on the fast path (an error on eager calls and in checked
mode), empty bags give zeros, combiners "sum", "mean", "sqrtn" and "max" with optional
per-id weights. mean / sqrtn are folded into per-lookup coefficients
(`pooling_coefficients`), so the primitive pools with "sum" or "max" only.

Inference only: the primitive has no derivatives (a JVP raises, naming the op). vmap
over lookups folds the batch into one call; a batched table runs a loop.
Implementations: "xla" (gather, dequantize, segment reduce; every backend), "cpu_ffi"
(C++, target `sparsejax_quantized_bag`), "pallas" (Triton on CUDA; interpret mode on
CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _checks
from .._embedding_bag import pooling_coefficients, validate_bag
from .._primitive import define_primitive, sequential_batch_rule
from .._segment_spmm import fold_vmapped_lookups
from . import base, cpu_ffi

__all__ = ["quantized_embedding_bag", "quantized_bag_p"]


def quantized_embedding_bag(
    table: base.QuantizedTable,  # codes of a [V, D] table
    ids: jax.Array,  # i32[N]
    segment_ids: jax.Array,  # i32[N], bag of each id, non-decreasing over valid ids
    num_segments: int,
    *,
    weights: jax.Array | None = None,  # f[N]
    combiner: str = "sum",
    implementation: str | None = None,
    name: str = "table",
) -> jax.Array:  # f32[num_segments, D]
    """Pooled lookup in a quantized table: one float32 row per bag.

    Args:
      table: a QuantizedTable (`quantize_rows`), int8 or int4, on the device.
      ids: row ids, flat; negative ids are padding.
      segment_ids: the bag of each id, in `[0, num_segments)`, non-decreasing over the
        non-padding ids (bags one after another, as in CSR).
      num_segments: static number of bags.
      weights: optional per-id weights.
      combiner: "sum", "mean", "sqrtn" or "max".
      implementation: "xla", "cpu_ffi", "pallas" or None for the platform's best.
      name: the table's name, used in error messages.

    Returns:
      `f32[num_segments, D]`: `embedding_bag` of the dequantized table.

    Raises:
      TypeError / ValueError at trace time for a malformed table (dtypes, shapes), bad
      ids, weights or options; IndexError on eager calls (or in checked mode) for an
      id >= V, naming it.

    Example:
      >>> w = np.array([[1.0, -2.0], [0.5, 0.0]], np.float32)
      >>> ids, bags = jnp.array([0, 1, 1]), jnp.array([0, 0, 1])
      >>> out = quantized_embedding_bag(quantize_rows(w, 8), ids, bags, 2)
      >>> bool(jnp.abs(out - embedding_bag(jnp.asarray(w), ids, bags, 2)).max() < 0.01)
      True
    """
    op = "quantized_embedding_bag"
    base.check_table(op, table, name)
    # The bag is embedding_bag's on the dequantized table: check it against that shape.
    float_table = jax.ShapeDtypeStruct((table.vocab, table.dim), jnp.float32)
    num_segments = validate_bag(
        op, float_table, ids, segment_ids, num_segments, weights, combiner, implementation
    )
    data, scale, zero_point = (
        jnp.asarray(_checks.check_unsharded(op, name, x))
        for x in (table.data, table.scale, table.zero_point)
    )
    _checks.check_lookups(op, name, table.vocab, num_segments, ids, segment_ids, weights)
    ids = jnp.asarray(ids, jnp.int32)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    if weights is not None:
        weights = jnp.asarray(weights)
    coef = pooling_coefficients(ids, segment_ids, num_segments, table.vocab, weights, combiner)
    return quantized_bag_p.bind(
        coef,
        ids,
        segment_ids,
        data,
        scale,
        zero_point,
        num_segments=num_segments,
        bits=table.bits,
        dim=table.dim,
        combiner="max" if combiner == "max" else "sum",
        # Unweighted sum: coef is 1 on every valid lookup, which kernels may assume.
        unit_values=combiner == "sum" and weights is None,
        implementation=implementation,
    )


# ---------------------------------------------------------------- primitive rules
# Operands (coef f32[N], ids i32[N], segment_ids i32[N], data u8[V, W], scale f16[V],
# zero_point u8[V]). Params: num_segments, bits, dim, combiner ("sum" or "max": mean and
# sqrtn are in coef), unit_values (coef == 1 on every valid lookup), implementation.
def _abstract_eval(coef, ids, segment_ids, data, scale, zero_point, *, num_segments, dim, **_):
    return jax.core.ShapedArray((num_segments, dim), jnp.float32)


def _batch_rule(args, dims, *, num_segments, **params):
    if any(d is not None for d in dims[3:]):  # a batch of tables: one call per table
        return sequential_batch_rule(
            quantized_bag_p, args, dims, num_segments=num_segments, **params
        )
    flat, size, _ = fold_vmapped_lookups(args[:4], (*dims[:3], None), num_segments)
    out = quantized_bag_p.bind(*flat, *args[4:], num_segments=size * num_segments, **params)
    return out.reshape(size, num_segments, out.shape[-1]), 0


def _jvp(primals, tangents, **params):
    raise TypeError(
        "sparsejax.ops.quantized_embedding_bag is inference-only and has no derivatives: "
        "train the float table (embedding_bag), then quantize it with quantize_rows"
    )


quantized_bag_p = define_primitive(
    "quantized_bag",
    log_name="quantized_embedding_bag",
    abstract_eval=_abstract_eval,
    implementations={
        "xla": base.quantized_bag,
        "cpu_ffi": cpu_ffi.quantized_bag,
        "pallas": f"{__package__}.pallas_triton:quantized_bag",
    },
    batch_rule=_batch_rule,
    jvp=_jvp,
)
