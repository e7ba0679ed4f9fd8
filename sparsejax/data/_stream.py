"""`FileSource`: files of one format read chunk by chunk, resumably, by one process's share.

Why: a dataset larger than memory must train with bounded memory, and a run interrupted
at hour 5 must resume where it stopped, not re-read from the start. A `FileSource` yields
`Chunk`s: a few MB of parsed rows as raw-id `Examples`, that chunk's `ParseReport`, and
the `StreamPosition` where the next chunk starts. `chunks(position)` resumes there. The
`Loader` trains from a source with a bounded shuffle buffer (see `Loader`); `read()`
reads everything into memory (what `read_criteo` and friends do).

Formats: "criteo" (`CriteoParser`), "delimited" (`DelimitedParser` with a
`TableSchema`), "libsvm" (`LibsvmParser`, libFM too, with an optional field map),
"parquet" (`ParquetParser` with a `TableSchema`). Text may be gzip or zstd compressed
(by the file name's ending).

Processes: `rank` / `num_processes` select this process's share (`shard_files`): whole
files when there are at least as many files as processes, else byte ranges of plain
text files and interleaved blocks (compressed text) or record batches (Parquet). The
shares of all ranks are disjoint and cover every row.

`transform(Examples) -> Examples` runs on every chunk as it is parsed (under a `Loader`,
in its background thread, off the training loop), e.g. an id mapping or a join. For
resuming to be exact it must be deterministic (the same chunk in, the same rows out).

Example::

    src = FileSource("day_*.tsv.gz", format="criteo", label={"map": {-1: 0}},
                     transform=lambda ex: ex.map_ids(mappings))
    loader = Loader(src, packer, shuffle_buffer=1 << 18, seed=0, epochs=1)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from os import PathLike
from typing import Any

from ._criteo import CriteoParser
from ._csv import DelimitedParser, ParseErrors, ParseReport, TableSchema
from ._files import (
    DataFileError,
    FilePiece,
    align_to_line,
    compression,
    delimited_header,
    expand_files,
    iter_line_blocks,
    shard_files,
)
from ._labels import LabelRule
from ._libsvm import LibsvmParser
from ._loader import Examples
from ._parquet import ParquetParser, _pa

FORMATS = ("criteo", "delimited", "libsvm", "parquet")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamPosition:
    """Where a `FileSource` continues: piece `piece` of this process's share, at
    uncompressed byte `offset` (text; None: the piece's start) or record batch `offset`
    (Parquet), whose first line (row) is number `line`, and whose block is number `block`.
    """

    piece: int = 0
    offset: int | None = None
    line: int = 1
    block: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StreamPosition:
        return cls(
            piece=int(d["piece"]),
            offset=None if d.get("offset") is None else int(d["offset"]),
            line=int(d.get("line", 1)),
            block=int(d.get("block", 0)),
        )


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Parsed rows of one block of a file and where the next chunk starts."""

    examples: Examples
    report: ParseReport
    position: StreamPosition  # the position after this chunk
    path: str
    first_line: int  # line (Parquet: row) number of the chunk's first row


class FileSource:
    """Files of one format as a resumable stream of `Chunk`s (see the module docstring).

    Args:
      files: a path, a glob or a list of them (`expand_files`; errors name `key`).
      format: "criteo" | "delimited" | "libsvm" | "parquet".
      schema: the `TableSchema` (or its dict) for delimited and Parquet.
      label: a `LabelRule` (or its dict). Default: the format's label must be 0 or 1
        (Criteo without a rule keeps its own rule: a label other than "0"/"1" makes the
        line malformed).
      labeled: Criteo only: False for files without the label field.
      field_map: libSVM/libFM only: {field id | "lo-hi" index range: feature name}.
      feature: libSVM only: the bag's name without a field map.
      strict: raise at the first malformed line instead of counting and skipping it.
      max_lines: stop after this many lines (rows) in all (for small reads and tests).
      rank, num_processes: this process's share of the files.
      transform: applied to every chunk's `Examples` as it is parsed.
      block_bytes: text bytes per chunk (a chunk holds whole lines).
      block_lines: at most this many lines per chunk (None: no limit).
      batch_rows: Parquet rows per record batch (= per chunk).
      key: the config key named in file errors (e.g. "data.train").
      data_dir: where relative paths are also looked up.
    """

    def __init__(
        self,
        files: str | PathLike | Sequence[str | PathLike],
        *,
        format: str,
        schema: TableSchema | Mapping | None = None,
        label: LabelRule | Mapping | None = None,
        labeled: bool = True,
        field_map: Mapping | None = None,
        feature: str = "features",
        strict: bool = False,
        max_lines: int | None = None,
        rank: int = 0,
        num_processes: int = 1,
        transform: Callable[[Examples], Examples] | None = None,
        block_bytes: int = 4 << 20,
        block_lines: int | None = None,
        batch_rows: int = 1 << 15,
        key: str = "data",
        data_dir: str | PathLike | None = None,
    ):
        if format not in FORMATS:
            raise ValueError(f"{key}: format must be one of {list(FORMATS)}, got {format!r}")
        if block_lines is not None and block_lines < 1:
            raise ValueError(f"block_lines must be >= 1, got {block_lines}")
        self.format = format
        self.files = expand_files(files, key=key, data_dir=data_dir)
        self.strict = strict
        self.max_lines = max_lines
        self.transform = transform
        self.block_bytes = block_bytes
        self.block_lines = block_lines
        self.batch_rows = batch_rows
        self.rank, self.num_processes = rank, num_processes
        self.pieces: list[FilePiece] = shard_files(
            self.files, rank=rank, num_processes=num_processes, splittable=format != "parquet"
        )
        rule = None if label is None else LabelRule.from_dict(label)
        if isinstance(schema, Mapping):
            schema = TableSchema.from_dict(schema)
        self.schema = schema
        self._skip = [0] * len(self.files)  # header bytes per file
        if format == "criteo":
            self.parser = CriteoParser(labeled=labeled, label=rule)
        elif format == "libsvm":
            self.parser = LibsvmParser(field_map=field_map, label=rule, feature=feature)
        elif format == "delimited":
            if schema is None:
                raise ValueError(f"{key}: format 'delimited' needs a schema")
            header, self._skip = delimited_header(
                self.files, delimiter=schema.delimiter, header=schema.header
            )
            names = list(schema.columns) if schema.columns is not None else header
            try:
                self.parser = DelimitedParser(schema, names, rule)
            except ValueError as e:
                raise DataFileError(f"{self.files[0]}: {e}") from None
        else:
            if schema is None:
                raise ValueError(f"{key}: format 'parquet' needs a schema")
            self.parser = ParquetParser(schema, rule)
            _, _, pq = _pa()
            for f in self.files:
                self.parser.check_file(f, pq.ParquetFile(f).schema_arrow.names)
        self.report = ParseReport(path=self.describe())
        """Everything `chunks()` parsed so far, merged (updated as chunks are read)."""

    def share(self, rank: int, num_processes: int) -> FileSource:
        """The same files and parsing, as process `rank` of `num_processes` reads them
        (how a position saved by another process count is resumed: `Loader`)."""
        other = copy.copy(self)
        other.rank, other.num_processes = rank, num_processes
        other.pieces = shard_files(
            self.files, rank=rank, num_processes=num_processes, splittable=self.format != "parquet"
        )
        other.report = ParseReport(path=self.describe())
        return other

    def describe(self) -> str:
        """The files, for reports: one path, or the first and a count."""
        if len(self.files) == 1:
            return self.files[0]
        return f"{self.files[0]} and {len(self.files) - 1} more files"

    # -- reading -------------------------------------------------------------------------
    def chunks(self, position: StreamPosition | Mapping | None = None) -> Iterator[Chunk]:
        """This process's share as `Chunk`s, from `position` (default: the start)."""
        if isinstance(position, Mapping):
            position = StreamPosition.from_dict(position)
        pos = position or StreamPosition()
        remaining = self.max_lines
        for p in range(pos.piece, len(self.pieces)):
            start = pos if p == pos.piece else StreamPosition(piece=p)
            gen = (
                self._parquet_chunks(p, start, remaining)
                if self.format == "parquet"
                else self._text_chunks(p, start, remaining)
            )
            for chunk in gen:
                if remaining is not None:
                    remaining -= chunk.report.lines_read
                self.report = self.report.merge(chunk.report)
                if self.transform is not None:
                    chunk = dataclasses.replace(chunk, examples=self.transform(chunk.examples))
                yield chunk
            if remaining is not None and remaining <= 0:
                return

    def _text_chunks(self, p: int, pos: StreamPosition, limit: int | None) -> Iterator[Chunk]:
        piece = self.pieces[p]
        path = piece.path
        skip = self._skip[piece.index]
        if pos.offset is None:
            if piece.start <= skip:
                offset, line = skip, 1 + (skip > 0)
            else:
                offset, line = align_to_line(path, piece.start)
            block = 0
        else:
            offset, line, block = pos.offset, pos.line, pos.block
        taken = 0
        for b in iter_line_blocks(
            path,
            start_offset=offset,
            start_line=line,
            start_block=block,
            end=piece.end,
            block_bytes=self.block_bytes,
            block_lines=self.block_lines,
            every=piece.every,
            which=piece.which,
        ):
            if not b.mine:
                continue
            data, n_lines = b.data, b.num_lines
            if limit is not None and taken + n_lines > limit:
                n_lines = limit - taken
                data = b"\n".join(data.split(b"\n", n_lines)[:n_lines]) + b"\n"
            taken += n_lines
            errs = ParseErrors(path, self.strict)
            ex, n = self.parser.parse(data, b.first_line, path, errs)
            nxt = StreamPosition(piece=p, offset=b.next_offset, line=b.next_line, block=b.index + 1)
            yield Chunk(ex, errs.report(n, len(ex)), nxt, path, b.first_line)
            if limit is not None and taken >= limit:
                return

    def _parquet_chunks(self, p: int, pos: StreamPosition, limit: int | None) -> Iterator[Chunk]:
        _, _, pq = _pa()
        piece = self.pieces[p]
        path = piece.path
        pf = pq.ParquetFile(path)
        self.parser.check_file(path, pf.schema_arrow.names)
        meta = pf.metadata
        # Batches are numbered over the file: row group g holds ceil(rows_g / batch_rows).
        b0, row0 = 0, 1
        target = pos.offset or 0
        cols = self.parser.columns
        for g in range(meta.num_row_groups):
            rows_g = meta.row_group(g).num_rows
            nb = -(-rows_g // self.batch_rows)
            if b0 + nb <= target:
                b0, row0 = b0 + nb, row0 + rows_g
                continue
            mine = [k for k in range(b0, b0 + nb) if k >= target and k % piece.every == piece.which]
            if mine:
                row = row0
                for k, batch in enumerate(
                    pf.iter_batches(batch_size=self.batch_rows, row_groups=[g], columns=cols),
                    b0,
                ):
                    if k >= target and k % piece.every == piece.which:
                        if limit is not None:
                            if limit <= 0:
                                return
                            batch = batch.slice(0, limit)
                            limit -= batch.num_rows
                        errs = ParseErrors(path, self.strict)
                        ex, n = self.parser.parse(batch, row, path, errs)
                        nxt = StreamPosition(
                            piece=p, offset=k + 1, line=row + batch.num_rows, block=k + 1
                        )
                        yield Chunk(ex, errs.report(n, len(ex)), nxt, path, row)
                    row += batch.num_rows
            b0, row0 = b0 + nb, row0 + rows_g

    def read(self) -> tuple[Examples, ParseReport]:
        """This process's whole share in memory, and its `ParseReport`."""
        parts = []
        report = ParseReport(path=self.describe())
        for chunk in self.chunks():
            parts.append(chunk.examples)
            report = report.merge(chunk.report)
        if not parts:
            parts = [self.empty()]
        return (parts[0] if len(parts) == 1 else Examples.concat(parts)), report

    def empty(self) -> Examples:
        """`Examples` with this source's features and no rows."""
        if self.format == "parquet":
            import pyarrow as pa

            _, _, pq = _pa()
            sch = pq.ParquetFile(self.files[0]).schema_arrow
            batch = pa.RecordBatch.from_pylist([], schema=sch)
            ex = self.parser.parse(batch, 1, self.files[0], ParseErrors(self.files[0], False))[0]
        else:
            ex = self.parser.parse(b"", 1, self.files[0], ParseErrors(self.files[0], False))[0]
        return self.transform(ex) if self.transform is not None else ex

    def __repr__(self) -> str:
        share = f", rank {self.rank} of {self.num_processes}" if self.num_processes > 1 else ""
        comp = {compression(f) for f in self.files} - {None}
        c = f", {'/'.join(sorted(comp))}" if comp else ""
        return f"FileSource({self.format}: {self.describe()}{c}{share})"
