"""Prepared data: a dataset written once as raw column files (`write_prepared`, or
`sparsejax data`) that a `Loader` reads by memory map, with nothing to parse.

A prepared directory holds the table rows the run's id mappings gave (not raw text), so
a batch is a gather of rows from a few files:

    prepared.json      the manifest: rows, row-group size, columns (file, dtype, shape,
                       a crc32 per row group), features (table, rows, layout), meta
    labels.bin         f32[N] (or [N, k])
    dense.bin          f32[N, num_dense]
    ids.bin            i32[N, F]: the features with exactly one id per example (CTR
                       data's categorical columns), side by side
    keys.bin           i64[N, K]: the same for dynamic tables' raw keys (and tables of
                       2**31 rows or more)
    <feature>.offsets  i64[N + 1] and <feature>.values (i32 or i64), <feature>.weights
                       (f32): bags, weighted and sequence features

Rows are checked in row groups: a file shorter than the manifest says is refused when
opened, naming the file and the row group where it ends; a row group whose crc32 does
not match is refused the first time a batch reads it, naming the file and the group.
The manifest is written last and the directory renamed into place, so a writer killed
midway leaves no prepared directory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..embedding import FeatureSpec, TableSpec
from ._batch import JaggedIds
from ._loader import BoundedCache, Examples, HostBatch, ragged_source

MANIFEST = "prepared.json"
FORMAT = "sparsejax-prepared"
VERSION = 1
_INT32_MAX = 2**31 - 1


class PreparedDataError(ValueError):
    """A prepared directory that cannot be read as it is: missing, truncated or corrupt
    files, or a schema other than the run's."""


def one_id(spec: FeatureSpec) -> bool:
    """A feature stored as one id per example (a column of the `ids`/`keys` matrix)."""
    return not spec.is_sequence and spec.max_ids == 1 and not spec.weighted


def _wide(table: TableSpec) -> bool:
    return table.dynamic is not None or table.vocab_size > _INT32_MAX


def _table_rows(table: TableSpec) -> int | None:
    """The rows a feature's ids index (None: a dynamic table's raw keys)."""
    return None if table.dynamic is not None else table.vocab_size


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each feature's ids live: the `ids` (int32) or `keys` (int64) matrix's
    column, or its own ragged files."""

    ids: tuple[str, ...]
    keys: tuple[str, ...]
    ragged: tuple[str, ...]

    @classmethod
    def of(cls, tables: Sequence[TableSpec], features: Sequence[FeatureSpec]) -> _Layout:
        by_name = {t.name: t for t in tables}
        ids, keys, ragged = [], [], []
        for f in features:
            if not one_id(f):
                ragged.append(f.name)
            else:
                (keys if _wide(by_name[f.table]) else ids).append(f.name)
        return cls(tuple(ids), tuple(keys), tuple(ragged))

    def kind(self, name: str) -> str:
        return "ids" if name in self.ids else "keys" if name in self.keys else "ragged"


# ---------------------------------------------------------------------------------------
# Writing


class _ColumnWriter:
    """Appends one column's rows to its file, with a crc32 per row group."""

    def __init__(self, root: str, name: str, dtype, row_shape: tuple[int, ...] = (), leading=None):
        """`leading`: rows written first, outside every row group (an offsets column's 0)."""
        self.file, self.dtype, self.row_shape = name, np.dtype(dtype), tuple(row_shape)
        self.f = open(os.path.join(root, name), "wb")  # noqa: SIM115 - closed in close()
        self.rows = 0
        self.crc: list[int] = []
        if leading is not None:
            lead = np.ascontiguousarray(leading, self.dtype)
            self.f.write(memoryview(lead).cast("B"))
            self.rows = lead.shape[0]

    def write_group(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, self.dtype)
        self.f.write(memoryview(block).cast("B"))
        self.crc.append(zlib.crc32(memoryview(block).cast("B")))
        self.rows += block.shape[0]

    def close(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {
            "file": self.file,
            "dtype": self.dtype.str,
            "shape": [self.rows, *self.row_shape],
            "crc32": self.crc,
        }


def write_prepared(
    path: str | os.PathLike,
    chunks: Examples | Iterable[Examples],
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    *,
    row_group: int = 1 << 16,
    meta: Mapping[str, Any] | None = None,
) -> PreparedData:
    """Write `chunks` (examples whose ids are already table rows, or a dynamic table's
    int64 keys) as a prepared directory at `path`, and open it.

    Every id is checked against its table (a row outside it, or a one-id feature with
    another count, is an error naming the feature and the example); `meta` is kept in
    the manifest (e.g. the config and id mappings that made the rows). `path` must not
    exist: the files go to a temporary directory beside it, renamed into place when all
    are written.
    """
    path = os.fspath(path)
    if row_group < 1:
        raise ValueError(f"row_group must be >= 1, got {row_group}")
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists; prepared data is written to a new directory")
    chunks = [chunks] if isinstance(chunks, Examples) else chunks
    layout = _Layout.of(tables, features)
    by_table = {t.name: t for t in tables}
    specs = {f.name: f for f in features}
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    writer = _Writer(tmp, layout, by_table, specs, row_group)
    try:
        for chunk in chunks:
            writer.add(chunk)
        columns, rows, num_dense = writer.close()
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "rows": rows,
            "row_group": row_group,
            "num_dense": num_dense,
            "features": {
                f.name: {
                    "table": f.table,
                    "rows": _table_rows(by_table[f.table]),
                    "layout": layout.kind(f.name),
                    "max_ids": f.max_ids,
                    "sequence": f.is_sequence,
                    "weighted": f.weighted,
                }
                for f in features
            },
            "columns": columns,
            "meta": dict(meta or {}),
        }
        with open(os.path.join(tmp, MANIFEST), "w") as fh:
            json.dump(manifest, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, path)
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PreparedData(path)


