"""Memory-saving tables: one logical table stored as a few smaller ones.

A `TableSpec` with `compose=Composition(...)` keeps its features' ids in `[0, vocab_size)`
and its `[B, D]` outputs, but stores `parts` smaller tables, each indexed by its own
function of the id, whose rows are combined per id:

- `"qr"`, quotient-remainder (Shi et al., "Compositional Embeddings Using Complementary
  Partitions", KDD 2020): row(id) = Q[id // m] (op) R[id % m], `ceil(V / m) + m` rows
  instead of V and no two ids share both parts.
- `"multihash"` (DeepRec's multi-hash variable): row(id) = H_1[h_1(id)] (op) ...
  (op) H_k[h_k(id)], k tables of `rows` rows, with independent hashes: two ids collide
  in all k tables rarely. `hashes: 1` is the plain hashing trick. Id 0, the row the id
  mappings give a missing (empty) or rare value, keeps row 0 of every part to itself
  (as `HashMapping` does); the other ids hash into rows 1..rows-1.

`op` is "mul" (elementwise; the paper's best), "add", or "concat" (each part `D / k`
wide). The layer (`EmbeddingBagCollection`) expands such a table into plain tables
(`expand`), so stores, sharding, optimizers, checkpoints and export see ordinary tables
named `<table>.q` / `<table>.r` or `<table>.h<i>`; ids map with `part_ids` and outputs
combine with `combine`. Pooling is per part, so "add" and "concat" are exact for any
combiner (not "add" with "max"); "mul" needs the product per id: one-hot features and
sequences, where it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Literal

import jax.numpy as jnp
import numpy as np

from .._hashing import mix32
from ..ops import check_lookups

KINDS = ("qr", "multihash")
OPS = ("mul", "add", "concat")
_SEEDS = (0x9E3779B9, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C, 0xFD7046C5)
"""Seeds of the multi-hash functions (at most this many hashes)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Composition:
    """How a table is stored as smaller ones (module docstring)."""

    kind: Literal["qr", "multihash"]
    rows: int | None = None
    """qr: remainder rows m (None: the largest m within `fraction`, else ceil(sqrt(V)),
    the fewest rows); multihash: rows of each hashed table (None: `fraction` of V split
    over the hashes)."""
    fraction: float | None = None
    """Memory budget as a fraction of the full table's values, used when `rows` is None.
    qr: the most rows within it, or the fewest (about 2 sqrt(V)) where a small table
    cannot meet it; multihash: needed without `rows`."""
    hashes: int = 2
    """multihash: number of hashed tables."""
    op: Literal["mul", "add", "concat"] = "mul"
    """How the parts' rows combine."""

    def __post_init__(self):
        owner = "Composition"
        if self.kind not in KINDS:
            raise ValueError(f"{owner}: `kind` must be one of {KINDS}, got {self.kind!r}")
        if self.op not in OPS:
            raise ValueError(f"{owner}: `op` must be one of {OPS}, got {self.op!r}")
        if self.rows is not None and (not isinstance(self.rows, int) or self.rows < 1):
            raise ValueError(f"{owner}: `rows` must be an int >= 1, got {self.rows!r}")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"{owner}: `fraction` must be in (0, 1], got {self.fraction!r}")
        if not 1 <= self.hashes <= len(_SEEDS):
            raise ValueError(f"{owner}: `hashes` must be in [1, {len(_SEEDS)}], got {self.hashes}")
        if self.kind == "multihash" and self.rows is None and self.fraction is None:
            raise ValueError(f"{owner}: a multihash table needs `rows` or `fraction`")

    @property
    def num_parts(self) -> int:
        return 2 if self.kind == "qr" else self.hashes

    def part_dim(self, dim: int) -> int:
        """Row width of each part of a table of width `dim`."""
        return dim // self.num_parts if self.op == "concat" else dim

    def part_rows(self, vocab: int, dim: int, table: str = "table") -> list[int]:
        """Rows of each part for a `[vocab, dim]` table. Raises ValueError naming the
        table and the sizes when the parts would take more memory than the full table."""
        k, part_dim = self.num_parts, self.part_dim(dim)
        budget = None if self.fraction is None else self.fraction * vocab * dim
        if self.kind == "qr":
            m = self.rows
            if m is None and budget is not None:  # largest m: ceil(V/m) + m within budget
                m = _largest_qr_rows(vocab, budget / part_dim)
            if m is None:
                m = math.isqrt(vocab - 1) + 1 if vocab > 1 else 1
            rows = [-(-vocab // m), m]
        else:
            per = self.rows if self.rows is not None else int(budget / part_dim / k)
            rows = [max(1, per)] * k
        used, full = sum(rows) * part_dim, vocab * dim
        if used > full:
            raise ValueError(
                f"table {table!r}: its {self.kind} parts would take {rows} rows x {part_dim} = "
                f"{used:,} values, more than the full table's {vocab:,} x {dim} = {full:,}; "
                f"use fewer rows or store the table whole"
            )
        return rows


def _largest_qr_rows(vocab: int, budget_rows: float) -> int | None:
    """The largest m with ceil(V / m) + m <= budget_rows (None if none)."""
    best = None
    # ceil(V/m) + m is convex in m with its minimum near sqrt(V): search m >= sqrt(V).
    lo = max(1, math.isqrt(vocab))
    if -(-vocab // lo) + lo > budget_rows:
        return None
    hi = vocab
    while lo <= hi:
        mid = (lo + hi) // 2
        if -(-vocab // mid) + mid <= budget_rows:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def part_names(table: str, composition: Composition) -> list[str]:
    if composition.kind == "qr":
        return [f"{table}.q", f"{table}.r"]
    return [f"{table}.h{i}" for i in range(composition.hashes)]


def fmix32(x, seed: int):
    """A 32-bit integer hash (murmur3's finalizer of x + seed); numpy or jnp uint32 in."""
    xp = np if isinstance(x, np.ndarray) else jnp
    return mix32(x + xp.uint32(seed))


def part_ids(composition: Composition, ids, vocab: int, rows: Sequence[int]) -> list:
    """Each part's row ids of logical `ids` (numpy or jnp): padding (< 0) stays -1, and
    an id >= vocab becomes the part's row count, out of range for the lookup as the
    id was for the full table (an error where the lookup checks, else padding)."""
    xp = np if isinstance(ids, np.ndarray) else jnp
    valid = (ids >= 0) & (ids < vocab)
    safe = xp.where(valid, ids, 0)
    if composition.kind == "qr":
        m = rows[1]
        parts = [safe // m, safe % m]
    else:  # id 0 (the mappings' missing / rare row) keeps row 0 of every part
        u = safe.astype(xp.uint32)
        parts = []
        for seed, r in zip(_SEEDS, rows, strict=False):
            hashed = 1 + fmix32(u, seed) % xp.uint32(max(r - 1, 1))
            parts.append(xp.where((safe == 0) | (r == 1), 0, hashed).astype(ids.dtype))
    return [
        xp.where(valid, p, xp.where(ids < 0, -1, r)).astype(ids.dtype)
        for p, r in zip(parts, rows, strict=True)
    ]


def combine(composition: Composition, parts: Sequence):
    """The logical output from the parts' outputs (same shapes but the last axis)."""
    if composition.op == "concat":
        return jnp.concatenate(parts, axis=-1)
    out = parts[0]
    for p in parts[1:]:
        out = out * p if composition.op == "mul" else out + p
    return out


@dataclasses.dataclass(frozen=True)
class Expansion:
    """The plain tables and features standing for composed ones (`expand`)."""

    tables: tuple
    features: tuple
    composed: Mapping[str, tuple]
    """{logical feature: (Composition, table, vocab, part rows, part feature names)}."""
    logical: tuple
    """The logical features' names, in order."""

    def split_features(self, features: Mapping) -> dict:
        """The store's input: each composed feature's ids as its parts' ids."""
        if not self.composed:
            return dict(features)
        out = {k: v for k, v in features.items() if k not in self.composed}
        for name, (comp, table, vocab, rows, parts) in self.composed.items():
            if name not in features:
                continue
            f = features[name]
            # the logical id range, so an error names the feature's id, not a part's row
            check_lookups(f"EmbeddingBagCollection of feature {name!r}", table, vocab, 0, f.ids)
            for part, ids in zip(parts, part_ids(comp, f.ids, vocab, rows), strict=True):
                out[part] = dataclasses.replace(f, ids=ids)
        return out

    def combine_outputs(self, outputs: Mapping) -> dict:
        """The layer's output: each composed feature's parts combined, in feature order."""
        if not self.composed:
            return dict(outputs)
        out = {}
        for name in self.logical:
            if name in self.composed:
                comp, *_, parts = self.composed[name]
                out[name] = combine(comp, [outputs[p] for p in parts])
            else:
                out[name] = outputs[name]
        return out


def expand(tables: Sequence, features: Sequence) -> Expansion:
    """Plain `TableSpec`s and `FeatureSpec`s for `tables` whose `compose` is set (others
    pass through). Raises ValueError naming the table or feature for what cannot be
    composed: "concat" with D not divisible by the parts, "add" with max pooling, "mul"
    with a multi-id bag, parts larger than the table."""
    composed_tables = {t.name: t for t in tables if getattr(t, "compose", None) is not None}
    logical = tuple(f.name for f in features)
    if not composed_tables:
        return Expansion(tuple(tables), tuple(features), {}, logical)
    out_tables, part_rows = [], {}
    for t in tables:
        comp = getattr(t, "compose", None)
        if comp is None:
            out_tables.append(t)
            continue
        k = comp.num_parts  # (TableSpec refuses compose on a tiered table)
        if comp.op == "concat" and t.dim % k:
            raise ValueError(
                f"table {t.name!r}: compose op 'concat' splits dim {t.dim} over {k} parts; "
                f"use a dim divisible by {k}"
            )
        rows = comp.part_rows(t.vocab_size, t.dim, t.name)
        part_rows[t.name] = rows
        for name, r in zip(part_names(t.name, comp), rows, strict=True):
            out_tables.append(
                dataclasses.replace(
                    t, name=name, vocab_size=r, dim=comp.part_dim(t.dim), compose=None
                )
            )
    out_features, composed = [], {}
    for f in features:
        t = composed_tables.get(f.table)
        if t is None:
            out_features.append(f)
            continue
        comp = t.compose
        if comp.op == "mul" and f.combiner is not None and (f.max_ids > 1 or f.weighted):
            what = "weighted ids" if f.weighted else f"a bag of {f.max_ids} ids"
            raise ValueError(
                f"feature {f.name!r}: compose op 'mul' of table {t.name!r} multiplies rows "
                f"per id, which pooling {what} does not keep; use op 'add' or 'concat'"
            )
        if comp.op == "add" and f.combiner == "max":
            raise ValueError(
                f"feature {f.name!r}: compose op 'add' of table {t.name!r} does not commute "
                f"with max pooling; use op 'concat'"
            )
        parts = []
        for tname in part_names(t.name, comp):
            sub = f"{f.name}@{tname}"
            parts.append(sub)
            out_features.append(dataclasses.replace(f, name=sub, table=tname))
        composed[f.name] = (comp, t.name, t.vocab_size, part_rows[t.name], tuple(parts))
    return Expansion(tuple(out_tables), tuple(out_features), composed, logical)


def stored_values(table, composition: Composition | None = None) -> int:
    """Values (rows x dim) the table stores: its parts' for a composed table (or as
    `composition` would store it; ValueError where its parts would not fit)."""
    comp = composition or getattr(table, "compose", None)
    if comp is None:
        return table.device_rows * table.dim
    return sum(comp.part_rows(table.vocab_size, table.dim, table.name)) * comp.part_dim(table.dim)
