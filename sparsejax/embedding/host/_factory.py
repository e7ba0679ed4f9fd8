"""The one factory of host sides: which kinds of store have host work."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._host_store import HostExecution
from ._owned import OwnedTables
from ._protocol import HostSide, HostSides
from ._tiered import HostTables


def host_side(
    stores: Mapping[tuple, Any],
    mesh,
    *,
    layer_keys: Mapping[tuple, Any],
    expansions: Mapping | None = None,
    schedule: Callable | None = None,
    l2: float = 0.0,
    process_count: int = 1,
) -> HostSides:
    """The host sides of a model's layers (`stores`: `{layer path: TableStore}` on the
    trainer's mesh), initialized from `layer_keys`, composed in step order. The one
    place that knows which kinds of store have host work."""
    parts: list[HostSide] = []
    if HostExecution.needed(stores):
        parts.append(HostExecution(stores, mesh, expansions=expansions, schedule=schedule, l2=l2))
    if HostTables.needed(stores):
        if process_count > 1:  # each process owns some keys: they talk every step
            parts.append(OwnedTables(stores, _peers()))
        else:
            parts.append(HostTables(stores))
    for p in parts:
        if process_count > 1 and p.one_process:
            raise ValueError(p.one_process)
    sides = HostSides(parts)
    sides.init(layer_keys)
    return sides


def _peers():
    """The job's host exchange (`jax.distributed`'s processes)."""
    from ..._peers import job_exchange

    return job_exchange()
