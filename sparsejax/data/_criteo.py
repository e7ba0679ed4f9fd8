"""Criteo Kaggle DAC reader (`label \\t I1..I13 \\t C1..C26`) and the id mappings.

Preprocessing (shared with an independent PyTorch reference, so it is exact):

* dense I1..I13: empty -> 0, else x -> log1p(max(x, 0)) (computed in float64, stored f32);
* categorical C1..C26, one id each: raw = int(hex, 16) as int64, empty -> -1 (missing);
* ids: a separate per-feature step shared by train and eval, `HashMapping(buckets)`
  (0 if missing else 1 + raw % (buckets - 1)) or `VocabMapping.fit(train, min_count)`
  (values seen >= min_count times in train -> 1..n by increasing raw value, else 0).

Parsing is vectorized over a chunk of lines: the chunk's bytes are split at tabs and
newlines with numpy, every column is converted by digit arithmetic on the byte array, and
only lines that fail are re-checked one by one in Python (to name the reason and field).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from os import PathLike

import numpy as np

from ..embedding._spec import FeatureSpec, TableSpec
from ._batch import JaggedIds
from ._csv import MISSING, ParseReport, _Errors, open_text
from ._loader import Examples

NUM_DENSE = 13
NUM_CATEGORICAL = 26
DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
CATEGORICAL_NAMES = tuple(f"C{i}" for i in range(1, NUM_CATEGORICAL + 1))
MAX_HEX_DIGITS = 8
"""Criteo ids are 32-bit hashes written as 8 hex digits; longer values are malformed."""
_MAX_FAST_DIGITS = 18  # longer dense integers go to the exact per-line Python path

_DENSE_RE = re.compile(rb"-?[0-9]+")
_HEX_RE = re.compile(rb"[0-9a-fA-F]{1,%d}" % MAX_HEX_DIGITS)
_HEX_LUT = np.full(256, 255, np.uint8)
for _c in b"0123456789":
    _HEX_LUT[_c] = _c - 48
for _c in b"abcdef":
    _HEX_LUT[_c] = _c - 87
    _HEX_LUT[_c - 32] = _c - 87  # upper case


def _parse_decimal(arr: np.ndarray, start: np.ndarray, length: np.ndarray):
    """Signed decimal integers at `arr[start:start+length]` (elementwise, any shape);
    returns (values int64, bad bool). Empty fields give 0 and are not bad."""
    last = arr.shape[0] - 1
    neg = (length > 0) & (arr[np.minimum(start, last)] == ord("-"))
    bad = (length > _MAX_FAST_DIGITS) | (neg & (length == 1))
    val = np.zeros(start.shape, np.int64)
    width = int(min(length.max(initial=0), _MAX_FAST_DIGITS))
    for j in range(width):
        valid = (j < length) & ~(neg & (j == 0))
        d = arr[np.minimum(start + j, last)].astype(np.int64) - 48
        ok = (d >= 0) & (d <= 9)
        bad |= valid & ~ok
        val = np.where(valid & ok, val * 10 + d, val)
    return np.where(neg, -val, val), bad


def _parse_hex(arr: np.ndarray, start: np.ndarray, length: np.ndarray):
    """Hex ids (1..MAX_HEX_DIGITS digits); returns (raw int64, empty -> -1, bad bool)."""
    last = arr.shape[0] - 1
    bad = length > MAX_HEX_DIGITS
    val = np.zeros(start.shape, np.uint32)  # 8 hex digits fit 32 bits
    for j in range(min(int(length.max(initial=0)), MAX_HEX_DIGITS)):
        valid = j < length
        d = _HEX_LUT[arr[np.minimum(start + j, last)]]
        ok = d != 255
        bad |= valid & ~ok
        val = np.where(valid & ok, (val << np.uint32(4)) | d, val)
    return np.where(length == 0, MISSING, val.astype(np.int64)), bad


def _dense_transform(x: np.ndarray) -> np.ndarray:
    return np.log1p(np.maximum(x, 0).astype(np.float64)).astype(np.float32)


def _check_line(fields: list[bytes], labeled: bool):
    """The exact per-line parse (used only for lines the fast path flagged): returns
    (label, dense ints, raw ids) or (reason, field, value) of the first bad field."""
    off = 1 if labeled else 0
    label = 0
    if labeled:
        if fields[0] not in (b"0", b"1"):
            return None, ("bad_label", "label", fields[0].decode(errors="replace"))
        label = int(fields[0])
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


def _parse_chunk(data: bytes, first_line: int, labeled: bool, errs: _Errors):
    """Parse a chunk of whole lines; returns (labels, dense, raw ids [n, 26], lines)."""
    if data and not data.endswith(b"\n"):
        data += b"\n"
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    n_fields = NUM_DENSE + NUM_CATEGORICAL + (1 if labeled else 0)
    arr = np.frombuffer(data, np.uint8)
    sep = np.flatnonzero((arr == 9) | (arr == 10))
    line_last = np.flatnonzero(arr[sep] == 10)  # index in `sep` of each line's newline
    n_lines = line_last.shape[0]
    line_first = np.empty(n_lines, np.int64)  # index in `sep` of each line's first field end
    line_first[:1] = 0
    line_first[1:] = line_last[:-1] + 1
    counts = line_last - line_first + 1
    good_count = counts == n_fields
    # Field k of line l ends at sep[line_first[l] + k] and starts after the previous one.
    field_start = np.empty(sep.shape[0], np.int64)
    field_start[:1] = 0
    field_start[1:] = sep[:-1] + 1
    k = np.minimum(line_first[:, None] + np.arange(n_fields), sep.shape[0] - 1)
    start, end = field_start[k], sep[k]
    length = np.where(good_count[:, None], end - start, 0)
    bad = ~good_count
    off = 1 if labeled else 0
    if labeled:
        lab = arr[start[:, 0]]
        bad |= (length[:, 0] != 1) | ((lab != ord("0")) & (lab != ord("1")))
        labels = (lab == ord("1")).astype(np.float32)
    else:
        labels = np.zeros(n_lines, np.float32)
    dsl = slice(off, off + NUM_DENSE)
    dense_int, bad_d = _parse_decimal(arr, start[:, dsl], length[:, dsl])
    csl = slice(off + NUM_DENSE, n_fields)
    raw, bad_c = _parse_hex(arr, start[:, csl], length[:, csl])
    bad |= bad_d.any(1) | bad_c.any(1)
    dense = _dense_transform(dense_int)
    keep = ~bad
    for i in np.flatnonzero(bad):  # exact re-check names the reason (or accepts the line)
        line_no = first_line + int(i)
        lo = int(sep[line_first[i] - 1]) + 1 if i > 0 else 0
        fields = data[lo : int(sep[line_last[i]])].split(b"\t")
        if len(fields) != n_fields:
            errs.add(
                line_no, "field_count", "(line)", f"{len(fields)} fields", f"expected {n_fields}"
            )
            continue
        parsed, err = _check_line(fields, labeled)
        if err is not None:
            errs.add(line_no, *err)
            continue
        label, d, c = parsed
        labels[i] = label
        dense[i] = _dense_transform(np.asarray(d, np.float64))
        raw[i] = c
        keep[i] = True
    return labels[keep], dense[keep], raw[keep], n_lines


def _examples(labels: np.ndarray, dense: np.ndarray, raw: np.ndarray) -> Examples:
    n = labels.shape[0]
    ones = np.ones(n, np.int32)
    sparse = {
        name: JaggedIds(lengths=ones, values=np.ascontiguousarray(raw[:, j]))
        for j, name in enumerate(CATEGORICAL_NAMES)
    }
    return Examples(labels=labels, dense=dense, sparse=sparse)


def iter_criteo_chunks(
    path: str | PathLike,
    *,
    chunk_lines: int = 1 << 15,
    labeled: bool = True,
    strict: bool = False,
    max_lines: int | None = None,
) -> Iterator[tuple[Examples, ParseReport]]:
    """Read a Criteo TSV file `chunk_lines` lines at a time (for files larger than memory);
    yields `(Examples of raw ids, ParseReport of that chunk)`; `ParseReport.merge` joins
    the reports. See `read_criteo` for the format and preprocessing."""
    if chunk_lines < 1:
        raise ValueError(f"chunk_lines must be >= 1, got {chunk_lines}")
    path_s = str(path)
    line_no = 1
    remaining = max_lines
    with open_text(path_s, "rb") as f:
        while remaining is None or remaining > 0:
            take = chunk_lines if remaining is None else min(chunk_lines, remaining)
            data = b"".join(itertools.islice(f, take))
            if not data:
                break
            errs = _Errors(path_s, strict)
            labels, dense, raw, n_lines = _parse_chunk(data, line_no, labeled, errs)
            line_no += n_lines
            if remaining is not None:
                remaining -= n_lines
            yield _examples(labels, dense, raw), errs.report(n_lines, labels.shape[0])


def read_criteo(
    path: str | PathLike,
    *,
    labeled: bool = True,
    strict: bool = False,
    max_lines: int | None = None,
    chunk_lines: int = 1 << 15,
) -> tuple[Examples, ParseReport]:
    """Read a Criteo Kaggle DAC file into `Examples` of raw ids, and a `ParseReport`.

    Format: one example per line, tab-separated, `label I1..I13 C1..C26` (40 fields), or
    without the label (39 fields) when `labeled=False` (Kaggle test files; labels are 0).
    Dense features are `I1..I13` preprocessed to log1p(max(x, 0)) (empty -> 0); sparse
    features `"C1".."C26"` hold one raw id each: the hex value as int64, empty -> -1.
    Apply an id mapping per feature (`HashMapping`, `VocabMapping`) with
    `Examples.map_ids` before packing.

    Malformed lines (wrong field count, bad label, a dense field that is not an integer,
    a categorical that is not 1-8 hex digits) are skipped and counted in the report; with
    `strict=True` the first raises `ValueError` naming file, line, field and value.

    Example::

        examples, report = read_criteo("train.txt")
        print(report)  # train.txt: kept 10,000 of 10,000 lines; no malformed lines
        train, valid = examples.split(9_000)
        vocab = fit_vocab(train, min_count=2)
        train, valid = train.map_ids(vocab), valid.map_ids(vocab)
    """
    chunks, report = [], ParseReport(path=str(path))
    for ex, rep in iter_criteo_chunks(
        path, chunk_lines=chunk_lines, labeled=labeled, strict=strict, max_lines=max_lines
    ):
        chunks.append(ex)
        report = report.merge(rep)
    if not chunks:
        chunks = [
            _examples(
                np.zeros(0, np.float32),
                np.zeros((0, NUM_DENSE), np.float32),
                np.zeros((0, NUM_CATEGORICAL), np.int64),
            )
        ]
    return (chunks[0] if len(chunks) == 1 else Examples.concat(chunks)), report


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


def vocab_sizes(mappings: Mapping[str, HashMapping | VocabMapping]) -> dict[str, int]:
    """Rows each feature's table needs after its mapping, for building `TableSpec`s."""
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
