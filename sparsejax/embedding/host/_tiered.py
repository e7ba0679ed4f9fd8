"""The host side of tiered tables: dynamic IDs and the device cache.

A tiered table (`TableSpec.dynamic` and/or `TableSpec.cache`) keeps every row and
optimizer slot in a host store (`HostRows`: RAM, then disk) and only a device cache of
`device_rows` rows, plus one default row, in the jitted state. The jitted step never sees
a raw ID: before each step, `HostTables.prepare_train`

1. maps the batch's raw keys to host rows (`IdMap`; a static table's ids are its rows),
   admitting new keys (`CountFilter` / `BloomFilter`) and evicting old ones (TTL, norm,
   `max_rows`); keys without a row read the default row and receive no update;
2. maps rows to cache slots: a miss takes a free slot or the least recently (or
   frequently) used one the batch does not use;
3. dispatches one jitted exchange per embedding layer (state donated): it gathers the
   victims' rows and slots (written back to the host store at the next call) and
   scatters the misses' rows in; the batch's ids become slot ids.

JAX dispatch is asynchronous, so steps 1-2 for batch t+1 run on the host while the
device runs step t (the prefetch pipeline of TorchRec's TrainPipelineSparseDist). Moving
rows never changes their values, so with the same order of updates a cached table
trains exactly as the same table fully on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import numpy as np

from .._store import subtree, tiered_feature_key, with_subtree
from ._host_table import HostTable, bucket_size
from ._protocol import HostSide
from ._snapshot import TableSnapshot


def layer_table_key(path: tuple[str, ...], table: str) -> str:
    """ "<layer path>/<table>": a tiered table's name in checkpoints and stats."""
    return f"{'/'.join(path) or '<root>'}/{table}"


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where a tiered table's cache lives in its layer's stacked state."""

    stack: str
    rows: Callable[[np.ndarray], np.ndarray]  # cache slots -> stack rows
    stack_rows: int  # an exchange's padding index (out of bounds: dropped)
    capacity: int
    zero_default: bool


class _Layer:
    """The tiered tables of one embedding layer and its jitted exchanges."""

    def __init__(self, path, store, tables: dict[str, HostTable]):
        self.path, self.tables = path, tables
        self.place = {}
        for name, ht in tables.items():
            self.place[name] = _Placement(
                *store.cache_rows(name),
                ht.capacity,
                ht.spec.dynamic is None or ht.spec.dynamic.default_row == "zeros",
            )
        self.stacks = sorted({p.stack for p in self.place.values()})
        # two programs, not one: a gather and a scatter of the same buffer in one XLA
        # program make XLA copy the whole stack (~50 ms for 800k rows x 16 on 2 cores);
        # apart, the gather reads first and the donated scatter writes in place
        self.gather = jax.jit(gather_rows)
        self.scatter = jax.jit(scatter_rows, donate_argnums=0)
        self.scatter_copy = jax.jit(scatter_rows)  # eval: the state is not changed


def gather_rows(state, index):
    """`{stack: (weights, {slot: values})}` at the rows `index[stack]` of each stack
    (out-of-bounds padding reads zeros)."""
    return {
        stack: (
            state[stack]["weights"].at[idx].get(mode="fill", fill_value=0),
            {k: v.at[idx].get(mode="fill", fill_value=0) for k, v in state[stack]["slots"].items()},
        )
        for stack, idx in index.items()
    }


def scatter_rows(state, loads):
    """Write each stack's loaded rows (weights and slots) at their stack rows: one
    scatter per array (padding indices are out of bounds: dropped)."""
    out = {}
    for stack, st in state.items():
        ld = loads[stack]
        out[stack] = {
            "weights": st["weights"]
            .at[ld["index"]]
            .set(ld["weights"].astype(st["weights"].dtype), mode="drop"),
            "slots": {
                k: v.at[ld["index"]].set(ld["slots"][k], mode="drop")
                for k, v in st["slots"].items()
            },
        }
    return out


def _features_of(store, table: str) -> tuple:
    return tuple(f for f in store.features.values() if f.table == table)


def _pad(a: np.ndarray, n: int, fill=0) -> np.ndarray:
    out = np.full((n, *a.shape[1:]), fill, a.dtype)
    out[: a.shape[0]] = a
    return out


class HostTables(HostSide):
    """The host side (`HostSide`) of every tiered table of a model, by embedding layer
    and table.

    `Trainer` builds one at `init` when a layer has tiered tables (a part of
    `trainer.host`) and calls `prepare` before every step; checkpoints call `snapshot` /
    `restore` / `mark_saved`. Each tiered table is a `HostTable` keyed
    "<layer path>/<table>" (`tables`).

    Args:
      layouts: each embedding layer's `TableStore` by module path
        (`sparsejax.nn.embedding_layouts`).
    """

    name = "tiered tables"
    saves_rows = True
    release_every = 100
    """Train steps between `HostRows.release_pages` of the tables with a disk tier: the
    disk blocks' pages touched since leave the process's resident memory (they stay in
    the files and the page cache), so memory stays flat while the disk tier grows."""

    def __init__(self, layouts: Mapping):
        self.layers: dict[tuple, _Layer] = {}
        for path, store in layouts.items():
            if store.tiered_tables:
                self.layers[path] = self._layer(path, store)
        readers: dict[str, list[tuple[str, bool]]] = {}  # feature -> (table, tiered)
        for store in layouts.values():
            tiered = store.tiered_tables
            for f in store.features.values():
                readers.setdefault(f.name, []).append((f.table, f.table in tiered))
        for feature, tables in readers.items():
            if any(t for _, t in tables) and not all(t for _, t in tables):
                raise ValueError(
                    f"feature {feature!r} is read by tiered and plain tables "
                    f"({sorted(n for n, _ in tables)}): its ids cannot be both raw keys and "
                    f"rows; give every table it reads the same dynamic/cache setting"
                )
        self.shared_features = {f for f, tables in readers.items() if len(tables) > 1}
        """Features several tiered tables read: their slot ids travel per table."""
        self.step = 0  # training steps prepared (= the state's step)
        self._pending: list = []  # exchanges whose evicted rows are not written back yet

    def _layer(self, path, store) -> _Layer:
        """The host side of one layer's tiered tables (a whole table each)."""
        tables = {
            name: HostTable(spec, _features_of(store, name), key=layer_table_key(path, name))
            for name, spec in store.tiered_tables.items()
        }
        return _Layer(path, store, tables)

    @staticmethod
    def needed(layouts: Mapping) -> bool:
        """Whether any layer of `layouts` has a tiered table."""
        return any(s.tiered_tables for s in layouts.values())

    @property
    def tables(self) -> dict[str, HostTable]:
        return {ht.key: ht for layer in self.layers.values() for ht in layer.tables.values()}

    def init(self, layer_keys: Mapping) -> None:
        """Initial rows; `layer_keys[path]` is the key the layer's store was initialized
        with (a static cached table then starts exactly as on the device)."""
        for path, layer in self.layers.items():
            for ht in layer.tables.values():
                ht.init(layer_keys[path])

    # ---- steps ---------------------------------------------------------------------------
    def prepare(self, state_tables: Mapping, batch, *, train: bool):
        """`prepare_train` or `prepare_eval`."""
        if train:
            return self.prepare_train(state_tables, batch)
        return self.prepare_eval(state_tables, batch)

    def prepare_train(self, state_tables: Mapping, batch):
        """`(state_tables, batch)` for the next train step: raw ids mapped to cache slots,
        the misses loaded (one jitted exchange per layer, the state donated)."""
        self.step += 1
        self._write_back()
        self._run_eviction(state_tables, self.step, due_only=True)
        if self.step % self.release_every == 0:  # the disk tiers' pages leave the RSS
            for ht in self.tables.values():
                if ht.rows.disk_bytes_used:
                    ht.rows.release_pages()
        return self._prepare(state_tables, batch, train=True)

    def prepare_eval(self, state_tables: Mapping, batch):
        """`(state_tables, batch)` to evaluate `batch`: nothing of the host side or of
        `state_tables` changes (the returned tables are a copy where needed)."""
        self._write_back()
        return self._prepare(state_tables, batch, train=False)

    def _prepare(self, state_tables, batch, *, train: bool):
        """Each tiered table's features as slot ids: under the feature's name, and under
        `tiered_feature_key(feature, table)` when several tiered tables (e.g. DeepFM's
        embedding and first-order tables, in two layers) read one feature."""
        raw, features = batch.features, dict(batch.features)
        for layer in self.layers.values():
            moves = {}
            for name, ht in layer.tables.items():
                missing = [f.name for f in ht.features if f.name not in raw]
                if missing:
                    raise KeyError(f"batch lacks features {missing} of table {name!r}")
                ids = {f.name: raw[f.name].ids for f in ht.features}
                mapped, load_slots, load_rows, old_rows = ht.map_batch(ids, self.step, train=train)
                for f in ht.features:
                    slots = dataclasses.replace(raw[f.name], ids=mapped[f.name])
                    if f.name in self.shared_features:
                        features[tiered_feature_key(f.name, name)] = slots
                    features[f.name] = (
                        slots if features[f.name] is raw[f.name] else features[f.name]
                    )
                moves[name] = (load_slots, load_rows, old_rows)
            state_tables = self._dispatch(state_tables, layer, moves, train=train)
        return state_tables, dataclasses.replace(batch, features=features)

    def _dispatch(self, state_tables, layer: _Layer, moves, *, train: bool):
        """Per stack, one padded index of the rows entering the cache (each table's load
        slots, then each default row that needs (re)writing): train gathers what those
        slots hold first (written back at the next call), then scatters the new rows."""
        layer_state = subtree(state_tables, layer.path)
        sub = {k: layer_state[k] for k in layer.stacks}
        loads, segments = {}, {}
        for stack in layer.stacks:
            names = [t for t in moves if layer.place[t].stack == stack]
            resets = {
                t: layer.place[t].zero_default or layer.tables[t].default_reset for t in names
            }
            n = sum(moves[t][0].shape[0] for t in names) + sum(resets.values())
            size, first = bucket_size(n), layer.tables[names[0]]
            index = np.full(size, layer.place[names[0]].stack_rows, np.int32)
            weights = np.zeros((size, first.spec.dim), first.rows.dtype)
            slots = {
                sp.name: np.zeros((size,) if sp.per_row else (size, first.spec.dim), np.float32)
                for sp in first.slot_specs
            }
            at, segs = 0, []
            for t in names:  # each table's loads
                load_slots, load_rows, old_rows = moves[t]
                ht, p, k = layer.tables[t], layer.place[t], load_slots.shape[0]
                index[at : at + k] = p.rows(load_slots)
                w, sl = ht.rows.gather(load_rows)
                weights[at : at + k] = w
                for name, v in sl.items():
                    slots[name][at : at + k] = v
                segs.append((t, np.arange(at, at + k), old_rows))
                at += k
            for t in names:  # then the default rows
                if resets[t]:
                    ht, p = layer.tables[t], layer.place[t]
                    dw, ds = ht.default_row()
                    index[at] = p.rows(np.array(p.capacity))
                    weights[at] = dw
                    for name, v in ds.items():
                        slots[name][at] = v
                    at += 1
                    if train:
                        ht.default_reset = False
            loads[stack] = {"index": index, "weights": weights, "slots": slots}
            segments[stack] = segs
        if not train:
            new = layer.scatter_copy(sub, loads)
            return with_subtree(state_tables, layer.path, {**layer_state, **new})
        evicted = layer.gather(sub, {k: v["index"] for k, v in loads.items()})
        for leaf in jax.tree.leaves(evicted):
            leaf.copy_to_host_async()
        self._pending.append((layer, segments, evicted))
        new = layer.scatter(sub, loads)
        return with_subtree(state_tables, layer.path, {**layer_state, **new})

    def _write_back(self) -> None:
        """Store the rows the previous exchanges moved out of the cache (`_pending`:
        per stack, each table's positions in the gathered rows and the rows they held)."""
        for layer, segments, evicted in self._pending:
            for stack, segs in segments.items():
                if not any((old >= 0).any() for _, _, old in segs):
                    continue
                w, slots = self._on_host(evicted[stack])
                for t, pos, old in segs:
                    keep = pos[old >= 0]
                    if keep.shape[0]:
                        layer.tables[t].rows.scatter(
                            old[old >= 0], w[keep], {k: v[keep] for k, v in slots.items()}
                        )
        self._pending = []

    def _on_host(self, gathered):
        """An exchange's gathered rows as host arrays."""
        return jax.device_get(gathered)

    def flush(self, state_tables: Mapping) -> None:
        """Copy every cached row (and a trainable default row) to the host store, so the
        host holds every table's current state (the cache keeps its rows)."""
        self._write_back()
        for path, layer in self.layers.items():
            sub = subtree(state_tables, path)
            sub = {k: sub[k] for k in layer.stacks}
            for name, ht in layer.tables.items():  # one gather per table: flushes are rare
                p = layer.place[name]
                slots = np.nonzero(ht.slot_row >= 0)[0]
                rows, n = ht.slot_row[slots].astype(np.int64), slots.shape[0]
                idx = np.full(bucket_size(n + 1), p.stack_rows, np.int32)
                idx[:n] = p.rows(slots)
                idx[n] = p.rows(np.array(p.capacity))  # the default row
                w, s = jax.device_get(layer.gather(sub, {p.stack: idx}))[p.stack]
                ht.rows.scatter(rows, w[:n], {k: v[:n] for k, v in s.items()})
                if not p.zero_default:
                    ht.default_values = (w[n].astype(np.float32), {k: v[n] for k, v in s.items()})

    def _run_eviction(self, state_tables, step: int, *, due_only: bool) -> None:
        """The eviction policies of the dynamic tables (those due at `step`, or all)."""
        flushed = False
        for layer in self.layers.values():
            for ht in layer.tables.values():
                ev = ht.spec.dynamic.eviction if ht.dynamic else None
                if ev is None or (due_only and step % ev.every_steps):
                    continue
                if ev.min_norm is not None and not flushed:
                    self.flush(state_tables)
                    flushed = True
                ht.evict_rows(
                    ht.expired_rows(step, ht.rows.norms if ev.min_norm is not None else None)
                )

    # ---- checkpoints ---------------------------------------------------------------------
    def snapshot(self, state_tables: Mapping, *, incremental: bool) -> dict[str, TableSnapshot]:
        """Every tiered table's host state after running the eviction policies and
        flushing the cache; `incremental`: only what changed since `mark_saved`."""
        self._run_eviction(state_tables, self.step, due_only=False)
        self.flush(state_tables)
        return {key: ht.snapshot(self.step, incremental) for key, ht in self.tables.items()}

    def mark_saved(self) -> None:
        """The last snapshot is on disk: the next incremental one starts from here."""
        for ht in self.tables.values():
            ht.mark_saved()

    def restore(self, chain) -> None:
        """Rebuild every table from `chain` (snapshot dicts, full first, then deltas;
        other host sides' tables in them are ignored); the device caches start empty (as
        `import_tables` leaves them)."""
        if not chain:
            raise ValueError("HostTables.restore: an empty chain")
        for key, ht in self.tables.items():
            missing = [i for i, c in enumerate(chain) if key not in c]
            if missing:
                raise KeyError(
                    f"the checkpoint has no host state for tiered table {key!r} "
                    f"(it has {sorted(chain[missing[0]])})"
                )
            ht.restore([c[key] for c in chain])
        self._pending = []
        self.step = int(next(iter(chain[-1].values())).step) if chain[-1] else self.step

    def stats(self) -> dict[str, dict]:
        """Per table: rows live, admitted, rejected, evicted, lookups and rows moved per
        step, cache hit rate, host bytes in RAM and on disk."""
        return {key: ht.report() for key, ht in self.tables.items()}

    def export(self, state_tables: Mapping) -> dict[str, dict]:
        """`{key: {"keys", "weights", "slots", "default"}}`, current (flushes), rows
        sorted by key."""
        self.flush(state_tables)
        out = {}
        for key, ht in self.tables.items():
            rows, keys = ht.live_rows()
            order = np.argsort(keys, kind="stable")
            w, s = ht.rows.gather(rows[order])
            out[key] = {
                "keys": keys[order],
                "weights": w,
                "slots": s,
                "default": ht.default_row()[0],
            }
        return out
