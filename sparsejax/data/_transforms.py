"""Column transforms over raw-id `Examples`: multi-hot bags from 0/1 indicator columns,
joins with side tables keyed by a column, `max_ids` caps (a history keeps its last N
ids), and dropping dense columns.

Each transform is a function of the rows it is given, so it runs the same on a whole
split or on each chunk a streaming reader yields (`ColumnTransform` composes them into
one callable with a running `TransformReport`). They work on raw ids, before the id
mapping: a side table's key is compared with the data's key column by raw id (the hash
of a string, or the integer with `int_ids`), so both must be read alike.

`Examples` carry their dense features as one unnamed matrix; the transforms take the
names of its columns (`dense_names`, in order) and return the names after them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from ._batch import JaggedIds
from ._csv import MISSING
from ._loader import Examples


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _replace(ex: Examples, *, dense=None, sparse=None) -> Examples:
    return Examples(
        labels=ex.labels,
        dense=ex.dense if dense is None else dense,
        sparse=ex.sparse if sparse is None else sparse,
    )


def _dense_index(dense_names: Sequence[str], columns: Sequence[str], what: str) -> list[int]:
    names = list(dense_names)
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"{what}: columns {missing} are not among the dense columns {names}")
    return [names.index(c) for c in columns]


# ---------------------------------------------------------------------------------------
# The transforms, one function each


def indicator_bag(
    ex: Examples, dense_names: Sequence[str], name: str, columns: Sequence[str]
) -> tuple[Examples, tuple[str, ...]]:
    """Replace the dense 0/1 `columns` by one multi-hot feature `name` holding, per row,
    the positions (0-based, in `columns` order) of its nonzero columns: MovieLens's 19
    genre columns become one `genres` bag. Returns the examples and the remaining dense
    names."""
    if name in ex.sparse:
        raise ValueError(f"indicator bag {name!r}: a sparse feature of that name exists")
    idx = _dense_index(dense_names, columns, f"indicator bag {name!r}")
    present = ex.dense[:, idx] != 0
    rows, cols = np.nonzero(present)  # row-major: each row's positions in order
    bag = JaggedIds(
        lengths=np.bincount(rows, minlength=len(ex)).astype(np.int32),
        values=cols.astype(np.int64),
    )
    keep = [i for i in range(len(dense_names)) if i not in set(idx)]
    out = _replace(ex, dense=ex.dense[:, keep], sparse={**ex.sparse, name: bag})
    return out, tuple(dense_names[i] for i in keep)


def drop_dense(
    ex: Examples, dense_names: Sequence[str], columns: Sequence[str]
) -> tuple[Examples, tuple[str, ...]]:
    """Remove the dense `columns` (e.g. a time column read only to split by)."""
    drop = set(_dense_index(dense_names, columns, "drop_dense"))
    keep = [i for i in range(len(dense_names)) if i not in drop]
    return _replace(ex, dense=ex.dense[:, keep]), tuple(dense_names[i] for i in keep)


def cap_ids(ex: Examples, max_ids: Mapping[str, int]) -> tuple[Examples, dict[str, tuple]]:
    """Keep the last `max_ids[name]` ids of each example of the named features (a
    history is oldest first, so its most recent ids stay). Returns the examples and,
    per capped feature, `(rows cut, ids dropped)`."""
    sparse, cut = dict(ex.sparse), {}
    for name, cap in max_ids.items():
        if name not in sparse:
            raise ValueError(f"cap_ids: no sparse feature {name!r} (have {list(sparse)})")
        col = sparse[name]
        lengths = np.asarray(col.lengths, np.int64)
        over = lengths > cap
        if not over.any():
            continue
        off = _offsets(lengths)
        example = np.repeat(np.arange(lengths.shape[0]), lengths)
        keep = np.arange(off[-1]) >= off[1:][example] - cap
        sparse[name] = JaggedIds(
            lengths=np.minimum(lengths, cap).astype(col.lengths.dtype),
            values=np.asarray(col.values)[keep],
            weights=None if col.weights is None else np.asarray(col.weights)[keep],
        )
        cut[name] = (int(over.sum()), int((lengths - cap)[over].sum()))
    return _replace(ex, sparse=sparse), cut


class JoinKeyError(ValueError):
    """A row's key is missing from a side table joined with `on_missing="error"`."""

    def __init__(self, message: str, *, source: str, key: str, raw_key: int, row: int):
        super().__init__(message)
        self.source, self.key, self.raw_key, self.row = source, key, raw_key, row


