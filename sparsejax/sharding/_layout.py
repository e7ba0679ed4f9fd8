"""How the sharded store lays tables out: pieces (a table, or a column piece of one) in
stacks (one state array of `shards` blocks of `rows_per_shard` rows), and groups (one
lookup call per stack and pooling kind).

A row-split table of `V` rows over `S` shards is cut into contiguous blocks of
`B = ceil(V / S)` rows (TorchRec's row-wise layout): shard `s` holds the table's rows
`[s * B, (s + 1) * B)` at local rows `offset .. offset + B`, so each device's rows of a
table are one block of the table's logical `[B * S, dim]` layout (what a checkpoint
writes as that device's shard). `Piece.route` is the one place that maps ids to
(owner shard, local row)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..embedding import ALONE_BYTES, FeatureSpec, TableSpec, row_bytes, stack_name
from . import _placement as pl


@dataclasses.dataclass(frozen=True)
class Piece:
    """One table, or one column piece of a column-wise table, inside a stack."""

    table: TableSpec  # the piece's own spec (a column piece: dim / M)
    source: str  # the user's table
    column: int | None  # index of a column piece
    shard: int  # table-wise: the shard holding it
    offset: int  # first local row on its shard(s)
    stride: int  # 1: whole on `shard`; S: split over S shards in blocks of `local_rows`

    @property
    def local_rows(self) -> int:
        """Rows the piece takes on each shard holding it (`B = ceil(V / S)` when split)."""
        return -(-self.table.vocab_size // self.stride)

    @property
    def padded_rows(self) -> int:
        """Rows of the piece's logical layout: `local_rows * stride` (>= vocab_size)."""
        return self.local_rows * self.stride

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """`[lo, hi)`: the table rows (not padding) that shard `shard` holds, at local rows
        `offset .. offset + hi - lo` (empty for a shard that holds none)."""
        if self.stride == 1:
            return (0, self.table.vocab_size) if shard == self.shard else (0, 0)
        lo = min(shard * self.local_rows, self.table.vocab_size)
        return lo, min(lo + self.local_rows, self.table.vocab_size)

    def route(self, ids, shards: int):
        """Owner shard and local row of the piece's (valid) ids: jnp on the device
        (int32), or numpy on the host (int64 ids of any size in, int64 local rows out:
        below 2**31 on every shard). A split piece's row `i` is on shard `i // B` at
        local row `offset + i % B` (`B = local_rows`)."""
        xp = np if isinstance(ids, np.ndarray) else jnp
        if self.stride == 1:
            return xp.full_like(ids, self.shard), self.offset + ids
        del shards  # the piece's own split (`stride`) is the stack's shards
        b = self.local_rows
        owner = ids // b
        return owner, self.offset + (ids - owner * b)


@dataclasses.dataclass(frozen=True)
class ShardedStack:
    """Tables of one placement, dim, dtype and optimizer: one state array of `shards`
    blocks of `rows_per_shard` rows, block `s` on the devices of shard `s`."""

    name: str
    placement: str
    pieces: tuple[Piece, ...]
    dim: int
    dtype: str
    optimizer: object
    shards: int
    rows_per_shard: int

    @property
    def axes(self) -> tuple[str, ...]:
        return pl.shard_axes(self.placement)

    @property
    def replicas(self) -> tuple[str, ...]:
        return pl.replica_axes(self.placement)

    def spec(self, ndim: int) -> P:
        """The `PartitionSpec` of a state leaf of rank `ndim` (rows split over `axes`)."""
        axes = self.axes
        first = None if not axes else axes[0] if len(axes) == 1 else axes
        return P(first, *([None] * (ndim - 1)))


@dataclasses.dataclass(frozen=True)
class Entry:
    """One feature reading one piece: a slice of its group's bags."""

    feature: FeatureSpec
    piece: Piece


@dataclasses.dataclass(frozen=True)
class ShardedGroup:
    """One lookup call: the entries of one stack pooled the same way ("sum" carries
    sum/mean/sqrtn and sequences through per-id coefficients; "max" is its own)."""

    name: str
    stack: str
    entries: tuple[Entry, ...]
    combiner: str

    @property
    def needs_coefficients(self) -> bool:
        return any(
            e.feature.weighted or e.feature.combiner in ("mean", "sqrtn") for e in self.entries
        )


