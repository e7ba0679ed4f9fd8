"""Schema-driven reader of delimited text (CSV/TSV) into `Examples`, and the `ParseReport`
that every reader returns."""

from __future__ import annotations

import dataclasses
import difflib
import gzip
import hashlib
import math
from collections.abc import Mapping, Sequence
from os import PathLike

import numpy as np

from ._batch import JaggedIds
from ._loader import Examples

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

    MAX_FIRST_ERRORS = 10

    @property
    def lines_skipped(self) -> int:
        return self.lines_read - self.lines_kept

    def merge(self, other: ParseReport) -> ParseReport:
        """The report of reading this part and then `other` (chunks of one file)."""
        errors = dict(self.errors)
        for k, v in other.errors.items():
            errors[k] = errors.get(k, 0) + v
        return ParseReport(
            path=self.path,
            lines_read=self.lines_read + other.lines_read,
            lines_kept=self.lines_kept + other.lines_kept,
            errors=errors,
            first_errors=(self.first_errors + other.first_errors)[: self.MAX_FIRST_ERRORS],
        )

    def summary(self) -> str:
        s = f"{self.path}: kept {self.lines_kept:,} of {self.lines_read:,} lines"
        if not self.errors:
            return s + "; no malformed lines"
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(self.errors.items()))
        first = "; ".join(f"line {ln} {r} {f}={v!r}" for ln, r, f, v in self.first_errors[:3])
        return f"{s}; skipped {self.lines_skipped:,} ({reasons}); first: {first}"

    def __str__(self) -> str:
        return self.summary()


class _Errors:
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

    def report(self, lines_read: int, lines_kept: int) -> ParseReport:
        return ParseReport(
            path=self.path,
            lines_read=lines_read,
            lines_kept=lines_kept,
            errors=dict(self.counts),
            first_errors=tuple(self.first),
        )


def open_text(path: str | PathLike, mode: str = "rb"):
    """Open a plain or gzip-compressed (`.gz`) file."""
    path = str(path)
    return gzip.open(path, mode) if path.endswith(".gz") else open(path, mode)


def stable_hash(value: str) -> int:
    """A 63-bit id of a string, the same in every process and Python version (blake2b);
    never negative, so it cannot collide with the missing id -1."""
    digest = hashlib.blake2b(value.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


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
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in valid:
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"TableSchema: unknown key {key!r}{hint} (valid keys: {valid})")
        return cls(**d)

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
# Reader


class _Bad(Exception):
    def __init__(self, reason: str, field: str, value: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.field, self.value, self.detail = reason, field, value, detail


def read_delimited(
    path: str | PathLike,
    schema: TableSchema | Mapping,
    *,
    strict: bool = False,
    max_lines: int | None = None,
) -> tuple[Examples, ParseReport]:
    """Read a delimited text file as `schema` says into `Examples` of raw ids.

    Malformed lines (wrong number of fields, a bad label/dense/id/weight) are skipped and
    counted in the `ParseReport`; with `strict=True` the first one raises a `ValueError`
    naming the file, line, field and value. Raw ids (hashes, or integers with `int_ids`)
    still need an id mapping (`HashMapping`, `VocabMapping`) before they index tables.

    Example::

        schema = TableSchema.from_dict({"label": "click", "categorical": ["user"],
                                        "multi_hot": ["tags"], "dense": ["age"]})
        examples, report = read_delimited("clicks.csv", schema)
        print(report)
    """
    if not isinstance(schema, TableSchema):
        schema = TableSchema.from_dict(schema)
    path = str(path)
    errs = _Errors(path, strict)
    nd = len(schema.dense)
    labels: list[float] = []
    dense_rows: list[list[float]] = []
    lengths: dict[str, list[int]] = {c: [] for c in schema.sparse_columns}
    values: dict[str, list[int]] = {c: [] for c in schema.sparse_columns}
    weights: dict[str, list[float]] = {c: [] for c in schema.weighted}
    hash_cache: dict[str, int] = {}

    def to_id(col: str, text: str) -> int:
        if schema.int_ids:
            if not text.isdigit() or not text.isascii():
                raise _Bad("bad_id", col, text, "expected a non-negative integer id")
            return int(text)
        h = hash_cache.get(text)
        if h is None:
            h = hash_cache[text] = stable_hash(text)
        return h

    def to_float(reason: str, col: str, text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise _Bad(reason, col, text, "not a number") from None
        if not math.isfinite(x):
            raise _Bad(reason, col, text, "not finite")
        return x

    with open_text(path, "rt") as f:
        first_line = 1
        if schema.header:
            header = f.readline().rstrip("\r\n").split(schema.delimiter)
            first_line = 2
        names = list(schema.columns) if schema.columns is not None else header
        schema.check_columns(names)
        pos = {c: i for i, c in enumerate(names)}
        n_fields = len(names)
        label_i = pos[schema.label] if schema.label else None
        dense_i = [pos[c] for c in schema.dense]
        cat_i = [(c, pos[c]) for c in schema.categorical]
        bag_i = [(c, pos[c], c in schema.weighted) for c in (*schema.multi_hot, *schema.sequence)]
        read = 0
        for line_no, line in enumerate(f, first_line):
            if max_lines is not None and read >= max_lines:
                break
            read += 1
            fields = line.rstrip("\r\n").split(schema.delimiter)
            try:
                if len(fields) != n_fields:
                    raise _Bad(
                        "field_count", "(line)", f"{len(fields)} fields", f"expected {n_fields}"
                    )
                y = 0.0
                if label_i is not None:
                    y = to_float("bad_label", schema.label, fields[label_i])
                row = [
                    schema.dense_missing
                    if fields[i] == ""
                    else to_float("bad_dense", schema.dense[k], fields[i])
                    for k, i in enumerate(dense_i)
                ]
                cats = [MISSING if fields[i] == "" else to_id(c, fields[i]) for c, i in cat_i]
                bags = []
                for c, i, is_weighted in bag_i:
                    items = fields[i].split(schema.separator) if fields[i] else []
                    if not is_weighted:
                        bags.append(([to_id(c, t) for t in items], None))
                        continue
                    ids, ws = [], []
                    for t in items:
                        key, sep, w = t.rpartition(schema.weight_separator)
                        if not sep:
                            raise _Bad("bad_weight", c, t, "expected id:weight")
                        ids.append(to_id(c, key))
                        ws.append(to_float("bad_weight", c, w))
                    bags.append((ids, ws))
            except _Bad as e:
                errs.add(line_no, e.reason, e.field, e.value, e.detail)
                continue
            labels.append(y)
            dense_rows.append(row)
            for (c, _), v in zip(cat_i, cats, strict=True):
                lengths[c].append(1)
                values[c].append(v)
            for (c, _, is_weighted), (ids, ws) in zip(bag_i, bags, strict=True):
                lengths[c].append(len(ids))
                values[c].extend(ids)
                if is_weighted:
                    weights[c].extend(ws)

    n = len(labels)
    dense = np.asarray(dense_rows, np.float64).reshape(n, nd)
    if schema.dense_log1p:
        dense = np.log1p(np.maximum(dense, 0.0))
    sparse = {
        c: JaggedIds(
            lengths=np.asarray(lengths[c], np.int32),
            values=np.asarray(values[c], np.int64),
            weights=np.asarray(weights[c], np.float32) if c in weights else None,
        )
        for c in schema.sparse_columns
    }
    examples = Examples(
        labels=np.asarray(labels, np.float32), dense=dense.astype(np.float32), sparse=sparse
    )
    return examples, errs.report(read, n)
