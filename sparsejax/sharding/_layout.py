"""How the sharded store lays tables out: pieces (a table, or a column piece of one) in
stacks (one state array of `shards` blocks of `rows_per_shard` rows), and groups (one
lookup call per stack and pooling kind)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..embedding import FeatureSpec, TableSpec, stack_name
from . import _placement as pl


@dataclasses.dataclass(frozen=True)
class Piece:
    """One table, or one column piece of a column-wise table, inside a stack."""

    table: TableSpec  # the piece's own spec (a column piece: dim / M)
    source: str  # the user's table
    column: int | None  # index of a column piece
    shard: int  # table-wise: the shard holding it
    offset: int  # first local row on its shard(s)
    stride: int  # 1: whole on `shard`; S: row i on shard i % S, local row offset + i // S

    @property
    def local_rows(self) -> int:
        return -(-self.table.vocab_size // self.stride)

    def route(self, ids, shards: int):
        """Owner shard and local row of the piece's (valid) ids: jnp on the device
        (int32), or numpy on the host (int64 ids of any size in, int32 local rows out)."""
        xp = np if isinstance(ids, np.ndarray) else jnp
        if self.stride == 1:
            return xp.full_like(ids, self.shard), self.offset + ids
        return ids % shards, self.offset + ids // shards


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


def _build_pieces(tables, mesh_shape) -> list[tuple[str, Piece]]:
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
        t = t.device_view()  # a tiered table: its device cache (the host side fills it)
        out.append((p, Piece(t, t.name, None, 0, 0, 1)))
    return out


def build_stacks(tables, mesh_shape) -> dict[str, ShardedStack]:
    by_key: dict[tuple, list[Piece]] = {}
    for kind, piece in _build_pieces(tables, mesh_shape):
        t = piece.table
        by_key.setdefault((kind, stack_name(t.dim, t.dtype, t.optimizer)), []).append(piece)
    stacks = {}
    for (kind, base), pieces in sorted(by_key.items()):
        shards = pl.num_shards(kind, mesh_shape)
        whole = [p for p in pieces if p.column is None]
        shard_of = (
            pl.assign_table_wise(
                {p.source: p.table.vocab_size * pl.row_bytes(p.table) for p in whole}, shards
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
            raise ValueError(
                f"stack {kind}_{base}: {rows} rows on one device exceed the int32 row ids "
                f"of the kernels; shard its tables over more devices"
            )
        first = placed[0].table
        name = f"{kind}_{base}"
        stacks[name] = ShardedStack(
            name, kind, tuple(placed), first.dim, first.dtype, first.optimizer, shards, max(rows, 1)
        )
    return stacks
