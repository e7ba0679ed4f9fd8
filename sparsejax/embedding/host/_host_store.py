"""Host-executed tables: a table in host memory whose lookups and sparse updates run on
the host's CPU (the C++ kernels), beside a dense network on the accelerator.

`TableSpec(placement="host")` puts a table here (DeepRec's CPU-placed EmbeddingVariable
beside a GPU dense part). A layer with any host table gets a `HybridTableStore`: its
device tables in the store their placement picks, its host tables in a
`DeviceTableStore` on the host's CPU device, kept as one state part, `"host"`.

The jitted step never reads a host table. `HostExecution` (the trainer's host side)
looks the batch up on the host before the step and hands the step the pooled rows in
place of the tables: inside the step, the `"host"` part is `{"rows": {group: [bags, D]}}`,
and the store's update writes the gradient of those rows into the same place, so it
leaves with the step's output. The host then applies it with the tables' sparse
optimizers, the same function the device store runs, so a host table trains exactly as
the same table on the device.

Pipelining (`HostExecution.finish(..., next_batch=)`): before step t's update, the host
looks up step t+1's batch on the tables as they are (overlapping the device's step t);
after the update it recomputes only the bags that read a row step t updated. A bag is
recomputed from scratch by the same kernel, so the result is the same bits as looking
everything up after the update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._compose import Expansion
from .._device_store import DeviceTableStore
from .._spec import FeatureSpec, TableSpec
from .._store import StoreBase, default_mesh, subtree, with_subtree
from ._protocol import HostSide

HOST = "host"
"""The placement of a host-executed table, and the name of its state part."""
ROWS = "rows"
"""Inside the jitted step, the host part's key of the pooled rows (in) and their
gradient (out)."""
_PREFIX = "host:"  # the host groups' output keys, apart from the device groups'


def host_mesh() -> Mesh:
    """The host's CPU device (on a CPU-only machine, the first device) on a "data" axis."""
    return Mesh(np.array(jax.devices("cpu")[:1]), ("data",))


def _host_implementation(implementation: str | None) -> str | None:
    """The kernels the host part runs: the layer's choice if it runs on a CPU, else the
    CPU's best (a GPU kernel choice, "pallas", applies to the device part only)."""
    return implementation if implementation in ("xla", "cpu_ffi") else None


