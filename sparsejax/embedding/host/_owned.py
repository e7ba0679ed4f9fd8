"""Tiered tables in several processes: each process owns the keys `key_owner` gives it.

`OwnedTables` is `HostTables` for a job of P processes. Each process's `HostTable`s hold
only the keys it owns (their map, admission counts, eviction metadata, host rows and
tiers), and its cache slots lie on its own devices (`OwnerLayout`: the cache is one
row-wise table over every device). Per step, with the batch share of each process:

1. each process finds its batch's distinct keys per table and sends each owner its
   keys with their counts: one all-to-all over the host (`sparsejax._peers`), all
   tables at once, never more keys than the batch's distinct ones;
2. each owner maps the keys it got from everyone, as one process maps a batch
   (`HostTable.map_keys`: admission with the counts summed over the processes, eviction,
   cache placement), and answers every sender the view rows of its keys, with the rows
   it will load on each of its devices (so every process agrees on the exchange's size);
3. each process moves rows between its host rows and its own cache slots: one jitted
   gather (the rows leaving, written back at the next step) and one donated scatter (the
   rows entering) per stack under `shard_map`, each device at its own rows, no
   collective.

The lookup and the sparse update then run over the view rows as over any row-wise table
(the store's exchange of ids and pooled rows). The host work of a step (1-3) runs while
the devices still compute the step before (asynchronous dispatch): the all-to-all is on
the host, not queued behind the device step. A process that dies mid-exchange makes the
others fail with one line (`PeerLostError`) instead of waiting.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._store import subtree, tiered_feature_key, with_subtree
from ._host_table import HostTable, bucket_size, split_by_feature, table_report
from ._id_map import unique_keys
from ._owners import OwnerLayout, key_owner
from ._tiered import HostTables, _features_of, gather_rows, layer_table_key, scatter_rows

_PAD = np.iinfo(np.int32).max  # an exchange's padding row: out of bounds on every device


@dataclasses.dataclass(frozen=True)
class _OwnedPlacement:
    """Where this process's cache slots of a tiered table live."""

    stack: str
    layout: OwnerLayout
    owner: int
    rows: Callable  # view rows -> (device among this process's, local stack row)
    zero_default: bool

    @property
    def holds_default(self) -> bool:
        """Whether the default row is on this process's devices (the last owner's)."""
        return self.owner == self.layout.owners - 1


class _OwnedLayer:
    """One embedding layer's tiered tables in a process, and its exchange programs: each
    device gathers and scatters its own rows (`shard_map`, no collective)."""

    def __init__(self, path, store, tables: dict[str, HostTable], place: dict):
        self.path, self.tables, self.place = path, tables, place
        self.stacks = sorted({p.stack for p in place.values()})
        self.mesh = store.mesh
        specs = jax.tree.map(lambda s: s.spec, store.state_shardings())
        specs = {k: specs[k] for k in self.stacks}
        self.row_spec = {k: PartitionSpec(specs[k]["weights"][0]) for k in self.stacks}
        self.devices = len(self.mesh.local_devices)
        self.shards = int(self.mesh.size)
        rows = {k: (specs[k]["weights"], specs[k]["slots"]) for k in self.stacks}
        loads = {
            k: {
                "index": self.row_spec[k],
                "weights": specs[k]["weights"],
                "slots": specs[k]["slots"],
            }
            for k in self.stacks
        }

        def local(fn, in_specs, out_specs):
            return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

        self.gather = jax.jit(local(gather_rows, (specs, self.row_spec), rows))
        scatter = local(scatter_rows, (specs, loads), specs)
        self.scatter = jax.jit(scatter, donate_argnums=0)
        self.scatter_copy = jax.jit(scatter)

    def global_rows(self, stack: str, local: np.ndarray) -> jax.Array:
        """This process's `[devices * n, ...]` rows of an exchange as the global array
        the programs take (device `k`'s at `[k * n, (k + 1) * n)`)."""
        spec = PartitionSpec(*self.row_spec[stack], *([None] * (local.ndim - 1)))
        n = local.shape[0] // self.devices
        return jax.make_array_from_process_local_data(
            NamedSharding(self.mesh, spec), local, (self.shards * n, *local.shape[1:])
        )


