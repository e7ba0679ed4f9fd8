"""Table stacking: which tables share one array, a pure function of the specs.

Tables with the same dim, storage dtype and optimizer (hyperparameters included) can be
stored as one array with a row offset per table, so a batch costs one kernel call per
stack instead of one per table (FBGEMM's table-batched embedding). A stack's name is
derived from that key alone (`d64_float32_rowwiseadagrad_1a2b3c`), never from the
declaration order, so adding or removing a table leaves every other stack's name (and
so its Flax variable) unchanged. Within a stack, tables are ordered by name.

A stack never holds more than `MAX_STACK_ROWS` rows: the kernels address rows with
int32 ids, so tables that would overflow it are split into further stacks of the same
key (named with a `_1`, `_2`, ... suffix).

A table of `ALONE_BYTES` or more (weights and slots on one device) is a stack of its own
(`{key}_{table}`): stacking saves kernel calls for small tables, and a large table gains
nothing from it but its stack array is then the table itself, which a checkpoint or an
export writes as it is instead of copying its rows out of the stack.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

from ..ops.optimizers import SparseOptimizer
from ._spec import TableSpec

MAX_STACK_ROWS = 2**31 - 1
"""Rows of one stack at most: its stacked ids (`table id + row offset`) stay int32."""

ALONE_BYTES = 256 << 20
"""Bytes on one device from which a table is a stack of its own (weights and slots)."""


def row_bytes(spec: TableSpec, dim: int | None = None) -> int:
    """Bytes one row of `spec` takes on a device: weights in their dtype plus every
    optimizer slot (f32: one per row or one per column; `dim` of a column piece)."""
    dim = spec.dim if dim is None else dim
    weight = 2 if spec.dtype == "bfloat16" else 4
    slots = sum(1 if s.per_row else dim for s in spec.optimizer.slots())
    return dim * weight + 4 * slots


@dataclasses.dataclass(frozen=True)
class Stack:
    """Tables stored as one array: same dim, dtype and optimizer."""

    name: str
    tables: tuple[TableSpec, ...]
    offsets: tuple[int, ...]
    """First row of each table in the stack."""
    dim: int
    dtype: str
    optimizer: SparseOptimizer

    @property
    def rows(self) -> int:
        return self.offsets[-1] + self.tables[-1].vocab_size

    def offset_of(self, table: str) -> int:
        """First row of `table` in the stack."""
        for t, off in zip(self.tables, self.offsets, strict=True):
            if t.name == table:
                return off
        raise KeyError(f"table {table!r} is not in stack {self.name!r}")


def stack_name(dim: int, dtype: str, optimizer: SparseOptimizer) -> str:
    """`d{dim}_{dtype}_{optimizer}_{hash of its hyperparameters}`: stable across runs and
    declaration orders (the hash is of the optimizer's repr, its class and fields)."""
    digest = hashlib.sha256(repr(optimizer).encode()).hexdigest()[:6]
    return f"d{dim}_{dtype}_{type(optimizer).__name__.lower()}_{digest}"


def plan_stacks(
    tables: Sequence[TableSpec],
    *,
    max_rows: int = MAX_STACK_ROWS,
    alone_bytes: int | None = None,
) -> dict[str, Stack]:
    """Stacks of `tables`, by name: one per (dim, dtype, optimizer), split so that none
    has more than `max_rows` rows, and one per table of `alone_bytes` (`ALONE_BYTES`)
    or more. The result depends on the set of specs only."""
    alone_bytes = ALONE_BYTES if alone_bytes is None else alone_bytes
    by_key: dict[str, list[TableSpec]] = {}
    for t in sorted(tables, key=lambda t: t.name):
        key = stack_name(t.dim, t.dtype, t.optimizer)
        if t.vocab_size * row_bytes(t) >= alone_bytes:
            key = f"{key}_{t.name}"
        by_key.setdefault(key, []).append(t)
    stacks = {}
    for base in sorted(by_key):
        parts: list[list[TableSpec]] = [[]]
        rows = 0
        for t in by_key[base]:
            if t.vocab_size > max_rows:
                raise ValueError(
                    f"table {t.name!r}: vocab_size {t.vocab_size} exceeds the "
                    f"{max_rows} rows of one stack (int32 row ids); place it row_wise "
                    f"(sparsejax.sharding) so each device holds a shard of it"
                )
            if parts[-1] and rows + t.vocab_size > max_rows:
                parts.append([])
                rows = 0
            parts[-1].append(t)
            rows += t.vocab_size
        for i, members in enumerate(parts):
            name = base if i == 0 else f"{base}_{i}"
            offsets = [0]
            for t in members[:-1]:
                offsets.append(offsets[-1] + t.vocab_size)
            first = members[0]
            stacks[name] = Stack(
                name, tuple(members), tuple(offsets), first.dim, first.dtype, first.optimizer
            )
    return stacks
