"""The table store: the one interface between embedding layers and table state.

An embedding layer (functional or Flax) never touches table arrays itself: it asks a
`TableStore` for the rows of a batch's ids, hands back the gradient of what it got, and
exports or imports tables by name for checkpoints. Two stores implement it:
`DeviceTableStore` (stacked tables, whole on every device of a mesh) and
`sparsejax.sharding.ShardedTableStore` (tables placed on a ("data", "model") mesh);
both hold dynamic and host-cached tables as device caches that their host side
(`sparsejax.embedding.host`) fills. `sparsejax.sharding.make_store` picks the store for
a layer's specs and placements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._spec import FeatureSpec, TableSpec

State = Any
"""A store's table state: a dict of named parts (`TableStore.state_names`), each a
pytree of arrays."""


def subtree(tree: Mapping, path: Sequence[str]) -> Any:
    """The node of a nested mapping at `path` (a layer's state in the "embedding"
    collection, by module path)."""
    for k in path:
        tree = tree[k]
    return tree


def with_subtree(tree: Mapping, path: Sequence[str], value: Any) -> dict:
    """`tree` with the node at `path` replaced by `value` (the other nodes shared)."""
    if not path:
        return value
    return {**tree, path[0]: with_subtree(tree[path[0]], path[1:], value)}


def default_mesh() -> Mesh:
    """One device (the default one) on a "data" axis: the mesh when none is given."""
    return Mesh(np.array(jax.devices()[:1]), ("data",))


@runtime_checkable
class TableStore(Protocol):
    """Where embedding tables live and how a batch reads and updates them.

    A store is built from the specs, a mesh and an implementation choice, and is
    immutable: its state is a separate pytree, passed in and returned, so it jits and
    donates like any other state. What each method must guarantee:

    - `state_names` / `init_part(key, name)` / `init(key)`: the state is
      `{name: part}`; `init` is `{n: init_part(key, n) for n in state_names}`. Each
      table's initial values are a deterministic function of `key` and the table's name
      (not of the other tables, the order of the specs or the layout). Called with a
      concrete key, `init_part` places the part with `state_shardings()[name]` and
      refuses, before allocating, a part that cannot fit in the devices' memory (one
      line naming the part's tables, its bytes and the memory available). A name stays
      the same when tables of other names are added or removed.
    - `state_shardings()`: the `NamedSharding` of every state leaf on `mesh` (same tree
      as the state), for `jax.jit(in_shardings=..., out_shardings=...)`.
      `abstract_state()` is the same tree of `jax.ShapeDtypeStruct`s (with shardings),
      computed without allocating; `abstract_tables()` likewise for `export_tables`.
    - `lookup(state, features, batch_size)`: `features` maps every feature name to its
      `PaddedIds`; returns `(outputs, residuals)`. `outputs` is a dict of arrays whose
      gradient the caller takes (the layer perturbs each), `residuals` a pytree of what
      the sparse update needs besides that gradient. Ids outside their table look up
      nothing. `split(outputs, batch_size)` turns `outputs` into
      `{feature: [B, D] or [B, max_ids, D]}` (differentiably).
    - `apply_gradients(state, residuals, grads, *, step, learning_rate=None)`: `grads`
      has the structure of `outputs`; updates only the rows the lookup touched, with
      each table's sparse optimizer, and returns the new state (in place under
      donation). It never builds a dense table gradient. Optional keywords, passed
      only when used: `learning_rate_scale` (a traced multiplier of every table's
      learning rate) and `l2` (L2 on the touched rows; see `apply_group_gradients`).
    - `export_tables(state)` / `import_tables(tables)`: the state as
      `{table name: {"weights": [V, D], "slots": {slot: [V(, D)]}}}` and back (placed
      with `state_shardings()`), independent of the store's layout: a change of
      layout, mesh or store never breaks a restore. `import_tables` names a missing
      table or a mismatched shape or slot set.
    - `with_mesh(mesh)`: the same store on another mesh (an error naming the axis if
      the store cannot use one of the mesh's axes).
    - `shards_batch`, `tiered_tables`: whether each device takes its own slice of the
      batch, and the tables whose rows live on the host side (`StoreBase`'s defaults:
      no and none). What a store does on the host between steps is its `HostSide`.
    """

    tables: Mapping[str, TableSpec]
    features: Mapping[str, FeatureSpec]
    mesh: Mesh
    shards_batch: bool
    tiered_tables: Mapping[str, TableSpec]

    @property
    def state_names(self) -> tuple[str, ...]: ...

    def init_part(self, key: jax.Array, name: str) -> Any: ...

    def init(self, key: jax.Array) -> State: ...

    def state_shardings(self) -> State: ...

    def abstract_state(self) -> State: ...

    def abstract_tables(self) -> dict: ...

    def lookup(
        self, state: State, features: Mapping, batch_size: int
    ) -> tuple[dict[str, jax.Array], Any]: ...

    def split(self, outputs: Mapping[str, jax.Array], batch_size: int) -> dict[str, jax.Array]: ...

    def apply_gradients(
        self,
        state: State,
        residuals: Any,
        grads: Mapping[str, jax.Array],
        *,
        step: jax.Array | int,
        learning_rate: jax.Array | float | None = None,
    ) -> State: ...

    def export_tables(self, state: State) -> dict: ...

    def import_tables(self, tables: Mapping) -> State: ...

    def with_mesh(self, mesh: Mesh) -> TableStore: ...

    def jitted_export(self) -> Callable[[State], dict]: ...

    def batch_features(self) -> dict[str, FeatureSpec]: ...


class StoreBase:
    """What both table stores share: identity from their specs, mesh and kernels
    (`_specs`, `mesh`, `implementation`), the state's names (`stacks`) and shardings
    (from `abstract_state`), `init` from `init_part`, and the first release's names."""

    shards_batch = False
    """Whether its tables are placed on the mesh, so every device takes its own slice of
    the batch (ids included)."""
    tiered_tables: Mapping = MappingProxyType({})
    """`{name: TableSpec}` of its tiered tables (dynamic or host-cached: their rows live
    on the host side, a device cache in the state)."""

    def _key(self):
        return (type(self), self._specs, self.mesh, self.implementation)

    def __eq__(self, other):
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(self.stacks)

    def state_shardings(self) -> dict:
        """The `NamedSharding` of every state leaf."""
        return jax.tree.map(lambda s: s.sharding, self.abstract_state())

    def abstract_tables(self) -> dict:
        """`export_tables`' shapes and dtypes, without allocating (restore targets)."""
        return jax.eval_shape(self.export_tables, self.abstract_state())

    # ---- sharded per-table form: what checkpoints and exports write, shard by shard ----
    def abstract_sharded_tables(self) -> dict:
        """`{table: {"weights": ShapeDtypeStruct([rows, dim], dtype, sharding), "slots":
        {...}}}`: each table in its logical layout (row `i` is the table's row `i`), as
        this store places it: `sharding` says which device holds which rows (or
        columns), and `rows` is `vocab_size` padded up to a multiple of the table's row
        shards (padding rows are never read). Tiered tables are left out. Base: every
        table whole, replicated on the store's mesh."""
        everywhere = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=everywhere),
            self.abstract_tables(),
        )

    def sharded_tables(self, state: Mapping) -> dict:
        """The arrays `abstract_sharded_tables` describes, built from the rows each device
        already holds (a sharded store gathers no table into one place). Exported
        eagerly: a table that is its stack's whole array is that array, not a copy."""

        def placed(a, sds):
            if a.sharding.is_equivalent_to(sds.sharding, a.ndim):
                return a
            return jax.device_put(a, sds.sharding)

        return jax.tree.map(placed, self.export_tables(state), self.abstract_sharded_tables())

    def import_copy_bytes(self) -> int:
        """Bytes `import_sharded_tables` allocates in this process beside the tables it
        is given (a restore holds both for a while). Base: all of them (it builds every
        stack anew)."""
        return sum(
            math.prod(s.shape) * s.dtype.itemsize * len(s.sharding.addressable_devices)
            for s in jax.tree.leaves(self.abstract_sharded_tables())
        )

    def import_sharded_tables(self, tables: Mapping) -> dict:
        """Inverse of `sharded_tables`: arrays placed as `abstract_sharded_tables` says
        (e.g. restored so by orbax, each process reading only its rows), with at least
        `vocab_size` rows (rows past it are padding); each device builds its own part of
        the state from its own rows."""
        trimmed = {
            name: jax.tree.map(lambda a, v=self.tables[name].vocab_size: a[:v], t)
            for name, t in tables.items()
        }
        return self.import_tables(trimmed)

    def jitted_export(self) -> Callable[[Mapping], dict]:
        """`export_tables` jitted (a store whose state spans devices no one jit takes
        jits it in parts)."""
        return jax.jit(self.export_tables)

    def batch_features(self) -> dict[str, FeatureSpec]:
        """Every batch key its lookup reads, with the feature behind it: each feature,
        and each tiered table's own slot ids of a feature (`tiered_feature_key`)."""
        out = {}
        for f in self.features.values():
            out[f.name] = f
            if f.table in self.tiered_tables:
                out[tiered_feature_key(f.name, f.table)] = f
        return out

    def init(self, key: jax.Array) -> dict:
        """Fresh weights (each table from its own initializer) and optimizer slots."""
        return {name: self.init_part(key, name) for name in self.stacks}

    # Names of the first release, kept for one more (the trainer and checkpoints use them).
    def tables_by_name(self, state: Mapping) -> dict:
        """Old name of `export_tables`."""
        return self.export_tables(state)

    def state_from_tables(self, tables: Mapping) -> dict:
        """Old name of `import_tables`."""
        return self.import_tables(tables)


