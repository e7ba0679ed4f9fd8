"""Criteo Kaggle DAC reader (`label \\t I1..I13 \\t C1..C26`) and the id mappings.

Preprocessing (shared with an independent PyTorch reference, so it is exact):

* dense I1..I13: empty -> 0, else x -> log1p(max(x, 0)) (computed in float64, stored f32);
* categorical C1..C26, one id each: raw = int(hex, 16) as int64, empty -> -1 (missing);
* ids: a separate per-feature step shared by train and eval, `HashMapping(buckets)`
  (0 if missing else 1 + raw % (buckets - 1)) or `VocabMapping.fit(train, min_count)`
  (values seen >= min_count times in train -> 1..n by increasing raw value, else 0), or
  for a dynamic table `RawIdMapping()` (raw kept as the int64 key, missing ->
  `MISSING_KEY`).

Parsing is vectorized over a chunk of lines: the chunk's bytes are split at tabs and
newlines with numpy, every column is converted by digit arithmetic on the byte array, and
only lines that fail are re-checked one by one in Python (to name the reason and field).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

from ..embedding import MISSING_KEY, FeatureSpec, TableSpec
from . import _text
from ._batch import JaggedIds
from ._csv import MISSING, ParseErrors
from ._labels import LabelRule
from ._loader import Examples
from ._text import count_lines, parse_decimal, parse_float, parse_hex, split_fields

NUM_DENSE = 13
NUM_CATEGORICAL = 26
DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
CATEGORICAL_NAMES = tuple(f"C{i}" for i in range(1, NUM_CATEGORICAL + 1))
MAX_HEX_DIGITS = 8
"""Criteo ids are 32-bit hashes written as 8 hex digits; longer values are malformed."""

_DENSE_RE = re.compile(rb"-?[0-9]+")
_HEX_RE = re.compile(rb"[0-9a-fA-F]{1,%d}" % MAX_HEX_DIGITS)


def _dense_transform(x: np.ndarray) -> np.ndarray:
    return np.log1p(np.maximum(x, 0).astype(np.float64)).astype(np.float32)


def _check_line(fields: list[bytes], labeled: bool, rule: LabelRule | None):
    """The exact per-line parse (used only for lines the fast path flagged): returns
    (label, dense ints, raw ids) or (reason, field, value) of the first bad field."""
    off = 1 if labeled else 0
    label = 0.0
    if labeled:
        if rule is None:
            if fields[0] not in (b"0", b"1"):
                return None, ("bad_label", "label", fields[0].decode(errors="replace"))
            label = float(fields[0])
        else:
            try:
                label = float(fields[0])
            except ValueError:
                return None, ("bad_label", "label", fields[0].decode(errors="replace"))
            if not math.isfinite(label):
                return None, ("bad_label", "label", fields[0].decode(errors="replace"))
    dense = []
    for name, f in zip(DENSE_NAMES, fields[off : off + NUM_DENSE], strict=True):
        if f and not _DENSE_RE.fullmatch(f):
            return None, ("bad_dense", name, f.decode(errors="replace"))
        dense.append(int(f) if f else 0)
    cats = []
    for name, f in zip(CATEGORICAL_NAMES, fields[off + NUM_DENSE :], strict=True):
        if f and not _HEX_RE.fullmatch(f):
            return None, ("bad_categorical", name, f.decode(errors="replace"))
        cats.append(int(f, 16) if f else MISSING)
    return (label, dense, cats), None


class CriteoParser:
    """Parses chunks of whole Criteo TSV lines into `Examples` of raw ids (used by
    `read_criteo`, `iter_criteo_chunks` and `FileSource(format="criteo")`).

    `label=None` keeps the format's rule: the label field is "0" or "1", other lines are
    malformed (`bad_label`). With a `LabelRule` the label is any number, mapped and
    checked by the rule (a value outside the allowed set is a `LabelError`).
    """

    def __init__(self, *, labeled: bool = True, label: LabelRule | None = None):
        self.labeled = labeled
        self.rule = label

    def parse(self, data: bytes, first_line: int, path: str, errs: ParseErrors):
        """`(Examples, lines read)` of a chunk of whole lines starting at `first_line`."""
        labeled, rule = self.labeled, self.rule
        if data and not data.endswith(b"\n"):
            data += b"\n"
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        n_fields = NUM_DENSE + NUM_CATEGORICAL + (1 if labeled else 0)
        if _text.NATIVE is not None and rule is None:
            labels, dense_int, raw, bad, lo, hi = _parse_native(data, labeled)
        else:
            labels, dense_int, raw, bad, lo, hi = self._parse_numpy(data, n_fields)
        n_lines = labels.shape[0]
        dense = _dense_transform(dense_int)
        keep = ~bad
        for i in np.flatnonzero(bad):  # exact re-check names the reason (or accepts the line)
            line_no = first_line + int(i)
            fields = data[int(lo[i]) : int(hi[i])].split(b"\t")
            if len(fields) != n_fields:
                errs.add(
                    line_no,
                    "field_count",
                    "(line)",
                    f"{len(fields)} fields",
                    f"expected {n_fields}",
                )
                continue
            parsed, err = _check_line(fields, labeled, rule)
            if err is not None:
                errs.add(line_no, *err)
                continue
            label, d, c = parsed
            labels[i] = label
            dense[i] = _dense_transform(np.asarray(d, np.float64))
            raw[i] = c
            keep[i] = True
        kept = np.flatnonzero(keep)
        labels = labels[kept]
        if labeled and rule is not None:
            labels = rule.apply(labels, path=path, lines=first_line + kept)
        return _examples(labels.astype(np.float32), dense[kept], raw[kept]), n_lines

    def _parse_numpy(self, data: bytes, n_fields: int):
        """`(labels f64, dense int64, raw int64, bad, line_lo, line_hi)` of every line,
        vectorized with numpy (the path without the C++ extension, and with a label rule)."""
        arr = np.frombuffer(data, np.uint8)
        n_lines, start, length, good, lo, hi = split_fields(arr, 9, n_fields)
        bad = ~good
        off = 1 if self.labeled else 0
        if self.labeled and self.rule is None:
            lab = arr[np.minimum(start[:, 0], max(arr.shape[0] - 1, 0))]
            bad |= (length[:, 0] != 1) | ((lab != ord("0")) & (lab != ord("1")))
            labels = (lab == ord("1")).astype(np.float64)
        elif self.labeled:
            labels, lbad = parse_float(arr, start[:, 0], length[:, 0])
            bad |= lbad | (length[:, 0] == 0)
        else:
            labels = np.zeros(n_lines)
        dsl = slice(off, off + NUM_DENSE)
        dense_int, bad_d = parse_decimal(arr, start[:, dsl], length[:, dsl])
        csl = slice(off + NUM_DENSE, n_fields)
        raw, bad_c = parse_hex(arr, start[:, csl], length[:, csl], MAX_HEX_DIGITS)
        return labels, dense_int, raw, bad | bad_d.any(1) | bad_c.any(1), lo, hi


def _parse_native(data: bytes, labeled: bool):
    """`CriteoParser._parse_numpy`'s result, by the C++ parser (labels "0"/"1" only)."""
    n = count_lines(data)
    width = 1 + NUM_DENSE + NUM_CATEGORICAL + 1
    out = np.empty((n, width), np.int64)
    starts = np.empty(n + 1, np.int64)
    _text.NATIVE.parse_criteo(data, labeled, out.reshape(-1), starts)
    labels = out[:, 0].astype(np.float64)
    dense_int = out[:, 1 : 1 + NUM_DENSE]
    raw = np.ascontiguousarray(out[:, 1 + NUM_DENSE : -1])
    return labels, dense_int, raw, out[:, -1].astype(bool), starts[:-1], starts[1:] - 1