def _build_pieces(tables, mesh_shape, view_rows) -> list[tuple[str, Piece]]:
    """`(stack kind, piece)` of every table; offsets are filled in by `_stacks`."""
    out = []
    model = int(mesh_shape.get("model", 1))
    for t in tables:
        p = "replicated" if t.placement == "device" else t.placement
        if t.is_tiered and p == "column_wise":
            raise ValueError(
                f"table {t.name!r}: a dynamic or host-cached table cannot be column_wise "
                f"(its host side moves whole rows)"
            )
        if p == "column_wise":
            if t.dim % model:
                raise ValueError(
                    f"table {t.name!r}: column_wise placement splits dim {t.dim} over the "
                    f"{model} devices of the 'model' axis; it must divide by {model}"
                )
            if any(s.per_row for s in t.optimizer.slots()):
                raise ValueError(
                    f"table {t.name!r}: column_wise placement splits each row over devices, "
                    f"but {type(t.optimizer).__name__} keeps one value per whole row; use "
                    f"Adagrad, Adam, FTRL or SGD, or a row placement"
                )
            width = t.dim // model
            for k in range(model):
                piece_spec = dataclasses.replace(t, dim=width, placement="table_wise")
                out.append(("table_wise", Piece(piece_spec, t.name, k, k, 0, 1)))
            continue
        # a tiered table: its device cache (the host side fills it)
        t = t.device_view(view_rows.get(t.name))
        out.append((p, Piece(t, t.name, None, 0, 0, 1)))
    return out


def _alone(kind: str, piece: Piece, shards: int) -> bool:
    """Whether `piece` gets a stack of its own (`embedding.ALONE_BYTES` or more on one
    device; see `embedding._stacking`): a table split over every shard or on every
    one, or a column piece; a whole table-wise table stays stacked, since a table-wise
    stack is as tall on every shard as on its fullest one."""
    if kind == "table_wise" and piece.column is None:
        return False
    rows = piece.table.vocab_size
    if kind in ("row_wise", "table_row_wise"):
        rows = -(-rows // shards)
    return rows * row_bytes(piece.table) >= ALONE_BYTES


def build_stacks(tables, mesh_shape, view_rows=None) -> dict[str, ShardedStack]:
    """The stacks of `tables` on a mesh of `mesh_shape`, by name: one per placement kind
    and (dim, dtype, optimizer), and one per large table (`_alone`). `view_rows`: the
    device rows of tiered tables whose keys several processes own (`OwnerLayout`)."""
    by_key: dict[tuple, list[Piece]] = {}
    for kind, piece in _build_pieces(tables, mesh_shape, view_rows or {}):
        t = piece.table
        base = stack_name(t.dim, t.dtype, t.optimizer)
        if _alone(kind, piece, pl.num_shards(kind, mesh_shape)):
            base = f"{base}_{piece.source}"
        by_key.setdefault((kind, base), []).append(piece)
    stacks = {}
    for (kind, base), pieces in sorted(by_key.items()):
        shards = pl.num_shards(kind, mesh_shape)
        whole = [p for p in pieces if p.column is None]
        shard_of = (
            pl.assign_table_wise(
                {p.source: p.table.vocab_size * row_bytes(p.table) for p in whole}, shards
            )
            if kind == "table_wise"
            else {}
        )
        load = [0] * shards
        placed = []
        for p in sorted(pieces, key=lambda p: (p.source, p.column or 0)):
            if kind == "table_wise":
                s = p.shard if p.column is not None else shard_of[p.source]
                placed.append(dataclasses.replace(p, shard=s, offset=load[s], stride=1))
                load[s] += p.table.vocab_size
            else:
                stride = 1 if kind == "replicated" else shards
                p = dataclasses.replace(p, shard=0, offset=load[0], stride=stride)
                placed.append(p)
                load[0] += p.local_rows
        rows = max(load)
        if rows >= 2**31:
            raise ValueError(_too_many_rows(kind, base, placed, shards, rows))
        first = placed[0].table
        name = f"{kind}_{base}"
        stacks[name] = ShardedStack(
            name, kind, tuple(placed), first.dim, first.dtype, first.optimizer, shards, max(rows, 1)
        )
    return stacks


def _too_many_rows(kind: str, base: str, pieces, shards: int, rows: int) -> str:
    """One line: which table (or stack) overflows a shard's int32 rows, and how many
    devices (shards) it needs."""
    limit = 2**31 - 1
    big = max(pieces, key=lambda p: p.local_rows)
    if kind in ("row_wise", "table_row_wise"):
        total = sum(p.table.vocab_size for p in pieces)
        need = -(-total // limit)
        while sum(-(-p.table.vocab_size // need) for p in pieces) > limit:
            need += 1
        axis = "devices" if kind == "row_wise" else "devices on the 'model' axis"
        what = (
            f"table {big.source!r}"
            if len(pieces) == 1
            else f"stack {kind}_{base} (tables {sorted(p.source for p in pieces)})"
        )
        return (
            f"{what}: {rows} rows on each of {shards} shards exceed the {limit} int32 rows "
            f"of one device; {kind} needs at least {need} {axis}"
        )
    if big.local_rows > limit:
        return (
            f"table {big.source!r}: {big.local_rows} rows on one device exceed the {limit} "
            f"int32 rows of one device; place it row_wise over at least "
            f"{-(-big.local_rows // limit)} devices"
        )
    return (
        f"stack {kind}_{base}: {rows} rows on one device (tables "
        f"{sorted(p.source for p in pieces)}) exceed the {limit} int32 rows of one device; "
        f"place them over at least {-(-rows // limit)} devices (e.g. row_wise)"
    )