class _Writer:
    """Buffers rows until a row group is full, then writes it to every column."""

    def __init__(self, root, layout: _Layout, tables, specs, row_group: int):
        self.root, self.layout, self.tables, self.specs = root, layout, tables, specs
        self.row_group = row_group
        self.pending: list[Examples] = []
        self.pending_rows = 0
        self.rows = 0
        self.cols: dict[str, _ColumnWriter] | None = None
        self.value_offsets = {name: 0 for name in layout.ragged}

    def add(self, chunk: Examples) -> None:
        self._check(chunk)
        if len(chunk) == 0:
            return
        self.pending.append(chunk)
        self.pending_rows += len(chunk)
        if self.pending_rows >= self.row_group:
            whole = Examples.concat(self.pending)
            full = len(whole) // self.row_group * self.row_group
            for a in range(0, full, self.row_group):
                self._write(whole[a : a + self.row_group])
            rest = whole[full:]
            self.pending = [rest] if len(rest) else []
            self.pending_rows = len(rest)

    def _check(self, chunk: Examples) -> None:
        first = self.rows + self.pending_rows
        missing = set(self.specs) - set(chunk.sparse)
        if missing:
            raise PreparedDataError(f"the examples have no feature {sorted(missing)[0]!r}")
        for name, spec in self.specs.items():
            col = chunk.sparse[name]
            table = self.tables[spec.table]
            if name not in self.layout.ragged:
                bad = np.flatnonzero(np.asarray(col.lengths) != 1)
                if bad.size:
                    raise PreparedDataError(
                        f"feature {name!r}: example {first + int(bad[0])} has "
                        f"{int(col.lengths[bad[0]])} ids; its FeatureSpec takes exactly one"
                    )
            values = np.asarray(col.values)
            top = _table_rows(table)
            bad = np.flatnonzero((values < 0) | (values >= (top or np.iinfo(np.int64).max)))
            if bad.size:
                example = int(np.searchsorted(np.cumsum(col.lengths), bad[0], side="right"))
                raise PreparedDataError(
                    f"feature {name!r}: id {int(values[bad[0]])} of example {first + example} "
                    f"is outside table {spec.table!r}"
                    + (f" of {top} rows" if top is not None else " (keys are >= 0)")
                )

    def _open(self, chunk: Examples) -> dict[str, _ColumnWriter]:
        root, lay = self.root, self.layout
        cols = {
            "labels": _ColumnWriter(root, "labels.bin", np.float32, chunk.labels.shape[1:]),
            "dense": _ColumnWriter(root, "dense.bin", np.float32, (chunk.num_dense,)),
        }
        if lay.ids:
            cols["ids"] = _ColumnWriter(root, "ids.bin", np.int32, (len(lay.ids),))
        if lay.keys:
            cols["keys"] = _ColumnWriter(root, "keys.bin", np.int64, (len(lay.keys),))
        for name in lay.ragged:
            spec = self.specs[name]
            wide = _wide(self.tables[spec.table])
            cols[f"{name}.offsets"] = _ColumnWriter(
                root, f"{name}.offsets", np.int64, leading=np.zeros(1)
            )
            cols[f"{name}.values"] = _ColumnWriter(
                root, f"{name}.values", np.int64 if wide else np.int32
            )
            if spec.weighted:
                cols[f"{name}.weights"] = _ColumnWriter(root, f"{name}.weights", np.float32)
        return cols

    def _write(self, ex: Examples) -> None:
        if self.cols is None:
            self.cols = self._open(ex)
        cols, lay = self.cols, self.layout
        if ex.num_dense != cols["dense"].row_shape[0]:
            raise PreparedDataError(
                f"example {self.rows}: {ex.num_dense} dense features, the first rows had "
                f"{cols['dense'].row_shape[0]}"
            )
        cols["labels"].write_group(ex.labels)
        cols["dense"].write_group(ex.dense)
        if lay.ids:
            cols["ids"].write_group(np.stack([ex.sparse[n].values for n in lay.ids], 1))
        if lay.keys:
            cols["keys"].write_group(np.stack([ex.sparse[n].values for n in lay.keys], 1))
        for name in lay.ragged:
            col = ex.sparse[name]
            ends = self.value_offsets[name] + np.cumsum(col.lengths, dtype=np.int64)
            cols[f"{name}.offsets"].write_group(ends)
            self.value_offsets[name] = int(ends[-1]) if ends.size else self.value_offsets[name]
            cols[f"{name}.values"].write_group(col.values)
            if col.weights is not None and f"{name}.weights" in cols:
                cols[f"{name}.weights"].write_group(col.weights)
        self.rows += len(ex)

    def abort(self) -> None:
        for col in (self.cols or {}).values():
            col.f.close()

    def close(self) -> tuple[dict, int, int]:
        if self.pending_rows:
            self._write(Examples.concat(self.pending))
        if self.cols is None:
            raise PreparedDataError("no examples to write")
        return (
            {k: c.close() for k, c in self.cols.items()},
            self.rows,
            self.cols["dense"].row_shape[0],
        )


