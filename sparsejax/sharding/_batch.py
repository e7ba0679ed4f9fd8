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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from ..data import PaddedIds, SparseBatch
from ..embedding import FeatureSpec


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
) -> SparseBatch:
    """`batch` (host arrays) with every feature in `features` re-padded per device.

    Args:
      batch: this process's examples (all of them in one process).
      features: the specs of the features to split (others stay as they are).
      devices: this process's devices; the batch size must divide by it.
      global_batch: the batch size over all processes (default: this batch's).
      first_device: the mesh index of this process's first device (bags are numbered
        over the global batch).
    """
    b = batch.batch_size
    global_batch = b if global_batch is None else global_batch
    if b % devices:
        raise ValueError(
            f"shard_batch: batch size {b} does not divide over the {devices} devices of "
            f"this process"
        )
    local = b // devices
    out = dict(batch.features)
    for name, spec in features.items():
        if name not in batch.features:
            continue
        out[name] = _split_feature(
            name,
            batch.features[name],
            bags=local * spec.bags_per_example(),
            devices=devices,
            capacity=capacity_per_device(spec, global_batch, global_batch // local),
            first_device=first_device,
        )
    return dataclasses.replace(batch, features=out)


def _split_feature(name, jag, *, bags, devices, capacity, first_device) -> PaddedIds:
    ids, segs = np.asarray(jag.ids), np.asarray(jag.segments, np.int64)
    weights = None if jag.weights is None else np.asarray(jag.weights, np.float32)
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
    new_w = None
    if weights is not None:
        new_w = np.zeros(devices * capacity, np.float32)
        new_w[slot] = weights[take]
    return PaddedIds(new_ids, new_segs, new_w)


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
        )
    return dataclasses.replace(batch, features=out)
