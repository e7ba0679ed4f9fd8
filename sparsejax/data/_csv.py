"""Schema-driven reader of delimited text (CSV/TSV, any one-character delimiter) into
`Examples`, and the `ParseReport` that every reader returns.

Parsing is vectorized over a chunk of lines (see `_text.py`): the chunk is split into
fields with numpy, numbers are converted by digit arithmetic, string ids are hashed once
per distinct string; only lines the fast path flags are re-checked one by one in Python,
to name the reason and the field. `read_delimited` reads one file, several files or a
glob (the header on the first file only; see `_files.delimited_header`), plain, gzip or
zstd; `FileSource(format="delimited")` streams the same parse chunk by chunk.
`delimited_fields` splits the same way but leaves the fields unconverted (`TextFields`),
for readers that keep raw values (the event log's ids and dates).
"""

from __future__ import annotations

import dataclasses
import difflib
import gzip
import math
from collections.abc import Mapping, Sequence
from os import PathLike

import numpy as np

from ._batch import JaggedIds
from ._labels import LabelRule
from ._loader import Examples
from ._options import options_from_dict
from ._text import (
    Hasher,
    TextFields,
    items_of,
    parse_decimal,
    parse_float,
    split_fields,
    stable_hash_bytes,
)
from ._text import stable_hash as stable_hash

MISSING = -1
"""Raw id of a missing categorical value (id mappings send it to row 0)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParseReport:
    """What a reader kept and skipped. `str(report)` is a one-line summary."""

    path: str
    """The file read."""
    lines_read: int = 0
    """Data lines read (a header line is not counted)."""
    lines_kept: int = 0
    """Lines that became examples."""
    errors: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Skipped lines per reason, e.g. {"field_count": 1, "bad_dense": 2}."""
    first_errors: tuple[tuple[int, str, str, str], ...] = ()
    """The first few malformed lines: (1-based line number, reason, field, value)."""
    first_error_paths: tuple[str, ...] = ()
    """The file of each of `first_errors` (when read from several files; else empty)."""

    MAX_FIRST_ERRORS = 10

    @property
    def lines_skipped(self) -> int:
        return self.lines_read - self.lines_kept

    def merge(self, other: ParseReport) -> ParseReport:
        """The report of reading this part and then `other` (chunks of one file)."""
        errors = dict(self.errors)
        for k, v in other.errors.items():
            errors[k] = errors.get(k, 0) + v
        first = (self.first_errors + other.first_errors)[: self.MAX_FIRST_ERRORS]
        paths = ()
        if self.first_error_paths or other.first_error_paths or other.path != self.path:
            paths = (self._error_paths() + other._error_paths())[: len(first)]
        return ParseReport(
            path=self.path,
            lines_read=self.lines_read + other.lines_read,
            lines_kept=self.lines_kept + other.lines_kept,
            errors=errors,
            first_errors=first,
            first_error_paths=paths,
        )

    def _error_paths(self) -> tuple[str, ...]:
        return self.first_error_paths or (self.path,) * len(self.first_errors)

    def summary(self) -> str:
        s = f"{self.path}: kept {self.lines_kept:,} of {self.lines_read:,} lines"
        if not self.errors:
            return s + "; no malformed lines"
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(self.errors.items()))
        paths = self.first_error_paths
        first = "; ".join(
            (f"{paths[i]}:{ln}" if paths else f"line {ln}") + f" {r} {f}={v!r}"
            for i, (ln, r, f, v) in enumerate(self.first_errors[:3])
        )
        return f"{s}; skipped {self.lines_skipped:,} ({reasons}); first: {first}"

    def __str__(self) -> str:
        return self.summary()


class ParseErrors:
    """Collects malformed lines for a `ParseReport`, or raises at the first if strict."""

    def __init__(self, path: str, strict: bool):
        self.path, self.strict = path, strict
        self.counts: dict[str, int] = {}
        self.first: list[tuple[int, str, str, str]] = []

    def add(self, line_no: int, reason: str, field: str, value: str, detail: str = "") -> None:
        if self.strict:
            raise ValueError(
                f"{self.path}:{line_no}: {reason}: field {field} = {value!r}"
                + (f" ({detail})" if detail else "")
            )
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.first) < ParseReport.MAX_FIRST_ERRORS:
            self.first.append((line_no, reason, field, value))

    def add_many(self, line_nos: Sequence[int], reason: str, field: str, values: Sequence[str]):
        """`add` of many lines with one reason and field (`values`: one per line)."""
        if self.strict and len(line_nos):
            self.add(int(line_nos[0]), reason, field, values[0])
        self.counts[reason] = self.counts.get(reason, 0) + len(line_nos)
        room = max(ParseReport.MAX_FIRST_ERRORS - len(self.first), 0)
        for line_no, value in zip(line_nos[:room], values[:room], strict=True):
            self.first.append((int(line_no), reason, field, value))

    def report(self, lines_read: int, lines_kept: int) -> ParseReport:
        return ParseReport(
            path=self.path,
            lines_read=lines_read,
            lines_kept=lines_kept,
            errors=dict(self.counts),
            first_errors=tuple(self.first),
        )


