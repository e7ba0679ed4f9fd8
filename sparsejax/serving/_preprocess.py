"""Raw feature values in, table rows out: the training run's preprocessing, replayed.

A request's examples are JSON objects of raw values (`{"I1": 3, "C1": "68fd1e64"}`).
They go through the same code the run read its data with, so serving cannot drift
from training:

- `criteo` and `delimited` data: each example becomes one line of the run's file
  format and is parsed by the run's own parser (`CriteoParser`, `DelimitedParser`):
  the same hex parsing, string hashing, dense transforms and checks;
- `ids` (synthetic data): the values are the table rows themselves;

then the run's column transforms (indicator bags, dropped columns, `max_ids` caps)
and id mappings (hash buckets, the fitted vocabulary, a dynamic table's keys).

Defaults (documented in docs/serving.md): a missing feature is an empty field, as in the
data files (a missing dense value is the reader's default, a missing id maps to the
missing-id row, or an empty bag); an unseen id gets the table's default row (a
vocabulary's row 0, a dynamic table's default row). Anything else that is wrong is a
`RequestError` naming the example, the feature and the value.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Mapping, Sequence

import numpy as np

from ..data import (
    CATEGORICAL_NAMES,
    DENSE_NAMES,
    ColumnTransform,
    CriteoParser,
    DelimitedParser,
    Examples,
    HashMapping,
    JaggedIds,
    ParseErrors,
    RawIdMapping,
    TableSchema,
    VocabMapping,
)

_NUMBER_TYPES = frozenset({int, float})
_INT_TYPES = frozenset({int})


def _finite_number(v) -> bool:
    """A JSON number, finite as a float (an integer too large for one is not)."""
    if type(v) not in (int, float):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


_NO_LIMIT = np.iinfo(np.int64).max  # a dynamic table's keys: any id >= 0 (this one is
# read on its own)


def _plain_table(
    examples: Sequence[Mapping], names: Sequence[str], types: frozenset, dtype
) -> np.ndarray | None:
    """The (examples, names) array of `dtype` where every example has each of `names`
    with a value of `types`; None otherwise (and for no examples or no names)."""
    if not examples or not names:
        return None
    get = operator.itemgetter(*names)
    try:
        rows = [get(ex) for ex in examples]
    except KeyError:
        return None
    if len(names) == 1:
        rows = [(v,) for v in rows]
    if not types.issuperset(map(type, itertools.chain.from_iterable(rows))):
        return None
    return _as_array(rows, dtype)


def _as_array(values: list, dtype) -> np.ndarray | None:
    """`values` as an array of `dtype`; None where one does not fit (a huge integer)."""
    try:
        return np.asarray(values, dtype)
    except OverflowError:
        return None


class RequestError(ValueError):
    """A request's fault: an unknown, missing or wrongly typed feature, a bad value, too
    many examples. One line naming the example index, the feature and the value."""


@dataclasses.dataclass(frozen=True)
class KeyMapping:
    """A dynamic table's raw keys -> serving rows: key `keys[i]` is row `rows[i]` (row i
    where `rows` is None; keys sorted); any other key (unseen, or evicted) is
    `default_row`. A published table leaves rows free between the keys' and the default
    row, for the keys its deltas add (`updated`)."""

    keys: np.ndarray  # int64[n], sorted
    default_row: int
    rows: np.ndarray | None = None  # int64[n]: each key's row (None: row i)

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        raw = np.asarray(raw, np.int64)
        n = self.keys.shape[0]
        if n == 0:
            return np.full(raw.shape, self.default_row, np.int64)
        i = np.minimum(np.searchsorted(self.keys, raw), n - 1)
        found = self.keys[i] == raw
        return np.where(found, i if self.rows is None else self.rows[i], self.default_row)

    def updated(
        self, added: np.ndarray, removed: np.ndarray, added_rows: np.ndarray | None = None
    ) -> KeyMapping:
        """This mapping with the `removed` keys gone (their rows free) and the `added`
        keys at `added_rows`, or (None) in the lowest free rows, in the order given. A
        `ValueError` names a key or row that does not fit (a removed key it lacks, an
        added key it has, a row taken, out of range or given twice); `TooFewRows` when
        fewer rows are free than keys are added."""
        keys = self.keys
        rows = np.arange(keys.shape[0]) if self.rows is None else self.rows
        removed = np.asarray(removed, np.int64)
        if removed.size:
            i = np.minimum(np.searchsorted(keys, removed), max(keys.shape[0] - 1, 0))
            have = keys[i] == removed if keys.size else np.zeros(removed.shape, bool)
            if not have.all():
                raise ValueError(f"removes key {int(removed[~have][0])}, which is not served")
            keep = np.ones(keys.shape[0], bool)
            keep[i] = False
            keys, rows = keys[keep], rows[keep]
        added = np.asarray(added, np.int64)
        if added.ndim != 1 or (added_rows is not None and np.shape(added_rows) != added.shape):
            raise ValueError(f"adds {added.shape} keys at {np.shape(added_rows)} rows")
        if not added.size:
            return KeyMapping(keys, self.default_row, rows)
        taken = np.zeros(self.default_row, bool)
        taken[rows] = True
        if added_rows is None:
            added_rows = np.flatnonzero(~taken)[: added.shape[0]]
            if added_rows.shape[0] < added.shape[0]:
                raise TooFewRows(f"{added.shape[0]:,} new keys, {added_rows.shape[0]:,} free rows")
        else:
            added_rows = np.asarray(added_rows, np.int64)
            bad = (added_rows < 0) | (added_rows >= self.default_row)
            if bad.any():
                raise ValueError(
                    f"adds key {int(added[bad][0])} at row {int(added_rows[bad][0])}, "
                    f"outside rows 0..{self.default_row - 1}"
                )
            twice = taken[added_rows]
            by_row = np.argsort(added_rows, kind="stable")
            twice[by_row[1:][added_rows[by_row][1:] == added_rows[by_row][:-1]]] = True
            if twice.any():
                raise ValueError(
                    f"adds key {int(added[twice][0])} at row {int(added_rows[twice][0])}, "
                    f"which another key has"
                )
        order = np.argsort(added, kind="stable")
        added, added_rows = added[order], added_rows[order]
        at = np.searchsorted(keys, added)
        dup = keys[np.minimum(at, keys.shape[0] - 1)] == added if keys.size else at < 0
        dup[1:] |= added[1:] == added[:-1]
        if dup.any():
            raise ValueError(f"adds key {int(added[dup][0])}, which is served already")
        return KeyMapping(
            np.insert(keys, at, added), self.default_row, np.insert(rows, at, added_rows)
        )


class TooFewRows(ValueError):
    """`KeyMapping.updated`: fewer rows are free than keys are added."""


def _chain(*maps):
    maps = [m for m in maps if m is not None]
    if len(maps) == 1:
        return maps[0]

    def mapped(raw):
        for m in maps:
            raw = m(raw)
        return raw

    return mapped


def key_mapping(entry: Mapping, arrays: Mapping[str, np.ndarray]) -> KeyMapping:
    """A dynamic table's `KeyMapping` from its manifest entry (kind "keys")."""
    rows = entry.get("rows")
    return KeyMapping(
        arrays[entry["array"]], int(entry["default_row"]), None if rows is None else arrays[rows]
    )


