"""`ShardedTableStore`: tables placed on a ("data", "model") mesh, looked up and updated
under `shard_map` with explicit collectives that move ids and pooled rows, never tables.

Every device holds `B / N` examples of the batch (`shard_batch` re-pads the ids per
device) and one piece of every table (`_placement`). Tables of one placement, dim,
dtype and optimizer share a stack: on each shard a block of `rows_per_shard` rows, where
each table keeps its own rows (table-wise: on its one shard; row-wise: shard `s` holds
the table's rows `[s * B, (s + 1) * B)`, `B = ceil(V / S)`, contiguous at local rows
`offset .. offset + B`, TorchRec's row-wise layout; `_layout.Piece.route`). So each
device's rows of a table are one block of the table's logical layout: `init` draws only
those rows (`sparsejax.embedding.fill_rows`, a pure function of key, table name and
row), and `sharded_tables` / `import_sharded_tables` pass them to and from a sharded
`jax.Array` of the logical `[B * S, dim]` table without a gather.

One step, per stack and pooling kind, with S shards and R replicas:
- lookup: each device sorts its ids by owner into S buckets of `n` entries each (`n`:
  the ids the device holds, so a bucket never overflows, however skewed the ids), and
  an all-to-all over the shard axes hands each owner its rows' ids, bags and pooling
  coefficients; the owner pools them into partial bags, and an all-to-all sends the
  partial sums back (S x bags x D floats), where they are added (max pooling: taken from
  the one owner a bag has, so row-split tables refuse it);
- update: the gradient of the pooled rows is all-gathered over the shard axes (each owner
  sees the bags its rows went into), the owners' received lookups and those gradients
  are all-gathered over the replica axes, and every copy of a shard applies its sparse
  optimizer to its own rows: the same update the single-device store makes, summed in
  another order.
Bytes per step grow with the batch, the features and the dim, never with the vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import ops
from ..embedding import (
    FeatureSpec,
    StoreBase,
    TableSpec,
    apply_group_gradients,
    available_memory,
    check_saved_table,
    check_specs,
    empty_table,
    fill_rows,
    format_bytes,
    init_block_rows,
    row_bytes,
    rows_on_devices,
    stack_shapes,
    tiered_feature_key,
)
from ..embedding.host import OwnerLayout, owner_layout
from . import _placement as pl
from ._exchange import gather_update, lookup_group
from ._layout import Entry, Piece, ShardedGroup, ShardedStack, build_stacks

ALL = pl.AXES


class ShardedTableStore(StoreBase):
    """Tables placed on a ("data", "model") mesh by their `placement`; implements
    `TableStore`. The batch must be split per device (`shard_batch`; the `Trainer` does
    it): each device looks up and updates for its `B / N` examples.

    Args:
      tables, features: the specs; each table's `placement` is one of
        `sparsejax.sharding.PLACEMENTS` ("device" counts as "replicated").
      mesh: a mesh with axes ("data", "model") (default: `make_mesh()`).
      implementation: kernel choice for the sparse ops (None: the platform's best).
    """

    shards_batch = True
    """The batch must be split per device (`shard_batch`) before the lookup."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        features: Sequence[FeatureSpec],
        *,
        mesh: Mesh | None = None,
        implementation: str | None = None,
    ):
        tables, features = tuple(tables), tuple(features)
        check_specs(tables, features)
        self.mesh = pl.make_mesh() if mesh is None else mesh
        if tuple(self.mesh.axis_names) != ALL:
            raise ValueError(
                f"ShardedTableStore: the mesh's axes are {tuple(self.mesh.axis_names)}; it "
                f"needs {ALL} (sparsejax.sharding.make_mesh)"
            )
        self._specs = (tables, features)
        self.tables = {t.name: t for t in tables}
        self.tiered_tables = {t.name: t for t in tables if t.is_tiered}
        """Dynamic and host-cached tables: the state holds their device caches, which
        `sparsejax.embedding.HostTables` fills (`cache_rows`)."""
        self.features = {f.name: f for f in features}
        self.implementation = implementation
        shape = dict(self.mesh.shape)
        self.num_devices = int(self.mesh.size)
        self.owner_layouts = self._owner_layouts()
        """`{tiered table: OwnerLayout}` when the mesh spans several processes: each owns
        the keys `key_owner` gives it, and its cache slots are on its own devices."""
        self.stacks = build_stacks(
            tables, shape, {n: lay.view_rows for n, lay in self.owner_layouts.items()}
        )
        pieces = {}
        for s in self.stacks.values():
            for p in s.pieces:
                pieces.setdefault(p.source, []).append((s.name, p))
        self._pieces = {k: sorted(v, key=lambda sp: sp[1].column or 0) for k, v in pieces.items()}
        groups: dict[tuple[str, str], list[Entry]] = {}
        for f in features:
            kind = "max" if f.combiner == "max" else "sum"
            for stack, piece in self._pieces[f.table]:
                if kind == "max" and self.stacks[stack].placement in ("row_wise", "table_row_wise"):
                    raise ValueError(
                        f"feature {f.name!r}: max pooling over table {f.table!r} placed "
                        f"{self.stacks[stack].placement} would need every shard's winner; "
                        f"place the table table_wise, column_wise or replicated"
                    )
                groups.setdefault((stack, kind), []).append(Entry(f, piece))
        self.groups = {
            f"{stack}_{kind}": ShardedGroup(f"{stack}_{kind}", stack, tuple(es), kind)
            for (stack, kind), es in sorted(groups.items())
        }

    def _owner_layouts(self) -> dict:
        processes = [d.process_index for d in self.mesh.devices.flat]
        owners = len(set(processes))
        if owners == 1 or not self.tiered_tables:
            return {}
        per = self.num_devices // owners
        blocks = [processes[i * per : (i + 1) * per] for i in range(owners)]
        if blocks != [[p] * per for p in range(owners)]:
            raise ValueError(
                "ShardedTableStore: dynamic or host-cached tables over several processes "
                "need every process's devices, in process order (sparsejax.sharding.make_mesh)"
            )
        for t in self.tiered_tables.values():
            if t.placement != "row_wise":
                raise ValueError(
                    f"table {t.name!r} is dynamic or host-cached and the mesh spans {owners} "
                    f"processes: place it row_wise (each process holds the cache slots of "
                    f"the keys it owns), not {t.placement}"
                )
        return {n: owner_layout(t.device_rows, owners, per) for n, t in self.tiered_tables.items()}

    def _view(self, table: str) -> TableSpec:
        """What the devices hold of `table` (a tiered table: its device cache)."""
        layout = self.owner_layouts.get(table)
        return self.tables[table].device_view(None if layout is None else layout.view_rows)

    def owner_cache(self, table: str) -> tuple[str, OwnerLayout, int, Callable]:
        """Where this process's cache slots of tiered `table` live (the mesh spans
        several processes): `(stack, layout, owner, rows)`; `rows(view_rows)` gives
        `(device, local row)` of view rows on this process's devices (`device`: their
        position among them, in mesh order)."""
        ((name, piece),) = self._pieces[table]
        st, layout = self.stacks[name], self.owner_layouts[table]
        owner = jax.process_index()

        def rows(view_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            shard, local = piece.route(np.asarray(view_rows, np.int64), st.shards)
            return shard - owner * layout.devices, local

        return name, layout, owner, rows

    def __repr__(self):
        placed = {s.name: s.placement for s in self.stacks.values()}
        return f"ShardedTableStore(stacks={placed}, mesh={dict(self.mesh.shape)})"

    def with_mesh(self, mesh: Mesh) -> ShardedTableStore:
        tables, features = self._specs
        return ShardedTableStore(tables, features, mesh=mesh, implementation=self.implementation)

    # ---- state ----------------------------------------------------------------------
    def _sharding(self, stack: ShardedStack, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, stack.spec(ndim))

    def abstract_state(self) -> dict:
        """Shapes, dtypes and shardings of the state (each stack split over its shard
        axes), without allocating."""
        return {
            name: stack_shapes(
                st.shards * st.rows_per_shard,
                st.dim,
                st.dtype,
                st.optimizer,
                lambda ndim, st=st: self._sharding(st, ndim),
            )
            for name, st in self.stacks.items()
        }

    def device_bytes(self, name: str) -> int:
        """Bytes of stack `name` on one device (weights and slots of one shard)."""
        st = self.stacks[name]
        return st.rows_per_shard * row_bytes(st.pieces[0].table)

    def _device_shards(self, st: ShardedStack) -> dict:
        """`{device: shard index}` of this process's devices of the mesh, for stack `st`
        (rows split over its axes, "data" major)."""
        devices = self.mesh.devices
        model = devices.shape[1]
        out = {}
        for (i, k), d in np.ndenumerate(devices):
            if d.process_index != jax.process_index():
                continue
            out[d] = {(): 0, ("model",): k, ("data", "model"): i * model + k}[st.axes]
        return out

    def _what(self, st: ShardedStack) -> str:
        tables = sorted({p.source for p in st.pieces})
        if len(tables) == 1:
            return f"table {tables[0]!r} ({st.placement})"
        return f"stack {st.name!r} (tables {tables}, {st.placement})"

    def init_memory(self, name: str) -> tuple[int, int]:
        """`(per device, host of this process)` bytes that `init_part(key, name)` peaks
        at: one shard's weights and slots per device; on the host, this process's
        shards (CPU devices: the devices' buffers are host memory, the weights adopted
        without a copy) or one shard's weights staged at a time (other devices), plus
        one init block drawn aside (`fill_rows`)."""
        st = self.stacks[name]
        per_device = self.device_bytes(name)
        local = list(self._device_shards(st))
        weights = st.rows_per_shard * st.dim * jnp.dtype(st.dtype).itemsize
        block = min(init_block_rows(st.dim), st.rows_per_shard) * st.dim * 4  # drawn aside
        if all(d.platform == "cpu" for d in local):
            host = per_device * len(local) + block
        else:
            host = weights + block
        return per_device, host

    def check_memory(self, name: str) -> None:
        """Refuse, before allocating, a stack whose shard does not fit on a device, or
        whose shards do not fit in this process's host memory (one line: the table or
        stack, the need and what is available)."""
        st = self.stacks[name]
        per_device, host = self.init_memory(name)
        local = list(self._device_shards(st))
        if local and all(d.platform == "cpu" for d in local):
            checks = [
                (
                    host,
                    available_memory([]),
                    f"on this process's host ({len(local)} "
                    f"device(s) x {format_bytes(per_device)} + an init block)",
                )
            ]
        else:
            checks = [
                (per_device, available_memory(local), "per device"),
                (host, available_memory([]), "on the host to stage one shard"),
            ]
        for need, avail, where in checks:
            if avail is not None and need > avail[0]:
                raise MemoryError(
                    f"ShardedTableStore.init: {self._what(st)} needs {format_bytes(need)} "
                    f"{where} but {format_bytes(avail[0])} is available ({avail[1]}); use "
                    f"more devices or processes, or a row placement"
                )

    def _fill_shard(
        self, key: jax.Array, st: ShardedStack, shard: int, lo: int, hi: int, out: np.ndarray
    ) -> None:
        """Rows `[lo, hi)` of shard `shard`'s weights into the host block `out`: each
        piece's own rows drawn in place (`fill_rows`), zeros elsewhere."""
        out[...] = 0
        for p in st.pieces:
            first, last = p.shard_rows(shard)
            if p.stride == 1 and p.shard != shard:
                continue
            a, b = max(lo, p.offset), min(hi, p.offset + last - first)
            if a >= b:
                continue
            spec = self._view(p.source)
            cols = None if p.column is None else slice(p.column * st.dim, (p.column + 1) * st.dim)
            fill_rows(key, spec, first + a - p.offset, out[a - lo : b - lo], cols)

    def init_part(self, key: jax.Array, name: str) -> dict:
        """Weights and slots of stack `name`: every table's values are the ones every
        store draws (`fill_rows`: a function of `key`, the table's name and the row).
        Each process draws only the shards its devices hold, a block of rows at a time
        (`rows_on_devices`), and no host or device ever holds a whole row-split table; a
        stack that cannot fit is refused first (`check_memory`)."""
        st = self.stacks[name]
        abstract = self.abstract_state()[name]
        if isinstance(key, jax.core.Tracer):
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
        self.check_memory(name)
        by_shard: dict[int, list] = {}
        for d, shard in self._device_shards(st).items():
            by_shard.setdefault(shard, []).append(d)
        weights, slots = {}, {s.name: [] for s in st.optimizer.slots()}
        shape = (st.rows_per_shard, st.dim)
        for shard, devices in sorted(by_shard.items()):
            fill = functools.partial(self._fill_shard, key, st, shard)
            arrays = rows_on_devices(shape, jnp.dtype(st.dtype), devices, fill)
            weights.update(zip(devices, arrays, strict=True))
            for d in devices:
                for s in st.optimizer.slots():
                    slot_shape = (st.rows_per_shard,) if s.per_row else shape
                    slots[s.name].append(jnp.full(slot_shape, s.init, s.dtype, device=d))
        make = jax.make_array_from_single_device_arrays
        return {
            "weights": make(
                abstract["weights"].shape, abstract["weights"].sharding, list(weights.values())
            ),
            "slots": {
                k: make(abstract["slots"][k].shape, abstract["slots"][k].sharding, v)
                for k, v in slots.items()
            },
        }

    # ---- per-table form -------------------------------------------------------------
    def _piece_rows(self, st: ShardedStack, piece: Piece, a: jax.Array) -> jax.Array:
        """The piece's logical rows `[V, ...]` from a stack array `[S * rows, ...]`."""
        blocks = a.reshape(st.shards, st.rows_per_shard, *a.shape[1:])
        if piece.stride == 1:
            return blocks[piece.shard, piece.offset : piece.offset + piece.table.vocab_size]
        rows = blocks[:, piece.offset : piece.offset + piece.local_rows]
        return rows.reshape(-1, *a.shape[1:])[: piece.table.vocab_size]

    def _set_piece_rows(self, st, piece, a, rows):
        blocks = a.reshape(st.shards, st.rows_per_shard, *a.shape[1:])
        if piece.stride == 1:
            blocks = blocks.at[piece.shard, piece.offset : piece.offset + rows.shape[0]].set(rows)
        else:
            pad = piece.padded_rows - rows.shape[0]
            rows = jnp.pad(rows, [(0, pad)] + [(0, 0)] * (rows.ndim - 1))
            rows = rows.reshape(st.shards, piece.local_rows, *rows.shape[1:])
            blocks = blocks.at[:, piece.offset : piece.offset + piece.local_rows].set(rows)
        return blocks.reshape(a.shape)

    def export_tables(self, state: Mapping) -> dict:
        """`{table: {"weights": [V, D], "slots": {...}}}`, the layout-free form (tiered
        tables left out: their state is on the host, `HostTables.snapshot`)."""
        out = {}
        for src, pieces in self._pieces.items():
            if src in self.tiered_tables:
                continue
            parts = [
                jax.tree.map(
                    lambda a, st=self.stacks[sn], p=p: self._piece_rows(st, p, a), state[sn]
                )
                for sn, p in pieces
            ]
            if len(parts) == 1:
                out[src] = parts[0]
            else:  # column pieces side by side
                out[src] = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *parts)
        return out

    def _import_stack(self, name: str, tables: Mapping) -> dict:
        st = self.stacks[name]
        abstract = self.abstract_state()[name]

        def build(tables):
            state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
            for p in st.pieces:
                tab = tables[p.source]
                w = p.table.dim
                cols = slice(None) if p.column is None else slice(p.column * w, (p.column + 1) * w)
                state["weights"] = self._set_piece_rows(
                    st, p, state["weights"], jnp.asarray(tab["weights"])[:, cols].astype(st.dtype)
                )
                for s in st.optimizer.slots():
                    v = jnp.asarray(tab["slots"][s.name])
                    v = v if s.per_row else v[:, cols]
                    state["slots"][s.name] = self._set_piece_rows(
                        st, p, state["slots"][s.name], v.astype(s.dtype)
                    )
            return state

        shardings = jax.tree.map(lambda s: s.sharding, abstract)
        return jax.jit(build, out_shardings=shardings)(tables)

    def import_tables(self, tables: Mapping) -> dict:
        """Inverse of `export_tables`, placed on this store's mesh (any mesh saved them);
        names a missing table or a mismatched shape or slot set. Tiered tables get an
        empty device cache."""
        full = {}
        for src, spec in self.tables.items():
            if src in self.tiered_tables:
                full[src] = empty_table(self._view(src))
                continue
            check_saved_table(spec, tables.get(src), tables)
            full[src] = tables[src]
        out = {}
        for name, st in self.stacks.items():
            out[name] = self._import_stack(name, {p.source: full[p.source] for p in st.pieces})
        return out

    def cache_rows(self, table: str) -> tuple[str, Callable[[np.ndarray], np.ndarray], int]:
        """Where tiered `table`'s device cache lives: its stack, the stack rows of cache
        rows (a row-split cache is split as any table, `Piece.route`), and the stack's
        rows (an out-of-bounds index, for padding)."""
        ((name, piece),) = self._pieces[table]
        st = self.stacks[name]

        def rows(slots: np.ndarray) -> np.ndarray:
            shard, local = piece.route(np.asarray(slots, np.int64), st.shards)
            return (shard * st.rows_per_shard + local).astype(np.int32)

        return name, rows, st.shards * st.rows_per_shard

    # ---- sharded per-table form: each device's own rows, no gather -----------------
    def _table_sharding(self, src: str, ndim: int) -> NamedSharding:
        """Where the logical `[rows, dim]` (or `[rows]`) table `src` lives: row-split over
        its shard axes, columns over "model", replicated, or (table-wise) copied on the
        devices of its one shard only (a sub-mesh)."""
        (sn, p), *rest = self._pieces[src]
        st = self.stacks[sn]
        if p.column is not None:
            return NamedSharding(self.mesh, P(None, "model") if ndim == 2 else P(None))
        if p.stride > 1:
            return NamedSharding(self.mesh, st.spec(ndim))
        if st.placement == "table_wise":
            sub = Mesh(self.mesh.devices[:, p.shard : p.shard + 1], ALL)
            return NamedSharding(sub, P())
        return NamedSharding(self.mesh, P())

    def abstract_sharded_tables(self) -> dict:
        """`{table: {"weights", "slots"}}` as `jax.ShapeDtypeStruct`s of each table's
        logical layout: rows padded to `B * S` for a row-split table (shard `s` holds
        rows `[s * B, (s + 1) * B)`), `vocab_size` otherwise; sharded as this store
        places it (row-split over its shard axes and copied over the others; column-wise
        `P(None, "model")`; replicated `P()`; table-wise on the devices of its shard).
        Tiered tables are left out."""
        out = {}
        for src, pieces in self._pieces.items():
            if src in self.tiered_tables:
                continue
            spec = self.tables[src]
            rows = pieces[0][1].padded_rows
            out[src] = {
                "weights": jax.ShapeDtypeStruct(
                    (rows, spec.dim), jnp.dtype(spec.dtype), sharding=self._table_sharding(src, 2)
                ),
                "slots": {
                    s.name: jax.ShapeDtypeStruct(
                        (rows,) if s.per_row else (rows, spec.dim),
                        jnp.dtype(s.dtype),
                        sharding=self._table_sharding(src, 1 if s.per_row else 2),
                    )
                    for s in spec.optimizer.slots()
                },
            }
        return out

    @staticmethod
    def _leaf(tree: Mapping, path: tuple[str, ...]):
        for k in path:
            tree = tree[k]
        return tree

    @staticmethod
    def _leaf_paths(optimizer) -> list[tuple[str, ...]]:
        return [("weights",)] + [("slots", s.name) for s in optimizer.slots()]

    def _piece_on(self, src: str, device) -> tuple[ShardedStack, Piece, int]:
        """The stack, piece and stack shard of table `src` on `device`."""
        for sn, p in self._pieces[src]:
            st = self.stacks[sn]
            shard = self._device_shards(st)[device]
            if p.stride > 1 or p.shard == shard:
                return st, p, shard
        raise AssertionError(f"table {src!r} has no piece on {device}")

    def sharded_tables(self, state: Mapping) -> dict:
        """The arrays `abstract_sharded_tables` describes, each device's part a slice of
        its own stack block (the block itself, without a copy, when the table is a whole
        stack's block): no device gathers rows of another."""
        abstract = self.abstract_sharded_tables()
        local: dict = {}

        def block(st, path, device):
            k = (st.name, path)
            if k not in local:
                arr = self._leaf(state[st.name], path)
                local[k] = {sh.device: sh.data for sh in arr.addressable_shards}
            return local[k][device]

        out = {}
        for src, sds_tree in abstract.items():
            out[src] = {"weights": None, "slots": {}}
            for path in self._leaf_paths(self.tables[src].optimizer):
                sds = self._leaf(sds_tree, path)
                parts = []
                for d in sds.sharding.addressable_devices:
                    st, p, _ = self._piece_on(src, d)
                    b = block(st, path, d)
                    n = p.local_rows
                    parts.append(
                        b if (p.offset, n) == (0, st.rows_per_shard) else b[p.offset : p.offset + n]
                    )
                arr = jax.make_array_from_single_device_arrays(
                    sds.shape, sds.sharding, parts, dtype=sds.dtype
                )
                if path == ("weights",):
                    out[src]["weights"] = arr
                else:
                    out[src]["slots"][path[1]] = arr
        return out

    def _placed(self, src: str, tree: Mapping, abstract: Mapping) -> dict:
        """Table `src` (checked) with every leaf shaped and placed as `abstract` says:
        as given when it already is, else padded or cut to the rows and resharded by
        XLA (a whole table from an older checkpoint, or another store's layout)."""
        spec = self.tables[src]
        w = tree["weights"]
        if w.ndim != 2 or w.shape[1] != spec.dim or w.shape[0] < spec.vocab_size:
            raise ValueError(
                f"table {src!r}: sharded weights have shape {tuple(w.shape)}, the spec needs "
                f"[>= {spec.vocab_size}, {spec.dim}]"
            )
        want = sorted(s.name for s in spec.optimizer.slots())
        if sorted(tree.get("slots", {})) != want:
            raise ValueError(
                f"table {src!r}: saved optimizer slots {sorted(tree.get('slots', {}))}, "
                f"{type(spec.optimizer).__name__} needs {want}"
            )

        def fit(a, sds):
            if (
                isinstance(a, jax.Array)
                and a.shape == sds.shape
                and a.dtype == sds.dtype
                and a.sharding.is_equivalent_to(sds.sharding, a.ndim)
            ):
                return a
            rows = sds.shape[0]

            def cut(x):
                x = x[:rows].astype(sds.dtype)
                pad = rows - x.shape[0]
                return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x

            return jax.jit(cut, out_shardings=sds.sharding)(a)

        return {
            "weights": fit(w, abstract["weights"]),
            "slots": {k: fit(tree["slots"][k], abstract["slots"][k]) for k in want},
        }

    def import_sharded_tables(self, tables: Mapping) -> dict:
        """Inverse of `sharded_tables`: arrays placed as `abstract_sharded_tables` says
        (e.g. restored so by orbax, each process reading only its rows; anything else is
        resharded to that first), at least `vocab_size` rows each (padding rows are
        ignored). Each device builds its stack block from its own rows only. Tiered tables
        get an empty device cache; a missing table or a mismatched shape is named."""
        abstract = self.abstract_sharded_tables()
        placed = {}
        for src in abstract:
            if src not in tables:
                raise KeyError(f"no saved state for table {src!r} (saved: {sorted(tables)})")
            placed[src] = self._placed(src, tables[src], abstract[src])
        out = {}
        for name, st in self.stacks.items():
            target = self.abstract_state()[name]
            out[name] = {"weights": None, "slots": {}}
            slots = {s.name: s for s in st.optimizer.slots()}
            for path in self._leaf_paths(st.optimizer):
                sds = self._leaf(target, path)
                init = 0 if path == ("weights",) else slots[path[1]].init
                arrays = []
                for d, shard in self._device_shards(st).items():
                    arrays.append(self._build_block(st, shard, d, path, placed, sds, init))
                arr = jax.make_array_from_single_device_arrays(
                    sds.shape, sds.sharding, arrays, dtype=sds.dtype
                )
                if path == ("weights",):
                    out[name]["weights"] = arr
                else:
                    out[name]["slots"][path[1]] = arr
        return out

    def import_copy_bytes(self) -> int:
        """Bytes `import_sharded_tables` allocates in this process beside the tables it
        is given: every stack block it assembles from several pieces, padding or an
        empty cache (a block that is one table's rows exactly is taken as it is)."""
        total = 0
        for name, st in self.stacks.items():
            for shard in self._device_shards(st).values():
                mine = [p for p in st.pieces if p.stride > 1 or p.shard == shard]
                lo, hi = mine[0].shard_rows(shard) if len(mine) == 1 else (0, 0)
                whole = (
                    len(mine) == 1
                    and mine[0].offset == 0
                    and hi - lo == st.rows_per_shard
                    and mine[0].source not in self.tiered_tables
                )
                total += 0 if whole else self.device_bytes(name)
        return total

    def _build_block(self, st, shard, device, path, placed, sds, init) -> jax.Array:
        """Shard `shard`'s block of one state leaf on `device`, from the rows of each
        table that `device` holds (zeros or the slot's initial value elsewhere)."""
        tail = sds.shape[1:]
        dtype = sds.dtype
        fill = lambda n, v: jnp.full((n, *tail), v, dtype, device=device)  # noqa: E731
        parts, end = [], 0
        for p in sorted(st.pieces, key=lambda p: p.offset):
            if p.stride == 1 and p.shard != shard:
                continue
            lo, hi = p.shard_rows(shard)
            if p.offset > end:
                parts.append(fill(p.offset - end, 0))
            if p.source in self.tiered_tables:  # an empty device cache
                parts.append(fill(p.local_rows, init))
            else:
                arr = self._leaf(placed[p.source], path)
                (rows,) = [sh.data for sh in arr.addressable_shards if sh.device == device]
                rows = rows[: hi - lo].astype(dtype)
                parts.append(rows)
                if hi - lo < p.local_rows:  # padding rows past the vocabulary
                    parts.append(fill(p.local_rows - (hi - lo), 0))
            end = p.offset + p.local_rows
        if end < st.rows_per_shard:
            parts.append(fill(st.rows_per_shard - end, 0))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    # ---- lookup and update ------------------------------------------------------------
    def _local_batch(self, batch_size: int) -> int:
        if batch_size % self.num_devices:
            raise ValueError(
                f"ShardedTableStore: batch size {batch_size} does not divide over the "
                f"{self.num_devices} devices of the mesh"
            )
        return batch_size // self.num_devices

    def _split_features(self, features: Mapping) -> dict:
        missing = set(self.features) - set(features)
        if missing:
            raise KeyError(f"batch lacks features {sorted(missing)}")
        out = {}
        for name, f in self.features.items():
            jag = features[name]
            if f.table in self.tiered_tables:  # its own slot ids, if the batch has them
                jag = features.get(tiered_feature_key(name, f.table), jag)
            if jag.ids.shape[0] % self.num_devices:
                raise ValueError(
                    f"feature {name!r}: {jag.ids.shape[0]} ids do not split over "
                    f"{self.num_devices} devices; pass the batch through "
                    f"Trainer.put_batch or sparsejax.sharding.shard_batch"
                )
            out[name] = jag
        return out

    def lookup(self, state: Mapping, features: Mapping, batch_size: int):
        """Pooled rows per group (`[N x local bags, D]`, device-major) and what each
        owner received (the update's residuals). Ids outside their table look up
        nothing; `sparsejax.ops.checks()` reports them by feature, table and position."""
        b_local = self._local_batch(batch_size)
        feats = self._split_features(features)
        for name, f in self.features.items():  # the whole batch: positions as given
            jag = feats[name]
            ops.check_lookups(
                f"{type(self).__name__}.lookup of feature {name!r}",
                f.table,
                self._view(f.table).vocab_size,
                batch_size * f.bags_per_example(),
                jnp.asarray(jag.ids, jnp.int32),
                jnp.asarray(jag.segments, jnp.int32),
                None if jag.weights is None else jnp.asarray(jag.weights, jnp.float32),
                defer=self.num_devices > 1,  # a raising callback would hang the others
            )
        state_specs = jax.tree.map(lambda s: s.spec, self.state_shardings())
        feat_specs = jax.tree.map(lambda _: P(ALL), feats)

        def local(state, feats):
            outputs, residuals = {}, {}
            for gname, group in self.groups.items():
                st = self.stacks[group.stack]
                outputs[gname], residuals[gname] = lookup_group(
                    group, st, state[st.name]["weights"], feats, b_local, self.implementation
                )
            return outputs, residuals

        out_specs = (
            {g: P(ALL) for g in self.groups},
            {
                g: (P(ALL), P(ALL), None if not grp.needs_coefficients else P(ALL))
                for g, grp in self.groups.items()
            },
        )
        fn = jax.shard_map(
            local, mesh=self.mesh, in_specs=(state_specs, feat_specs), out_specs=out_specs
        )
        return fn({k: state[k] for k in self.stacks}, feats)

    def split(self, outputs: Mapping[str, jax.Array], batch_size: int) -> dict[str, jax.Array]:
        """Per feature `[B, D]` (or `[B, max_ids, D]`); column pieces side by side."""
        n = self.num_devices
        b_local = self._local_batch(batch_size)
        parts: dict[str, list] = {}
        for gname, group in self.groups.items():
            out = outputs[gname]
            out = out.reshape(n, out.shape[0] // n, out.shape[1])
            start = 0
            for e in group.entries:
                bags = b_local * e.feature.bags_per_example()
                rows = out[:, start : start + bags].reshape(n * bags, out.shape[2])
                parts.setdefault(e.feature.name, []).append((e.piece.column or 0, rows))
                start += bags
        result = {}
        for name, f in self.features.items():
            pieces = [r for _, r in sorted(parts[name], key=lambda cr: cr[0])]
            rows = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)
            result[name] = rows.reshape(batch_size, f.max_ids, -1) if f.is_sequence else rows
        return result

    def apply_gradients(
        self,
        state: Mapping,
        residuals: Mapping,
        grads: Mapping[str, jax.Array],
        *,
        step: jax.Array | int,
        learning_rate: jax.Array | float | None = None,
        learning_rate_scale: jax.Array | float | None = None,
        l2: float = 0.0,
        implementation: str | None = None,
    ) -> dict:
        """Each shard's sparse optimizer step on its own rows, with the lookups and pooled
        gradients of the whole batch that touched them (see the module docstring)."""
        impl = self.implementation if implementation is None else implementation
        mesh_shape = dict(self.mesh.shape)
        state_specs = jax.tree.map(lambda s: s.spec, self.state_shardings())
        scalars = {
            "step": jnp.asarray(step, jnp.int32),
            "lr": None if learning_rate is None else jnp.asarray(learning_rate, jnp.float32),
            "scale": None
            if learning_rate_scale is None
            else jnp.asarray(learning_rate_scale, jnp.float32),
        }

        def local(state, residuals, grads, scalars):
            lookups, g_all = {}, {}
            for gname, group in self.groups.items():
                st = self.stacks[group.stack]
                lookups[gname], g_all[gname] = gather_update(
                    group, st, residuals[gname], grads[gname], mesh_shape
                )
            return apply_group_gradients(
                state,
                lookups,
                g_all,
                step=scalars["step"],
                learning_rate=scalars["lr"],
                learning_rate_scale=scalars["scale"],
                l2=l2,
                implementation=impl,
            )

        res_specs = {
            g: (P(ALL), P(ALL), None if not grp.needs_coefficients else P(ALL))
            for g, grp in self.groups.items()
        }
        fn = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(
                state_specs,
                res_specs,
                {g: P(ALL) for g in self.groups},
                jax.tree.map(lambda _: P(), scalars),
            ),
            out_specs=state_specs,
        )
        new = fn(
            {k: state[k] for k in self.stacks},
            {g: residuals[g] for g in self.groups},
            {g: grads[g] for g in self.groups},
            scalars,
        )
        return {**state, **new}
