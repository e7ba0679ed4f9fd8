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
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _checks, _dispatch

__all__ = ["segment_spmm", "segment_spmm_ref", "segment_spmm_p", "DEFAULT_CHUNK_SIZE"]

DEFAULT_CHUNK_SIZE = 1 << 16
"""Nonzeros per chunk in the XLA implementation: bounds its peak memory at
chunk x D floats, whatever the number of nonzeros."""


def segment_spmm_ref(values, col_ids, segment_ids, dense, num_segments, *, implementation=None):
    """Pure-jnp reference with the same signature (`implementation` is ignored)."""
    del implementation
    k = dense.shape[0]
    valid = (col_ids >= 0) & (col_ids < k) & (segment_ids >= 0) & (segment_ids < num_segments)
    rows = jnp.take(dense, jnp.where(valid, col_ids, 0), axis=0).astype(jnp.float32)
    rows = rows * jnp.where(valid, values.astype(jnp.float32), 0.0)[:, None]
    out = jax.ops.segment_sum(rows, jnp.where(valid, segment_ids, 0), num_segments)
    return out.astype(dense.dtype)


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
    num_segments = _static_count(op, "num_segments", num_segments)
    _checks.check_lookups(op, "dense", dense.shape[0], num_segments, col_ids, segment_ids, values)
    return segment_spmm_p.bind(
        values.astype(jnp.float32),
        col_ids.astype(jnp.int32),
        segment_ids.astype(jnp.int32),
        dense,
        num_segments=num_segments,
        implementation=implementation,
        sorted_segments=True,
        unit_values=False,
    )


def _static_count(op: str, name: str, n) -> int:
    try:
        n = int(n)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"sparsejax.ops.{op}: `{name}` must be a static Python int") from None
    if n < 0:
        raise ValueError(f"sparsejax.ops.{op}: `{name}` must be >= 0, got {n}")
    return n


def _bind(values, col_ids, segment_ids, dense, *, num_segments, implementation, sorted_segments,
          unit_values=False):
    return segment_spmm_p.bind(
        values, col_ids, segment_ids, dense, num_segments=num_segments,
        implementation=implementation, sorted_segments=sorted_segments, unit_values=unit_values,
    )


