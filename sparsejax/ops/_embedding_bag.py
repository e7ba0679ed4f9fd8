"""Embedding bags (pooled lookups) and unpooled lookups.

sum / mean / sqrtn pooling is linear in the table: each lookup k contributes
`coef[k] * table[ids[k]]` to its bag, with `coef = weight / normalizer(bag)`. So these
combiners are `segment_spmm(coef, ids, segment_ids, table)` and share its kernels and
autodiff; gradients w.r.t. `weights` flow through `coef` by plain jnp autodiff.
max pooling is not linear and has its own primitive, `segment_max_p`, which also
returns which lookup won each output element so that the JVP is exact.

Semantics (the public contract, DESIGN.md): ids < 0 are padding and contribute
nothing; ids >= vocab also contribute nothing on the fast path (an error in checked
mode); mean/sqrtn normalize by the sum (of squares) of the weights of the valid ids
(their count when unweighted); an empty or all-padding bag gives zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _checks, _dispatch
from ._segment_spmm import _static_count, fold_vmapped_lookups, segment_spmm_p

__all__ = [
    "COMBINERS",
    "embedding_bag",
    "embedding_bag_ref",
    "embedding_lookup",
    "embedding_lookup_ref",
    "pooling_coefficients",
    "segment_max_p",
]

COMBINERS = ("sum", "mean", "sqrtn", "max")


def _valid(ids, segment_ids, vocab, num_segments):
    return (ids >= 0) & (ids < vocab) & (segment_ids >= 0) & (segment_ids < num_segments)


def pooling_coefficients(ids, segment_ids, num_segments, vocab, weights=None, combiner="sum"):
    """f32[N]: the factor each lookup's row is multiplied by (0 for invalid lookups)."""
    valid = _valid(ids, segment_ids, vocab, num_segments)
    w = jnp.ones(ids.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    w = jnp.where(valid, w, 0.0)
    if combiner in ("sum", "max"):
        return w
    seg = jnp.where(valid, segment_ids, num_segments)
    if combiner == "mean":
        norm = jax.ops.segment_sum(w, seg, num_segments + 1)
    else:  # sqrtn
        norm = jnp.sqrt(jax.ops.segment_sum(w * w, seg, num_segments + 1))
    norm = norm[seg]
    return jnp.where(norm != 0, w / jnp.where(norm != 0, norm, 1.0), 0.0)


def _validate_bag(op, table, ids, segment_ids, num_segments, weights, combiner, implementation):
    _dispatch.check_implementation(implementation)
    if combiner not in COMBINERS:
        raise ValueError(f"sparsejax.ops.{op}: combiner={combiner!r} is not one of {COMBINERS}")
    _checks.check_array(op, "table", table, ndim=2, kind="float")
    _checks.check_array(op, "ids", ids, ndim=1, kind="int")
    _checks.check_array(op, "segment_ids", segment_ids, ndim=1, kind="int")
    if weights is not None:
        _checks.check_array(op, "weights", weights, ndim=1, kind="float")
    _checks.check_same_length(op, ids=ids, segment_ids=segment_ids, weights=weights)
    return _static_count(op, "num_segments", num_segments)


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
    num_segments = _validate_bag(op, table, ids, segment_ids, num_segments, weights, combiner,
                                 implementation)
    _checks.check_lookups(op, name, table.shape[0], num_segments, ids, segment_ids, weights)
    ids = ids.astype(jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    coef = pooling_coefficients(ids, segment_ids, num_segments, table.shape[0], weights, combiner)
    params = dict(num_segments=num_segments, implementation=implementation)
    if combiner == "max":
        return segment_max_p.bind(coef, ids, segment_ids, table, **params)[0]
    # Unweighted sum: coef is 1 on every valid lookup, which kernels may assume.
    unit = combiner == "sum" and weights is None
    return segment_spmm_p.bind(coef, ids, segment_ids, table, sorted_segments=True,
                               unit_values=unit, **params)


def embedding_bag_ref(table, ids, segment_ids, num_segments, *, weights=None, combiner="sum",
                      implementation=None, name="table"):
    """Pure-jnp reference of `embedding_bag` (same signature)."""
    del implementation, name
    vocab = table.shape[0]
    valid = _valid(ids, segment_ids, vocab, num_segments)
    coef = pooling_coefficients(ids, segment_ids, num_segments, vocab, weights, combiner)
    rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0).astype(jnp.float32)
    seg = jnp.where(valid, segment_ids, num_segments)
    if combiner == "max":
        x = jnp.where(valid[:, None], rows * coef[:, None], -jnp.inf)
        out = jax.ops.segment_max(x, seg, num_segments + 1)[:num_segments]
        out = jnp.where(jnp.isneginf(out), 0.0, out)
    else:
        out = jax.ops.segment_sum(rows * coef[:, None], seg, num_segments + 1)[:num_segments]
    return out.astype(table.dtype)


def embedding_lookup(table: jax.Array, ids: jax.Array, *, implementation: str | None = None,
                     name: str = "table") -> jax.Array:
    """Unpooled lookup: `table[ids]` with shape `ids.shape + (D,)`; ids < 0 give zero rows.

    Uses the same kernels and autodiff as `embedding_bag` (one bag per id).
    """
    op = "embedding_lookup"
    _dispatch.check_implementation(implementation)
    _checks.check_array(op, "table", table, ndim=2, kind="float")
    _checks.check_array(op, "ids", ids, kind="int")
    _checks.check_lookups(op, name, table.shape[0], ids.size, ids)
    flat = ids.reshape(-1).astype(jnp.int32)
    n = flat.shape[0]
    coef = ((flat >= 0) & (flat < table.shape[0])).astype(jnp.float32)
    out = segment_spmm_p.bind(coef, flat, jnp.arange(n, dtype=jnp.int32), table, num_segments=n,
                              implementation=implementation, sorted_segments=True,
                              unit_values=True)
    return out.reshape(*ids.shape, table.shape[1])


def embedding_lookup_ref(table, ids, *, implementation=None, name="table"):
    """Pure-jnp reference of `embedding_lookup`."""
    del implementation, name
    valid = (ids >= 0) & (ids < table.shape[0])
    rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0)
    return jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))