@dataclasses.dataclass(frozen=True, eq=False)
class SideTable:
    """A side table indexed by its key column's raw ids (one row per key), with one extra
    default row (missing ids, empty bags, dense 0) attached to keys it lacks.

    Build it with `SideTable.build` from the examples a reader made of the side file.
    """

    key: str
    """Key column (a one-id sparse feature of both the side table and the data)."""
    keys: np.ndarray
    """Sorted raw key values, int64[n]."""
    rows: Examples
    """n + 1 rows: row i holds keys[i]'s features, row n the default row."""
    dense_names: tuple[str, ...]
    """Names of `rows.dense`' columns."""
    source: str = "side table"
    """The file(s), for messages."""

    @classmethod
    def build(
        cls,
        ex: Examples,
        dense_names: Sequence[str],
        key: str,
        *,
        columns: Sequence[str] | None = None,
        source: str = "side table",
        dense_missing: float = 0.0,
    ) -> SideTable:
        """Index `ex` (the side file's rows) by its one-id feature `key`, keeping the
        sparse and dense `columns` (default: all but the key). Rows with an empty key are
        dropped; a key on two rows is an error naming it."""
        if key not in ex.sparse:
            raise ValueError(f"{source}: key column {key!r} is not a sparse column")
        kcol = ex.sparse[key]
        if np.any(np.asarray(kcol.lengths) != 1):
            raise ValueError(f"{source}: key column {key!r} must hold one id per row")
        raw = np.asarray(kcol.values, np.int64)
        names = set(ex.sparse) | set(dense_names)
        if columns is None:
            columns = [c for c in (*ex.sparse, *dense_names) if c != key]
        unknown = [c for c in columns if c not in names]
        if unknown:
            raise ValueError(f"{source}: columns {unknown} are not read (have {sorted(names)})")
        order = np.argsort(raw, kind="stable")
        order = order[raw[order] >= 0]  # rows with no key can never match
        keys = raw[order]
        dup = np.flatnonzero(keys[1:] == keys[:-1])
        if dup.size:
            raise ValueError(
                f"{source}: key {key} = {int(keys[dup[0]])} is on more than one row "
                f"(a side table holds one row per key)"
            )
        sparse_cols = [c for c in columns if c in ex.sparse]
        dense_cols = [c for c in columns if c not in ex.sparse]
        didx = [list(dense_names).index(c) for c in dense_cols]
        taken, _, dense = ex.take(order)
        sparse = {}
        for c in sparse_cols:
            col = taken[c]
            one_id = bool(np.all(np.asarray(ex.sparse[c].lengths) == 1))
            # default row: a missing id for a one-id column, an empty bag otherwise
            sparse[c] = JaggedIds(
                lengths=np.append(col.lengths, 1 if one_id else 0),
                values=np.append(col.values, [MISSING] if one_id else []).astype(np.int64),
                weights=None
                if col.weights is None
                else np.append(col.weights, [1.0] if one_id else []).astype(np.float32),
            )
        n = keys.shape[0]
        dense_rows = np.concatenate(
            [dense[:, didx], np.full((1, len(didx)), dense_missing, np.float32)]
        )
        rows = Examples(labels=np.zeros(n + 1, np.float32), dense=dense_rows, sparse=sparse)
        return cls(key=key, keys=keys, rows=rows, dense_names=tuple(dense_cols), source=source)

    def lookup(self, raw_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row of each key in `rows`, the default row n where absent; found mask)."""
        raw_keys = np.asarray(raw_keys, np.int64)
        n = self.keys.shape[0]
        i = np.searchsorted(self.keys, raw_keys)
        found = (raw_keys >= 0) & (i < n) & (self.keys[np.minimum(i, max(n - 1, 0))] == raw_keys)
        if n == 0:
            found = np.zeros(raw_keys.shape, bool)
        return np.where(found, i, n), found


def join(
    ex: Examples,
    dense_names: Sequence[str],
    side: SideTable,
    *,
    on_missing: str = "default",
) -> tuple[Examples, tuple[str, ...], int]:
    """Attach `side`'s columns to each row by its `side.key` value. A key the side table
    lacks (or an empty key) gets the default row (missing ids, empty bags, dense 0), or
    with `on_missing="error"` raises `JoinKeyError` naming the source, key and value.
    Returns the examples, the dense names after (side dense columns appended) and the
    number of rows that got the default row."""
    if on_missing not in ("default", "error"):
        raise ValueError(f"on_missing must be 'default' or 'error', got {on_missing!r}")
    if side.key not in ex.sparse:
        raise ValueError(f"join with {side.source}: the data has no key column {side.key!r}")
    kcol = ex.sparse[side.key]
    if np.any(np.asarray(kcol.lengths) != 1):
        raise ValueError(f"join with {side.source}: key column {side.key!r} must hold one id")
    clash = (set(side.rows.sparse) & set(ex.sparse)) | (set(side.dense_names) & set(dense_names))
    if clash:
        raise ValueError(
            f"join with {side.source}: columns {sorted(clash)} are already in the data"
        )
    raw = np.asarray(kcol.values, np.int64)
    rows, found = side.lookup(raw)
    missing = int((~found).sum())
    if missing and on_missing == "error":
        r = int(np.flatnonzero(~found)[0])
        raise JoinKeyError(
            f"{side.source} has no row with {side.key} = {int(raw[r])} "
            f"({missing} rows of the data lack theirs)",
            source=side.source,
            key=side.key,
            raw_key=int(raw[r]),
            row=r,
        )
    sparse, _, dense = side.rows.take(rows)
    out = Examples(
        labels=ex.labels,
        dense=np.concatenate([ex.dense, dense], axis=1),
        sparse={**ex.sparse, **sparse},
    )
    return out, (*dense_names, *side.dense_names), missing


# ---------------------------------------------------------------------------------------
# Composition


@dataclasses.dataclass
class TransformReport:
    """What the transforms changed: rows that got a side table's default row, per join,
    and rows cut to `max_ids`, per feature. `str(report)` is one line."""

    rows: int = 0
    """Rows transformed."""
    missing_keys: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per join (its label): rows whose key the side table lacks (default row)."""
    truncated: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Per capped feature: [rows cut, ids dropped]."""
    caps: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per capped feature: its `max_ids`."""

    def summary(self) -> str:
        parts = []
        for label, n in self.missing_keys.items():
            if n:
                parts.append(f"{label}: {n:,} of {self.rows:,} rows lack a key (default row)")
        for name, (rows, ids) in self.truncated.items():
            if rows:
                cap = self.caps[name]
                parts.append(
                    f"{name}: {rows:,} rows longer than max_ids={cap} kept their last {cap}"
                    f" ({ids:,} ids dropped)"
                )
        return "; ".join(parts)

    def __str__(self) -> str:
        return self.summary()


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Join:
    """One configured join: the indexed side table and what to do with missing keys."""

    side: SideTable
    on_missing: str = "default"
    label: str = ""
    """Name in the report (default: the side table's source)."""