def mapping_from_entry(
    entry: Mapping, arrays: Mapping[str, np.ndarray], keys: KeyMapping | None = None
):
    """The id mapping a manifest entry describes (see `_export.mapping_entry`); a
    dynamic table's with `keys` in place of the entry's own (after deltas)."""
    kind = entry["kind"]
    if kind == "hash":
        m = HashMapping(buckets=int(entry["buckets"]))
    elif kind == "vocab":
        m = VocabMapping(values=arrays[entry["array"]])
    elif kind == "keys":
        m = keys or key_mapping(entry, arrays)
    elif kind == "identity":
        m = None
    else:
        raise ValueError(f"unknown id mapping kind {kind!r}")
    return _chain(RawIdMapping() if entry.get("raw_keys") else None, m)


def _bad_type(i: int, name: str, v, want: str) -> RequestError:
    shown = repr(v)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return RequestError(f"example {i}: feature {name!r}: expected {want}, got {shown}")


class Preprocessor:
    """Parses requests' raw examples into mapped `Examples` (see the module docstring).

    Args:
      spec: the manifest's "input" section (`_export.input_spec`).
      mappings: per sparse feature, its id mapping (None: the value is the row).
      rows: per sparse feature, the rows of its table (ids are checked against it).
      max_ids: per pooled bag feature, the most ids an example may have.
      max_examples: the most examples one request may hold.
    """

    def __init__(
        self,
        spec: Mapping,
        mappings: Mapping[str, object],
        rows: Mapping[str, int],
        max_ids: Mapping[str, int],
        *,
        max_examples: int = 4096,
    ):
        self.kind = spec["kind"]
        self.dense = tuple(spec["dense"])
        self.sparse = tuple(spec["sparse"])
        self.fields = (*self.dense, *self.sparse)
        self._allowed = frozenset(self.fields)
        self.mappings = {k: v for k, v in mappings.items() if v is not None}
        self.rows = dict(rows)
        self.max_ids = dict(max_ids)
        self.max_examples = max_examples
        t = spec.get("transform") or {}
        self.transform = ColumnTransform(
            tuple(t.get("dense_names", self.dense)),
            indicator_bags=t.get("indicator_bags") or None,
            drop=tuple(t.get("drop", ())),
            max_ids=t.get("max_ids") or None,
        )
        if self.kind == "criteo":
            self._parser = CriteoParser(labeled=False)
            self._delim, self._sep = "\t", None
            self._line_fields = (*DENSE_NAMES, *CATEGORICAL_NAMES)
        elif self.kind == "delimited":
            schema = TableSchema.from_dict({**spec["schema"], "label": None, "header": False})
            self._line_fields = tuple(schema.columns)
            self._parser = DelimitedParser(schema, self._line_fields)
            self._delim, self._sep = schema.delimiter, schema.separator
        elif self.kind != "ids":
            raise ValueError(f"unknown input kind {self.kind!r}")

    # ---- checks shared by every kind ----------------------------------------------------
    def _check_examples(self, examples) -> int:
        if isinstance(examples, (str, bytes, Mapping)) or not isinstance(examples, Sequence):
            raise RequestError(
                f"expected a list of examples (objects of feature values), got "
                f"{type(examples).__name__}"
            )
        n = len(examples)
        if n == 0:
            raise RequestError("the request has no examples")
        if n > self.max_examples:
            raise RequestError(
                f"the request has {n} examples; at most {self.max_examples} per request"
            )
        allowed = self._allowed
        for i, ex in enumerate(examples):
            if not isinstance(ex, Mapping):
                raise RequestError(
                    f"example {i}: expected an object of feature values, got {type(ex).__name__}"
                )
            if not allowed.issuperset(ex):
                unknown = sorted(str(k) for k in ex if k not in allowed)
                raise RequestError(
                    f"example {i}: unknown feature {unknown[0]!r} (the model's features: "
                    f"{', '.join(self.fields)})"
                )
        return n

    def parse(self, examples: Sequence[Mapping]) -> Examples:
        """Mapped `Examples` of the request (labels 0), or a `RequestError`."""
        n = self._check_examples(examples)
        raw = self._read_ids(examples, n) if self.kind == "ids" else self._read_lines(examples)
        ex = raw if self.transform.is_identity else self.transform(raw)
        for name, cap in self.max_ids.items():
            if ex.most_ids(name) > cap:
                lengths = ex.sparse[name].lengths
                i = int(np.argmax(lengths))
                raise RequestError(
                    f"example {i}: feature {name!r} has {int(lengths[i])} ids, at most {cap}"
                )
        return ex.map_ids(self.mappings) if self.mappings else ex

    # ---- file formats: one line per example, parsed by the run's parser -----------------
    def _cell(self, i: int, name: str, v) -> str:
        t = type(v)
        if t is str:
            return v
        if v is None:
            return ""
        if t is int:
            return str(v)
        if t is float:
            if not math.isfinite(v):
                raise _bad_type(i, name, v, "a finite number")
            return repr(v)
        if t is list and self._sep is not None:
            return self._sep.join(self._item(i, name, x) for x in v)
        want = "a string, a number or null" + (", or a list" if self._sep else "")
        raise _bad_type(i, name, v, want)

    def _item(self, i: int, name: str, x) -> str:
        if type(x) in (str, int):
            s = str(x)
            if self._sep in s:
                raise _bad_type(i, name, x, f"list items without {self._sep!r}")
            return s
        raise _bad_type(i, name, x, "list items that are strings or integers")

    def _read_lines(self, examples: Sequence[Mapping]) -> Examples:
        delim, fields, cell = self._delim, self._line_fields, self._cell
        want = len(fields) - 1
        lines = []
        for i, ex in enumerate(examples):
            get = ex.get
            line = delim.join([cell(i, f, get(f)) for f in fields])
            if line.count(delim) != want or "\n" in line or "\r" in line:
                for f in fields:  # name the value that holds a delimiter or newline
                    s = cell(i, f, get(f))
                    if delim in s or "\n" in s or "\r" in s:
                        raise _bad_type(i, f, get(f), f"a value without {delim!r} or newlines")
            lines.append(line)
        data = ("\n".join(lines) + "\n").encode()
        errs = ParseErrors("request", strict=False)
        ex, _ = self._parser.parse(data, 0, "request", errs)
        if errs.counts:
            line, reason, field, value = errs.first[0]
            raise RequestError(f"example {line}: feature {field!r}: {reason} (value {value!r})")
        return ex

    # ---- synthetic data: the values are the rows ----------------------------------------
    def _read_ids(self, examples: Sequence[Mapping], n: int) -> Examples:
        """Where every example has every feature as a plain number (ids: one integer
        each), all the dense features, then all the ids, are converted and checked at
        once (a batch's cost was ~4 us a feature before any example); a feature with
        any other value is read on its own, column by column, value by value."""
        dense = np.zeros((n, len(self.dense)), np.float32)
        table = _plain_table(examples, self.dense, _NUMBER_TYPES, np.float64)
        plain = table is not None and np.isfinite(table).all()
        if plain:
            dense[:] = table
        for j, name in enumerate(() if plain else self.dense):
            column = [ex.get(name) for ex in examples]
            if _NUMBER_TYPES.issuperset(map(type, column)):
                got = _as_array(column, np.float64)
                if got is not None and np.isfinite(got).all():
                    dense[:, j] = got
                    continue
            for i, v in enumerate(column):
                if v is None:
                    continue
                if not _finite_number(v):
                    raise _bad_type(i, name, v, "a finite number")
                dense[i, j] = v
        table = _plain_table(examples, self.sparse, _INT_TYPES, np.int64)
        in_range = [False] * len(self.sparse)
        if table is not None:
            limits = [_NO_LIMIT if self.rows[k] is None else self.rows[k] for k in self.sparse]
            in_range = ((table.min(axis=0) >= 0) & (table.max(axis=0) < limits)).tolist()
            table = np.ascontiguousarray(table.T)
        sparse, one_id = {}, []
        for j, name in enumerate(self.sparse):
            if in_range[j]:
                sparse[name] = JaggedIds(lengths=np.ones(n, np.int64), values=table[j])
                one_id.append(name)
                continue
            rows, lengths = self.rows[name], np.zeros(n, np.int64)
            column = [ex.get(name) for ex in examples]
            if _INT_TYPES.issuperset(map(type, column)):
                got = _as_array(column, np.int64)
                if got is not None and (
                    not n or (got.min() >= 0 and (rows is None or got.max() < rows))
                ):
                    sparse[name] = JaggedIds(lengths=np.ones(n, np.int64), values=got)
                    one_id.append(name)
                    continue
            if rows is None:  # a dynamic table's keys, or ids its mapping takes
                rows = 1 << 63
            values = []
            for i, v in enumerate(column):
                ids = () if v is None else (v if type(v) is list else (v,))
                for x in ids:
                    if type(x) is not int or not 0 <= x < rows:
                        raise _bad_type(i, name, x, f"an integer id in [0, {rows})")
                values.extend(ids)
                lengths[i] = len(ids)
            sparse[name] = JaggedIds(lengths=lengths, values=np.asarray(values, np.int64))
        return Examples.unchecked(np.zeros(n, np.float32), dense, sparse, one_id)
