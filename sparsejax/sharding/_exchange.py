"""The sharded store's exchange of one step, per device under `shard_map`: route each
id to the shard that owns its row, pool there, send partial bags back (`lookup_group`),
and gather what an owner's update needs (`gather_update`).

Send buffers. Each device sorts its ids by owner into S buckets of `c` slots and one
all-to-all swaps them. XLA:CPU has no `ragged_all_to_all` (jax 0.10.2: "not supported
by XLA:CPU ThunkEmitter"), so the buckets have a fixed size, a static part of the
compiled step. Without a capacity `c = n` (every id a device holds: never overflows,
and moves S x the ids, about 2x the bytes needed at S = 2). With one, `c` is what the
host says the step needs: the `Trainer` counts, before each step, how many ids every
one of its devices sends to every owner (`shard_batch(counts=...)`: it has the ids),
takes the maximum over all processes (one small all-gather, so every process compiles
the same program), and keeps a per-group capacity that only grows: the maximum seen
times a headroom, rounded up to 1/16 of a power of two so that a run compiles a few
times. The capacity travels with the batch (`PaddedIds.exchange`), so a new one is a
new trace, never a stale one. A batch that needs more than the capacity grows it
before the step runs (counted: `Trainer.exchange_stats`), so no id is dropped.

Should a device still find a bucket over its capacity (a caller that passed a capacity
its batch does not fit), the ids that do not fit are not looked up, and the device's
pooled rows of that group are NaN: the loss turns non-finite and training stops (`fit`
checks every loss); never a silently smaller sum.

Host-routed ids (`PaddedIds.owners`, a row-split table of 2**31 rows or more): the host
gave each id's owner shard and its int32 row there, less the piece's offset
(`Piece.route` on int64 ids), so the device routes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import ops
from ..embedding import GroupLookups
from . import _placement as pl

ALL = pl.AXES


INT32_MAX = 2**31 - 1


def group_capacity(group, feats) -> int | None:
    """The send-buffer slots per owner the batch gives `group` (None: room for all)."""
    caps = [
        dict(getattr(feats[e.feature.name], "exchange", ())).get(group.name) for e in group.entries
    ]
    return None if any(c is None for c in caps) else max(caps)


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
        if getattr(jag, "owners", None) is not None:  # routed on the host: i = row - offset
            o = jnp.asarray(jag.owners, jnp.int32)
            vocab = piece.local_rows
            valid = (i >= 0) & (i < vocab) & (o >= 0) & (o < st.shards) & (s >= 0) & (s < fb)
            owner, local = o, i + piece.offset
        else:
            vocab = min(piece.table.vocab_size, INT32_MAX)
            valid = (i >= 0) & (i < vocab) & (s >= 0) & (s < fb)
            owner, local = piece.route(jnp.where(valid, i, 0), st.shards)
        if group.needs_coefficients and group.combiner == "sum":
            coefs.append(ops.pooling_coefficients(i, s, fb, vocab, w, f.combiner or "sum"))
        elif group.needs_coefficients:
            coefs.append(jnp.ones(i.shape, jnp.float32) if w is None else w)
        owners.append(jnp.where(valid, owner, st.shards))
        rows.append(local)
        segs.append(jnp.clip(s, 0, fb - 1) + bags)
        bags += fb
    owner, row, seg = (jnp.concatenate(x) for x in (owners, rows, segs))
    coef = jnp.concatenate(coefs) if coefs else None
    row, seg, coef, overflow = route(owner, row, seg, coef, st, bags, group_capacity(group, feats))
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
    out = jnp.where(overflow, jnp.nan, out)  # ids were left out: never a silent sum
    return out.astype(pooled.dtype), (row, seg, coef)


def route(owner, row, seg, coef, st, bags, capacity=None):
    """Bucket a device's lookups by owner (`capacity` slots per owner, default `n`: every
    id it holds) and swap the buckets over the shard axes. Returns what this device
    owns, from every peer: rows, bags (peer q's bag k is `q * bags + k`) and
    coefficients; and whether an owner's bucket overflowed (its extra ids left out)."""
    if st.shards == 1:
        return jnp.where(owner < 1, row, -1), seg, coef, jnp.zeros((), bool)
    s, n = st.shards, owner.shape[0]
    c = n if capacity is None else max(1, min(int(capacity), n))
    order = jnp.argsort(owner, stable=True)
    so = owner[order]
    counts = jnp.zeros((s + 1,), jnp.int32).at[so].add(1)
    start = jnp.cumsum(counts) - counts
    pos = jnp.arange(n, dtype=jnp.int32) - start[so]
    dest = jnp.where((so < s) & (pos < c), so * c + pos, s * c)
    overflow = (counts[:s] > c).any()

    def send(values, fill):
        buf = jnp.full((s * c,), fill, values.dtype).at[dest].set(values[order], mode="drop")
        return jax.lax.all_to_all(buf.reshape(s, c), st.axes, 0, 0, tiled=True)

    recv_row = send(row, -1).reshape(-1)
    recv_seg = (send(seg, bags - 1) + (jnp.arange(s, dtype=jnp.int32) * bags)[:, None]).reshape(-1)
    recv_coef = None if coef is None else send(coef, 0.0).reshape(-1)
    return recv_row, recv_seg, recv_coef, overflow


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