class HybridTableStore(StoreBase):
    """Device tables and host-executed tables (`placement="host"`) of one layer.
    Implements `TableStore`; the state is the device store's parts plus `"host"`.

    Inside one jitted step with the host tables as inputs (a custom loop on a CPU-only
    machine), the host part is looked up and updated like a device table. Beside an
    accelerator a jit cannot take arrays of both, so the host part runs through
    `HostExecution`, as the `Trainer` does (module docstring).
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        features: Sequence[FeatureSpec],
        *,
        mesh: Mesh | None = None,
        implementation: str | None = None,
    ):
        tables, features = tuple(tables), tuple(features)
        self.mesh = default_mesh() if mesh is None else mesh
        self.implementation = implementation
        self._specs = (tables, features)
        self.tables = {t.name: t for t in tables}
        self.features = {f.name: f for f in features}
        for t in tables:
            if t.placement == HOST and t.is_tiered:
                raise ValueError(
                    f"table {t.name!r}: placement 'host' runs the whole table on the host; "
                    f"a dynamic or host-cached table keeps its rows there already (drop one)"
                )
        host_names = {t.name for t in tables if t.placement == HOST}
        dev_t = [t for t in tables if t.name not in host_names]
        dev_f = [f for f in features if f.table not in host_names]
        self.host = DeviceTableStore(
            [dataclasses.replace(t, placement="device") for t in tables if t.name in host_names],
            [f for f in features if f.table in host_names],
            mesh=host_mesh(),
            implementation=_host_implementation(implementation),
        )
        placed = sorted(t.name for t in dev_t if t.placement != "device")
        if placed:
            raise ValueError(
                f"tables {sorted(host_names)} (placement 'host') sit beside tables placed "
                f"on the mesh ({placed}); host tables work beside 'device' tables only"
            )
        self.device = (
            DeviceTableStore(dev_t, dev_f, mesh=self.mesh, implementation=implementation)
            if dev_t
            else None
        )
        self.tiered_tables = {} if self.device is None else self.device.tiered_tables
        self.stacks = {**(self.device.stacks if self.device else {}), HOST: None}

    def __repr__(self):
        return f"{type(self).__name__}(device={self.device!r}, host={self.host!r})"

    def with_mesh(self, mesh: Mesh) -> HybridTableStore:
        """The same store with its device tables on `mesh` (the host part stays put)."""
        tables, features = self._specs
        return HybridTableStore(tables, features, mesh=mesh, implementation=self.implementation)

    # ---- state ----------------------------------------------------------------------
    def abstract_state(self) -> dict:
        out = {} if self.device is None else dict(self.device.abstract_state())
        out[HOST] = self.host.abstract_state()
        return out

    def init_part(self, key: jax.Array, name: str) -> Any:
        if name == HOST:
            return self.host.init(key)
        return self.device.init_part(key, name)

    def export_tables(self, state: Mapping) -> dict:
        out = {} if self.device is None else self.device.export_tables(_device_part(state))
        return {**out, **self.host.export_tables(state[HOST])}

    def jitted_export(self) -> Callable[[Mapping], dict]:
        """`export_tables` jitted per part (one jit cannot take arrays on the host's CPU
        and on the mesh's devices together)."""
        host = jax.jit(self.host.export_tables)
        dev = None if self.device is None else jax.jit(self.device.export_tables)

        def export(state):
            out = {} if dev is None else dev(_device_part(state))
            return {**out, **host(state[HOST])}

        return export

    def import_tables(self, tables: Mapping) -> dict:
        host = {n: tables.get(n) for n in self.host.tables}
        out = {} if self.device is None else dict(self.device.import_tables(tables))
        out[HOST] = self.host.import_tables({k: v for k, v in host.items() if v is not None})
        return out

    def cache_rows(self, table: str):
        """The device store's cache rows of a tiered table (`HostTables`)."""
        return self.device.cache_rows(table)

    # ---- lookup and update ------------------------------------------------------------
    def lookup(self, state: Mapping, features: Mapping, batch_size: int):
        outputs, residuals = {}, {}
        if self.device is not None:
            outputs, residuals["device"] = self.device.lookup(
                _device_part(state), features, batch_size
            )
        host = state[HOST]
        if ROWS in host:  # looked up on the host, before the step
            rows, residuals[HOST] = host[ROWS], None
        else:
            rows, residuals[HOST] = self.host.lookup(host, features, batch_size)
        outputs.update({_PREFIX + g: v for g, v in rows.items()})
        return outputs, residuals

    def split(self, outputs: Mapping[str, jax.Array], batch_size: int) -> dict[str, jax.Array]:
        dev, host = _by_part(outputs)
        out = self.host.split(host, batch_size)
        if self.device is not None:
            out.update(self.device.split(dev, batch_size))
        return {name: out[name] for name in self.features}

    def apply_gradients(self, state, residuals, grads, *, step, learning_rate=None, **kw):
        new = {}
        dev_grads, host_grads = _by_part(grads)
        if self.device is not None:
            new = dict(
                self.device.apply_gradients(
                    _device_part(state),
                    residuals["device"],
                    dev_grads,
                    step=step,
                    learning_rate=learning_rate,
                    **kw,
                )
            )
        if residuals[HOST] is None:  # the rows came from the host: so goes their gradient
            new[HOST] = {ROWS: host_grads}
        else:
            new[HOST] = self.host.apply_gradients(
                state[HOST],
                residuals[HOST],
                host_grads,
                step=step,
                learning_rate=learning_rate,
                **kw,
            )
        return new


def _device_part(state: Mapping) -> dict:
    return {k: v for k, v in state.items() if k != HOST}


def _by_part(outputs: Mapping) -> tuple[dict, dict]:
    """Per-group outputs (or their gradients) as `(device groups', host groups')`, the
    host groups' keys without `_PREFIX`."""
    dev = {g: v for g, v in outputs.items() if not g.startswith(_PREFIX)}
    host = {g[len(_PREFIX) :]: v for g, v in outputs.items() if g.startswith(_PREFIX)}
    return dev, host


@dataclasses.dataclass
class _Ahead:
    """The next batch's lookup, taken on the tables before this step's update."""

    batch: Any
    rows: dict
    lookups: dict
    previous: dict  # this step's lookups: the rows its update changes


class HostExecution(HostSide):
    """The host side (`HostSide`) of host-executed tables: one per model.

    `prepare` / `lookup` (before a step) puts each hybrid layer's pooled host rows on the mesh in
    place of its host tables; `finish` (after it) applies the rows' gradient on the
    host and puts the tables back. Between the two the state's `"host"` parts hold rows,
    not tables, so nothing else may read them then (the `Trainer` keeps the two together
    in `train_step`).

    Args:
      stores: `{layer path: store}` of the model's layers; the hybrid ones are run here.
      mesh: the mesh of the jitted step (the rows are replicated on it).
      expansions: `{layer path: Expansion}`: how each layer turns its batch's features
        into its store's (composed tables' parts); None: as they are.
      schedule, l2: the trainer's `sparse_schedule` and `sparse_l2`.
    """

    name = "host-executed tables"
    profile_part = "host_tables"
    one_process = (
        "host-executed tables (placement 'host') train in one process; "
        "place them on the devices to train across processes"
    )

    def __init__(
        self,
        stores: Mapping[tuple, Any],
        mesh: Mesh,
        *,
        expansions: Mapping[tuple, Expansion] | None = None,
        schedule: Callable | None = None,
        l2: float = 0.0,
    ):
        self.stores = {p: s for p, s in stores.items() if isinstance(s, HybridTableStore)}
        self.mesh = mesh
        self.rows_sharding = NamedSharding(mesh, PartitionSpec())
        self._cpu = host_mesh().devices.flat[0]
        self._lookups: dict[tuple, tuple] = {}  # path -> (tables, residuals) of the step
        self._ahead: dict[tuple, _Ahead] = {}
        self._latest: dict[tuple, Any] = {}  # path -> the tables `finish` returned
        self.looks_ahead = any(d.platform != "cpu" for d in mesh.devices.flat)
        """Whether `finish` looks the next batch up ahead (default: when the step runs
        on an accelerator; on a CPU-only machine host and device share the cores, and
        the bags recomputed after the update are extra work)."""
        self._ahead_bags = [0, 0]  # bags looked up ahead, and recomputed (jax scalars)
        self._jit_lookup = {}
        self._jit_fix = {}
        self._jit_apply = {}
        self._inputs: dict[tuple, tuple[str, ...]] = {}  # the batch features each reads
        for path, store in self.stores.items():
            host = store.host
            ex = (expansions or {}).get(path)
            split = (lambda f: f) if ex is None else ex.split_features
            parts = {p: name for name, c in (ex.composed if ex else {}).items() for p in c[4]}
            self._inputs[path] = tuple(sorted({parts.get(f, f) for f in host.features}))

            def lookup(tables, layout, buffers, batch_size, host=host, split=split):
                features = split(_unpack(layout, buffers))
                return host.lookup(tables, {f: features[f] for f in host.features}, batch_size)

            def apply(tables, residuals, grads, step, host=host):
                scale = None if schedule is None else schedule(step - 1)
                kw = {} if scale is None else {"learning_rate_scale": scale}
                if l2:
                    kw["l2"] = l2
                return host.apply_gradients(tables, residuals, grads, step=step, **kw)

            self._jit_lookup[path] = jax.jit(lookup, static_argnums=(1, 3))
            self._jit_fix[path] = jax.jit(lambda *a, host=host: _fix(host, *a))
            self._jit_apply[path] = jax.jit(apply, donate_argnums=0)

    @staticmethod
    def needed(stores: Mapping) -> bool:
        """Whether any layer of `stores` has host-executed tables."""
        return any(isinstance(s, HybridTableStore) for s in stores.values())

    def stats(self) -> dict:
        """`{"host-executed tables": {"bags_looked_ahead", "recomputed_fraction"}}`: bags
        of the train lookups served by the look-ahead, and the fraction of them
        recomputed after the update (they read a row it changed): what the look-ahead
        saved is the rest."""
        bags, dirty = self._ahead_bags
        return {
            self.name: {"bags_looked_ahead": bags, "recomputed_fraction": int(dirty) / max(bags, 1)}
        }

    def prepare(self, tables: Mapping, batch, *, train: bool):
        """`lookup`; the batch passes through."""
        return self.lookup(tables, batch, train=train), batch

    def step_sharding(self, tables: Mapping, replicated) -> dict:
        """A host part holds its pooled rows (in) and their gradient (out), replicated."""
        for path in self.stores:
            tables = with_host_part(tables, path, replicated)
        return tables

    def device_tables(self, tables: Mapping) -> dict:
        """The host parts emptied (the jitted step never takes host tables)."""
        for path in self.stores:
            tables = with_host_part(tables, path, {})
        return tables

    def _look_up(self, path: tuple, tables, batch):
        """The host lookup of `batch`'s features of the layer at `path`: `(rows, lookups)`."""
        feats = {n: batch.features[n] for n in self._inputs[path]}
        layout, buffers = _pack(feats)
        return self._jit_lookup[path](
            tables, layout, jax.device_put(buffers, self._cpu), batch.batch_size
        )

    def lookup(self, tables: Mapping, batch, *, train: bool = True) -> dict:
        """`tables` with each hybrid layer's `"host"` part replaced by `{"rows": ...}`,
        the batch's pooled host rows on the mesh. `train`: a train step's, whose
        update `finish` applies (else an eval's)."""
        for path in self.stores:
            host_tables = subtree(tables, path)[HOST]
            if ROWS in host_tables:  # looked up already
                continue
            ahead = self._ahead.pop(path, None) if train else None
            if ahead is not None and ahead.batch is batch and host_tables is self._latest.get(path):
                rows, dirty = self._jit_fix[path](
                    host_tables, ahead.rows, ahead.lookups, ahead.previous
                )
                lks = ahead.lookups
                self._ahead_bags[0] += sum(int(r.shape[0]) for r in rows.values())
                self._ahead_bags[1] = self._ahead_bags[1] + dirty
            else:
                rows, lks = self._look_up(path, host_tables, batch)
            if train:
                self._lookups[path] = (host_tables, lks)
            rows = jax.device_put(rows, self.rows_sharding)
            tables = with_host_part(tables, path, {ROWS: rows})
        return tables

    def finish(self, tables: Mapping, step: jax.Array, next_batch=None) -> dict:
        """`tables` (the step's output) with each `"host"` part's row gradient applied to
        the host tables, which replace it. With `next_batch`, that batch is looked up on
        the tables first (see the module docstring)."""
        step = jax.device_put(step, self._cpu)
        for path in self.stores:
            host_tables, lks = self._lookups.pop(path)
            if next_batch is not None and self.looks_ahead:
                rows, nxt = self._look_up(path, host_tables, next_batch)
                self._ahead[path] = _Ahead(next_batch, rows, nxt, lks)
            grads = jax.device_put(subtree(tables, path)[HOST][ROWS], self._cpu)
            new = self._jit_apply[path](host_tables, lks, grads, step)
            self._latest[path] = new
            tables = with_host_part(tables, path, new)
        return tables


def _pack(tree) -> tuple[tuple, list]:
    """`tree`'s leaves as one flat array per dtype (a few host-to-CPU copies instead of
    one per feature and field: 52 for Criteo's 26 features, ~2.5 ms a step) and the
    static layout `_unpack` rebuilds it from."""
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [np.asarray(x) for x in leaves]
    dtypes = sorted({x.dtype.str for x in leaves})
    buffers = [np.concatenate([x.ravel() for x in leaves if x.dtype.str == d]) for d in dtypes]
    return (treedef, tuple((x.shape, dtypes.index(x.dtype.str)) for x in leaves)), buffers


def _unpack(layout: tuple, buffers: Sequence[jax.Array]):
    """Inverse of `_pack` (inside the jitted lookup)."""
    treedef, shapes = layout
    at = [0] * len(buffers)
    leaves = []
    for shape, b in shapes:
        n = int(np.prod(shape))
        leaves.append(buffers[b][at[b] : at[b] + n].reshape(shape))
        at[b] += n
    return jax.tree.unflatten(treedef, leaves)


def _fix(host: DeviceTableStore, tables, rows, lookups, previous) -> dict:
    """`rows` (looked up before the previous step's update) with every bag that reads a
    row the update changed (any id of `previous` in the same stack) looked up again, and
    how many bags that was."""
    touched = {}
    for lk in previous.values():
        touched.setdefault(lk.stack, []).append(lk.ids)
    out, recomputed = {}, jnp.zeros((), jnp.int32)
    for g, lk in lookups.items():
        bags = rows[g].shape[0]
        if lk.stack not in touched:
            out[g] = rows[g]
            continue
        t = jnp.sort(jnp.concatenate(touched[lk.stack]))
        at = jnp.clip(jnp.searchsorted(t, lk.ids), 0, t.shape[0] - 1)
        hit = (t[at] == lk.ids) & (lk.ids >= 0)
        dirty = jnp.zeros((bags,), jnp.bool_).at[lk.segments].max(hit, mode="drop")
        ids = jnp.where(dirty[jnp.clip(lk.segments, 0, bags - 1)], lk.ids, -1)
        again = host._bag(tables[lk.stack], dataclasses.replace(lk, ids=ids), bags)
        out[g] = jnp.where(dirty[:, None], again, rows[g])
        recomputed += dirty.sum(dtype=jnp.int32)
    return out, recomputed


def with_host_part(tables: Mapping, path: tuple, value: Any) -> dict:
    """`tables` (the "embedding" collection) with the `"host"` part of the layer at
    `path` set to `value`."""
    return with_subtree(tables, (*path, HOST), value)


__all__ = ["HOST", "HostExecution", "HybridTableStore"]
