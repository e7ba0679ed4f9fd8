"""The host-side protocol: everything a table store does on the host between steps.

A table store keeps its device state behind `TableStore`; whatever else it does on the
host (map raw ids to rows, plan and run cache moves, admit and evict, run host-executed
lookups and updates, write back, snapshot) sits behind `HostSide`. Each kind of store
with host work has one `HostSide` implementation; `host_side` (the one factory) builds
them for a model's layers and composes them into `HostSides`, which the trainer holds.
The trainer, loop, checkpointer, profiler, exporter and runner call only this protocol
and never ask what kind of store they hold.

A host side owns the rows of the table shards its process holds (today every process
holds whole tables; a per-process shard changes what a part holds, not the protocol).
A method a host side does not support raises `HostOperationError`, one line naming the
host side and the method.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class HostOperationError(TypeError):
    """A host-side protocol method that this kind of host side does not support."""


class HostSide:
    """One kind of host work of a model's tables (the protocol; the base supports what
    every host side does the same way and refuses the rest by name).

    Attributes:
      name: what it is in messages, e.g. "tiered tables".
      saves_rows: whether it holds rows a checkpoint must save from the host
        (`snapshot` / `restore`), beside the orbax state.
      maps_batches: whether a batch must pass through `prepare` before it is placed on
        the devices (its ids are not yet the device's rows).
      looks_ahead: whether `finish` wants the next batch (it works on it during a step).
      one_process: why it trains in one process only (None: it works in many).
      profile_part: where a step profile puts its `prepare` / `finish` time: "host"
        (host work of the step) or "host_tables" (tables run on the host).
    """

    name = "host side"
    saves_rows = False
    maps_batches = True
    looks_ahead = False
    one_process: str | None = None
    profile_part = "host"

    @property
    def tables(self) -> Mapping[str, Any]:
        """`{table key: its host object}` of the host rows it owns ("layer/table")."""
        return {}

    def _unsupported(self, method: str):
        raise HostOperationError(f"{self.name} do not support the host operation {method!r}")

    # ---- steps ------------------------------------------------------------------------
    def init(self, layer_keys: Mapping[tuple, Any]) -> None:
        """Initial host rows; `layer_keys[path]` is the key the layer's store took."""

    def prepare(self, tables: Mapping, batch, *, train: bool) -> tuple[dict, Any]:
        """`(tables, batch)` for the next train (or eval) step: ids mapped, rows moved,
        host lookups put in place. An eval changes nothing of the host side."""
        self._unsupported("prepare")

    def finish(self, tables: Mapping, step, next_batch=None) -> Mapping:
        """`tables` after the jitted train step, with its host updates applied."""
        return tables

    def step_sharding(self, tables: Mapping, replicated) -> Mapping:
        """The jitted step's shardings of the tables (`tables`: the state's) as the host
        side hands them over between `prepare` and `finish`."""
        return tables

    def device_tables(self, tables: Mapping) -> Mapping:
        """`tables` as a jitted step takes them without the host (profiling a bare step)."""
        return tables

    # ---- checkpoints and export -------------------------------------------------------
    def snapshot(self, tables: Mapping, *, incremental: bool) -> dict:
        """`{table key: TableSnapshot}` of its host rows (`incremental`: what changed
        since `mark_saved`)."""
        self._unsupported("snapshot")

    def mark_saved(self) -> None:
        """The last snapshot is on disk: the next incremental one starts from here."""
        self._unsupported("mark_saved")

    def restore(self, chain: Sequence[Mapping]) -> None:
        """Rebuild its host rows from `chain` (snapshot dicts, full first, then deltas)."""
        self._unsupported("restore")

    def export(self, tables: Mapping) -> dict:
        """`{table key: {"keys", "weights", "slots", "default"}}`: its host rows, current,
        and the row a key without one reads."""
        self._unsupported("export")

    def stats(self) -> dict:
        """`{table key: {stat: value}}`, JSON-able numbers."""
        return {}

    def close(self) -> None:
        """Release files and threads (a no-op where there are none)."""


class HostSides(HostSide):
    """The composite the trainer holds: every host side of a model, in step order
    (host-executed lookups before cache exchanges). Empty when no table has host work:
    then every call passes its arguments through."""

    name = "host sides"

    def __init__(self, parts: Sequence[HostSide] = ()):
        self.parts = tuple(parts)

    @property
    def saves_rows(self) -> bool:
        return any(p.saves_rows for p in self.parts)

    @property
    def maps_batches(self) -> bool:
        return any(p.maps_batches for p in self.parts)

    @property
    def looks_ahead(self) -> bool:
        return any(p.looks_ahead for p in self.parts)

    def __repr__(self):
        return f"HostSides({', '.join(p.name for p in self.parts)})"

    @property
    def tables(self):
        return {k: v for p in self.parts for k, v in p.tables.items()}

    def _saving(self) -> tuple[HostSide, ...]:
        return tuple(p for p in self.parts if p.saves_rows)

    def init(self, layer_keys):
        for p in self.parts:
            p.init(layer_keys)

    def prepare(self, tables, batch, *, train):
        for p in self.parts:
            tables, batch = p.prepare(tables, batch, train=train)
        return tables, batch

    def finish(self, tables, step, next_batch=None):
        for p in self.parts:
            tables = p.finish(tables, step, next_batch)
        return tables

    def step_sharding(self, tables, replicated):
        for p in self.parts:
            tables = p.step_sharding(tables, replicated)
        return tables

    def device_tables(self, tables):
        for p in self.parts:
            tables = p.device_tables(tables)
        return tables

    def snapshot(self, tables, *, incremental):
        snaps = [p.snapshot(tables, incremental=incremental) for p in self._saving()]
        return {k: v for snap in snaps for k, v in snap.items()}

    def mark_saved(self):
        for p in self._saving():
            p.mark_saved()

    def restore(self, chain):
        for p in self._saving():
            p.restore(chain)

    def export(self, tables):
        return {k: v for p in self._saving() for k, v in p.export(tables).items()}

    def stats(self):
        return {k: v for p in self.parts for k, v in p.stats().items()}

    def close(self):
        for p in self.parts:
            p.close()