# ---------------------------------------------------------------- implementations
def xla_segment_spmm(values, col_ids, segment_ids, dense, *, num_segments,
                     chunk_size=DEFAULT_CHUNK_SIZE, sorted_segments=False):
    """Gather + segment_sum over fixed chunks of nonzeros (peak memory chunk x D)."""
    nnz, k = values.shape[0], dense.shape[0]
    valid = (col_ids >= 0) & (col_ids < k) & (segment_ids >= 0) & (segment_ids < num_segments)
    values = jnp.where(valid, values, 0.0)
    col_ids = jnp.where(valid, col_ids, 0)
    segment_ids = jnp.where(valid, segment_ids, num_segments)  # dropped by segment_sum

    def chunk_sum(v, c, s):
        rows = dense.at[c].get(mode="promise_in_bounds").astype(jnp.float32) * v[:, None]
        return jax.ops.segment_sum(rows, s, num_segments, indices_are_sorted=sorted_segments)

    if nnz <= chunk_size:
        return chunk_sum(values, col_ids, segment_ids).astype(dense.dtype)
    n_chunks = -(-nnz // chunk_size)
    pad = n_chunks * chunk_size - nnz
    v = jnp.pad(values, (0, pad)).reshape(n_chunks, chunk_size)
    c = jnp.pad(col_ids, (0, pad)).reshape(n_chunks, chunk_size)
    s = jnp.pad(segment_ids, (0, pad), constant_values=num_segments).reshape(n_chunks, -1)

    def body(i, acc):
        return acc + chunk_sum(v[i], c[i], s[i])

    out = jax.lax.fori_loop(0, n_chunks, body,
                            jnp.zeros((num_segments, dense.shape[1]), jnp.float32))
    return out.astype(dense.dtype)


def _impl_fn(impl: str, platform: str, sorted_segments: bool, unit_values: bool):
    if impl == "xla":
        return functools.partial(xla_segment_spmm, sorted_segments=sorted_segments)
    if impl == "cpu_ffi":
        from . import _cpu_ffi

        # With unit values the kernel gets no values array, so XLA drops the
        # computation of `v` (embedding_bag's coefficients) altogether.
        return lambda v, c, s, d, *, num_segments: _cpu_ffi.spmm(
            None if unit_values else v, c, s, d, num_segments)
    from . import _pallas

    if not sorted_segments:  # the Pallas kernel needs CSR order; transposes are unsorted
        return xla_segment_spmm
    return functools.partial(_pallas.spmm, interpret=platform != "cuda")


# ---------------------------------------------------------------- primitive rules
# Params: num_segments, implementation, sorted_segments (CSR order over valid entries)
# and unit_values (values[k] == 1 for every valid entry: implementations may ignore
# `values`, as embedding_bag's unweighted sum does).
segment_spmm_p = Primitive("sparsejax_segment_spmm")


def _abstract_eval(values, col_ids, segment_ids, dense, *, num_segments, **_):
    return jax.core.ShapedArray((num_segments, dense.shape[1]), dense.dtype)


def _lowering(platform):
    def rule(ctx, *args, num_segments, implementation, sorted_segments, unit_values):
        impl = _dispatch.resolve_implementation(implementation, platform)
        _dispatch.log_choice("segment_spmm", platform, implementation, impl)
        fn = _impl_fn(impl, platform, sorted_segments, unit_values)
        return mlir.lower_fun(functools.partial(fn, num_segments=num_segments),
                              multiple_results=False)(ctx, *args)

    return rule


@functools.cache
def _jitted_bind(**params):
    return jax.jit(functools.partial(_bind, **params))


def _impl(*args, **params):
    return _jitted_bind(**params)(*args)


def fold_vmapped_lookups(args, dims, num_segments):
    """Fold a vmapped axis of (values, col_ids, segment_ids, dense) into one flat problem.

    Batch b's segments become `b * num_segments + s`; a batched `dense` is stacked and
    its column ids shifted the same way. Returns the flat arrays, the batch size and the
    per-batch number of nonzeros.
    """
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    nnz = next(a.shape[1 if d == 0 else 0] if d is not None else a.shape[0]
               for a, d in zip(args[:3], dims[:3], strict=True))
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


def _batch_rule(args, dims, *, num_segments, implementation, sorted_segments, unit_values):
    flat, size, _ = fold_vmapped_lookups(args, dims, num_segments)
    out = _bind(*flat, num_segments=size * num_segments, implementation=implementation,
                sorted_segments=sorted_segments, unit_values=unit_values)
    return out.reshape(size, num_segments, out.shape[-1]), 0


def _jvp(primals, tangents, **params):
    values, col_ids, segment_ids, dense = primals
    d_values, _, _, d_dense = tangents
    out = _bind(*primals, **params)
    terms = []
    if type(d_values) is not ad.Zero:
        terms.append(_bind(d_values, col_ids, segment_ids, dense,
                           **dict(params, unit_values=False)))
    if type(d_dense) is not ad.Zero:
        terms.append(_bind(values, col_ids, segment_ids, d_dense, **params))
    if not terms:
        return out, ad.Zero(jax.typeof(out).to_tangent_aval())
    return out, functools.reduce(jnp.add, terms)


def _transpose(ct, values, col_ids, segment_ids, dense, *, num_segments, implementation,
               sorted_segments, unit_values):
    del unit_values  # the transposed products take `values` as computed
    if type(ct) is ad.Zero:
        return None, None, None, None
    k = (dense.aval if ad.is_undefined_primal(dense) else dense).shape[0]
    valid = (col_ids >= 0) & (col_ids < k) & (segment_ids >= 0) & (segment_ids < num_segments)
    values_ct = dense_ct = None
    if ad.is_undefined_primal(dense):
        # The same product with the roles of rows and columns swapped (scatter-add).
        dense_ct = _bind(jnp.where(valid, values, 0.0), jnp.where(valid, segment_ids, -1),
                         col_ids, ct.astype(dense.aval.dtype), num_segments=k,
                         implementation=implementation, sorted_segments=False)
    if ad.is_undefined_primal(values):
        # Sampled dense-dense product: <ct[segment], dense[col]> per nonzero.
        rows = jnp.take(dense, jnp.where(valid, col_ids, 0), axis=0).astype(jnp.float32)
        cts = jnp.take(ct, jnp.where(valid, segment_ids, 0), axis=0).astype(jnp.float32)
        values_ct = jnp.where(valid, jnp.sum(rows * cts, axis=1), 0.0)
    return values_ct, None, None, dense_ct


segment_spmm_p.def_abstract_eval(_abstract_eval)
segment_spmm_p.def_impl(_impl)
mlir.register_lowering(segment_spmm_p, _lowering("xla_only"))
mlir.register_lowering(segment_spmm_p, _lowering("cpu"), platform="cpu")
mlir.register_lowering(segment_spmm_p, _lowering("cuda"), platform="cuda")
batching.primitive_batchers[segment_spmm_p] = _batch_rule
ad.primitive_jvps[segment_spmm_p] = _jvp
ad.primitive_transposes[segment_spmm_p] = _transpose
