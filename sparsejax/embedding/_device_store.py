"""`DeviceTableStore`: tables stacked in device memory, replicated on a mesh.

The first `TableStore`, and the functional layer between the primitives and Flax.
Tables with the same dim, dtype and optimizer are stacked into one array
(`plan_stacks`: row offsets per table, ids shifted into the stack), so a batch costs one
lookup and one sparse update per stack and pooling kind, whatever the number of features
(FBGEMM's table batching). The stacking is internal: users name tables and features,
and `export_tables` / `import_tables` convert the state to and from a per-table form for
checkpoints, so a change of stacking never breaks a restore.

State: `{stack_name: {"weights": [rows, D], "slots": {slot: [rows(, D)]}}}`, every array
replicated on the store's mesh.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import ops
from ..ops import check_lookups
from ..ops.optimizers import SparseOptimizer
from ._memory import available_memory, format_bytes
from ._spec import FeatureSpec, TableSpec, check_specs, uniform_init
from ._stacking import MAX_STACK_ROWS, Stack, plan_stacks
from ._store import (
    StoreBase,
    check_saved_table,
    default_mesh,
    empty_table,
    stack_shapes,
    tiered_feature_key,
)

MESH_AXES = ("data", "model")
"""Mesh axes the device store accepts: "data" (any size; the batch may be split along
it, the tables are replicated) and "model" (size 1 only: splitting tables over devices
is the sharded store's job)."""


@dataclasses.dataclass(frozen=True)
class Group:
    """One lookup call: the features of one stack pooled the same way ("sum" carries
    sum/mean/sqrtn and sequences through per-id coefficients; "max" is its own call)."""

    name: str
    stack: str
    features: tuple[FeatureSpec, ...]
    combiner: str

    @property
    def needs_coefficients(self) -> bool:
        """False for plain unweighted sum/max/sequence pooling: every valid id counts 1,
        so no per-id coefficients are passed (the C++ kernel then skips them)."""
        return any(f.weighted or f.combiner in ("mean", "sqrtn") for f in self.features)


@dataclasses.dataclass(frozen=True)
class GroupLookups:
    """What a group looked up, in stacked-row space: everything the sparse update needs
    besides the gradient. Static fields travel as pytree metadata."""

    ids: jax.Array  # i32[N], -1 for padding and for ids outside their table
    segments: jax.Array  # i32[N], non-decreasing
    coefficients: jax.Array | None  # f32[N] pooling factor of each id; None: all 1
    stack: str
    combiner: str
    optimizer: SparseOptimizer


jax.tree_util.register_dataclass(
    GroupLookups,
    data_fields=["ids", "segments", "coefficients"],
    meta_fields=["stack", "combiner", "optimizer"],
)


def _name_hash(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _table_key(key: jax.Array, name: str) -> jax.Array:
    """A table's init key depends on its name only, not on its stack or position."""
    return jax.random.fold_in(key, _name_hash(name))


INIT_BLOCK_ELEMENTS = 1 << 20
"""Elements of one init block (4 MiB of float32): a table's rows are drawn in blocks of
`init_block_rows(dim)` rows, each from its own generator, so any range of rows can be
drawn alone and gets the values the whole table would have."""


def init_block_rows(dim: int) -> int:
    """Rows of one init block of a table of `dim` columns."""
    return max(1, INIT_BLOCK_ELEMENTS // dim)


def _block_initializer(init, shape: tuple[int, int]):
    """`init` with a default that depends on the whole table's shape fixed from it (the
    default uniform bound sqrt(1 / vocab_size)), so a block draws the table's
    distribution."""
    if isinstance(init, uniform_init) and init.scale is None:
        return uniform_init(init._bound(shape))
    return init


def _draw_block(key: jax.Array, key_data: list, table: TableSpec, block: int, out: np.ndarray):
    """Block `block` of `table`'s initial weights (`out`: `[rows of the block, dim]`)."""
    init = _block_initializer(table.initializer, (table.vocab_size, table.dim))
    if hasattr(init, "fill") or hasattr(init, "host"):
        rng = np.random.default_rng([*key_data, _name_hash(table.name), block])
        if hasattr(init, "fill"):
            init.fill(rng, out)
        else:
            out[...] = init.host(rng, out.shape, out.dtype)
    else:  # a jax initializer: one draw per block (it sees the block's shape)
        k = jax.random.fold_in(_table_key(key, table.name), block)
        out[...] = np.asarray(init(k, out.shape, out.dtype))


def fill_rows(
    key: jax.Array,
    table: TableSpec,
    start: int,
    out: np.ndarray,
    columns: slice | None = None,
) -> None:
    """Write rows `[start, start + len(out))` of `table`'s initial weights (columns
    `columns` of them, default all) into the host array `out` (the storage dtype).

    The values are a pure function of `key`, the table's name and the global row: rows
    are drawn in fixed blocks of `init_block_rows(dim)` rows, block `b` from a
    generator seeded by (key data, name hash, b) (counter-based), so one device, 8
    devices or 64 processes, each drawing only its own rows, give the same table.
    Whole blocks are drawn in place; a block cut by the range (or a column piece) is
    drawn into a temporary of one block and copied."""
    n = out.shape[0]
    if n == 0:
        return
    br = init_block_rows(table.dim)
    v = table.vocab_size
    key_data = np.asarray(jax.random.key_data(key)).ravel().tolist()
    dtype = jnp.dtype(table.dtype)
    for b in range(start // br, (start + n - 1) // br + 1):
        lo, hi = b * br, min((b + 1) * br, v)
        a, z = max(lo, start), min(hi, start + n)
        dst = out[a - start : z - start]
        if a == lo and z == hi and columns is None and out.dtype == dtype:
            _draw_block(key, key_data, table, b, dst)
            continue
        tmp = np.empty((hi - lo, table.dim), dtype)
        _draw_block(key, key_data, table, b, tmp)
        dst[...] = tmp[a - lo : z - lo] if columns is None else tmp[a - lo : z - lo, columns]


def fill_table(key: jax.Array, table: TableSpec, rows: np.ndarray) -> None:
    """Write `table`'s initial weights (a function of `key` and its name only) into the
    host array `rows` ([vocab_size, dim], the storage dtype): `fill_rows` of every row."""
    fill_rows(key, table, 0, rows)


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized host array aligned to 64 bytes, which the CPU client can adopt
    as a device buffer without a copy (`device_put(..., may_alias=True)`): for arrays
    that are only read (serving); state a step donates is built by `rows_on_devices`."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)


FILL_BYTES = 64 << 20
"""`rows_on_devices` stages at most this many bytes of rows on the host at a time."""

_write_rows = jax.jit(
    lambda dst, src, lo: jax.lax.dynamic_update_slice_in_dim(dst, src, lo, 0), donate_argnums=0
)


def rows_on_devices(
    shape: tuple[int, ...],
    dtype,
    devices: Sequence[jax.Device],
    fill: Callable[[int, int, np.ndarray], None],
    block_bytes: int | None = None,
) -> list[jax.Array]:
    """One array of `shape` on each of `devices`, whose rows `[lo, hi)` are what
    `fill(lo, hi, out)` writes into the host block `out`, staged one block of
    `block_bytes` (default `FILL_BYTES`) at a time.

    The host never holds more than one block, and each device owns its buffer, so the
    step that donates the array updates it in place: a host buffer adopted by a CPU
    device instead (`may_alias`) is copied by the first donating step, and both copies
    stay alive (twice the table's memory for the rest of the run)."""
    dtype = np.dtype(dtype)
    rows = int(shape[0])
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize)
    block = max(1, min(rows, (block_bytes or FILL_BYTES) // row_bytes))
    if block >= rows:  # one block: each device copies it
        host = np.empty(shape, dtype)
        fill(0, rows, host)
        return [jax.device_put(host, d, may_alias=False) for d in devices]
    outs = [jnp.zeros(shape, dtype, device=d) for d in devices]
    for lo in range(0, rows, block):
        lo = min(lo, rows - block)  # the last block ends at the last row (rewriting some)
        host = np.empty((block, *shape[1:]), dtype)
        fill(lo, lo + block, host)
        at = np.int32(lo)
        outs = [
            _write_rows(o, jax.device_put(host, d, may_alias=False), at)
            for o, d in zip(outs, devices, strict=True)
        ]
        jax.block_until_ready(outs)  # the block is copied before the next one is drawn
    return outs


def check_mesh(mesh: Mesh, owner: str = "DeviceTableStore") -> None:
    """Refuse a mesh axis the device store cannot use, naming it."""
    for axis, size in dict(mesh.shape).items():
        if axis not in MESH_AXES:
            raise ValueError(
                f"{owner}: mesh axis {axis!r} is not one the device store can "
                f"use (it accepts {MESH_AXES}; tables are replicated)"
            )
        if axis == "model" and size != 1:
            raise ValueError(
                f"{owner}: mesh axis 'model' has size {size}; the device store "
                f"replicates tables and needs it of size 1 (splitting tables "
                f"over devices needs a sharded store)"
            )


class DeviceTableStore(StoreBase):
    """Looks up and sparsely updates a set of features over a set of tables, held in
    device memory as stacked arrays replicated on `mesh`. Implements `TableStore`.

    Args:
      tables, features: the specs (names unique, every table read by some feature).
      mesh: the devices the tables live on (default: one device). Accepted axes:
        `MESH_AXES`.
      implementation: kernel choice for the sparse ops (None: the platform's best).
      max_stack_rows: rows of one stack at most (`MAX_STACK_ROWS`, int32 row ids).

    Example:
      >>> tables = [TableSpec(name="item", vocab_size=1000, dim=8)]
      >>> features = [FeatureSpec(name="clicked", table="item", combiner="mean", max_ids=5)]
      >>> store = DeviceTableStore(tables, features)
      >>> state = store.init(jax.random.key(0))
      >>> outputs, lookups = store.lookup(state, batch.features, batch.batch_size)
      >>> pooled = store.split(outputs, batch.batch_size)          # {"clicked": [B, 8]}
      >>> # ... g = gradient of the loss w.r.t. `outputs` ...
      >>> state = store.apply_gradients(state, lookups, g, step=1)
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        features: Sequence[FeatureSpec],
        *,
        mesh: Mesh | None = None,
        implementation: str | None = None,
        max_stack_rows: int = MAX_STACK_ROWS,
    ):
        tables, features = tuple(tables), tuple(features)
        check_specs(tables, features)
        self.mesh = default_mesh() if mesh is None else mesh
        check_mesh(self.mesh, type(self).__name__)
        self._specs = (tables, features, max_stack_rows)
        self.tables = {t.name: t for t in tables}
        self.features = {f.name: f for f in features}
        self.implementation = implementation
        # a tiered table is held as its device cache (its "view"); the host side
        # (`sparsejax.embedding.HostTables`) fills it and maps raw ids to cache slots
        self.device_tables = {t.name: t.device_view() for t in tables}
        self.tiered_tables = {t.name: t for t in tables if t.is_tiered}
        self.stacks: dict[str, Stack] = plan_stacks(
            tuple(self.device_tables.values()), max_rows=max_stack_rows
        )
        self.stack_of = {t.name: s.name for s in self.stacks.values() for t in s.tables}
        groups: dict[tuple[str, str], list[FeatureSpec]] = {}
        for f in features:
            kind = "max" if f.combiner == "max" else "sum"
            groups.setdefault((self.stack_of[f.table], kind), []).append(f)
        self.groups = {
            f"{stack}_{kind}": Group(f"{stack}_{kind}", stack, tuple(fs), kind)
            for (stack, kind), fs in sorted(groups.items())
        }

    def __repr__(self):
        return (
            f"{type(self).__name__}(stacks={list(self.stacks)}, mesh={dict(self.mesh.shape)}, "
            f"implementation={self.implementation!r})"
        )

    def with_mesh(self, mesh: Mesh) -> DeviceTableStore:
        """The same store on `mesh`."""
        tables, features, max_rows = self._specs
        return DeviceTableStore(
            tables, features, mesh=mesh, implementation=self.implementation, max_stack_rows=max_rows
        )

    # ---- state ----------------------------------------------------------------------
    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def abstract_state(self) -> dict:
        """Shapes, dtypes and shardings of the state, without allocating."""
        r = self._replicated()
        return {
            name: stack_shapes(stack.rows, stack.dim, stack.dtype, stack.optimizer, lambda _: r)
            for name, stack in self.stacks.items()
        }

    def part_bytes(self, name: str) -> tuple[int, int]:
        """`(weights, optimizer slots)` bytes of stack `name` (one replica)."""
        leaves = self.abstract_state()[name]
        size = lambda s: int(np.prod(s.shape)) * s.dtype.itemsize  # noqa: E731
        return (size(leaves["weights"]), sum(size(s) for s in jax.tree.leaves(leaves["slots"])))

    def check_memory(self, name: str) -> None:
        """Refuse, before allocating, a stack that does not fit in the mesh's devices.

        The need is init's measured peak: the stack's weights and slots (one copy per
        device; on CPU the weights are drawn into the buffer the first device adopts)
        plus one init block drawn aside (`fill_rows`); on other devices, the weights
        staged on the host as well."""
        devices = list(self.mesh.devices.flat)
        weights, slots = self.part_bytes(name)
        stack = self.stacks[name]
        largest = max(t.vocab_size for t in stack.tables)
        block = min(init_block_rows(stack.dim), largest) * stack.dim * 4  # drawn aside
        checks = [(weights + slots + block, available_memory(devices), "")]
        if all(d.platform != "cpu" for d in devices):  # the weights are staged on the host
            checks = [
                (weights + slots, available_memory(devices), ""),
                (weights + block, available_memory([]), " to stage the weights"),
            ]
        for need, avail, why in checks:
            if avail is not None and need > avail[0]:
                what = (
                    f"table {stack.tables[0].name!r}"
                    if len(stack.tables) == 1
                    else f"stack {name!r} (tables {[t.name for t in stack.tables]})"
                )
                raise MemoryError(
                    f"{type(self).__name__}.init: {what} needs {format_bytes(need)} "
                    f"(weights {format_bytes(weights)} + optimizer slots {format_bytes(slots)}"
                    f"{'' if need == weights + slots else f' + init block {format_bytes(block)}'}) "
                    f"but {format_bytes(avail[0])} is available ({avail[1]}{why}); use fewer "
                    f"or smaller tables, or a sharded store"
                )

    def init_part(self, key: jax.Array, name: str) -> dict:
        """Weights and slots of stack `name`; each table's values depend on `key` and the
        table's name only.

        With a concrete key the stack is allocated once on the host in its storage
        dtype and each table's rows are filled in place (initializers with a `fill`
        method, the default one, draw in chunks, so the peak stays at the stack's size),
        then placed on the mesh (without a copy on CPU); a stack that cannot fit is
        refused first. Under tracing, each table comes from its initializer (jax.random).
        """
        stack = self.stacks[name]
        if isinstance(key, jax.core.Tracer):
            weights = jnp.concatenate(
                [
                    jnp.asarray(
                        t.initializer(
                            _table_key(key, t.name), (t.vocab_size, t.dim), jnp.dtype(stack.dtype)
                        ),
                        stack.dtype,
                    )
                    for t in stack.tables
                ]
            )
            return {"weights": weights, "slots": stack.optimizer.init_slots(stack.rows, stack.dim)}
        self.check_memory(name)

        def fill(lo: int, hi: int, out: np.ndarray) -> None:
            out[...] = 0
            for t, off in zip(stack.tables, stack.offsets, strict=True):
                a, b = max(lo, off), min(hi, off + t.vocab_size)
                if a < b:
                    fill_rows(key, t, a - off, out[a - lo : b - lo])

        r = self._replicated()
        shape = (stack.rows, stack.dim)
        devices = list(r.addressable_devices_indices_map(shape))
        weights = jax.make_array_from_single_device_arrays(
            shape, r, rows_on_devices(shape, jnp.dtype(stack.dtype), devices, fill)
        )
        slots = {
            s.name: jnp.full(
                (stack.rows,) if s.per_row else (stack.rows, stack.dim), s.init, s.dtype, device=r
            )
            for s in stack.optimizer.slots()
        }
        return {"weights": weights, "slots": slots}

    def export_tables(self, state: Mapping) -> dict:
        """`{table: {"weights": [V, D], "slots": {...}}}`: the stacking-free form. Tiered
        tables are not in it: their state is on the host (`HostTables.snapshot`)."""
        out = {}
        for name, stack in self.stacks.items():
            for t, off in zip(stack.tables, stack.offsets, strict=True):
                if t.name in self.tiered_tables:
                    continue
                rows = slice(off, off + t.vocab_size)
                out[t.name] = {
                    "weights": state[name]["weights"][rows],
                    "slots": {k: v[rows] for k, v in state[name]["slots"].items()},
                }
        return out

    def import_tables(self, tables: Mapping) -> dict:
        """Inverse of `export_tables`, placed on the mesh; names a missing table or a
        mismatched shape or slot set. Tiered tables get an empty device cache."""
        state = {}
        for name, stack in self.stacks.items():
            parts = []
            for t in stack.tables:
                if t.name in self.tiered_tables:
                    parts.append(empty_table(t))
                    continue
                check_saved_table(t, tables.get(t.name), tables)
                parts.append(tables[t.name])
            slot_names = [s.name for s in stack.optimizer.slots()]
            state[name] = {
                "weights": jnp.concatenate([jnp.asarray(p["weights"], stack.dtype) for p in parts]),
                "slots": {
                    s: jnp.concatenate([jnp.asarray(p["slots"][s]) for p in parts])
                    for s in slot_names
                },
            }
        return jax.device_put(state, self.state_shardings())

    def cache_rows(self, table: str) -> tuple[str, Callable[[np.ndarray], np.ndarray], int]:
        """Where tiered `table`'s device cache lives: its stack, the stack rows of cache
        rows, and the stack's rows (an out-of-bounds index, for padding)."""
        stack = self.stacks[self.stack_of[table]]
        offset = stack.offset_of(table)
        return stack.name, lambda slots: (offset + slots).astype(np.int32), stack.rows

    def init_stack(self, key: jax.Array, stack_name: str) -> dict:
        """Old name of `init_part`."""
        return self.init_part(key, stack_name)

    # ---- lookup and update ------------------------------------------------------------
    def lookup(
        self, state: Mapping, features: Mapping, batch_size: int
    ) -> tuple[dict[str, jax.Array], dict[str, GroupLookups]]:
        """Pooled rows per group (`[bags, D]`) and what each group looked up.

        `features` maps feature name -> `PaddedIds` (see `sparsejax.data.SparseBatch`).
        Ids outside their table look up nothing (they never reach another table of
        the stack); `sparsejax.ops.checks()` or the host packer reports them by name.
        """
        missing = set(self.features) - set(features)
        if missing:
            raise KeyError(f"batch lacks features {sorted(missing)}")
        outputs, lookups = {}, {}
        for gname, group in self.groups.items():
            stack = self.stacks[group.stack]
            ids, segs, coefs, offset = [], [], [], 0
            for f in group.features:
                jag = features[f.name]
                if f.table in self.tiered_tables:  # its own slot ids, if the batch has them
                    jag = features.get(tiered_feature_key(f.name, f.table), jag)
                table = self.device_tables[f.table]
                start = stack.offset_of(f.table)
                bags = batch_size * f.bags_per_example()
                i = jnp.asarray(jag.ids, jnp.int32)
                s = jnp.asarray(jag.segments, jnp.int32)
                w = None if jag.weights is None else jnp.asarray(jag.weights, jnp.float32)
                check_lookups(
                    f"{type(self).__name__}.lookup of feature {f.name!r}",
                    f.table,
                    table.vocab_size,
                    bags,
                    i,
                    s,
                    w,
                    defer=self.mesh.size > 1,  # a raising callback would hang the others
                )
                if group.needs_coefficients and group.combiner == "sum":
                    coefs.append(
                        ops.pooling_coefficients(
                            i, s, bags, table.vocab_size, w, f.combiner or "sum"
                        )
                    )
                elif group.needs_coefficients:  # max: the weights scale the rows
                    coefs.append(jnp.ones(i.shape, jnp.float32) if w is None else w)
                inside = (i >= 0) & (i < table.vocab_size)
                ids.append(jnp.where(inside, i + start, -1))
                segs.append(s + offset)
                offset += bags
            lk = GroupLookups(
                jnp.concatenate(ids),
                jnp.concatenate(segs),
                jnp.concatenate(coefs) if coefs else None,
                group.stack,
                group.combiner,
                stack.optimizer,
            )
            outputs[gname] = self._bag(state[group.stack], lk, offset)
            lookups[gname] = lk
        return outputs, lookups

    def _bag(self, stack_state: Mapping, lk: GroupLookups, num_bags: int) -> jax.Array:
        """One group's pooled rows from its stack's state (the one place a store reads
        its weights; `sparsejax.serving.InferenceTableStore` reads quantized rows)."""
        return ops.embedding_bag(
            stack_state["weights"],
            lk.ids,
            lk.segments,
            num_bags,
            weights=lk.coefficients,
            combiner=lk.combiner,
            implementation=self.implementation,
            name=lk.stack,
        )

    def split(self, outputs: Mapping[str, jax.Array], batch_size: int) -> dict[str, jax.Array]:
        """Per feature: `[B, D]` pooled, or `[B, max_ids, D]` for a sequence.

        One `jnp.split` per group: its gradient is one concatenate, where per-feature
        slices would each be padded back to the group's size and summed (26 features:
        26 full-size adds, ~40 ms of a B=4096 DLRM step on 2 cores).
        """
        out = {}
        for gname, group in self.groups.items():
            sizes = [batch_size * f.bags_per_example() for f in group.features]
            pieces = jnp.split(outputs[gname], np.cumsum(sizes)[:-1].tolist())
            for f, rows in zip(group.features, pieces, strict=True):
                out[f.name] = rows.reshape(batch_size, f.max_ids, -1) if f.is_sequence else rows
        return {name: out[name] for name in self.features}

    def apply_gradients(
        self,
        state: Mapping,
        lookups: Mapping[str, GroupLookups],
        grads: Mapping[str, jax.Array],
        *,
        step: jax.Array | int,
        learning_rate: jax.Array | float | None = None,
        learning_rate_scale: jax.Array | float | None = None,
        l2: float = 0.0,
        implementation: str | None = None,
    ) -> dict:
        """Sparse optimizer step on the touched rows; see `apply_group_gradients`.
        `implementation` overrides the store's for this update."""
        return apply_group_gradients(
            state,
            lookups,
            grads,
            step=step,
            learning_rate=learning_rate,
            learning_rate_scale=learning_rate_scale,
            l2=l2,
            implementation=self.implementation if implementation is None else implementation,
        )


def _touched_once(ids: jax.Array) -> jax.Array:
    """i32[N]: every row id of `ids` once (sorted), -1 for repeats and padding."""
    ids = jnp.sort(ids)
    first = jnp.concatenate([jnp.ones((1,), jnp.bool_), ids[1:] != ids[:-1]])
    return jnp.where(first & (ids >= 0), ids, -1)


def _l2_lookups(
    state: Mapping, lookups: Mapping[str, GroupLookups], order: Sequence[str], l2: float
) -> dict[str, tuple[jax.Array, jax.Array]]:
    """The L2 term of each stack as extra lookups: `{group: (ids, grads)}` where `ids`
    holds every row the stack's groups touched once (-1 elsewhere) and `grads` is
    `l2 * row` (f32, from the weights before this step), attached to the stack's last
    group in `order`. Costs a sort of the looked-up ids and a gather of that many rows."""
    by_stack: dict[str, list[str]] = {}
    for g in order:
        by_stack.setdefault(lookups[g].stack, []).append(g)
    out = {}
    for stack, groups in by_stack.items():
        ids = _touched_once(jnp.concatenate([lookups[g].ids for g in groups]))
        rows = jnp.take(state[stack]["weights"], jnp.maximum(ids, 0), axis=0).astype(jnp.float32)
        out[groups[-1]] = (ids, jnp.where((ids >= 0)[:, None], l2 * rows, 0.0))
    return out


def apply_group_gradients(
    state: Mapping,
    lookups: Mapping[str, GroupLookups],
    grads: Mapping[str, jax.Array],
    *,
    step: jax.Array | int,
    learning_rate: jax.Array | float | None = None,
    learning_rate_scale: jax.Array | float | None = None,
    l2: float = 0.0,
    implementation: str | None = None,
) -> dict:
    """Update the rows each group touched, given the gradient of its pooled output.

    Donate `state` at the `jit` boundary and the update happens in place. A table read
    by a "sum"-kind and a "max" feature gets one optimizer step per kind; the "max" one
    goes first because it finds each bag's winning row in the table as the forward saw it.

    Args:
      learning_rate: replaces every table's `optimizer.learning_rate` (None: keep them).
      learning_rate_scale: multiplies the learning rate of every table (e.g. a schedule's
        value at this step; a traced scalar, so it changes without recompiling).
      l2: L2 regularization of the touched rows (a static float): the gradient of
        `0.5 * l2 * ||row||^2`, at the weights before this step, is added to every row
        the batch looked up, once per row and step however many times it was looked up
        (and once per table stack, even when sum- and max-pooled features both read
        it), before the sparse optimizer. Rows the batch did not touch are not decayed;
        the cost grows with the looked-up ids, never with the table size.
    """
    state = {k: dict(v) for k, v in state.items()}
    order = sorted(lookups, key=lambda g: lookups[g].combiner != "max")
    extra = _l2_lookups(state, lookups, order, l2) if l2 else {}
    for gname in order:
        lk = lookups[gname]
        st = state[lk.stack]
        ids, segments, coefficients, grad = lk.ids, lk.segments, lk.coefficients, grads[gname]
        if gname in extra:  # the L2 term: one more bag per touched row, holding that row
            l2_ids, l2_grads = extra[gname]
            first = grad.shape[0]
            ids = jnp.concatenate([ids, l2_ids])
            segments = jnp.concatenate(
                [segments, first + jnp.arange(l2_ids.shape[0], dtype=segments.dtype)]
            )
            if coefficients is not None:
                coefficients = jnp.concatenate(
                    [coefficients, jnp.ones(l2_ids.shape, coefficients.dtype)]
                )
            grad = jnp.concatenate([grad.astype(jnp.float32), l2_grads])
        lr = learning_rate
        if learning_rate_scale is not None:
            base = lk.optimizer.learning_rate if learning_rate is None else learning_rate
            lr = jnp.asarray(learning_rate_scale, jnp.float32) * base
        st["weights"], st["slots"] = ops.sparse_apply(
            st["weights"],
            st["slots"],
            ids,
            segments,
            grad,
            optimizer=lk.optimizer,
            step=step,
            weights=coefficients,
            combiner=lk.combiner,
            learning_rate=lr,
            implementation=implementation,
            name=lk.stack,
        )
    return state