class ColumnTransform:
    """The column transforms of a dataset as one callable over raw-id `Examples` chunks:
    indicator bags, joins, dropped dense columns, then `max_ids` caps, in that order.
    Counts accumulate in `report` (thread-safe, so a loader's background thread may call
    it). `dense_names` are the input's dense columns; `out_dense_names` the output's."""

    def __init__(
        self,
        dense_names: Sequence[str] = (),
        *,
        indicator_bags: Mapping[str, Sequence[str]] | None = None,
        joins: Sequence[Join] = (),
        drop: Sequence[str] = (),
        max_ids: Mapping[str, int] | None = None,
    ):
        self.dense_names = tuple(dense_names)
        self.indicator_bags = {k: tuple(v) for k, v in (indicator_bags or {}).items()}
        self.joins = tuple(joins)
        self.drop = tuple(drop)
        self.max_ids = dict(max_ids or {})
        self.report = TransformReport(caps=dict(self.max_ids))
        self._lock = threading.Lock()
        names = self.dense_names
        for bag, cols in self.indicator_bags.items():
            _dense_index(names, cols, f"indicator bag {bag!r}")
            names = tuple(n for n in names if n not in cols)
        for j in self.joins:
            names = (*names, *j.side.dense_names)
        _dense_index(names, self.drop, "drop")
        self.out_dense_names = tuple(n for n in names if n not in self.drop)

    @property
    def is_identity(self) -> bool:
        return not (self.indicator_bags or self.joins or self.drop or self.max_ids)

    def __call__(self, ex: Examples) -> Examples:
        names = self.dense_names
        for bag, cols in self.indicator_bags.items():
            ex, names = indicator_bag(ex, names, bag, cols)
        missing = []
        for j in self.joins:
            ex, names, m = join(ex, names, j.side, on_missing=j.on_missing)
            missing.append(m)
        if self.drop:
            ex, names = drop_dense(ex, names, self.drop)
        cut = {}
        if self.max_ids:
            ex, cut = cap_ids(ex, self.max_ids)
        with self._lock:
            r = self.report
            r.rows += len(ex)
            for j, m in zip(self.joins, missing, strict=True):
                label = j.label or j.side.source
                r.missing_keys[label] = r.missing_keys.get(label, 0) + m
            for name, (rows, ids) in cut.items():
                t = r.truncated.setdefault(name, [0, 0])
                t[0] += rows
                t[1] += ids
        return ex