# ---------------------------------------------------------------------------------------
# Reading


class PreparedData:
    """A prepared directory, memory-mapped: `take(rows)` gathers examples, `batch_rows`
    gives each batch's rows of an epoch (shuffled by windows of whole row groups, so a
    dataset larger than memory is read in large sequential runs), and `check` refuses a
    run whose tables and features are not the ones the rows were prepared for.

    `Loader(PreparedData(path), packer, ...)` trains from it: epochs, shuffling, exact
    resume as for `Examples`; when the loader puts batches on the device and every
    feature has one id per example, a batch is shipped as the gathered id matrix and
    unpacked on the device (`take_compact`).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        manifest = os.path.join(self.path, MANIFEST)
        if not os.path.isfile(manifest):
            raise PreparedDataError(
                f"{self.path}: no {MANIFEST}; not a prepared data directory (write one with "
                f"`sparsejax data CONFIG --out DIR`)"
            )
        try:
            with open(manifest) as fh:
                m = json.load(fh)
        except (OSError, ValueError) as e:
            raise PreparedDataError(f"{manifest}: unreadable manifest: {e}") from None
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            raise PreparedDataError(
                f"{manifest}: format {m.get('format')!r} version {m.get('version')!r}; this "
                f"sparsejax reads {FORMAT!r} version {VERSION}"
            )
        self.rows: int = int(m["rows"])
        self.row_group: int = int(m["row_group"])
        self.num_dense: int = int(m["num_dense"])
        self.features: dict[str, dict] = m["features"]
        self.meta: dict = m["meta"]
        self.layout = _Layout(
            tuple(n for n, f in self.features.items() if f["layout"] == "ids"),
            tuple(n for n, f in self.features.items() if f["layout"] == "keys"),
            tuple(n for n, f in self.features.items() if f["layout"] == "ragged"),
        )
        self._columns = m["columns"]
        self._maps: dict[str, np.ndarray] = {}
        for key, col in self._columns.items():  # offsets before their values
            self._maps[key] = self._map(key, col)
        self._groups = -(-self.rows // self.row_group)
        self._verified = np.zeros(self._groups, bool)
        self._all_verified = False
        # a batch spans at most two windows of an epoch; the loader's workers a few more
        self._windows = BoundedCache(8)

    def __len__(self) -> int:
        return self.rows

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(self.features)

    @functools.cached_property
    def sparse(self) -> dict[str, JaggedIds]:
        """Every feature's ids over all rows, as `Examples.sparse` (memory-mapped values;
        not verified: `take` verifies what it reads)."""
        out = {}
        for key, names in (("ids", self.layout.ids), ("keys", self.layout.keys)):
            ones = np.ones(self.rows, np.int32)
            for j, name in enumerate(names):
                out[name] = JaggedIds(lengths=ones, values=self._maps[key][:, j])
        for name in self.layout.ragged:
            out[name] = JaggedIds(
                lengths=np.diff(self._maps[f"{name}.offsets"]),
                values=self._maps[f"{name}.values"],
                weights=self._maps.get(f"{name}.weights"),
            )
        return {name: out[name] for name in self.features}

    def _map(self, key: str, col: dict) -> np.ndarray:
        """The column's file, memory-mapped; one shorter than the manifest says is
        refused, naming the row group where it ends."""
        file = os.path.join(self.path, col["file"])
        dtype, shape = np.dtype(col["dtype"]), tuple(col["shape"])
        if not os.path.isfile(file):
            raise PreparedDataError(f"{file}: missing (column {key!r} of {self.path})")
        row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        size, want = os.path.getsize(file), shape[0] * row_bytes
        if size < want:
            have = size // row_bytes  # whole entries in the file
            if key.endswith((".values", ".weights")):
                off = self._maps[key.rsplit(".", 1)[0] + ".offsets"]
                example = int(np.searchsorted(off, have, side="right")) - 1
            else:
                example = have - 1 if key.endswith(".offsets") else have
            raise PreparedDataError(
                f"{file}: {size:,} bytes, the manifest says {want:,}: truncated in row group "
                f"{example // self.row_group} (example {example:,}); prepare the data again"
            )
        if want == 0:
            return np.zeros(shape, dtype)
        return np.memmap(file, dtype=dtype, mode="r", shape=shape)

    # -- the run's schema -----------------------------------------------------------
    def check(self, packer) -> None:
        """Refuse (naming the column) a packer whose features and tables are not those
        the rows were prepared for: a feature missing or extra, another table, another
        table size, another layout, another count of dense features."""
        rows = {t: None if t in packer.dynamic else v for t, v in packer.vocab.items()}
        want = {f.name: f for f in packer.features}
        for name in self.features:
            if name not in want:
                raise PreparedDataError(
                    f"{self.path}: column {name!r} is not a feature of the run "
                    f"(its features: {sorted(want)})"
                )
        for name, spec in want.items():
            got = self.features.get(name)
            if got is None:
                raise PreparedDataError(
                    f"{self.path}: the run's feature {name!r} is not a column of the prepared "
                    f"data (its columns: {sorted(self.features)})"
                )
            n = rows[spec.table]
            if not one_id(spec):
                kind = "ragged"
            else:
                kind = "keys" if n is None or n > _INT32_MAX else "ids"
            for what, have, need in (
                ("table", got["table"], spec.table),
                ("table rows", got["rows"], n),
                ("layout", got["layout"], kind),
                ("max_ids", got["max_ids"], spec.max_ids),
                ("weighted", got["weighted"], spec.weighted),
            ):
                if have != need:
                    raise PreparedDataError(
                        f"{self.path}: column {name!r} was prepared with {what} {have!r}, the "
                        f"run has {need!r}; prepare the data again for this config"
                    )
        if packer.num_dense != self.num_dense:
            raise PreparedDataError(
                f"{self.path}: column 'dense' holds {self.num_dense} features, the run has "
                f"{packer.num_dense}"
            )

    def compact_for(self, packer) -> bool:
        """Whether every feature of `packer` is a column of the int32 `ids` matrix, so
        batches can be shipped as that matrix and unpacked on the device."""
        return set(self.layout.ids) == {f.name for f in packer.features} and not (
            self.layout.keys or self.layout.ragged
        )

    # -- batches --------------------------------------------------------------------
    def batch_rows(
        self,
        epoch: int,
        index: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        window_rows: int = 1 << 16,
    ) -> np.ndarray:
        """The rows (sorted, int64) of batch `index` of `epoch`.

        Unshuffled, batches are consecutive rows. Shuffled, the epoch visits windows of
        `window_rows // row_group` (at least one) whole row groups, the groups in an
        order drawn per `(seed, epoch)` and the rows of a window in an order drawn per
        `(seed, epoch, window)`: every row once an epoch, read in runs of row groups.
        """
        lo = index * batch_size
        hi = min(lo + batch_size, self.rows)
        if lo >= hi:
            raise IndexError(f"batch {index} of {batch_size} is past the {self.rows} rows")
        if not shuffle:
            return np.arange(lo, hi, dtype=np.int64)
        per = max(1, window_rows // self.row_group)
        starts = self._window_starts(epoch, seed, per)
        out = []
        w = int(np.searchsorted(starts, lo, side="right")) - 1
        while lo < hi:
            order = self._window(epoch, seed, per, w)
            a = lo - int(starts[w])
            take = order[a : a + (hi - lo)]
            out.append(take)
            lo += take.shape[0]
            w += 1
        return np.sort(np.concatenate(out))

    def _group_order(self, epoch: int, seed: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch, 0x5EED]).permutation(self._groups)

    def _window_starts(self, epoch: int, seed: int, per: int) -> np.ndarray:
        def build():
            order = self._group_order(epoch, seed)
            sizes = np.minimum(self.row_group, self.rows - order * self.row_group)
            sums = np.add.reduceat(sizes, np.arange(0, order.shape[0], per))
            return np.concatenate([[0], np.cumsum(sums)]).astype(np.int64)

        return self._windows.get(("starts", epoch, seed, per), build)

    def _window(self, epoch: int, seed: int, per: int, w: int) -> np.ndarray:
        def build():
            groups = self._group_order(epoch, seed)[w * per : (w + 1) * per]
            rows = np.concatenate(
                [
                    np.arange(g * self.row_group, min((g + 1) * self.row_group, self.rows))
                    for g in groups
                ]
            )
            return np.random.default_rng([seed, epoch, w]).permutation(rows)

        return self._windows.get(("rows", epoch, seed, per, w), build)

    def verify(self, rows: np.ndarray | None = None) -> None:
        """Check the crc32 of every row group that `rows` touch (all: None), once each."""
        if self._all_verified:
            return
        groups = np.arange(self._groups) if rows is None else np.unique(rows // self.row_group)
        for g in groups[~self._verified[groups]]:
            self._verify_group(int(g))
            self._verified[g] = True
        self._all_verified = bool(self._verified.all())

    def _verify_group(self, g: int) -> None:
        a, b = g * self.row_group, min((g + 1) * self.row_group, self.rows)
        for key, col in self._columns.items():
            arr = self._maps[key]
            if key.endswith(".values") or key.endswith(".weights"):
                off = self._maps[key.rsplit(".", 1)[0] + ".offsets"]
                lo, hi = int(off[a]), int(off[b])
            elif key.endswith(".offsets"):
                lo, hi = a + 1, b + 1
            else:
                lo, hi = a, b
            block = np.ascontiguousarray(arr[lo:hi])
            if zlib.crc32(memoryview(block).cast("B")) != col["crc32"][g]:
                size = arr.dtype.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64))
                raise PreparedDataError(
                    f"{os.path.join(self.path, col['file'])}: row group {g} (examples "
                    f"{a:,}-{b - 1:,}, bytes {lo * size:,}-{hi * size - 1:,}) does not match "
                    f"its checksum: the file is corrupt; prepare the data again"
                )

    def take(self, rows: np.ndarray) -> HostBatch:
        """Examples `rows` (verified) as host arrays of a batch, as `Examples.take`."""
        rows = np.asarray(rows, np.int64)
        self.verify(rows)
        sparse = {}
        ones = np.ones(rows.shape[0], np.int32)
        for key, names in (("ids", self.layout.ids), ("keys", self.layout.keys)):
            if names:
                block = self._maps[key][rows]
                for j, name in enumerate(names):
                    sparse[name] = JaggedIds(lengths=ones, values=block[:, j])
        for name in self.layout.ragged:
            off = self._maps[f"{name}.offsets"]
            starts, ends = off[rows], off[rows + 1]
            lengths = ends - starts
            src = ragged_source(starts, lengths)
            weights = self._maps.get(f"{name}.weights")
            sparse[name] = JaggedIds(
                lengths=lengths,
                values=np.asarray(self._maps[f"{name}.values"][src]),
                weights=None if weights is None else np.asarray(weights[src]),
            )
        sparse = {name: sparse[name] for name in self.features}
        return sparse, np.asarray(self._maps["labels"][rows]), np.asarray(self._maps["dense"][rows])

    def take_compact(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(ids i32[n, F], labels, dense)` of `rows` (verified): the batch of a dataset
        whose every feature is a column of `ids`, for unpacking on the device."""
        rows = np.asarray(rows, np.int64)
        self.verify(rows)
        return self._maps["ids"][rows], self._maps["labels"][rows], self._maps["dense"][rows]
