"""`ShardedTableStore`: tables placed on a ("data", "model") mesh, looked up and updated
under `shard_map` with explicit collectives that move ids and pooled rows, never tables.

Every device holds `B / N` examples of the batch (`shard_batch` re-pads the ids per
device) and one piece of every table (`_placement`). Tables of one placement, dim,
dtype and optimizer share a stack: on each shard a block of `rows_per_shard` rows, where
each table keeps its own rows (table-wise: on its one shard; row-wise: row `i` on shard
`i % S` at local row `offset + i // S`, so the hot low ids of skewed data spread over
every shard instead of filling the first).

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
    fill_table,
    format_bytes,
    stack_shapes,
    tiered_feature_key,
)
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
        self.stacks = build_stacks(tables, shape)
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
        return st.rows_per_shard * pl.row_bytes(st.pieces[0].table)

    def check_memory(self, name: str) -> None:
        """Refuse, before allocating, a stack whose shard does not fit on a device."""
        need = self.device_bytes(name)
        avail = available_memory(list(self.mesh.devices.flat))
        if avail is not None and need > avail[0]:
            st = self.stacks[name]
            raise MemoryError(
                f"ShardedTableStore.init: stack {name!r} (tables "
                f"{sorted({p.source for p in st.pieces})}, {st.placement}) needs "
                f"{format_bytes(need)} per device but {format_bytes(avail[0])} is "
                f"available ({avail[1]}); use more devices or a row placement"
            )

    def init_part(self, key: jax.Array, name: str) -> dict:
        """Weights and slots of stack `name`: every table's values are the ones the
        single-device store draws (a function of `key` and the table's name)."""
        st = self.stacks[name]
        if isinstance(key, jax.core.Tracer):
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.abstract_state()[name])
        self.check_memory(name)
        tables = {}
        for src in sorted({p.source for p in st.pieces}):
            spec = self.tables[src].device_view()
            rows = np.empty((spec.vocab_size, spec.dim), jnp.dtype(spec.dtype))
            fill_table(key, spec, rows)
            tables[src] = {
                "weights": rows,
                "slots": spec.optimizer.init_slots(spec.vocab_size, spec.dim),
            }
        return self._import_stack(name, tables)

    # ---- per-table form -------------------------------------------------------------
    def _piece_rows(self, st: ShardedStack, piece: Piece, a: jax.Array) -> jax.Array:
        """The piece's logical rows `[V, ...]` from a stack array `[S * rows, ...]`."""
        blocks = a.reshape(st.shards, st.rows_per_shard, *a.shape[1:])
        if piece.stride == 1:
            return blocks[piece.shard, piece.offset : piece.offset + piece.table.vocab_size]
        rows = blocks[:, piece.offset : piece.offset + piece.local_rows]
        rows = jnp.swapaxes(rows, 0, 1).reshape(-1, *a.shape[1:])
        return rows[: piece.table.vocab_size]

    def _set_piece_rows(self, st, piece, a, rows):
        blocks = a.reshape(st.shards, st.rows_per_shard, *a.shape[1:])
        if piece.stride == 1:
            blocks = blocks.at[piece.shard, piece.offset : piece.offset + rows.shape[0]].set(rows)
        else:
            pad = piece.local_rows * st.shards - rows.shape[0]
            rows = jnp.pad(rows, [(0, pad)] + [(0, 0)] * (rows.ndim - 1))
            rows = jnp.swapaxes(rows.reshape(piece.local_rows, st.shards, *rows.shape[1:]), 0, 1)
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
                full[src] = empty_table(spec.device_view())
                continue
            check_saved_table(spec, tables.get(src), tables)
            full[src] = tables[src]
        out = {}
        for name, st in self.stacks.items():
            out[name] = self._import_stack(name, {p.source: full[p.source] for p in st.pieces})
        return out

    def cache_rows(self, table: str) -> tuple[str, Callable[[np.ndarray], np.ndarray], int]:
        """Where tiered `table`'s device cache lives: its stack, the stack rows of cache
        rows (slot `i` of a row-split cache lives on shard `i % S`), and the stack's rows
        (an out-of-bounds index, for padding)."""
        ((name, piece),) = self._pieces[table]
        st = self.stacks[name]

        def rows(slots: np.ndarray) -> np.ndarray:
            shard, local = (
                (piece.shard, slots)
                if piece.stride == 1
                else (slots % st.shards, slots // st.shards)
            )
            return (shard * st.rows_per_shard + piece.offset + local).astype(np.int32)

        return name, rows, st.shards * st.rows_per_shard

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
                self.tables[f.table].device_view().vocab_size,
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
