"""A batch split per device, the form the sharded store reads.

A `SparseBatch` packs each feature's ids for the whole batch into one padded array. On a
mesh of N devices each device handles `B / N` consecutive examples, so each feature is
re-padded into N equal slices of `capacity_per_device` ids, slice `d` holding the ids of
device `d`'s examples. Segments keep their batch-wide bag numbers, so the result is still
a valid padded batch (any code that reads `PaddedIds` reads it unchanged).

Per device capacity: `min(feature capacity, B_local x max_ids)`; with the default
capacity (`B x max_ids`) no device can overflow. A smaller explicit capacity may be
exceeded by one device's share: that is an error naming the feature, the device and the
capacity needed, never a silent drop.

With `stores` (the sharded stores the batch feeds), two more things:
- 64-bit rows: the ids of a row-split table of 2**31 rows or more (int64 on the host)
  are routed here, with the table's `Piece.route`: the feature gets `owners` (int32
  owner shard) and its `ids` become int32 rows on the owner (less the piece's offset),
  so no device ever takes an int64 id (`route_on_host=True` routes every row-split
  feature, e.g. to test the path on small tables). Any other feature's ids must fit
  int32: an id at or above 2**31 is an error naming the feature, the table and the
  position, never a truncation.
- `counts`: a dict that receives, per lookup group of more than one shard,
  `int64[devices, shards]`: how many ids each of this process's devices sends to each
  owner (what the exchange's send buffers must hold; see `_exchange`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from ..data import PaddedIds, SparseBatch
from ..embedding import FeatureSpec, tiered_feature_key

INT32_MAX = 2**31 - 1


def capacity_per_device(spec: FeatureSpec, batch_size: int, devices: int) -> int:
    """Ids one device holds of `spec` in a batch of `batch_size` over `devices`."""
    local = batch_size // devices
    return min(spec.capacity_for(batch_size), local * spec.max_ids)


def shard_batch(
    batch: SparseBatch,
    features: Mapping[str, FeatureSpec],
    devices: int,
    *,
    global_batch: int | None = None,
    first_device: int = 0,
    stores: Sequence = (),
    route_on_host: bool = False,
    counts: dict | None = None,
) -> SparseBatch:
    """`batch` (host arrays) with every feature in `features` re-padded per device.

    Args:
      batch: this process's examples (all of them in one process).
      features: the specs of the features to split (others stay as they are).
      devices: this process's devices; the batch size must divide by it.
      global_batch: the batch size over all processes (default: this batch's).
      first_device: the mesh index of this process's first device (bags are numbered
        over the global batch).
      stores: the sharded stores (`ShardedTableStore`) that read the batch: their
        row-split tables of >= 2**31 rows are routed here (module docstring).
      route_on_host: route every row-split feature of `stores` here.
      counts: a dict to fill with each group's ids per (device, owner).
    """
    b = batch.batch_size
    global_batch = b if global_batch is None else global_batch
    if b % devices:
        raise ValueError(
            f"shard_batch: batch size {b} does not divide over the {devices} devices of "
            f"this process"
        )
    local = b // devices
    routed = _host_routed(stores, route_on_host)
    tiered = _tiered(stores)  # raw 64-bit keys, mapped to cache slots on the host
    out = dict(batch.features)
    for name, spec in features.items():
        if name not in batch.features:
            continue
        jag = batch.features[name]
        if name in routed:
            jag = _route(name, spec, jag, *routed[name])
        elif stores and spec.table not in tiered:
            _check_int32(name, spec, jag)
        out[name] = _split_feature(
            name,
            jag,
            bags=local * spec.bags_per_example(),
            devices=devices,
            capacity=capacity_per_device(spec, global_batch, global_batch // local),
            first_device=first_device,
        )
    if counts is not None:
        for store in stores:  # two layers may share a group name: the larger counts
            for g, c in owner_counts(store, out, devices).items():
                counts[g] = np.maximum(counts[g], c) if g in counts else c
    return dataclasses.replace(batch, features=out)


def _tiered(stores) -> set:
    return {t for s in stores for t in getattr(s, "tiered_tables", {})}


def _host_routed(stores, route_all: bool) -> dict:
    """`{feature: (piece, shards)}` of the features routed on the host."""
    out = {}
    for store in stores:
        for group in getattr(store, "groups", {}).values():
            st = store.stacks[group.stack]
            for e in group.entries:
                p = e.piece
                if p.stride > 1 and p.source not in store.tiered_tables:
                    if route_all or p.table.vocab_size > INT32_MAX:
                        out[e.feature.name] = (p, st.shards)
    return out


def _check_int32(name: str, spec: FeatureSpec, jag) -> None:
    ids = np.asarray(jag.ids)
    if ids.dtype.itemsize > 4 and ids.size and ids.max() > INT32_MAX:
        k = int(np.argmax(ids > INT32_MAX))
        raise ValueError(
            f"feature {name!r}: id {int(ids[k])} at position {k} of table {spec.table!r} "
            f"is >= 2**31, beyond a device's int32 ids; only a row-split table of 2**31 "
            f"rows or more takes such ids (its ids are routed on the host)"
        )


def _route(name: str, spec: FeatureSpec, jag, piece, shards: int) -> PaddedIds:
    """`jag` with `owners` and int32 rows on the owner (less the piece's offset)."""
    ids = np.asarray(jag.ids).astype(np.int64, copy=False)
    real = ids >= 0
    vocab = piece.table.vocab_size
    bad = np.flatnonzero(real & (ids >= vocab))
    if bad.size:
        k = int(bad[0])
        raise ValueError(
            f"feature {name!r}: id {int(ids[k])} at position {k} is outside table "
            f"{spec.table!r} of {vocab} rows"
        )
    owner, local = piece.route(np.where(real, ids, 0), shards)
    rows = np.where(real, np.asarray(local, np.int64) - piece.offset, -1)
    return dataclasses.replace(
        jag,
        ids=rows.astype(np.int32),
        owners=np.where(real, owner, 0).astype(np.int32),
    )


def owner_counts(store, features: Mapping, devices: int) -> dict[str, np.ndarray]:
    """`{group: int64[devices, shards]}`: the valid ids each device of a split batch
    (`features`, `devices` slices) sends each owner, per group of more than one shard."""
    out = {}
    for gname, group in getattr(store, "groups", {}).items():
        st = store.stacks[group.stack]
        if st.shards == 1:
            continue
        total = np.zeros(devices * st.shards, np.int64)
        for e in group.entries:
            jag = features[_feature_key(store, features, e.feature)]
            ids = np.asarray(jag.ids).reshape(devices, -1)
            dev = np.broadcast_to(np.arange(devices)[:, None], ids.shape)
            if getattr(jag, "owners", None) is not None:
                valid = (ids >= 0) & (ids < e.piece.local_rows)
                owner = np.asarray(jag.owners).reshape(devices, -1)
            else:
                valid = (ids >= 0) & (ids < e.piece.table.vocab_size)
                owner, _ = e.piece.route(np.where(valid, ids, 0).astype(np.int64), st.shards)
            idx = dev[valid] * st.shards + np.asarray(owner)[valid]
            total += np.bincount(idx, minlength=devices * st.shards)
        out[gname] = total.reshape(devices, st.shards)
    return out


def exchange_bytes(stores, counts, capacity, batch, first) -> tuple[int, int, int, int]:
    """Bytes this process's devices send to other devices in one step's lookup
    all-to-alls, and the bytes that must move: `(sent, needed, sent ids, needed ids)`.
    An id travels as its row and bag (8 bytes; 12 with a pooling coefficient); each
    owner returns every bag a partial sum (`S - 1` blocks of `bags x dim` rows)."""
    sent = needed = sent_ids = needed_ids = 0
    for store in stores:
        shape = dict(store.mesh.shape)
        model = int(shape.get("model", 1))
        for gname, group in getattr(store, "groups", {}).items():
            if gname not in counts:
                continue
            st = store.stacks[group.stack]
            c = counts[gname]  # [devices, shards]
            devices = c.shape[0]
            idb = 12 if group.needs_coefficients else 8
            b_local = batch.batch_size // devices
            bags = sum(b_local * e.feature.bags_per_example() for e in group.entries)
            n = sum(
                np.asarray(
                    batch.features[_feature_key(store, batch.features, e.feature)].ids
                ).shape[0]
                // devices
                for e in group.entries
            )
            cap = min(capacity[gname], n)
            back = (st.shards - 1) * bags * st.dim * np.dtype(st.dtype).itemsize
            for d in range(devices):
                g = first + d  # the device's mesh index: its shard along the stack's axes
                axes = st.axes
                own = g if len(axes) == 2 else (g % model if axes == ("model",) else g // model)
                others = int(c[d].sum() - c[d, own])
                sent_ids += (st.shards - 1) * cap * idb
                needed_ids += others * idb
                sent += back
                needed += back
    return sent + sent_ids, needed + needed_ids, sent_ids, needed_ids


def _feature_key(store, features: Mapping, f) -> str:
    """The key of feature `f` in `features` as the store reads it (a tiered table's
    slots, where the batch has them)."""
    if f.table in store.tiered_tables and tiered_feature_key(f.name, f.table) in features:
        return tiered_feature_key(f.name, f.table)
    return f.name


def _split_feature(name, jag, *, bags, devices, capacity, first_device) -> PaddedIds:
    ids, segs = np.asarray(jag.ids), np.asarray(jag.segments, np.int64)
    weights = None if jag.weights is None else np.asarray(jag.weights, np.float32)
    owners = None if jag.owners is None else np.asarray(jag.owners, np.int32)
    real = ids >= 0
    dev = np.where(real, segs // bags, devices)
    counts = np.bincount(dev, minlength=devices + 1)[:devices]
    if (counts > capacity).any():
        d = int(np.argmax(counts))
        raise ValueError(
            f"feature {name!r}: device {first_device + d} gets {int(counts[d])} ids of "
            f"its {bags} bags, over its capacity of {capacity}; set "
            f"FeatureSpec(capacity>={int(counts[d]) * devices}) (capacity is per batch; "
            f"each device holds capacity / devices ids)"
        )
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    take = np.flatnonzero(real)
    d = dev[take]
    slot = d * capacity + np.arange(take.size) - start[d]
    base = first_device * bags
    last = base + (np.arange(devices) + 1) * bags - 1  # each slice's padding: its last bag
    new_ids = np.full(devices * capacity, -1, ids.dtype)
    new_segs = np.repeat(last, capacity).astype(np.int32)
    new_ids[slot] = ids[take]
    new_segs[slot] = segs[take] + base
    new_w = new_o = None
    if weights is not None:
        new_w = np.zeros(devices * capacity, np.float32)
        new_w[slot] = weights[take]
    if owners is not None:
        new_o = np.zeros(devices * capacity, np.int32)
        new_o[slot] = owners[take]
    return PaddedIds(new_ids, new_segs, new_w, new_o)


def padding_batch(batch: SparseBatch, devices: int) -> SparseBatch:
    """`batch` with every feature all padding, `devices` x its capacity ids: the shapes
    a model traces with on a mesh, before the feature specs are known."""
    out = {}
    for name, jag in batch.features.items():
        cap = np.asarray(jag.ids).shape[0]
        bags_end = max(int(np.max(np.asarray(jag.segments), initial=0)), 0)
        out[name] = PaddedIds(
            np.full(devices * cap, -1, np.asarray(jag.ids).dtype),
            np.full(devices * cap, bags_end, np.int32),
            None if jag.weights is None else np.zeros(devices * cap, np.float32),
            None if jag.owners is None else np.zeros(devices * cap, np.int32),
        )
    return dataclasses.replace(batch, features=out)
