"""Embedding bags in plain jnp: the pooling coefficients every implementation shares,
the references, and the "xla" implementation of max pooling.

Pooling coefficients (sum / mean / sqrtn): lookup k contributes `coef[k] * table[ids[k]]`
to its bag with `coef = weight / normalizer(bag)`. sqrtn divides by the root of the
sum of squared weights; it scales each bag's weights by their largest magnitude before
squaring, so tiny weights (w**2 below the smallest float) still give the exact answer
instead of 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._segment_spmm.base import valid_entries


def pooling_coefficients(ids, segment_ids, num_segments, vocab, weights=None, combiner="sum"):
    """f32[N]: the factor each lookup's row is multiplied by (0 for invalid lookups)."""
    valid = valid_entries(ids, segment_ids, vocab, num_segments)
    w = jnp.ones(ids.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    w = jnp.where(valid, w, 0.0)
    if combiner in ("sum", "max"):
        return w
    seg = jnp.where(valid, segment_ids, num_segments)
    if combiner == "mean":
        norm = jax.ops.segment_sum(w, seg, num_segments + 1)[seg]
    else:  # sqrtn, in units of the bag's largest |weight| (no underflow of w * w)
        scale = jax.ops.segment_max(jnp.abs(w), seg, num_segments + 1)[seg]
        w = jnp.where(scale > 0, w / jnp.where(scale > 0, scale, 1.0), 0.0)
        norm = jnp.sqrt(jax.ops.segment_sum(w * w, seg, num_segments + 1))[seg]
    return jnp.where(norm != 0, w / jnp.where(norm != 0, norm, 1.0), 0.0)


def embedding_bag_ref(
    table,
    ids,
    segment_ids,
    num_segments,
    *,
    weights=None,
    combiner="sum",
    implementation=None,
    name="table",
):
    """Pure-jnp reference of `embedding_bag` (same signature)."""
    del implementation, name
    vocab = table.shape[0]
    valid = valid_entries(ids, segment_ids, vocab, num_segments)
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


def embedding_lookup_ref(table, ids, *, implementation=None, name="table"):
    """Pure-jnp reference of `embedding_lookup`."""
    del implementation, name
    valid = (ids >= 0) & (ids < table.shape[0])
    rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0)
    return jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))


def segment_max(values, col_ids, segment_ids, dense, *, num_segments):
    """(max over each segment of values[k] * dense[col[k]], index k of the max or -1)."""
    nnz = values.shape[0]
    valid = valid_entries(col_ids, segment_ids, dense.shape[0], num_segments)
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
