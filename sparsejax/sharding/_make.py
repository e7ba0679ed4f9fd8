"""Store construction: the table store a layer's specs and placements call for."""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import Mesh

from ..embedding import DeviceTableStore, FeatureSpec, HybridTableStore, TableSpec, TableStore
from ._store import ShardedTableStore


def make_store(
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    *,
    mesh: Mesh | None = None,
    implementation: str | None = None,
) -> TableStore:
    """The store for `tables`, chosen by their `placement`: all "device" (the default),
    `DeviceTableStore` (tables whole on every device); any "host", `HybridTableStore`
    (those tables looked up and updated on the host's CPU, the rest on the devices);
    any other placement, `ShardedTableStore` on `mesh`."""
    if any(t.placement == "host" for t in tables):
        return HybridTableStore(tables, features, mesh=mesh, implementation=implementation)
    if all(t.placement == "device" for t in tables):
        return DeviceTableStore(tables, features, mesh=mesh, implementation=implementation)
    return ShardedTableStore(tables, features, mesh=mesh, implementation=implementation)
