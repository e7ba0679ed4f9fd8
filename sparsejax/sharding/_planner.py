"""The planner: each table's placement on a ("data", "model") mesh, chosen from the
specs, the mesh, the memory of one device and a cost model, before anything is allocated.

Cost model, per table (with the tables that follow it, see `follow`), per device:

- memory: `table_device_bytes` of `_placement`, the bytes of the table's largest piece
  on one device: its device rows (a tiered table's cache plus its default row) times the
  weights plus every optimizer slot (`row_bytes`). Slots and caches are counted: a table
  that fits without its slots does not fit.
- communication: `comm_bytes`, the bytes one device moves per step through the sharded
  store's collectives for the table's ids and bags local to it (the step's `batch_size`
  split over all N devices: `n` ids = sum over its features of min(capacity, B/N x
  max_ids), as `shard_batch` pads them, `b` bags = sum of B/N x bags per example).
  Independent of the vocabulary.

Choice rule (deterministic: the same specs and mesh give the same plan everywhere):

1. A pinned table keeps its placement (`pinned`, or a spec whose `placement` is not
   "device"), checked as the store checks it: column-wise needs a dim divisible by the
   "model" axis and an optimizer without per-row slots (row-wise Adagrad's one value
   per row cannot be split by columns); split rows (row-wise, table-row-wise) refuse
   "max" pooling (a bag's partial maxima do not add).
2. Every other table gets a ladder of placements, from keeping it whole to splitting it
   over every device, each rung holding less of it on the busiest device (or, at equal
   pieces, on all devices together) than the rung before, and keeping only those under
   which the table alone fits the budget: "replicated" (only when its copy takes at
   most `replicate_max` of the budget: small tables), "table_wise" (the whole table on
   one index of "model"), then one of "table_row_wise" and "column_wise" (split over
   the "model" devices, one host's by default: the one of fewer bytes per step, which
   is table-row-wise, as column-wise sends every id to all M column pieces; column-wise
   where table-row-wise cannot serve: max pooling), then "row_wise" (split over all
   devices). A table starts on its first rung: it is split only as far as memory
   requires, since a whole table is looked up and updated in one place. Bytes per step
   decide between placements of equal memory; they are not minimized over all
   placements (e.g. a table-wise table moves more bytes than a replicated copy:
   `comm_bytes`).
3. Table-wise tables go to "model" indices by `assign_table_wise` (largest first onto
   the least-loaded index), per embedding layer and stack (dim, dtype, optimizer), as
   the store assigns them.
4. While a device holds more than the budget, a table moves down its ladder: the
   largest (its piece on a device; ties: by name) for which a lower rung brings the
   bytes over budget (summed over the devices) down, to the first such rung. The ids
   of a table cost about the same bytes per step whatever its size, so moving the
   largest frees the most memory per byte added. No move helps: a `PlanError` listing
   each table's need under its best placement and the budget.

The budget of a device is `device_memory x (1 - reserve)`: `reserve` (10% by default)
is kept for the dense parameters, their optimizer state, the activations and XLA's
buffers, which the planner does not model.

Bytes per step per host are the bytes of the host's devices added (`hosts` processes,
N / hosts devices each), some of them exchanged inside the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..embedding import TableSpec, format_bytes, stack_name
from ._placement import (
    AXES,
    PLACEMENTS,
    assign_table_wise,
    axis_size,
    num_shards,
    replica_axes,
    table_device_bytes,
)

RESERVE = 0.1
"""Share of each device's memory the planner leaves to the dense parameters, their
optimizer state, the activations and XLA's buffers."""
REPLICATE_MAX = 0.01
"""A table is replicated (when not pinned) only if its copy takes at most this share of
a device's budget."""
ID_BYTES = 12
"""Bytes one id travels as: its row (int32), its bag (int32) and its pooling coefficient
(float32)."""
_SPLIT_ROWS = ("row_wise", "table_row_wise")


