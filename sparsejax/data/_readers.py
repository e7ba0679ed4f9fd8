"""Each format's reader of whole files into memory: `read_criteo`, `read_delimited`,
`read_libsvm`, `read_parquet` (and `iter_criteo_chunks`), each one `FileSource` read to
its end. They sit above `_stream.py`, which sits above the formats' parsers, so the
parsers never import the stream that drives them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from os import PathLike

from ._csv import ParseReport, TableSchema
from ._labels import LabelRule
from ._libsvm import DEFAULT_FEATURE
from ._loader import Examples
from ._stream import FileSource


def iter_criteo_chunks(
    path: str | PathLike | Sequence[str | PathLike],
    *,
    chunk_lines: int = 1 << 15,
    labeled: bool = True,
    strict: bool = False,
    max_lines: int | None = None,
    label: LabelRule | Mapping | None = None,
) -> Iterator[tuple[Examples, ParseReport]]:
    """Read Criteo TSV file(s) `chunk_lines` lines at a time (for files larger than
    memory); yields `(Examples of raw ids, ParseReport of that chunk)`; `ParseReport.merge`
    joins the reports. See `read_criteo` for the format and preprocessing, and
    `FileSource` for resumable streaming."""
    if chunk_lines < 1:
        raise ValueError(f"chunk_lines must be >= 1, got {chunk_lines}")
    src = _criteo_source(path, labeled, strict, max_lines, chunk_lines, label)
    for chunk in src.chunks():
        yield chunk.examples, chunk.report


def read_criteo(
    path: str | PathLike | Sequence[str | PathLike],
    *,
    labeled: bool = True,
    strict: bool = False,
    max_lines: int | None = None,
    chunk_lines: int | None = None,
    label: LabelRule | Mapping | None = None,
) -> tuple[Examples, ParseReport]:
    """Read a Criteo Kaggle DAC file into `Examples` of raw ids, and a `ParseReport`.

    Format: one example per line, tab-separated, `label I1..I13 C1..C26` (40 fields), or
    without the label (39 fields) when `labeled=False` (Kaggle test files; labels are 0).
    Dense features are `I1..I13` preprocessed to log1p(max(x, 0)) (empty -> 0); sparse
    features `"C1".."C26"` hold one raw id each: the hex value as int64, empty -> -1.
    Apply an id mapping per feature (`HashMapping`, `VocabMapping`) with
    `Examples.map_ids` before packing.

    `path`: a file, a glob or a list of them (`expand_files`), plain, `.gz` or `.zst`.
    `label`: a `LabelRule` for files whose labels are not 0/1 (e.g. `{"map": {-1: 0}}`);
    without one, a label other than "0"/"1" makes the line malformed.

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
    return _criteo_source(path, labeled, strict, max_lines, chunk_lines, label).read()


def _criteo_source(path, labeled, strict, max_lines, block_lines, label):
    """The `FileSource` behind `read_criteo` and `iter_criteo_chunks`."""
    return FileSource(
        path,
        format="criteo",
        labeled=labeled,
        label=label,
        strict=strict,
        max_lines=max_lines,
        block_lines=block_lines,
        key="path",
    )


def read_delimited(
    path: str | PathLike | Sequence[str | PathLike],
    schema: TableSchema | Mapping,
    *,
    strict: bool = False,
    max_lines: int | None = None,
    label: LabelRule | Mapping | None = None,
) -> tuple[Examples, ParseReport]:
    """Read delimited text as `schema` says into `Examples` of raw ids.

    `path`: a file, a glob or a list of them (see `expand_files`), plain, `.gz` or
    `.zst`; with `schema.header` the first file's line 1 is the header and a later file
    may repeat it or start with data (a table split into a headed part and a header-less
    continuation reads as one table). `label`: a `LabelRule` (or its dict) that maps and
    checks the labels; default: `schema.label` must hold 0 or 1, else a `LabelError`
    naming file, line and value.

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
    return FileSource(
        path,
        format="delimited",
        schema=schema,
        label=label,
        strict=strict,
        max_lines=max_lines,
        key="path",
    ).read()


def read_libsvm(
    path,
    *,
    field_map: Mapping | None = None,
    label: LabelRule | Mapping | None = None,
    feature: str = DEFAULT_FEATURE,
    strict: bool = False,
    max_lines: int | None = None,
):
    """Read libSVM / libFM file(s) (a path, a glob or a list; plain, `.gz` or `.zst`) into
    `Examples` of raw ids and a `ParseReport`. The format, `field_map` and the label rule:
    `LibsvmParser`'s module docstring (default: labels 0/1; `{"map": {-1: 0}}` for -1/+1).

    Example::

        ex, report = read_libsvm("avazu.libfm", label={"map": {-1: 0}},
                                 field_map={0: "site", 1: "app", 2: "device"})
    """
    return FileSource(
        path,
        format="libsvm",
        field_map=field_map,
        label=label,
        feature=feature,
        strict=strict,
        max_lines=max_lines,
        key="path",
    ).read()


def read_parquet(
    path,
    schema: TableSchema | Mapping,
    *,
    label: LabelRule | Mapping | None = None,
    strict: bool = False,
    max_lines: int | None = None,
):
    """Read Parquet file(s) (a path, a glob or a list) into `Examples` of raw ids and a
    `ParseReport`; `schema` names the columns (its delimiter/header fields are unused).

    Example::

        ex, report = read_parquet("part-*.parquet", {"label": "click",
                                  "categorical": ["user", "item"], "dense": ["age"]})
    """
    return FileSource(
        path,
        format="parquet",
        schema=schema,
        label=label,
        strict=strict,
        max_lines=max_lines,
        key="path",
    ).read()