def _examples(labels: np.ndarray, dense: np.ndarray, raw: np.ndarray) -> Examples:
    n = labels.shape[0]
    ones = np.ones(n, np.int32)
    sparse = {
        name: JaggedIds(lengths=ones, values=np.ascontiguousarray(raw[:, j]))
        for j, name in enumerate(CATEGORICAL_NAMES)
    }
    return Examples(labels=labels, dense=dense, sparse=sparse)


def empty_criteo() -> Examples:
    """Criteo-shaped `Examples` with no rows."""
    return _examples(
        np.zeros(0, np.float32),
        np.zeros((0, NUM_DENSE), np.float32),
        np.zeros((0, NUM_CATEGORICAL), np.int64),
    )


# ---------------------------------------------------------------------------------------
# Id mappings


@dataclasses.dataclass(frozen=True, kw_only=True)
class HashMapping:
    """Raw ids -> rows by modulo: 0 if missing (raw < 0) else 1 + raw % (buckets - 1)."""

    buckets: int
    """Rows of the table (row 0 is the missing id)."""

    def __post_init__(self):
        if not isinstance(self.buckets, int) or self.buckets < 2:
            raise ValueError(f"HashMapping: buckets must be an int >= 2, got {self.buckets!r}")

    @property
    def vocab_size(self) -> int:
        return self.buckets

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        raw = np.asarray(raw, np.int64)
        return np.where(raw < 0, 0, 1 + raw % (self.buckets - 1))


