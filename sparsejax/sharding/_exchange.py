"""The sharded store's exchange of one step, per device under `shard_map`: route each
id to the shard that owns its row, pool there, send partial bags back (`lookup_group`),
and gather what an owner's update needs (`gather_update`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import ops
from ..embedding import GroupLookups
from . import _placement as pl

ALL = pl.AXES


def lookup_group(group, st, weights, feats, b_local, implementation):
    """One device's part of a group's lookup: partial bags from the owners, summed."""
    me = jax.lax.axis_index(ALL)
    owners, rows, segs, coefs = [], [], [], []
    bags = 0
    for e in group.entries:
        f, piece = e.feature, e.piece
        jag = feats[f.name]
        fb = b_local * f.bags_per_example()
        i = jnp.asarray(jag.ids, jnp.int32)
        s = jnp.asarray(jag.segments, jnp.int32) - me * fb
        w = None if jag.weights is None else jnp.asarray(jag.weights, jnp.float32)
        vocab = piece.table.vocab_size
        valid = (i >= 0) & (i < vocab) & (s >= 0) & (s < fb)
        if group.needs_coefficients and group.combiner == "sum":
            coefs.append(ops.pooling_coefficients(i, s, fb, vocab, w, f.combiner or "sum"))
        elif group.needs_coefficients:
            coefs.append(jnp.ones(i.shape, jnp.float32) if w is None else w)
        owner, local = piece.route(jnp.where(valid, i, 0), st.shards)
        owners.append(jnp.where(valid, owner, st.shards))
        rows.append(local)
        segs.append(jnp.clip(s, 0, fb - 1) + bags)
        bags += fb
    owner, row, seg = (jnp.concatenate(x) for x in (owners, rows, segs))
    coef = jnp.concatenate(coefs) if coefs else None
    row, seg, coef = route(owner, row, seg, coef, st, bags)
    pooled = ops.embedding_bag(
        weights,
        row,
        seg,
        st.shards * bags,
        weights=coef,
        combiner=group.combiner,
        implementation=implementation,
        name=st.name,
    )
    if st.shards == 1:
        return pooled, (row, seg, coef)
    if group.combiner == "max":  # bags an owner has no id of: no candidate
        count = jax.ops.segment_sum((row >= 0).astype(jnp.int32), seg, st.shards * bags)
        pooled = jnp.where((count > 0)[:, None], pooled, -jnp.inf)
    back = jax.lax.all_to_all(
        pooled.reshape(st.shards, bags, -1), st.axes, 0, 0, tiled=True
    ).astype(jnp.float32)
    if group.combiner == "max":
        best = back.max(0)
        out = jnp.where(jnp.isneginf(best), 0.0, best)
    else:
        out = back.sum(0)
    return out.astype(pooled.dtype), (row, seg, coef)


def route(owner, row, seg, coef, st, bags):
    """Bucket a device's lookups by owner (`n` slots per owner: never overflows) and
    swap the buckets over the shard axes. Returns what this device owns, from every
    peer: rows, bags (peer q's bag k is `q * bags + k`) and coefficients."""
    if st.shards == 1:
        return jnp.where(owner < 1, row, -1), seg, coef
    s, n = st.shards, owner.shape[0]
    order = jnp.argsort(owner, stable=True)
    so = owner[order]
    counts = jnp.zeros((s + 1,), jnp.int32).at[so].add(1)
    start = jnp.cumsum(counts) - counts
    dest = jnp.where(so < s, so * n + jnp.arange(n, dtype=jnp.int32) - start[so], s * n)

    def send(values, fill):
        buf = jnp.full((s * n,), fill, values.dtype).at[dest].set(values[order], mode="drop")
        return jax.lax.all_to_all(buf.reshape(s, n), st.axes, 0, 0, tiled=True)

    recv_row = send(row, -1).reshape(-1)
    recv_seg = (send(seg, bags - 1) + (jnp.arange(s, dtype=jnp.int32) * bags)[:, None]).reshape(-1)
    recv_coef = None if coef is None else send(coef, 0.0).reshape(-1)
    return recv_row, recv_seg, recv_coef


def gather_update(group, st, residual, grad, mesh_shape):
    """The update's lookups and gradients on one device: its shard's received lookups
    with every peer's bag gradients, from every replica of the shard."""
    row, seg, coef = residual
    bags = grad.shape[0]
    g = grad if st.shards == 1 else jax.lax.all_gather(grad, st.axes, axis=0, tiled=True)
    replicas = st.replicas
    r = pl.axis_size(mesh_shape, replicas)
    if r > 1:
        span = st.shards * bags

        def gather(x):
            return jax.lax.all_gather(x, replicas, axis=0, tiled=False)

        seg = (gather(seg) + (jnp.arange(r, dtype=jnp.int32) * span)[:, None]).reshape(-1)
        row = gather(row).reshape(-1)
        coef = None if coef is None else gather(coef).reshape(-1)
        g = gather(g).reshape(r * span, -1)
    return GroupLookups(row, seg, coef, st.name, group.combiner, st.optimizer), g
