"""Which process owns a key of a tiered table, and where its device cache lives.

In a job of P processes, a tiered table's keys are split by a pure function of the key
(`key_owner`), so every process routes any key without asking anyone: a fixed 64-bit
mix of the key picks one of `BUCKETS` buckets, and bucket `b` belongs to process
`b % P`. The owner keeps the keys' map, admission counts, eviction metadata, host rows
and cache slots; the others only send it keys. Checkpoints record `OWNER_HASH`, so a
restore never reads keys that were routed by another function, and a restore on another
process count re-routes every key by the same buckets.

The table's device cache is one row-split table over every device of the mesh (shard
`s` on the `s`-th device, process-major as `sparsejax.sharding.make_mesh` orders them),
so each owner's slots lie on its own devices (`OwnerLayout`): the host exchange of rows
between an owner's host store and its cache slots never leaves its process.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..._hashing import mix64

BUCKETS = 4096
"""Buckets of the key space; bucket `b` is owned by process `b % P`."""

OWNER_HASH = "splitmix64-xor-0x5bd1e995/4096"
"""The name of `key_bucket`, written into checkpoints (a restore refuses another)."""

_SALT = np.uint64(0x5BD1E995)


def key_bucket(keys: np.ndarray) -> np.ndarray:
    """int64[n] -> int64[n] in [0, BUCKETS): the key's bucket (a fixed hash)."""
    mixed = mix64(np.asarray(keys, np.int64).view(np.uint64) ^ _SALT)
    return (mixed >> np.uint64(52)).astype(np.int64)  # the top 12 bits


def key_owner(keys: np.ndarray, owners: int) -> np.ndarray:
    """int64[n] -> int64[n] in [0, owners): the process that owns each key."""
    if owners == 1:
        return np.zeros(np.shape(keys), np.int64)
    return key_bucket(keys) % owners


@dataclasses.dataclass(frozen=True)
class OwnerLayout:
    """A tiered table's device cache split over `owners` processes of `devices` devices
    each: owner `p` has `slots` cache slots, at the view's rows `p * devices * per_device
    + j`, on its own devices; the default row (what a key without a row reads) is the
    view's last row, on the last device, outside every owner's slots."""

    owners: int
    devices: int
    slots: int
    per_device: int

    @property
    def view_rows(self) -> int:
        """Rows of the device view (a multiple of the devices: no padding row)."""
        return self.owners * self.devices * self.per_device

    @property
    def default_row(self) -> int:
        return self.view_rows - 1

    def rows(self, owner: int, slots: np.ndarray) -> np.ndarray:
        """The view rows of `owner`'s cache `slots`."""
        return owner * self.devices * self.per_device + np.asarray(slots, np.int64)


def owner_layout(cache_rows: int, owners: int, devices: int) -> OwnerLayout:
    """The layout of a `cache_rows`-slot cache over `owners` processes of `devices`
    devices: each owner gets its share of the slots plus four standard deviations of the
    share of a batch's keys a hash gives it (binomial), at most `cache_rows`: a cache
    that holds a batch's distinct keys in one process holds each owner's share of them
    in several. Every device gets the same rows, one more than the slots it must hold
    somewhere, for the default row."""
    share = cache_rows / owners
    slots = min(cache_rows, math.ceil(share + 4 * math.sqrt(share) + 8))
    return OwnerLayout(owners, devices, slots, -(-(slots + 1) // devices))