def tiered_feature_key(feature: str, table: str) -> str:
    """The batch key of `feature`'s slot ids in tiered `table`, when several tiered
    tables read the feature (the store's lookup prefers it to the feature's name)."""
    return f"{feature}@{table}"


def stack_shapes(rows: int, dim: int, dtype: str, optimizer, sharding) -> dict:
    """`{"weights", "slots"}` of a stack of `rows` rows as `jax.ShapeDtypeStruct`s;
    `sharding(ndim)` is the `NamedSharding` of a leaf of that rank."""
    return {
        "weights": jax.ShapeDtypeStruct((rows, dim), jnp.dtype(dtype), sharding=sharding(2)),
        "slots": {
            s.name: jax.ShapeDtypeStruct(
                (rows,) if s.per_row else (rows, dim),
                jnp.dtype(s.dtype),
                sharding=sharding(1 if s.per_row else 2),
            )
            for s in optimizer.slots()
        },
    }


def empty_table(spec: TableSpec) -> dict:
    """`{"weights", "slots"}` of `spec` at zeros and the slots' initial values: a tiered
    table's device cache before the host side fills it."""
    return {
        "weights": np.zeros((spec.vocab_size, spec.dim), jnp.dtype(spec.dtype)),
        "slots": spec.optimizer.init_slots(spec.vocab_size, spec.dim),
    }


def check_saved_table(spec: TableSpec, saved: Mapping | None, saved_names) -> None:
    """Refuse, naming the table, a saved table that is missing or does not fit `spec`
    (its weights' shape, its optimizer's slots)."""
    if saved is None:
        raise KeyError(f"no saved state for table {spec.name!r} (saved: {sorted(saved_names)})")
    shape = tuple(saved["weights"].shape)
    if shape != (spec.vocab_size, spec.dim):
        raise ValueError(
            f"table {spec.name!r}: saved weights have shape {shape}, the spec says "
            f"{(spec.vocab_size, spec.dim)}"
        )
    want = sorted(s.name for s in spec.optimizer.slots())
    if sorted(saved["slots"]) != want:
        raise ValueError(
            f"table {spec.name!r}: saved optimizer slots {sorted(saved['slots'])}, "
            f"{type(spec.optimizer).__name__} needs {want}"
        )
