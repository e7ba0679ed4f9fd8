"""`segment_spmm` in plain jnp: the reference and the "xla" implementation.

The reference is the plain formula (one gather of every nonzero); the XLA path is the
same product in fixed chunks of nonzeros, so its peak memory is chunk x D floats
whatever the number of nonzeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_SIZE = 1 << 16
"""Nonzeros per chunk in the XLA implementation: bounds its peak memory at
chunk x D floats, whatever the number of nonzeros."""


def valid_entries(col_ids, segment_ids, k, num_segments):
    """Entry k is valid when 0 <= col_ids[k] < K and 0 <= segment_ids[k] < num_segments."""
    return (col_ids >= 0) & (col_ids < k) & (segment_ids >= 0) & (segment_ids < num_segments)


def segment_spmm_ref(values, col_ids, segment_ids, dense, num_segments, *, implementation=None):
    """Pure-jnp reference with the same signature (`implementation` is ignored)."""
    del implementation
    valid = valid_entries(col_ids, segment_ids, dense.shape[0], num_segments)
    rows = jnp.take(dense, jnp.where(valid, col_ids, 0), axis=0).astype(jnp.float32)
    rows = rows * jnp.where(valid, values.astype(jnp.float32), 0.0)[:, None]
    out = jax.ops.segment_sum(rows, jnp.where(valid, segment_ids, 0), num_segments)
    return out.astype(dense.dtype)


def segment_spmm(
    values,
    col_ids,
    segment_ids,
    dense,
    *,
    num_segments,
    sorted_segments=False,
    unit_values=False,
    chunk_size=DEFAULT_CHUNK_SIZE,
):
    """Gather + segment_sum over fixed chunks of nonzeros (peak memory chunk x D)."""
    del unit_values  # `values` is 1 on valid entries then; reading it costs little here
    nnz = values.shape[0]
    valid = valid_entries(col_ids, segment_ids, dense.shape[0], num_segments)
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

    out = jax.lax.fori_loop(
        0, n_chunks, body, jnp.zeros((num_segments, dense.shape[1]), jnp.float32)
    )
    return out.astype(dense.dtype)