def local_rows(a: jax.Array) -> np.ndarray:
    """This process's rows of a row-split global array, in device order."""
    shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def _read_rows(stack_state: Mapping, dev: np.ndarray, local: np.ndarray):
    """`(weights, {slot: values})` at `(device, local row)` pairs of this process's
    devices, read from each device's own block (no collective)."""

    def leaf(a):
        shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start or 0)
        out = np.empty((dev.shape[0], *a.shape[1:]), a.dtype)
        for k, sh in enumerate(shards):
            sel = np.nonzero(dev == k)[0]
            if sel.shape[0]:
                idx = np.zeros(bucket_size(sel.shape[0]), np.int32)
                idx[: sel.shape[0]] = local[sel]
                out[sel] = np.asarray(_take_rows(sh.data, idx))[: sel.shape[0]]
        return out

    return leaf(stack_state["weights"]), {k: leaf(v) for k, v in stack_state["slots"].items()}


@jax.jit
def _take_rows(block: jax.Array, idx: jax.Array) -> jax.Array:
    """`block[idx]` on the block's device: one program per (block, index bucket) shape,
    where eager indexing compiled its several steps again for every row count."""
    return jnp.take(block, idx, axis=0, mode="clip")


class OwnedTables(HostTables):
    """`HostTables` in a job of several processes (module docstring).

    Args:
      layouts: each embedding layer's `TableStore` by module path; every tiered table
        must have an `OwnerLayout` (`ShardedTableStore.owner_layouts`: placed row_wise
        on a mesh of every process's devices).
      peers: the processes' host all-to-all (`sparsejax._peers.PeerExchange`; the
        job's, shared: it stays open when this closes).
    """

    one_process = None

    def __init__(self, layouts: Mapping, peers):
        self.peers = peers
        self.owners = peers.num_processes
        super().__init__(layouts)
        self.exchanged = {"steps": 0, "keys": 0, "keys_away": 0, "bytes": 0}
        """Over the train steps: the distinct keys of this process's batches (each sent
        to its one owner, this process included), those sent to other processes, and
        the host bytes it sent them (keys, counts and the answers)."""

    def _layer(self, path, store) -> _OwnedLayer:
        owned = getattr(store, "owner_layouts", {})
        missing = sorted(set(store.tiered_tables) - set(owned))
        if missing:
            raise ValueError(
                f"tables {missing} are dynamic or host-cached and train in {self.owners} "
                f"processes: place them row_wise on a mesh of every process's devices "
                f"(sparsejax.sharding.ShardedTableStore)"
            )
        tables, place = {}, {}
        for name, spec in store.tiered_tables.items():
            stack, layout, owner, rows = store.owner_cache(name)
            tables[name] = HostTable(
                spec,
                _features_of(store, name),
                key=layer_table_key(path, name),
                owner=owner,
                owners=layout.owners,
                capacity=layout.slots,
            )
            zero = spec.dynamic is None or spec.dynamic.default_row == "zeros"
            place[name] = _OwnedPlacement(stack, layout, owner, rows, zero)
        return _OwnedLayer(path, store, tables, place)

    def _tables(self):
        return [
            (layer, name, ht) for layer in self.layers.values() for name, ht in layer.tables.items()
        ]

    # ---- one step ----------------------------------------------------------------------
    def _prepare(self, state_tables, batch, *, train: bool):
        """Steps 1-3 of the module docstring for this process's share of a batch."""
        tables = self._tables()
        mine, requests = self._requests(batch.features, tables, train)
        sent = self.peers.bytes_sent
        answers, moves = self._answer(self.peers.all_to_all(requests), tables, train)
        plans = {path: self._plan(layer, moves, train) for path, layer in self.layers.items()}
        need = np.array([pl[s]["need"] for pl in plans.values() for s in sorted(pl)], np.int64)
        back = self.peers.all_to_all([a + [need] for a in answers])
        if train:
            self.exchanged["bytes"] += self.peers.bytes_sent - sent
            self.exchanged["steps"] += 1
        features = self._view_rows(batch.features, back, mine, tables)
        sizes = np.max([b[-1] for b in back], axis=0).tolist()  # every owner's need
        for path, layer in self.layers.items():  # rows in and out of my cache slots
            n = {s: bucket_size(sizes.pop(0)) for s in sorted(plans[path])}
            state_tables = self._exchange(state_tables, layer, plans[path], n, train=train)
        return state_tables, dataclasses.replace(batch, features=features)

    def _requests(self, raw, tables, train: bool):
        """Each table's distinct keys of this process's batch share, with their counts,
        grouped by owner: `requests[owner]` (keys, counts per table), and what this
        process needs to spread the answers back over its features."""
        mine, requests = [], [[] for _ in range(self.owners)]
        for _, name, ht in tables:
            missing = [f.name for f in ht.features if f.name not in raw]
            if missing:
                raise KeyError(f"batch lacks features {missing} of table {name!r}")
            names, sizes, uniq, inverse, counts = ht.batch_keys(
                {f.name: raw[f.name].ids for f in ht.features}
            )
            owner = key_owner(uniq, self.owners)
            order = np.argsort(owner, kind="stable")
            cuts = np.searchsorted(owner[order], np.arange(self.owners + 1))
            for j in range(self.owners):
                sel = order[cuts[j] : cuts[j + 1]]
                requests[j] += [uniq[sel], counts[sel]]
            mine.append((names, sizes, uniq.shape[0], inverse, order, cuts))
            if train:
                self.exchanged["keys"] += uniq.shape[0]
                self.exchanged["keys_away"] += uniq.shape[0] - int(np.diff(cuts)[ht.owner])
        return mine, requests

    def _answer(self, got, tables, train: bool):
        """As the owner: map every process's keys (`got[process]`, as `_requests` sent
        them) as one batch, counts summed; `answers[process]`: each table's view rows of
        its keys, and `moves`: each table's cache exchange."""
        answers, moves = [[] for _ in range(self.owners)], {}
        for t, (layer, name, ht) in enumerate(tables):
            keys = [g[2 * t] for g in got]
            uniq, inv, _ = unique_keys(np.concatenate(keys))
            counts = np.bincount(inv, np.concatenate([g[2 * t + 1] for g in got]), uniq.shape[0])
            slots, *moves[(layer.path, name)] = ht.map_keys(
                uniq, counts.astype(np.int64), self.step, train=train
            )
            p = layer.place[name]
            view = np.where(
                slots == ht.capacity, p.layout.default_row, p.layout.rows(p.owner, slots)
            ).astype(np.int32)
            starts = np.cumsum([0] + [k.shape[0] for k in keys])
            for i in range(self.owners):
                answers[i].append(view[inv[starts[i] : starts[i + 1]]])
        return answers, moves

    def _view_rows(self, raw, back, mine, tables) -> dict:
        """The batch's features with the owners' answers (`back[owner]`) as ids: each
        tiered table's view rows (under `tiered_feature_key` too when several read one
        feature)."""
        features = dict(raw)
        for t, (_, name, _) in enumerate(tables):
            names, sizes, n_uniq, inverse, order, cuts = mine[t]
            rows = np.empty(n_uniq, np.int32)
            for j in range(self.owners):
                rows[order[cuts[j] : cuts[j + 1]]] = back[j][t]
            for f, ids in split_by_feature(rows, inverse, names, sizes).items():
                slots = dataclasses.replace(raw[f], ids=ids)
                if f in self.shared_features:
                    features[tiered_feature_key(f, name)] = slots
                if features[f] is raw[f]:
                    features[f] = slots
        return features

    def _plan(self, layer: _OwnedLayer, moves, train: bool) -> dict:
        """Per stack of `layer`: the rows this process loads into its cache slots (each
        table's, then the default row where this process holds it and it needs
        writing), as `(device, local row)` with their values, and `need`: the most rows
        one of its devices loads."""
        out = {}
        for stack in layer.stacks:
            names = [t for t in layer.tables if layer.place[t].stack == stack]
            devs, rows, weights, slots, segs, at = [], [], [], [], [], 0
            for t in names:
                load_slots, load_rows, old_rows = moves[(layer.path, t)]
                ht, p = layer.tables[t], layer.place[t]
                dev, local = p.rows(p.layout.rows(p.owner, load_slots))
                w, sl = ht.rows.gather(load_rows)
                devs.append(dev), rows.append(local), weights.append(w), slots.append(sl)
                segs.append((t, np.arange(at, at + dev.shape[0]), old_rows))
                at += dev.shape[0]
            for t in names:
                ht, p = layer.tables[t], layer.place[t]
                if p.holds_default and (p.zero_default or ht.default_reset):
                    dev, local = p.rows(np.array([p.layout.default_row]))
                    dw, ds = ht.default_row()
                    devs.append(dev), rows.append(local)
                    weights.append(dw[None].astype(ht.rows.dtype))
                    slots.append({k: np.asarray(v)[None] for k, v in ds.items()})
                    if train:
                        ht.default_reset = False
            dev = np.concatenate(devs)
            need = int(np.bincount(dev, minlength=layer.devices).max()) if dev.shape[0] else 0
            out[stack] = {
                "dev": dev,
                "rows": np.concatenate(rows),
                "weights": np.concatenate(weights),
                "slots": {k: np.concatenate([s[k] for s in slots]) for k in slots[0]},
                "segs": segs,
                "need": need,
            }
        return out

    def _exchange(self, state_tables, layer: _OwnedLayer, plan: dict, n: dict, *, train: bool):
        """Run `layer`'s planned loads (each device's padded to `n[stack]` rows): train
        gathers what the load rows held first (written back at the next step)."""
        layer_state = subtree(state_tables, layer.path)
        sub = {k: layer_state[k] for k in layer.stacks}
        loads, index, segments = {}, {}, {}
        for stack, pl in plan.items():
            size, d = n[stack], layer.devices
            order = np.argsort(pl["dev"], kind="stable")
            first = np.searchsorted(pl["dev"][order], np.arange(d))
            pos = np.empty(order.shape[0], np.int64)
            pos[order] = pl["dev"][order] * size + (
                np.arange(order.shape[0]) - first[pl["dev"][order]]
            )
            idx = np.full(d * size, _PAD, np.int32)
            idx[pos] = pl["rows"]
            w = np.zeros((d * size, *pl["weights"].shape[1:]), pl["weights"].dtype)
            w[pos] = pl["weights"]
            sl = {}
            for k, v in pl["slots"].items():
                sl[k] = np.zeros((d * size, *v.shape[1:]), v.dtype)
                sl[k][pos] = v
            index[stack] = layer.global_rows(stack, idx)
            loads[stack] = {
                "index": index[stack],
                "weights": layer.global_rows(stack, w),
                "slots": {k: layer.global_rows(stack, v) for k, v in sl.items()},
            }
            segments[stack] = [(t, pos[seg], old) for t, seg, old in pl["segs"]]
        if not train:
            new = layer.scatter_copy(sub, loads)
            return with_subtree(state_tables, layer.path, {**layer_state, **new})
        evicted = layer.gather(sub, index)
        self._pending.append((layer, segments, evicted))
        new = layer.scatter(sub, loads)
        return with_subtree(state_tables, layer.path, {**layer_state, **new})

    def _on_host(self, gathered):
        return jax.tree.map(local_rows, gathered)

    def flush(self, state_tables: Mapping) -> None:
        """Copy this process's cached rows (and the trainable default row, where it holds
        it) to its host rows, read from its own devices."""
        self._write_back()
        for path, layer in self.layers.items():
            sub = subtree(state_tables, path)
            for name, ht in layer.tables.items():
                p = layer.place[name]
                slots = np.nonzero(ht.slot_row >= 0)[0]
                view = p.layout.rows(p.owner, slots)
                if p.holds_default:
                    view = np.append(view, p.layout.default_row)
                dev, local = p.rows(view)
                w, s = _read_rows(sub[p.stack], dev, local)
                n = slots.shape[0]
                rows = ht.slot_row[slots].astype(np.int64)
                ht.rows.scatter(rows, w[:n], {k: v[:n] for k, v in s.items()})
                if p.holds_default and not p.zero_default:
                    ht.default_values = (w[n].astype(np.float32), {k: v[n] for k, v in s.items()})

    def stats(self) -> dict[str, dict]:
        """Per table the stats of all its owners together (`HostTables.stats`), with
        `rows_live_per_process`. A collective: every process calls it."""
        mine = {key: ht.totals() for key, ht in self.tables.items()}
        raw = np.frombuffer(json.dumps(mine).encode(), np.uint8)
        got = self.peers.all_to_all([[raw]] * self.owners)
        every = [json.loads(g[0].tobytes()) for g in got]
        out = {}
        for key in mine:
            parts = [e[key] for e in every]
            total = {k: sum(p[k] for p in parts) for k in parts[0]}
            total["steps"] = max(p["steps"] for p in parts)
            if any(p.get("pending_admission") == -1 for p in parts):  # a Bloom filter's
                total["pending_admission"] = -1
            out[key] = table_report(total) | {
                "rows_live_per_process": [p["rows_live"] for p in parts]
            }
        return out