def open_text(path: str | PathLike, mode: str = "rb"):
    """Open a plain, gzip (`.gz`) or zstd (`.zst`, `.zstd`) file with `open`'s modes.
    (Readers use `_files.open_file`, which also turns a truncated file into a one-line
    error.)"""
    path = str(path)
    low = path.lower()
    if low.endswith(".gz"):
        return gzip.open(path, mode)
    if low.endswith((".zst", ".zstd")):
        import zstandard

        return zstandard.open(path, mode)
    return open(path, mode)


# ---------------------------------------------------------------------------------------
# Schema


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSchema:
    """How to read a delimited text file into `Examples`.

    Columns not named by any role are ignored. Sparse features are named after their
    columns. Cell formats (no quoting; a delimiter never appears inside a cell):

    * categorical: one value; empty = missing (raw id -1). Strings are hashed with
      `stable_hash` (63-bit blake2b), or parsed as non-negative integers if `int_ids`.
    * multi_hot / sequence: values joined by `separator`, e.g. `"3|17|5"`; empty = no ids.
      A column listed in `weighted` holds `id:weight` items (`weight_separator`), e.g.
      `"3:0.5|17:2"`; every item must carry a weight.
    * dense: a float; empty = `dense_missing`; NaN/inf are malformed.
    * label: a float; empty is malformed.
    """

    delimiter: str = ","
    """Field delimiter ("\\t" for TSV)."""
    header: bool = True
    """The first line names the columns (and is skipped)."""
    columns: tuple[str, ...] | None = None
    """Column names, in file order; required when `header` is False, and overrides the
    header's names when given."""
    label: str | None = None
    """Label column; None reads unlabeled data (labels 0)."""
    dense: tuple[str, ...] = ()
    """Dense float columns, in the order of `Examples.dense`."""
    categorical: tuple[str, ...] = ()
    """One-id columns."""
    multi_hot: tuple[str, ...] = ()
    """Bag-of-ids columns (ragged)."""
    sequence: tuple[str, ...] = ()
    """Ordered id lists (ragged; oldest first, as `FeatureSpec.max_ids` keeps the last)."""
    weighted: tuple[str, ...] = ()
    """Multi-hot columns whose items are `id:weight`."""
    separator: str = "|"
    """Separator of ids inside a multi-hot or sequence cell."""
    weight_separator: str = ":"
    """Separator of id and weight inside an item of a weighted column."""
    int_ids: bool = False
    """Ids are non-negative decimal integers (kept as they are) instead of hashed strings."""
    dense_missing: float = 0.0
    """Value of an empty dense cell."""
    dense_log1p: bool = False
    """Transform dense values x -> log1p(max(x, 0)) (the Criteo preprocessing)."""

    def __post_init__(self):
        for name in ("dense", "categorical", "multi_hot", "sequence", "weighted"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise TypeError(f"TableSchema.{name} must be a list of column names, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if self.columns is not None:
            object.__setattr__(self, "columns", tuple(self.columns))
        elif not self.header:
            raise ValueError("TableSchema: `columns` is required when header=False")
        if len(self.delimiter) != 1:
            raise ValueError(f"TableSchema.delimiter must be one character, got {self.delimiter!r}")
        roles = [*self.dense, *self.categorical, *self.multi_hot, *self.sequence]
        if self.label is not None:
            roles.append(self.label)
        dup = {c for c in roles if roles.count(c) > 1}
        if dup:
            raise ValueError(f"TableSchema: columns {sorted(dup)} have more than one role")
        not_multi = set(self.weighted) - set(self.multi_hot)
        if not_multi:
            raise ValueError(f"TableSchema.weighted: {sorted(not_multi)} are not multi_hot columns")
        if self.columns is not None:
            self.check_columns(self.columns)

    @classmethod
    def from_dict(cls, d: Mapping) -> TableSchema:
        """From a plain dict (e.g. a YAML config section); an unknown key is an error that
        names it and the closest valid key."""
        return options_from_dict(cls, d, where="TableSchema")

    @property
    def sparse_columns(self) -> tuple[str, ...]:
        return (*self.categorical, *self.multi_hot, *self.sequence)

    def check_columns(self, names: Sequence[str]) -> None:
        """Every column the schema uses must be among `names`."""
        used = [*self.dense, *self.sparse_columns] + ([self.label] if self.label else [])
        for c in used:
            if c not in names:
                close = difflib.get_close_matches(c, list(names), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"TableSchema: column {c!r} is not in the file's columns {list(names)}{hint}"
                )


# ---------------------------------------------------------------------------------------
# Raw columns


def delimited_fields(
    data: bytes,
    delimiter: str,
    n_fields: int,
    columns: Sequence[int],
    *,
    first_line: int,
    errs: ParseErrors,
) -> tuple[TextFields, int]:
    """Columns `columns` of a chunk of whole lines of delimited text, unconverted
    (`TextFields`): for readers that keep raw values, such as the event log's ids and
    dates. Split as `DelimitedParser` splits (`split_fields`). Blank lines are skipped
    and not read; a line without exactly `n_fields` fields is skipped and added to
    `errs` ("field_count", value "<k> fields"). Returns (the fields, lines read).
    """
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    if data and not data.endswith(b"\n"):
        data += b"\n"
    delim = delimiter.encode()
    if len(delim) > 1:  # a non-ASCII delimiter: a control byte the chunk lacks stands in
        used = np.bincount(np.frombuffer(data, np.uint8), minlength=256)
        free = [b for b in range(1, 32) if not used[b]]
        if not free:
            raise ValueError(f"delimiter {delimiter!r}: the data uses every control byte")
        data, delim = data.replace(delim, bytes(free[:1])), bytes(free[:1])
    arr = np.frombuffer(data, np.uint8)
    n, start, length, good, lo, hi = split_fields(arr, delim[0], n_fields)
    blank = hi == lo
    bad = np.flatnonzero(~good & ~blank)
    if bad.size:
        seps = np.flatnonzero(arr == delim[0])
        count = np.searchsorted(seps, hi[bad]) - np.searchsorted(seps, lo[bad]) + 1
        errs.add_many(first_line + bad, "field_count", "(line)", [f"{c} fields" for c in count])
    keep = np.flatnonzero(good & ~blank)
    cols = list(columns)
    fields = TextFields(arr, first_line + keep, start[keep][:, cols], length[keep][:, cols])
    return fields, int(n - blank.sum())


# ---------------------------------------------------------------------------------------
# Reader


class _Bad(Exception):
    def __init__(self, reason: str, field: str, value: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.field, self.value, self.detail = reason, field, value, detail


def _text(b: bytes) -> str:
    return b.decode(errors="replace")


class DelimitedParser:
    """Parses chunks of whole lines of a delimited file with columns `names` into
    `Examples` of raw ids (used by `read_delimited` and `FileSource`).

    The label comes from `label.column`, else `schema.label` (None: unlabeled, labels 0);
    `label` (a `LabelRule`, default: values must be 0 or 1) maps and checks it.
    """

    def __init__(
        self,
        schema: TableSchema,
        names: Sequence[str],
        label: LabelRule | None = None,
        *,
        hasher: Hasher | None = None,
    ):
        names = list(names)
        self.rule = label if label is not None else LabelRule(column=schema.label)
        self.label_col = self.rule.column or schema.label
        if self.label_col != schema.label:  # the rule's column replaces the schema's
            schema = dataclasses.replace(schema, label=self.label_col)
        schema.check_columns(names)
        self.schema = schema
        pos = {c: i for i, c in enumerate(names)}
        self.n_fields = len(names)
        self.delim = schema.delimiter.encode()
        self.label_i = pos[self.label_col] if self.label_col is not None else None
        self.dense_i = [pos[c] for c in schema.dense]
        self.cat_i = [(c, pos[c]) for c in schema.categorical]
        self.bag_i = [
            (c, pos[c], c in schema.weighted) for c in (*schema.multi_hot, *schema.sequence)
        ]
        self.hasher = hasher or Hasher()
        self.exact_chunks = 0
        """Chunks parsed line by line because the fast path refused a line the exact
        path accepts (should stay 0; a test checks it)."""

    # -- the exact per-line path (names the reason; the reference for the fast path) ----
    def _to_id(self, col: str, text: bytes) -> int:
        if self.schema.int_ids:
            if not text.isdigit() or len(text) > 18:
                detail = "expected a non-negative integer id" + (
                    " below 10**18" if text.isdigit() else ""
                )
                raise _Bad("bad_id", col, _text(text), detail)
            return int(text)
        return stable_hash_bytes(text)

    @staticmethod
    def _to_float(reason: str, col: str, text: bytes) -> float:
        try:
            x = float(text)
        except ValueError:
            raise _Bad(reason, col, _text(text), "not a number") from None
        if not math.isfinite(x):
            raise _Bad(reason, col, _text(text), "not finite")
        return x

    def exact_line(self, line: bytes):
        """(raw label, dense row, categorical ids, bags) of one line, or raises `_Bad`."""
        s = self.schema
        fields = line.split(self.delim)
        if len(fields) != self.n_fields:
            raise _Bad(
                "field_count", "(line)", f"{len(fields)} fields", f"expected {self.n_fields}"
            )
        y = 0.0
        if self.label_i is not None:
            y = self._to_float("bad_label", self.label_col, fields[self.label_i])
        row = [
            s.dense_missing
            if fields[i] == b""
            else self._to_float("bad_dense", s.dense[k], fields[i])
            for k, i in enumerate(self.dense_i)
        ]
        cats = [-1 if fields[i] == b"" else self._to_id(c, fields[i]) for c, i in self.cat_i]
        bags = []
        sep, wsep = s.separator.encode(), s.weight_separator.encode()
        for c, i, is_weighted in self.bag_i:
            items = fields[i].split(sep) if fields[i] else []
            if not is_weighted:
                bags.append(([self._to_id(c, t) for t in items], None))
                continue
            ids, ws = [], []
            for t in items:
                key, found, w = t.rpartition(wsep)
                if not found:
                    raise _Bad("bad_weight", c, _text(t), "expected id:weight")
                ids.append(self._to_id(c, key))
                ws.append(self._to_float("bad_weight", c, w))
            bags.append((ids, ws))
        return y, row, cats, bags

    def _exact_chunk(self, lines: list[bytes], first_line: int, path: str, errs):
        s = self.schema
        labels, dense_rows, kept_lines = [], [], []
        lengths = {c: [] for c in s.sparse_columns}
        values = {c: [] for c in s.sparse_columns}
        weights = {c: [] for c in s.weighted}
        for k, line in enumerate(lines):
            try:
                y, row, cats, bags = self.exact_line(line)
            except _Bad as e:
                errs.add(first_line + k, e.reason, e.field, e.value, e.detail)
                continue
            labels.append(y)
            dense_rows.append(row)
            kept_lines.append(first_line + k)
            for (c, _), v in zip(self.cat_i, cats, strict=True):
                lengths[c].append(1)
                values[c].append(v)
            for (c, _, is_weighted), (ids, ws) in zip(self.bag_i, bags, strict=True):
                lengths[c].append(len(ids))
                values[c].extend(ids)
                if is_weighted:
                    weights[c].extend(ws)
        n = len(labels)
        sparse = {
            c: JaggedIds(
                lengths=np.asarray(lengths[c], np.int32),
                values=np.asarray(values[c], np.int64),
                weights=np.asarray(weights[c], np.float32) if c in weights else None,
            )
            for c in s.sparse_columns
        }
        dense = np.asarray(dense_rows, np.float64).reshape(n, len(s.dense))
        return self._finish(np.asarray(labels), dense, sparse, np.asarray(kept_lines), path)

    def _finish(self, raw_labels, dense, sparse, lines, path) -> Examples:
        if self.label_col is not None:
            labels = self.rule.apply(raw_labels, path=path, lines=lines)
        else:
            labels = np.zeros(len(lines), np.float32)
        if self.schema.dense_log1p:
            dense = np.log1p(np.maximum(dense, 0.0))
        return Examples(labels=labels, dense=dense.astype(np.float32), sparse=sparse)

    # -- the vectorized path ---------------------------------------------------------
    @staticmethod
    def _floats(data: bytes, arr, start, length):
        """(values, bad) of float fields: `parse_float`, with the values it flags
        re-tried by Python's float() (bad: not a number or not finite; empty is 0)."""
        val, flag = parse_float(arr, start, length)
        bad = np.zeros(flag.shape, bool)
        for idx in zip(*np.nonzero(flag), strict=True):
            s0 = int(start[idx])
            try:
                x = float(data[s0 : s0 + int(length[idx])])
            except ValueError:
                bad[idx] = True
                continue
            val[idx] = x
            bad[idx] = not math.isfinite(x)
        return val, bad

    def _ids(self, arr, start, length):
        """(ids, bad) of id fields (1-D); empty fields give -1 (callers decide)."""
        if self.schema.int_ids:
            v, b = parse_decimal(arr, start, length, signed=False)
            return np.where(length == 0, -1, v), b
        ids = np.full(start.shape[0], -1, np.int64)
        nz = np.flatnonzero(length > 0)
        ids[nz] = self.hasher(arr, start[nz], length[nz])
        return ids, np.zeros(start.shape[0], bool)

    def parse(self, data: bytes, first_line: int, path: str, errs: ParseErrors):
        """`(Examples, lines read)` of a chunk of whole lines starting at `first_line`."""
        s = self.schema
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        if data and not data.endswith(b"\n"):
            data += b"\n"
        arr = np.frombuffer(data, np.uint8)
        n, start, length, good, lo, hi = split_fields(arr, self.delim[0], self.n_fields)
        bad = ~good
        floats = ([self.label_i] if self.label_i is not None else []) + self.dense_i
        fval = np.zeros((n, 0))
        if floats:
            fs, fl = start[:, floats], length[:, floats]
            fval, fbad = self._floats(data, arr, fs, fl)
            bad |= fbad.any(1)
            if self.label_i is not None:
                bad |= fl[:, 0] == 0
            if self.dense_i:
                nd = len(floats) - len(self.dense_i)
                fval[:, nd:] = np.where(fl[:, nd:] == 0, s.dense_missing, fval[:, nd:])
        cat_ids = []
        for _, i in self.cat_i:
            ids, b = self._ids(arr, start[:, i], length[:, i])
            bad |= b & good
            cat_ids.append(ids)
        bags = []
        sep, wsep = ord(s.separator), ord(s.weight_separator)
        for _, i, is_weighted in self.bag_i:
            ist, ilen, cell, counts = items_of(arr, start[:, i], length[:, i], sep)
            w = None
            if is_weighted:  # id:weight items: split each at its last weight separator
                wpos = np.flatnonzero(arr == wsep)
                k = np.searchsorted(wpos, ist + ilen) - 1
                wp = wpos[np.maximum(k, 0)] if wpos.size else ist + ilen
                has = (k >= 0) & (wp >= ist) if wpos.size else np.zeros(ist.shape, bool)
                wp = np.where(has, wp, ist + ilen)
                wlen = np.maximum(ist + ilen - wp - 1, 0)
                w, wbad = self._floats(data, arr, wp + 1, wlen)
                bad[cell[~has | wbad | (wlen == 0)]] = True
                ilen = wp - ist  # the id part
            ids, b = self._ids(arr, ist, ilen)
            if s.int_ids:
                b |= ilen == 0
            else:
                ids = np.where(ilen == 0, _EMPTY_HASH, ids)
            bad[cell[b]] = True
            bags.append((ids, w, cell, counts))
        # Lines the fast path refused: the exact path names the reason (or accepts them).
        lines_of = {}
        for i in np.flatnonzero(bad):
            line = data[int(lo[i]) : int(hi[i])]
            try:
                self.exact_line(line)
            except _Bad as e:
                lines_of[int(i)] = e
                continue
            # The fast path refused a line the exact one accepts: parse the chunk exactly.
            self.exact_chunks += 1
            lines = data.split(b"\n")
            if lines and lines[-1] == b"":
                lines.pop()
            return self._exact_chunk(lines, first_line, path, errs), n
        for i, e in lines_of.items():
            errs.add(first_line + i, e.reason, e.field, e.value, e.detail)
        keep = ~bad
        kept = np.flatnonzero(keep)
        sparse = {}
        for (c, _), ids in zip(self.cat_i, cat_ids, strict=True):
            sparse[c] = JaggedIds(lengths=np.ones(kept.shape[0], np.int32), values=ids[kept])
        for (c, _, _), (ids, w, cell, counts) in zip(self.bag_i, bags, strict=True):
            item_keep = keep[cell]
            sparse[c] = JaggedIds(
                lengths=counts[kept].astype(np.int32),
                values=ids[item_keep],
                weights=None if w is None else w[item_keep].astype(np.float32),
            )
        nl = 1 if self.label_i is not None else 0
        raw_labels = fval[kept, 0] if nl else np.zeros(kept.shape[0])
        dense = fval[kept, nl:]
        sparse = {c: sparse[c] for c in s.sparse_columns}
        return self._finish(raw_labels, dense, sparse, first_line + kept, path), n


_EMPTY_HASH = stable_hash_bytes(b"")
