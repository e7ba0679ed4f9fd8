"""Parquet through pyarrow: columns as a `TableSchema` names them, read in record batches
(`pyarrow.parquet.ParquetFile.iter_batches`), so a file larger than memory streams.

Column types: dense and label columns are any numeric type (null -> `dense_missing`; a
null, NaN or infinite label and a NaN or infinite dense value make the row malformed);
categorical columns are integers or strings (null -> missing id -1); multi_hot and
sequence columns are lists of integers or strings (null -> no ids). Ids follow the
delimited reader's rules, so a table exported to Parquet gives the same raw ids as its
CSV: strings and integers are hashed with `stable_hash` of their text, unless
`int_ids`, where integers are kept (they must be >= 0). Weighted columns are not
supported in Parquet. A column the schema names that the file lacks is a one-line
`DataFileError` naming the file and the column. "Lines" in reports and errors are row
numbers (1-based) within the file.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import numpy as np

from ._batch import JaggedIds
from ._csv import ParseErrors, TableSchema
from ._files import DataFileError
from ._labels import LabelRule
from ._loader import Examples
from ._text import Hasher


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        raise ImportError("reading Parquet needs pyarrow: pip install pyarrow") from None
    return pa, pc, pq


class ParquetParser:
    """Converts Parquet record batches into `Examples` of raw ids."""

    def __init__(
        self, schema: TableSchema, label: LabelRule | None = None, *, hasher: Hasher | None = None
    ):
        if schema.weighted:
            raise ValueError(
                f"TableSchema.weighted {list(schema.weighted)}: weighted columns are not "
                f"supported for Parquet"
            )
        self.schema = schema
        self.rule = label if label is not None else LabelRule(column=schema.label)
        self.label_col = self.rule.column or schema.label
        self.hasher = hasher or Hasher()

    @property
    def columns(self) -> list[str]:
        s = self.schema
        cols = [*s.dense, *s.sparse_columns]
        return ([self.label_col] if self.label_col else []) + cols

    def check_file(self, path: str, names: Sequence[str]) -> None:
        for c in self.columns:
            if c not in names:
                close = difflib.get_close_matches(c, list(names), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise DataFileError(
                    f"{path}: column {c!r} is not in the Parquet file (its columns: "
                    f"{list(names)}){hint}"
                )

    def _ids(self, arr, col: str):
        """(int64 ids, bad rows mask) of a flat non-null array of ints or strings."""
        pa, pc, _ = _pa()
        t = arr.type
        if pa.types.is_integer(t):
            v = arr.to_numpy(zero_copy_only=False).astype(np.int64)
            if self.schema.int_ids:
                return v, v < 0
            arr = pc.cast(arr, pa.string())
        elif self.schema.int_ids:
            raise DataFileError(f"column {col!r}: int_ids needs an integer column, got {t}")
        if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type):
            arr = arr.cast(pa.binary())
        elif not (pa.types.is_string(arr.type) or pa.types.is_binary(arr.type)):
            raise DataFileError(f"column {col!r}: ids must be integers or strings, got {t}")
        arr = arr if arr.offset == 0 else pa.concat_arrays([arr])
        bufs = arr.buffers()
        off = np.frombuffer(bufs[1], np.int32, len(arr) + 1, arr.offset * 4)
        data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        start = off[:-1].astype(np.int64)
        length = (off[1:] - off[:-1]).astype(np.int64)
        return self.hasher(data, start, length), np.zeros(len(arr), bool)

    def parse(self, batch, first_row: int, path: str, errs: ParseErrors):
        """`(Examples, rows read)` of a record batch whose first row is `first_row`."""
        pa, pc, _ = _pa()
        s = self.schema
        n = batch.num_rows
        names = batch.schema.names
        col = {c: batch.column(names.index(c)) for c in self.columns}
        bad_reason = np.full(n, "", object)

        def flag(mask, reason, name, values):
            for i in np.flatnonzero(mask & (bad_reason == "")):
                bad_reason[i] = (reason, name, str(values[i]))

        def floats(name):
            a = col[name]
            if not (pa.types.is_integer(a.type) or pa.types.is_floating(a.type)):
                raise DataFileError(f"{path}: column {name!r} must be numeric, got {a.type}")
            x = a.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls -> NaN
            return x, np.asarray(a.is_null().to_numpy(zero_copy_only=False), bool)

        raw_labels = np.zeros(n)
        if self.label_col is not None:
            raw_labels, null = floats(self.label_col)
            flag(null | ~np.isfinite(raw_labels), "bad_label", self.label_col, raw_labels)
        dense = np.zeros((n, len(s.dense)))
        for k, c in enumerate(s.dense):
            x, null = floats(c)
            flag(~null & ~np.isfinite(x), "bad_dense", c, x)
            dense[:, k] = np.where(null, s.dense_missing, x)
        sparse = {}
        item_rows = {}
        for c in s.categorical:
            a = col[c]
            if pa.types.is_list(a.type) or pa.types.is_large_list(a.type):
                raise DataFileError(f"{path}: categorical column {c!r} holds lists; use multi_hot")
            null = np.asarray(a.is_null().to_numpy(zero_copy_only=False), bool)
            ids = np.full(n, -1, np.int64)
            nz = np.flatnonzero(~null)
            v, b = self._ids(a.drop_null(), c)
            ids[nz] = v
            bad = np.zeros(n, bool)
            bad[nz] = b
            flag(bad, "bad_id", c, ids)
            sparse[c] = (np.ones(n, np.int64), ids)
        for c in (*s.multi_hot, *s.sequence):
            a = col[c]
            if not (pa.types.is_list(a.type) or pa.types.is_large_list(a.type)):
                raise DataFileError(f"{path}: column {c!r} must be a list column, got {a.type}")
            lengths = pc.list_value_length(a).fill_null(0).to_numpy(zero_copy_only=False)
            lengths = lengths.astype(np.int64)
            flat = pc.list_flatten(a)
            rows = np.repeat(np.arange(n), lengths)
            nulls = np.asarray(flat.is_null().to_numpy(zero_copy_only=False), bool)
            ids = np.full(len(flat), -1, np.int64)
            nz = np.flatnonzero(~nulls)
            if nz.size:
                v, b = self._ids(flat.drop_null(), c)
                ids[nz] = v
                bad_rows = np.zeros(n, bool)
                bad_rows[rows[nz[b]]] = True
                flag(bad_rows, "bad_id", c, np.zeros(n))
            null_item_rows = np.zeros(n, bool)
            null_item_rows[rows[nulls]] = True
            flag(null_item_rows, "bad_id", c, ["null item"] * n)
            sparse[c] = (lengths, ids)
            item_rows[c] = rows
        bad = bad_reason != ""
        for i in np.flatnonzero(bad):
            errs.add(first_row + int(i), *bad_reason[i])
        kept = np.flatnonzero(~bad)
        out = {}
        for c in s.sparse_columns:
            lengths, ids = sparse[c]
            if c in item_rows:
                ids = ids[~bad[item_rows[c]]]
            else:
                ids = ids[kept]
            out[c] = JaggedIds(lengths=lengths[kept].astype(np.int32), values=ids)
        if self.label_col is not None:
            labels = self.rule.apply(
                raw_labels[kept], path=path, lines=first_row + kept, unit="row"
            )
        else:
            labels = np.zeros(kept.shape[0], np.float32)
        d = dense[kept]
        if s.dense_log1p:
            d = np.log1p(np.maximum(d, 0.0))
        return Examples(labels=labels, dense=d.astype(np.float32), sparse=out), n
