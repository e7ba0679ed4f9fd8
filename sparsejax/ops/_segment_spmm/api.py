"""`segment_spmm`: a segment-sorted (CSR-order COO) sparse matrix times a dense matrix.

    out[r] = sum over valid k with segment_ids[k] == r of values[k] * dense[col_ids[k]]

This is the workhorse of the package: an embedding bag with sum/mean/sqrtn pooling is
`segment_spmm(coefficients, ids, bags, table)`, an unpooled lookup is the same with
one segment per id, and the sparse optimizer reduces duplicate ids with it.

Entry k is valid when 0 <= col_ids[k] < K and 0 <= segment_ids[k] < num_segments.
Invalid entries (negative ids are padding) contribute nothing and are never read.

The primitive is linear in `values` and in `dense`; its JVP and transposes make
`jax.grad` exact (the transpose w.r.t. `dense` is a dense `[K, D]` array, which is what
`jax.grad` must return; the sparse training path never asks for it, see
`sparse_apply`). Implementations: "xla" (chunked gather + segment_sum, every backend),
"cpu_ffi" (C++), "pallas" (Triton on CUDA; interpret mode on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.interpreters import ad, batching

from .. import _checks, _dispatch
from .._primitive import define_primitive
from . import base, cpu_ffi

__all__ = ["segment_spmm", "segment_spmm_p", "fold_vmapped_lookups", "static_count"]


def segment_spmm(
    values: jax.Array,  # f[nnz]
    col_ids: jax.Array,  # i32[nnz]
    segment_ids: jax.Array,  # i32[nnz], non-decreasing over valid entries
    dense: jax.Array,  # f[K, D]
    num_segments: int,
    *,
    implementation: str | None = None,
) -> jax.Array:  # dense.dtype[num_segments, D]
    """Sparse (COO in row order) times dense, accumulated in float32.

    Args:
      values: the nonzero values, f32 (or any float; computed in f32).
      col_ids: column of each nonzero, i.e. the row of `dense` it reads; < 0 is padding.
      segment_ids: output row of each nonzero. Must be non-decreasing over valid
        entries (CSR order) for the fast kernels; checked on eager calls.
      dense: the `[K, D]` matrix (an embedding table), f32 or bf16.
      num_segments: static number of output rows.
      implementation: "xla", "cpu_ffi", "pallas" or None (best for the platform).

    Returns:
      `[num_segments, D]` array of `dense.dtype`.

    Example:
      >>> segment_spmm(jnp.array([1., 2.]), jnp.array([0, 2]), jnp.array([0, 0]),
      ...              jnp.eye(3), 1)
      Array([[1., 0., 2.]], dtype=float32)
    """
    op = "segment_spmm"
    _dispatch.check_implementation(implementation)
    _checks.check_array(op, "values", values, ndim=1, kind="float")
    _checks.check_array(op, "col_ids", col_ids, ndim=1, kind="int")
    _checks.check_array(op, "segment_ids", segment_ids, ndim=1, kind="int")
    _checks.check_array(op, "dense", dense, ndim=2, kind="float")
    _checks.check_same_length(op, values=values, col_ids=col_ids, segment_ids=segment_ids)
    num_segments = static_count(op, "num_segments", num_segments)
    dense = _checks.check_unsharded(op, "dense", dense)
    _checks.check_lookups(op, "dense", dense.shape[0], num_segments, col_ids, segment_ids, values)
    return segment_spmm_p.bind(
        jnp.asarray(values, jnp.float32),
        jnp.asarray(col_ids, jnp.int32),
        jnp.asarray(segment_ids, jnp.int32),
        dense,
        num_segments=num_segments,
        implementation=implementation,
        sorted_segments=True,
        unit_values=False,
    )


def static_count(op: str, name: str, n) -> int:
    """`n` as a static, non-negative Python int, or an error naming the argument."""
    try:
        n = int(n)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"sparsejax.ops.{op}: `{name}` must be a static Python int") from None
    if n < 0:
        raise ValueError(f"sparsejax.ops.{op}: `{name}` must be >= 0, got {n}")
    return n


# ---------------------------------------------------------------- primitive rules
# Operands (values f32[N], col_ids i32[N], segment_ids i32[N], dense T[K, D]).
# Params: num_segments, implementation, sorted_segments (CSR order over valid entries)
# and unit_values (values[k] == 1 for every valid entry: implementations may ignore
# `values`, as embedding_bag's unweighted sum does).
def _abstract_eval(values, col_ids, segment_ids, dense, *, num_segments, **_):
    return jax.core.ShapedArray((num_segments, dense.shape[1]), dense.dtype)


def fold_vmapped_lookups(args, dims, num_segments):
    """Fold a vmapped axis of (values, col_ids, segment_ids, dense) into one flat problem.

    Batch b's segments become `b * num_segments + s`; a batched `dense` is stacked and
    its column ids shifted the same way. Returns the flat arrays, the batch size and the
    per-batch number of nonzeros.
    """
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    nnz = next(
        a.shape[1 if d == 0 else 0] if d is not None else a.shape[0]
        for a, d in zip(args[:3], dims[:3], strict=True)
    )
    values, col_ids, segment_ids = (
        batching.bdim_at_front(a, d, size) if d is not None else jnp.broadcast_to(a, (size, nnz))
        for a, d in zip(args[:3], dims[:3], strict=True)
    )
    dense = args[3]
    batch = jnp.arange(size, dtype=jnp.int32)[:, None]
    seg_ok = (segment_ids >= 0) & (segment_ids < num_segments)
    segment_ids = jnp.where(seg_ok, segment_ids + batch * num_segments, -1)
    if dims[3] is not None:
        dense = batching.bdim_at_front(dense, dims[3], size)
        k = dense.shape[1]
        col_ok = (col_ids >= 0) & (col_ids < k)
        col_ids = jnp.where(col_ok, col_ids + batch * k, -1)
        dense = dense.reshape(size * k, dense.shape[2])
    flat = (values.reshape(-1), col_ids.reshape(-1), segment_ids.reshape(-1), dense)
    return flat, size, nnz


def _batch_rule(args, dims, *, num_segments, **params):
    flat, size, _ = fold_vmapped_lookups(args, dims, num_segments)
    out = segment_spmm_p.bind(*flat, num_segments=size * num_segments, **params)
    return out.reshape(size, num_segments, out.shape[-1]), 0


def _jvp(primals, tangents, **params):
    values, col_ids, segment_ids, dense = primals
    d_values, _, _, d_dense = tangents
    out = segment_spmm_p.bind(*primals, **params)
    terms = []
    if type(d_values) is not ad.Zero:
        terms.append(
            segment_spmm_p.bind(
                d_values, col_ids, segment_ids, dense, **dict(params, unit_values=False)
            )
        )
    if type(d_dense) is not ad.Zero:
        terms.append(segment_spmm_p.bind(values, col_ids, segment_ids, d_dense, **params))
    if not terms:
        return out, ad.Zero(jax.typeof(out).to_tangent_aval())
    return out, functools.reduce(jnp.add, terms)


def _transpose(
    ct,
    values,
    col_ids,
    segment_ids,
    dense,
    *,
    num_segments,
    implementation,
    sorted_segments,
    unit_values,
):
    del sorted_segments, unit_values  # the transposed products take `values` as computed
    if type(ct) is ad.Zero:
        return None, None, None, None
    k = (dense.aval if ad.is_undefined_primal(dense) else dense).shape[0]
    valid = base.valid_entries(col_ids, segment_ids, k, num_segments)
    values_ct = dense_ct = None
    if ad.is_undefined_primal(dense):
        # The same product with the roles of rows and columns swapped (scatter-add).
        dense_ct = segment_spmm_p.bind(
            jnp.where(valid, values, 0.0),
            jnp.where(valid, segment_ids, -1),
            col_ids,
            ct.astype(dense.aval.dtype),
            num_segments=k,
            implementation=implementation,
            sorted_segments=False,
            unit_values=False,
        )
    if ad.is_undefined_primal(values):
        # Sampled dense-dense product: <ct[segment], dense[col]> per nonzero.
        rows = jnp.take(dense, jnp.where(valid, col_ids, 0), axis=0).astype(jnp.float32)
        cts = jnp.take(ct, jnp.where(valid, segment_ids, 0), axis=0).astype(jnp.float32)
        values_ct = jnp.where(valid, jnp.sum(rows * cts, axis=1), 0.0)
    return values_ct, None, None, dense_ct


segment_spmm_p = define_primitive(
    "segment_spmm",
    abstract_eval=_abstract_eval,
    implementations={
        "xla": base.segment_spmm,
        "cpu_ffi": cpu_ffi.segment_spmm,
        "pallas": f"{__package__}.pallas_triton:segment_spmm",
    },
    batch_rule=_batch_rule,
    jvp=_jvp,
    transpose=_transpose,
)