# ---------------------------------------------------------------- max pooling primitive
def xla_segment_max(values, col_ids, segment_ids, dense, *, num_segments):
    """(max over each segment of values[k] * dense[col[k]], index k of the max or -1)."""
    nnz, k = values.shape[0], dense.shape[0]
    valid = _valid(col_ids, segment_ids, k, num_segments)
    seg = jnp.where(valid, segment_ids, num_segments)
    rows = dense.at[jnp.where(valid, col_ids, 0)].get(mode="promise_in_bounds")
    x = jnp.where(valid[:, None], rows.astype(jnp.float32) * values[:, None], -jnp.inf)
    best = jax.ops.segment_max(x, seg, num_segments + 1)
    positions = jnp.arange(nnz, dtype=jnp.int32)[:, None]
    is_best = valid[:, None] & (x == best[seg])
    first = jax.ops.segment_min(jnp.where(is_best, positions, nnz), seg, num_segments + 1)
    best, first = best[:num_segments], first[:num_segments]
    found = first < nnz
    return (jnp.where(found, best, 0.0).astype(dense.dtype), jnp.where(found, first, -1))


def _max_impl_fn(impl: str, platform: str):
    if impl == "xla":
        return xla_segment_max
    if impl == "cpu_ffi":
        from . import _cpu_ffi

        return lambda v, c, s, d, *, num_segments: _cpu_ffi.segment_max(v, c, s, d, num_segments)
    from . import _pallas

    def pallas_max(v, c, s, d, *, num_segments):
        return _pallas.embedding_bag_forward(d, c, s, v, num_segments, combiner="max",
                                             interpret=platform != "cuda")

    return pallas_max


segment_max_p = Primitive("sparsejax_segment_max")
segment_max_p.multiple_results = True


def _max_bind(values, col_ids, segment_ids, dense, *, num_segments, implementation):
    return segment_max_p.bind(values, col_ids, segment_ids, dense, num_segments=num_segments,
                              implementation=implementation)


def _max_abstract_eval(values, col_ids, segment_ids, dense, *, num_segments, implementation):
    shape = (num_segments, dense.shape[1])
    return (jax.core.ShapedArray(shape, dense.dtype), jax.core.ShapedArray(shape, jnp.int32))


def _max_lowering(platform):
    def rule(ctx, *args, num_segments, implementation):
        impl = _dispatch.resolve_implementation(implementation, platform)
        _dispatch.log_choice("embedding_bag[max]", platform, implementation, impl)
        fn = functools.partial(_max_impl_fn(impl, platform), num_segments=num_segments)
        return mlir.lower_fun(lambda *a: list(fn(*a)), multiple_results=True)(ctx, *args)

    return rule


@functools.cache
def _jitted_max(**params):
    return jax.jit(functools.partial(_max_bind, **params))


def _max_batch_rule(args, dims, *, num_segments, implementation):
    flat, size, nnz = fold_vmapped_lookups(args, dims, num_segments)
    out, argk = _max_bind(*flat, num_segments=size * num_segments, implementation=implementation)
    out = out.reshape(size, num_segments, -1)
    argk = argk.reshape(size, num_segments, -1)
    offsets = (jnp.arange(size, dtype=jnp.int32) * nnz)[:, None, None]
    return (out, jnp.where(argk >= 0, argk - offsets, -1)), (0, 0)


def _max_jvp(primals, tangents, **params):
    values, col_ids, _, dense = primals
    d_values, _, _, d_dense = tangents
    out, argk = _max_bind(*primals, **params)
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


segment_max_p.def_abstract_eval(_max_abstract_eval)
segment_max_p.def_impl(lambda *args, **params: _jitted_max(**params)(*args))
mlir.register_lowering(segment_max_p, _max_lowering("xla_only"))
mlir.register_lowering(segment_max_p, _max_lowering("cpu"), platform="cpu")
mlir.register_lowering(segment_max_p, _max_lowering("cuda"), platform="cuda")
batching.primitive_batchers[segment_max_p] = _max_batch_rule
ad.primitive_jvps[segment_max_p] = _max_jvp