class PlanError(ValueError):
    """The tables cannot be placed: they do not fit, or a pinned placement is invalid."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableShape(TableSpec):
    """A table as the planner sees it: a `TableSpec` without its checks, for plans of
    tables larger than the int32 row ids of batches and kernels (`vocab_size` >= 2**31,
    planned row-wise over many devices). It cannot be trained."""

    def __post_init__(self):
        pass


def comm_bytes(
    placement: str,
    *,
    ids: int,
    bags: int,
    dim: int,
    mesh_shape: Mapping[str, int],
    dtype_bytes: int = 4,
    id_bytes: int = ID_BYTES,
) -> dict[str, int]:
    """Bytes one device moves per step for one table under `placement`: the sizes of the
    sharded store's collective buffers (what the compiled HLO's collectives carry), for
    `ids` ids and `bags` bags local to the device, with S shards (`num_shards`) and R
    replicas (the size of the replica axes), D = `dim`, w = `dtype_bytes` per pooled
    value (the table's dtype) and `id_bytes` per id (12: row, bag and pooling
    coefficient; 8 when no feature of the table's stack needs a coefficient):

    - forward ids: id_bytes x S x ids. Each device buckets its ids by owner shard into
      an `[S, ids]` send buffer, all-to-all over the shard axes. This is the bound of
      a buffer with room for every id the device has; the `Trainer` sizes the buckets
      from the ids each owner gets (`_exchange`: about ids / S each, plus headroom), so
      a training step moves less.
    - forward rows: w x S x bags x D. The owners' partial pooled rows `[S, bags, D]`,
      all-to-all back and summed.
    - backward grads: w x S x bags x D. The pooled rows' gradients, all-gathered over
      the shard axes so each owner has the gradients of the bags it served.
    - backward replica sync: R x (id_bytes x S x ids + w x S x bags x D). The ids and
      gradients an owner received, all-gathered over the replica axes, so every replica
      applies the same sparse update to its copy of the rows.

    Column-wise: the store keeps each of the M column pieces as a table of dim D/M on
    its own index of "model", so each id is looked up M times (ids x M) and each bag
    is M bags of D/M values: the row terms equal table-wise's, the id terms are M times
    theirs. Terms over the shard axes vanish when S = 1 (replicated: no forward
    traffic), the replica sync when R = 1 (row-wise). Nothing depends on the vocabulary.

    Returns `{"forward": bytes, "backward": bytes}`.
    """
    s = num_shards(placement, mesh_shape)
    r = axis_size(mesh_shape, replica_axes(placement))
    if placement == "column_wise":  # M pieces of D/M columns, each reading every id
        ids, bags, dim = ids * s, bags * s, dim // s
    id_buf, row_buf = id_bytes * s * ids, dtype_bytes * s * bags * dim
    sharded = s > 1
    forward = (id_buf + row_buf) if sharded else 0
    backward = (row_buf if sharded else 0) + (r * (id_buf + row_buf) if r > 1 else 0)
    return {"forward": forward, "backward": backward}


def _weight_bytes(spec) -> int:
    return 2 if spec.dtype == "bfloat16" else 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Where each table lives on the mesh and what it costs (`plan_tables`)."""

    placements: Mapping[str, str]
    """Placement of every planned table (the tables following another included)."""
    assignment: Mapping[str, int]
    """Table-wise tables: the index of "model" holding each."""
    memory: Mapping[str, int]
    """Per table: bytes on a device holding its largest piece (weights, slots, cache)."""
    comm: Mapping[str, Mapping[str, int]]
    """Per table: `comm_bytes` ({"forward", "backward"}) per step per device."""
    device_bytes: tuple[int, ...]
    """Per index of "model": the tables' bytes on each device there (all of "data" alike)."""
    mesh_shape: Mapping[str, int]
    hosts: int
    batch_size: int
    device_memory: int
    reserve: float
    pinned: frozenset[str] = frozenset()
    follows: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Tables placed with another (a model's first-order twin): name -> leader."""
    on_host: tuple[str, ...] = ()
    """Tables left out of the plan: host-executed (`placement: host`), in host memory."""

    @property
    def devices(self) -> int:
        return axis_size(self.mesh_shape, AXES)

    @property
    def devices_per_host(self) -> int:
        return self.devices // self.hosts

    @property
    def budget(self) -> int:
        """Bytes of one device the tables may take: `device_memory x (1 - reserve)`."""
        return int(self.device_memory * (1 - self.reserve))

    @property
    def max_device_bytes(self) -> int:
        """The tables' bytes on the fullest device."""
        return max(self.device_bytes)

    def step_bytes(self, name: str) -> int:
        """Bytes per step per device of table `name` (forward and backward)."""
        return sum(self.comm[name].values())

    @property
    def bytes_per_device(self) -> int:
        """Bytes every device moves per step, all tables together."""
        return sum(self.step_bytes(n) for n in self.placements)

    @property
    def bytes_per_host(self) -> int:
        """Bytes one host's devices move per step (`bytes_per_device` x devices per host)."""
        return self.bytes_per_device * self.devices_per_host

    def shards(self, name: str) -> int:
        """Pieces table `name` is cut into (1: whole, on every device or one index of
        "model")."""
        p = self.placements[name]
        return 1 if p in ("replicated", "table_wise") else num_shards(p, self.mesh_shape)

    def apply(self, tables: Sequence) -> tuple:
        """`tables` with their planned placements (`dataclasses.replace`); tables the plan
        does not know are refused by name."""
        out = []
        for t in tables:
            if t.name not in self.placements:
                raise ValueError(f"Plan.apply: table {t.name!r} is not in the plan")
            p = self.placements[t.name]
            out.append(t if t.placement == p else dataclasses.replace(t, placement=p))
        return tuple(out)

    def table(self) -> str:
        """The plan as a text table: per table its placement, shards, memory per device
        and bytes per step per device; then the totals (memory of the fullest device
        against the budget, bytes per step per device and per host)."""
        m = self.mesh_shape
        head = (
            f"plan: {len(self.placements)} tables on {self.devices} "
            f"device{'s' * (self.devices != 1)} ({self.hosts} "
            f"host{'s' * (self.hosts != 1)} x {self.devices_per_host}; mesh data "
            f"{m.get('data', 1)} x model {m.get('model', 1)}), global batch "
            f"{self.batch_size:,}"
        )
        rows = [("table", "placement", "shards", "memory/device", "bytes/step/device")]
        for name in self.placements:
            p = self.placements[name]
            note = ""
            if name in self.follows:
                note = f" (with {self.follows[name]})"
            elif name in self.pinned:
                note = " (pinned)"
            shards = str(self.shards(name))
            if p == "table_wise":
                shards += f" @model {self.assignment[name]}"
            rows.append(
                (
                    name,
                    p + note,
                    shards,
                    format_bytes(self.memory[name]),
                    format_bytes(self.step_bytes(name)),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [head]
        for r in rows:
            cells = [
                c.ljust(w) if i < 3 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            lines.append("  ".join(cells).rstrip())
        lines.append(
            f"memory per device: {format_bytes(self.max_device_bytes)} (fullest device) of "
            f"{format_bytes(self.budget)} ({format_bytes(self.device_memory)} less "
            f"{self.reserve:.0%} reserve)"
        )
        lines.append(
            f"bytes per step: {format_bytes(self.bytes_per_device)} per device, "
            f"{format_bytes(self.bytes_per_host)} per host ({self.devices_per_host} "
            f"device{'s' * (self.devices_per_host != 1)})"
        )
        if self.on_host:
            lines.append(
                f"host-executed tables (placement host, in host memory, not planned): "
                f"{list(self.on_host)}"
            )
        return "\n".join(lines)


def _needs_coefficient(f) -> bool:
    return f.weighted or f.combiner in ("mean", "sqrtn")


@dataclasses.dataclass
class _Group:
    """A table and the tables that follow it: placed together, costed together."""

    name: str
    specs: list
    feats: dict  # table name -> [(feature, ids, bags)] local to one device
    pinned: str | None = None
    ladder: list = dataclasses.field(default_factory=list)
    rung: int = 0
    _comm: dict = dataclasses.field(default_factory=dict)

    @property
    def placement(self) -> str:
        return self.ladder[self.rung]

    def memory(self, placement: str, mesh_shape) -> int:
        return sum(table_device_bytes(s, placement, mesh_shape) for s in self.specs)

    def comm(self, placement: str, mesh_shape) -> int:
        """Bytes per step per device (each feature's ids with a coefficient if it needs
        one; `_table_comm` gives the final figures, with the stacks known)."""
        if placement in self._comm:
            return self._comm[placement]
        total = 0
        for s in self.specs:
            for f, n, b in self.feats[s.name]:
                c = comm_bytes(
                    placement,
                    ids=n,
                    bags=b,
                    dim=s.dim,
                    mesh_shape=mesh_shape,
                    dtype_bytes=_weight_bytes(s),
                    id_bytes=12 if _needs_coefficient(f) else 8,
                )
                total += c["forward"] + c["backward"]
        self._comm[placement] = total
        return total

    def invalid(self, placement: str, mesh_shape) -> str | None:
        """Why the group cannot take `placement` (None: it can), as the store refuses."""
        model = int(mesh_shape.get("model", 1))
        if placement == "column_wise":
            for s in self.specs:
                if s.is_tiered:
                    return f"table {s.name!r} is dynamic or host-cached: its rows move whole"
                if s.dim % model:
                    return (
                        f"column_wise splits dim {s.dim} of table {s.name!r} over the "
                        f"{model} devices of 'model'; it must divide"
                    )
                if any(slot.per_row for slot in s.optimizer.slots()):
                    return (
                        f"column_wise splits each row over devices, but "
                        f"{type(s.optimizer).__name__} keeps one value per whole row"
                    )
        if placement in _SPLIT_ROWS:
            for s in self.specs:
                for f, _, _ in self.feats[s.name]:
                    if f.combiner == "max":
                        return f"{placement} splits rows, and feature {f.name!r} pools by max"
        return None


def _check_args(mesh_shape, device_memory, hosts, batch_size, reserve, replicate_max) -> int:
    if set(mesh_shape) - set(AXES):
        raise ValueError(f"plan_tables: mesh axes must be among {AXES}, got {sorted(mesh_shape)}")
    for k, v in (*mesh_shape.items(), ("batch_size", batch_size), ("hosts", hosts)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"plan_tables: {k} must be a positive int, got {v!r}")
    n = axis_size(mesh_shape, AXES)
    if n % hosts:
        raise ValueError(f"plan_tables: {hosts} hosts do not divide the {n} devices")
    if not isinstance(device_memory, int) or device_memory < 1:
        raise ValueError(
            f"plan_tables: device_memory must be a positive int, got {device_memory!r}"
        )
    if not 0 <= reserve < 1:
        raise ValueError(f"plan_tables: reserve must be in [0, 1), got {reserve!r}")
    if not 0 <= replicate_max <= 1:
        raise ValueError(f"plan_tables: replicate_max must be in [0, 1], got {replicate_max!r}")
    if batch_size % n:
        raise PlanError(
            f"the global batch of {batch_size} does not split over the {n} devices (each "
            f"device takes B / {n} examples); give a multiple of {n}"
        )
    return n


def plan_tables(
    tables: Sequence,
    features: Sequence,
    *,
    batch_size: int,
    mesh_shape: Mapping[str, int],
    device_memory: int,
    hosts: int = 1,
    pinned: Mapping[str, str] | None = None,
    reserve: float = RESERVE,
    replicate_max: float = REPLICATE_MAX,
    follow: Mapping[str, str] | None = None,
) -> Plan:
    """Choose each table's placement (see the module docstring for the rule).

    Args:
      tables: the `TableSpec`s (or `TableShape`s) of the model, every embedding layer's.
      features: the `FeatureSpec`s reading them.
      batch_size: the global batch of one step (split over every device).
      mesh_shape: `{"data": H, "model": D}`.
      device_memory: bytes of one device.
      hosts: processes (hosts) the devices are in, for the bytes per host.
      pinned: `{table: placement}` kept as given (tables whose spec's `placement` is not
        "device" are pinned to it too; `pinned` wins).
      reserve: share of `device_memory` left to everything but the tables.
      replicate_max: a table is replicated only if it takes at most this share of the
        budget.
      follow: `{table: leader}`: tables placed with another one, counted with it, in an
        embedding layer of their own (DeepFM's 1-dim first-order tables follow theirs).

    Returns:
      The `Plan`.

    Raises:
      PlanError: the tables do not fit, naming each table's need under its best
        placement and the memory per device; a pinned placement is invalid, naming the
        table; or the batch does not split over the devices.
    """
    mesh_shape = {a: int(mesh_shape.get(a, 1)) for a in AXES}
    pinned, follow = dict(pinned or {}), dict(follow or {})
    n_dev = _check_args(mesh_shape, device_memory, hosts, batch_size, reserve, replicate_max)
    budget = int(device_memory * (1 - reserve))
    specs = {t.name: t for t in tables}
    for name, leader in follow.items():
        if name not in specs or leader not in specs or leader in follow:
            raise ValueError(f"plan_tables: follow {name!r} -> {leader!r} names no leading table")
    for name in pinned:
        if name not in specs:
            raise PlanError(f"placement pinned for table {name!r}, which the model does not have")
        if name in follow:
            raise PlanError(f"table {name!r} follows {follow[name]!r}; pin {follow[name]!r}")
    local = batch_size // n_dev
    feats: dict[str, list] = {name: [] for name in specs}
    for f in features:
        n = min(f.capacity_for(batch_size), local * f.max_ids)  # as shard_batch pads
        feats[f.table].append((f, n, local * f.bags_per_example()))
    groups: dict[str, _Group] = {}
    for t in tables:
        leader = follow.get(t.name, t.name)
        g = groups.setdefault(leader, _Group(leader, [], feats))
        g.specs.append(t)
    for g in groups.values():
        g.specs.sort(key=lambda s: s.name != g.name)  # the leader first
        lead = specs[g.name]
        p = pinned.get(g.name, lead.placement if lead.placement != "device" else None)
        if p is None:
            g.ladder = _ladder(g, mesh_shape, budget, replicate_max)
            continue
        if p not in PLACEMENTS:
            raise PlanError(f"table {g.name!r}: placement {p!r} is not one of {PLACEMENTS}")
        why = g.invalid(p, mesh_shape)
        if why:
            raise PlanError(f"table {g.name!r} pinned {p}: {why}")
        g.pinned, g.ladder = p, [p]
    order = sorted(groups)
    if any(not groups[n].ladder for n in order):
        raise _no_fit(groups, mesh_shape, budget, device_memory, reserve)
    while True:
        assignment, loads = _loads(groups, follow, mesh_shape)
        excess = _excess(loads, budget)
        if not excess:
            break
        move = _best_move(groups, follow, budget, excess, mesh_shape)
        if move is None:
            raise _no_fit(groups, mesh_shape, budget, device_memory, reserve)
        groups[move[0]].rung = move[1]
    placements = {t.name: groups[follow.get(t.name, t.name)].placement for t in tables}
    return Plan(
        placements=placements,
        assignment=assignment,
        memory={t.name: table_device_bytes(t, placements[t.name], mesh_shape) for t in tables},
        comm=_table_comm(specs, feats, placements, follow, mesh_shape),
        device_bytes=tuple(loads),
        mesh_shape=mesh_shape,
        hosts=hosts,
        batch_size=batch_size,
        device_memory=device_memory,
        reserve=reserve,
        pinned=frozenset(n for n, g in groups.items() if g.pinned is not None),
        follows=follow,
    )


def _stack_key(spec, placement: str, mesh_shape, follow) -> tuple:
    """The store's stack of a table (its embedding layer, stack kind, dim, dtype and
    optimizer): column pieces are table-wise tables of dim D / M."""
    dim = spec.dim
    if placement == "column_wise":
        placement, dim = "table_wise", dim // mesh_shape["model"]
    return (spec.name in follow, placement, stack_name(dim, spec.dtype, spec.optimizer))


def _table_comm(specs, feats, placements, follow, mesh_shape) -> dict[str, dict[str, int]]:
    """`comm_bytes` of every table, its features added, each feature's ids carrying a
    coefficient when any feature of its lookup group (stack and pooling kind) needs one,
    as the store sends them."""
    coef: dict[tuple, bool] = {}

    def group(t, f):
        kind = "max" if f.combiner == "max" else "sum"
        return (_stack_key(specs[t], placements[t], mesh_shape, follow), kind)

    for t, entries in feats.items():
        for f, _, _ in entries:
            key = group(t, f)
            coef[key] = coef.get(key, False) or _needs_coefficient(f)
    out = {}
    for t, entries in feats.items():
        total = {"forward": 0, "backward": 0}
        for f, n, b in entries:
            c = comm_bytes(
                placements[t],
                ids=n,
                bags=b,
                dim=specs[t].dim,
                mesh_shape=mesh_shape,
                dtype_bytes=_weight_bytes(specs[t]),
                id_bytes=12 if coef[group(t, f)] else 8,
            )
            total = {k: total[k] + c[k] for k in total}
        out[t] = total
    return out


def _footprint(g: _Group, placement: str, mesh_shape) -> tuple[int, int]:
    """(bytes on the device holding the largest piece, bytes on all devices together)."""
    piece = g.memory(placement, mesh_shape)
    n = axis_size(mesh_shape, AXES)
    on = n // mesh_shape["model"] if placement == "table_wise" else n
    return piece, piece * on


def _ladder(g: _Group, mesh_shape, budget: int, replicate_max: float) -> list[str]:
    """The placements a table may take, from whole to split, each holding less of it
    than the one before (on the busiest device, else on all together); only those under
    which it fits alone."""
    rungs = []
    if g.memory("replicated", mesh_shape) <= replicate_max * budget:
        rungs.append("replicated")
    rungs.append("table_wise")
    host = [p for p in ("table_row_wise", "column_wise") if not g.invalid(p, mesh_shape)]
    if host:  # the cheaper of the two; ties: table-row-wise
        rungs.append(min(host, key=lambda p: (g.comm(p, mesh_shape), p != "table_row_wise")))
    if not g.invalid("row_wise", mesh_shape):
        rungs.append("row_wise")
    out, last = [], None
    for p in rungs:
        piece, total = _footprint(g, p, mesh_shape)
        if piece > budget:
            continue
        if last is not None and not (piece <= last[0] and (piece, total) < last):
            continue
        out.append(p)
        last = (piece, total)
    return out


def _loads(groups, follow, mesh_shape) -> tuple[dict[str, int], list[int]]:
    """(table-wise assignment, bytes per index of "model"). Table-wise tables are
    assigned per stack, as the store does."""
    model = mesh_shape["model"]
    stacks: dict[tuple, dict[str, int]] = {}
    for g in groups.values():
        if g.placement == "table_wise":
            for s in g.specs:
                key = _stack_key(s, "table_wise", mesh_shape, follow)
                stacks.setdefault(key, {})[s.name] = table_device_bytes(s, "table_wise", mesh_shape)
    assignment: dict[str, int] = {}
    for key in sorted(stacks):
        assignment |= assign_table_wise(stacks[key], model)
    loads = [0] * model
    for g in groups.values():
        for s in g.specs:
            _add(
                loads,
                table_device_bytes(s, g.placement, mesh_shape),
                g.placement,
                assignment.get(s.name),
            )
    return assignment, loads


def _add(loads: list[int], piece: int, placement: str, index: int | None) -> None:
    """Add a table's piece to the loads per index of "model" (a table-wise one at
    `index`, every other placement on every index)."""
    if placement == "table_wise":
        loads[index] += piece
    else:
        for i in range(len(loads)):
            loads[i] += piece


def _excess(loads: Sequence[int], budget: int) -> int:
    return sum(max(0, x - budget) for x in loads)


def _best_move(groups, follow, budget, excess, mesh_shape):
    """`(table, rung)`: the largest unpinned table (by its piece on a device; ties by
    name) that some lower rung of its ladder brings the bytes over budget down for, and
    the first such rung (the fewest bytes per step). None if no move helps."""
    movable = [g for g in groups.values() if g.pinned is None and g.rung + 1 < len(g.ladder)]
    movable.sort(key=lambda g: (-g.memory(g.placement, mesh_shape), g.name))
    for g in movable:
        now = g.rung
        for rung in range(now + 1, len(g.ladder)):
            g.rung = rung
            after = _excess(_loads(groups, follow, mesh_shape)[1], budget)
            g.rung = now
            if after < excess:
                return g.name, rung
    return None


def _no_fit(groups, mesh_shape, budget, device_memory, reserve) -> PlanError:
    """The error of a plan that cannot fit: each table's need under its best placement
    (the least it can take on one device) and the budget."""
    needs = []
    for name in sorted(groups):
        g = groups[name]
        options = (
            [g.pinned] if g.pinned else [p for p in PLACEMENTS if not g.invalid(p, mesh_shape)]
        )
        best = min(options, key=lambda p: (g.memory(p, mesh_shape), p))
        needs.append((g.memory(best, mesh_shape), name, best))
    total = sum(n for n, _, _ in needs)
    items = ", ".join(f"{name} {format_bytes(b)} ({p})" for b, name, p in needs)
    return PlanError(
        f"the tables do not fit: {format_bytes(budget)} available per device "
        f"({format_bytes(device_memory)} less {reserve:.0%} reserve, "
        f"{axis_size(mesh_shape, AXES)} devices); each table's need per device under its "
        f"best placement: {items} (together {format_bytes(total)})"
    )