@dataclasses.dataclass(frozen=True)
class RawIdMapping:
    """Raw ids as the keys of a dynamic table (`TableSpec(dynamic=...)`): an id >= 0 is
    kept as it is (int64, no modulo, no collisions); a missing id (< 0, the readers' -1)
    becomes `MISSING_KEY`, a key of its own. The Criteo and delimited readers give 63-bit
    raw ids (hex values, `stable_hash` of strings, or integers with `int_ids`), so every
    distinct value keeps its own key."""

    @property
    def vocab_size(self) -> None:
        """None: a dynamic table has no vocabulary."""
        return None

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        raw = np.asarray(raw)
        if raw.dtype == np.uint64:
            big = raw >= np.uint64(1 << 63)
            if big.any():
                raise ValueError(
                    f"RawIdMapping: raw id {int(raw[big][0])} is >= 2**63; the keys of a "
                    f"dynamic table are 63-bit (hash larger ids, e.g. with stable_hash)"
                )
        raw = raw.astype(np.int64, copy=False)
        return np.where(raw < 0, np.int64(MISSING_KEY), raw)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class VocabMapping:
    """Raw ids -> rows by a vocabulary fitted on the train split (`fit`): the kept values
    get rows 1..n in increasing order of raw value; missing, rare and unseen ids get 0."""

    values: np.ndarray
    """Sorted kept raw values (int64[n]); row of values[i] is i + 1."""

    @classmethod
    def fit(cls, train_raw: np.ndarray, min_count: int = 1) -> VocabMapping:
        """Keep the non-missing values seen at least `min_count` times in `train_raw`."""
        raw = np.asarray(train_raw, np.int64)
        values, counts = np.unique(raw[raw >= 0], return_counts=True)
        return cls(values=values[counts >= min_count])

    @property
    def vocab_size(self) -> int:
        return int(self.values.shape[0]) + 1

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        raw = np.asarray(raw, np.int64)
        n = self.values.shape[0]
        if n == 0:
            return np.zeros_like(raw)
        i = np.searchsorted(self.values, raw)
        found = (raw >= 0) & (self.values[np.minimum(i, n - 1)] == raw)
        return np.where(found, i + 1, 0)


def fit_vocab(
    train: Examples, *, min_count: int = 1, features: Sequence[str] | None = None
) -> dict[str, VocabMapping]:
    """A `VocabMapping` per sparse feature (default: all), fitted on `train`'s raw ids."""
    names = train.feature_names if features is None else tuple(features)
    return {name: VocabMapping.fit(train.sparse[name].values, min_count) for name in names}


def vocab_sizes(
    mappings: Mapping[str, HashMapping | VocabMapping | RawIdMapping],
) -> dict[str, int | None]:
    """Rows each feature's table needs after its mapping, for building `TableSpec`s
    (None for a dynamic table's raw keys)."""
    return {name: m.vocab_size for name, m in mappings.items()}


def specs_for_vocab(
    vocab: Mapping[str, int], *, dim: int, combiner: str = "sum", **table_kwargs
) -> tuple[tuple[TableSpec, ...], tuple[FeatureSpec, ...]]:
    """One table per feature (named after it) of `vocab[name]` rows and width `dim`, and
    a one-id `FeatureSpec` reading it; `table_kwargs` go to every `TableSpec`."""
    tables = tuple(
        TableSpec(name=name, vocab_size=int(v), dim=dim, **table_kwargs)
        for name, v in vocab.items()
    )
    features = tuple(FeatureSpec(name=name, table=name, combiner=combiner) for name in vocab)
    return tables, features
