"""Embedding bags (pooled lookups) and unpooled lookups.

sum / mean / sqrtn pooling is linear in the table: each lookup k contributes
`coef[k] * table[ids[k]]` to its bag (`base.pooling_coefficients`). So these combiners
are `segment_spmm(coef, ids, segment_ids, table)` and share its kernels and autodiff;
gradients w.r.t. `weights` flow through `coef` by plain jnp autodiff. max pooling is
not linear and has its own primitive, `segment_max_p`, which also returns which lookup
won each output element so that the JVP is exact.

Semantics (the public contract): ids < 0 are padding and contribute nothing; ids >=
vocab also contribute nothing on the fast path (an error in checked mode); mean/sqrtn
normalize by the sum (of squares) of the weights of the valid ids (their count when
unweighted); an empty or all-padding bag gives zeros. Subnormal float32 weights (below
~1.2e-38) count as 0, as XLA flushes them on CPU and GPU; tiny normal weights are exact
(sqrtn scales each bag by its largest |weight| before squaring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from .. import _checks, _dispatch
from .._primitive import define_primitive
from .._segment_spmm import fold_vmapped_lookups, segment_spmm_p, static_count
from . import base, cpu_ffi

__all__ = ["COMBINERS", "embedding_bag", "embedding_lookup", "segment_max_p", "validate_bag"]

COMBINERS = ("sum", "mean", "sqrtn", "max")


def validate_bag(op, table, ids, segment_ids, num_segments, weights, combiner, implementation):
    """Trace-time checks shared by the ops that take bags; returns the static count."""
    _dispatch.check_implementation(implementation)
    if combiner not in COMBINERS:
        raise ValueError(f"sparsejax.ops.{op}: combiner={combiner!r} is not one of {COMBINERS}")
    _checks.check_array(op, "table", table, ndim=2, kind="float")
    _checks.check_array(op, "ids", ids, ndim=1, kind="int")
    _checks.check_array(op, "segment_ids", segment_ids, ndim=1, kind="int")
    if weights is not None:
        _checks.check_array(op, "weights", weights, ndim=1, kind="float")
    _checks.check_same_length(op, ids=ids, segment_ids=segment_ids, weights=weights)
    return static_count(op, "num_segments", num_segments)


def embedding_bag(
    table: jax.Array,  # f[V, D]
    ids: jax.Array,  # i32[N]
    segment_ids: jax.Array,  # i32[N], bag of each id, non-decreasing over valid ids
    num_segments: int,
    *,
    weights: jax.Array | None = None,  # f[N]
    combiner: str = "sum",
    implementation: str | None = None,
    name: str = "table",
) -> jax.Array:  # table.dtype[num_segments, D]
    """Pooled embedding lookup: one output row per bag.

    Args:
      table: `[V, D]` embedding table, f32 or bf16.
      ids: row ids, flat; negative ids are padding.
      segment_ids: the bag of each id, in `[0, num_segments)`, non-decreasing over the
        non-padding ids (bags laid out one after another, as in CSR).
      num_segments: static number of bags.
      weights: optional per-id weights (e.g. multi-hot feature strengths).
      combiner: "sum", "mean", "sqrtn" or "max".
      implementation: "xla", "cpu_ffi", "pallas" or None for the platform's best.
      name: the table's name, used in error messages.

    Returns:
      `[num_segments, D]` pooled rows of `table.dtype`, accumulated in f32.

    Raises:
      ValueError / TypeError at trace time for bad shapes, dtypes or options;
      IndexError on eager calls (or in checked mode) for an id >= V, naming it.

    Example:
      >>> table = jnp.arange(6.0).reshape(3, 2)
      >>> embedding_bag(table, jnp.array([0, 2, -1, 1]), jnp.array([0, 0, 1, 1]), 2)
      Array([[4., 6.],
             [2., 3.]], dtype=float32)
    """
    op = "embedding_bag"
    num_segments = validate_bag(
        op, table, ids, segment_ids, num_segments, weights, combiner, implementation
    )
    table = _checks.check_unsharded(op, name, table)
    _checks.check_lookups(op, name, table.shape[0], num_segments, ids, segment_ids, weights)
    ids = jnp.asarray(ids, jnp.int32)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    coef = base.pooling_coefficients(
        ids, segment_ids, num_segments, table.shape[0], weights, combiner
    )
    params = dict(num_segments=num_segments, implementation=implementation)
    if combiner == "max":
        return segment_max_p.bind(coef, ids, segment_ids, table, **params)[0]
    # Unweighted sum: coef is 1 on every valid lookup, which kernels may assume.
    unit = combiner == "sum" and weights is None
    return segment_spmm_p.bind(
        coef, ids, segment_ids, table, sorted_segments=True, unit_values=unit, **params
    )


def embedding_lookup(
    table: jax.Array, ids: jax.Array, *, implementation: str | None = None, name: str = "table"
) -> jax.Array:
    """Unpooled lookup: `table[ids]` with shape `ids.shape + (D,)`; ids < 0 give zero rows.

    Uses the same kernels and autodiff as `embedding_bag` (one bag per id).
    """
    op = "embedding_lookup"
    _dispatch.check_implementation(implementation)
    _checks.check_array(op, "table", table, ndim=2, kind="float")
    _checks.check_array(op, "ids", ids, kind="int")
    table = _checks.check_unsharded(op, name, table)
    _checks.check_lookups(op, name, table.shape[0], ids.size, ids)
    flat = jnp.asarray(ids, jnp.int32).reshape(-1)
    n = flat.shape[0]
    coef = ((flat >= 0) & (flat < table.shape[0])).astype(jnp.float32)
    out = segment_spmm_p.bind(
        coef,
        flat,
        jnp.arange(n, dtype=jnp.int32),
        table,
        num_segments=n,
        implementation=implementation,
        sorted_segments=True,
        unit_values=True,
    )
    return out.reshape(*ids.shape, table.shape[1])


# ---------------------------------------------------------------- max pooling primitive
# Operands as segment_spmm's (values, col_ids, segment_ids, dense); results
# (out dense.dtype[S, D], argk i32[S, D]: the winning lookup of each element, or -1).
def _max_abstract_eval(values, col_ids, segment_ids, dense, *, num_segments, implementation):
    shape = (num_segments, dense.shape[1])
    return (jax.core.ShapedArray(shape, dense.dtype), jax.core.ShapedArray(shape, jnp.int32))


def _max_batch_rule(args, dims, *, num_segments, implementation):
    flat, size, nnz = fold_vmapped_lookups(args, dims, num_segments)
    out, argk = segment_max_p.bind(
        *flat, num_segments=size * num_segments, implementation=implementation
    )
    out = out.reshape(size, num_segments, -1)
    argk = argk.reshape(size, num_segments, -1)
    offsets = (jnp.arange(size, dtype=jnp.int32) * nnz)[:, None, None]
    return (out, jnp.where(argk >= 0, argk - offsets, -1)), (0, 0)


def _max_jvp(primals, tangents, **params):
    values, col_ids, _, dense = (jnp.asarray(x) for x in primals)  # constants may be numpy
    d_values, _, _, d_dense = tangents
    out, argk = segment_max_p.bind(*primals, **params)
    found = argk >= 0
    k = jnp.where(found, argk, 0)  # [S, D]: the winning lookup of each output element
    rows = col_ids[k]
    cols = jnp.arange(out.shape[1])[None, :]
    tangent = jnp.zeros(out.shape, jnp.float32)
    if type(d_dense) is not ad.Zero:
        tangent += values[k] * d_dense[rows, cols].astype(jnp.float32)
    if type(d_values) is not ad.Zero:
        tangent += d_values[k] * dense[rows, cols].astype(jnp.float32)
    tangent = jnp.where(found, tangent, 0.0).astype(out.dtype)
    return (out, argk), (tangent, ad.Zero(jax.typeof(argk).to_tangent_aval()))


segment_max_p = define_primitive(
    "segment_max",
    log_name="embedding_bag[max]",
    abstract_eval=_max_abstract_eval,
    implementations={
        "xla": base.segment_max,
        "cpu_ffi": cpu_ffi.segment_max,
        "pallas": f"{__package__}.pallas_triton:segment_max",
    },
    batch_rule=_max_batch_rule,
    jvp=_max_jvp,
    multiple_results=True,
)
