"""Input files: which files a config names, how to open them, how to read them in blocks
of whole lines, and how processes share them.

* `expand_files(spec, key=...)`: a path, a glob or a list of them -> the files, in order;
  a missing file or a glob that matches nothing is a one-line `DataFileError` naming the
  config key and the pattern (caught at config time, not hours into a run).
* `open_file(path)`: plain, gzip (`.gz`) or zstd (`.zst`, `.zstd`) by extension, read as
  one uncompressed byte stream. A truncated or corrupt compressed file raises a one-line
  `DataFileError` naming the file and how many uncompressed bytes and lines were read,
  never a traceback and never a silent early end (zstd's own stream reader ends quietly
  at a truncation; this one checks that the last frame is complete).
* `iter_line_blocks(...)`: a file as blocks of whole lines (about `block_bytes` each) with
  the line number of each block's first line, so parsers work on a few MB at a time and
  errors name `file:line`. A block's end depends only on where it starts, so a reader
  that resumes at a block boundary reads exactly the blocks an uninterrupted one would.
* `shard_files(...)`: this process's share of the files (`rank` of `num_processes`): whole
  files when there are at least as many files as processes (file i goes to rank
  i % num_processes); otherwise each plain text file is split into byte ranges (a line
  belongs to the range in which it starts), and compressed files and Parquet files are
  interleaved by block / row group. Shares are disjoint and together cover every line.
* `first_line(path)` and `delimited_header(...)`: a delimited table split over several
  files with the header on the first file only (a later file whose line 1 equals the
  header skips it; one without a header is read whole; one whose header differs is an
  error naming both files and the first differing column). `starts_with_header(...)`:
  the same judgement of one file's line 1 (the runner's eval and test files, read
  apart from the train files, take the train header when they have none).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import zlib
from collections.abc import Iterator, Sequence
from os import PathLike

import numpy as np

from ._text import count_lines

COMPRESSED_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
"""File name endings read as compressed streams."""

_GLOB_CHARS = set("*?[")


class DataFileError(ValueError):
    """A problem with a data file a user can fix (missing, truncated, inconsistent): the
    message is one line naming the file (and line, column or config key)."""


def expand_files(
    spec: str | PathLike | Sequence[str | PathLike],
    *,
    key: str = "data",
    data_dir: str | PathLike | None = None,
) -> list[str]:
    """The files `spec` names: a path, a glob (`*`, `?`, `[..]`, `**` across folders) or a
    list of paths and globs. Returns absolute paths, in the order given, each glob's
    matches sorted by name, without duplicates.

    A relative path or glob that finds nothing in the working directory is looked up in
    `data_dir` (e.g. `$SPARSEJAX_DATA_DIR`) when given. A missing file or a glob that
    matches no file raises `DataFileError` naming `key` and the pattern.
    """
    items = [spec] if isinstance(spec, str | PathLike) else list(spec)
    if not items:
        raise DataFileError(f"{key}: no files given (an empty list)")
    out: list[str] = []
    seen: set[str] = set()
    for item in items:
        if not isinstance(item, str | PathLike):
            raise DataFileError(f"{key}: expected a path or a glob, got {item!r}")
        pattern = os.path.expanduser(os.fspath(item))
        found = _expand_one(pattern)
        if not found and data_dir is not None and not os.path.isabs(pattern):
            found = _expand_one(os.path.join(os.fspath(data_dir), pattern))
        if not found:
            where = f" (also looked in {os.fspath(data_dir)})" if data_dir is not None else ""
            if _GLOB_CHARS & set(pattern):
                raise DataFileError(f"{key}: the pattern {pattern!r} matches no files{where}")
            what = "is a directory, not a file" if os.path.isdir(pattern) else "no such file"
            raise DataFileError(f"{key}: {pattern!r}: {what}{where}")
        for f in found:
            if f not in seen:
                seen.add(f)
                out.append(f)
    return out


def _expand_one(pattern: str) -> list[str]:
    if _GLOB_CHARS & set(pattern):
        matches = sorted(glob.glob(pattern, recursive=True))
        return [os.path.abspath(m) for m in matches if os.path.isfile(m)]
    return [os.path.abspath(pattern)] if os.path.isfile(pattern) else []


def compression(path: str | PathLike) -> str | None:
    """ "gzip", "zstd" or None, by the file name's ending."""
    name = os.fspath(path).lower()
    for suffix, kind in COMPRESSED_SUFFIXES.items():
        if name.endswith(suffix):
            return kind
    return None


class _Stream:
    """A file's uncompressed bytes, read forward (`read`); `skip_to` moves to an
    uncompressed offset (a seek for plain files, decompress-and-drop otherwise).

    Compressed data is decompressed member by member (gzip) or frame by frame (zstd). A
    stream that ends inside a member or frame, or is corrupt, first delivers every byte
    it could decode and then raises `DataFileError` on the next read, so a reader sees
    the error before it could take the cut-off last line for a whole one.
    """

    def __init__(self, path: str):
        self.path = path
        self.kind = compression(path)
        self.raw = open(path, "rb")  # noqa: SIM115 - closed by close()
        self.pos = 0  # uncompressed bytes returned so far
        self.lines = 0  # newlines returned so far (for error messages)
        if self.kind is not None:
            if self.kind == "zstd":
                import zstandard

                self._zstd_error = zstandard.ZstdError
                self._dctx = zstandard.ZstdDecompressor()
            else:
                self._zstd_error = zlib.error
            self._obj = self._new()
            self._fed = False  # the current member / frame has received input
            self._pending = bytearray()
            self._eof = False
            self._error: DataFileError | None = None

    def _new(self):
        if self.kind == "gzip":
            return zlib.decompressobj(wbits=31)
        return self._dctx.decompressobj()

    def _fail(self, exc: BaseException) -> DataFileError:
        return DataFileError(
            f"{self.path}: truncated or corrupt {self.kind} data after {self.pos:,} "
            f"uncompressed bytes ({self.lines:,} complete lines) ({exc}); nothing after "
            f"that point was read"
        )

    def read(self, n: int) -> bytes:
        if self.kind is None:
            data = self.raw.read(n)
        else:
            data = self._read_compressed(n)
            self.lines += data.count(b"\n")  # only compressed streams report lines
        self.pos += len(data)
        return data

    def _read_compressed(self, n: int) -> bytes:
        while len(self._pending) < n and not self._eof and self._error is None:
            comp = self.raw.read(1 << 18)
            if not comp:
                if self._fed:
                    what = "member" if self.kind == "gzip" else "frame"
                    self._error = EOFError(f"the file ends inside a compressed {what}")
                self._eof = True
                break
            try:
                while comp:
                    self._fed = True
                    self._pending += self._obj.decompress(comp)
                    comp = b""
                    if self._obj.eof:  # a member / frame ended; the rest starts the next
                        comp = self._obj.unused_data
                        self._obj = self._new()
                        self._fed = False
            except (zlib.error, self._zstd_error) as exc:
                self._error = exc
        if not self._pending and self._error is not None:
            raise self._fail(self._error)
        data = bytes(self._pending[:n])
        del self._pending[:n]
        return data

    def skip_to(self, offset: int) -> None:
        if offset < self.pos:
            raise ValueError(f"{self.path}: cannot move back from {self.pos} to {offset}")
        if self.kind is None:
            self.raw.seek(offset)
            self.pos = offset
            return
        while self.pos < offset:
            if not self.read(min(offset - self.pos, 8 << 20)):
                raise DataFileError(
                    f"{self.path}: ends at {self.pos:,} uncompressed bytes, before the "
                    f"position {offset:,} to resume at"
                )

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_file(path: str | PathLike) -> _Stream:
    """Open a plain, gzip or zstd file (by its ending) for reading its uncompressed bytes
    with `read(n)`; use as a context manager."""
    return _Stream(os.fspath(path))


def read_bytes(path: str | PathLike) -> bytes:
    """The whole uncompressed content of a (small) file."""
    out = []
    with open_file(path) as f:
        while chunk := f.read(8 << 20):
            out.append(chunk)
    return b"".join(out)


def first_line(path: str | PathLike, limit: int = 1 << 20) -> bytes:
    """Line 1 of a file (uncompressed, without its newline; at most `limit` bytes)."""
    buf = b""
    with open_file(path) as f:
        while b"\n" not in buf and len(buf) < limit:
            chunk = f.read(64 << 10)
            if not chunk:
                break
            buf += chunk
    return buf.split(b"\n", 1)[0].rstrip(b"\r")


# ---------------------------------------------------------------------------------------
# Blocks of whole lines


@dataclasses.dataclass(frozen=True)
class LineBlock:
    """Whole lines of a file: `data` (ends with a newline unless it is the file's last line
    without one), the 1-based number of its first line, how many lines it holds, and
    where the next block starts (uncompressed byte offset, line number, block number)."""

    data: bytes
    first_line: int
    num_lines: int
    next_offset: int
    next_line: int
    index: int  # the block's number in the file (counted from the first data block)
    mine: bool  # this process parses it (interleaved shares skip the others)


def iter_line_blocks(
    path: str,
    *,
    start_offset: int = 0,
    start_line: int = 1,
    start_block: int = 0,
    end: int | None = None,
    block_bytes: int = 4 << 20,
    block_lines: int | None = None,
    every: int = 1,
    which: int = 0,
) -> Iterator[LineBlock]:
    """The lines of `path` from `start_offset` (the uncompressed offset of a line's start,
    numbered `start_line`) on, as blocks of at most `block_bytes` bytes (longer lines make
    a block of their own) and at most `block_lines` lines.

    `end`: stop after the line that contains byte `end - 1` (a byte range holds the lines
    that start in it). `every`/`which`: only blocks with index % every == which are
    `mine` (the others are read, counted and flagged, so line numbers stay right).
    A block's end depends only on its start, so resuming at `next_offset` / `next_line`
    / `index + 1` continues with the same blocks.
    """
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
    offset, line, index = start_offset, start_line, start_block
    with open_file(path) as f:
        f.skip_to(start_offset)
        f.lines = start_line - 1
        buf = b""
        eof = False
        while True:
            if end is not None and offset >= end:
                return
            while not eof and len(buf) < block_bytes:
                chunk = f.read(block_bytes - len(buf))
                if not chunk:
                    eof = True
                buf += chunk
            if not buf:
                return
            cut = _cut(buf, block_bytes, block_lines, end - offset if end is not None else None)
            while cut is None:  # a line longer than the block (or a cut beyond it)
                if eof:
                    cut = len(buf)
                    break
                chunk = f.read(block_bytes)
                if not chunk:
                    eof = True
                buf += chunk
                cut = _cut(buf, len(buf), block_lines, end - offset if end is not None else None)
            data, buf = buf[:cut], buf[cut:]
            n = count_lines(data) + (0 if data.endswith(b"\n") else 1)
            offset += len(data)
            yield LineBlock(
                data=data,
                first_line=line,
                num_lines=n,
                next_offset=offset,
                next_line=line + n,
                index=index,
                mine=index % every == which,
            )
            line += n
            index += 1


def _cut(buf: bytes, limit: int, max_lines: int | None, end_rel: int | None) -> int | None:
    """Where a block starting at buf[0] ends: after the last newline within `limit` bytes,
    after at most `max_lines` lines, and after the line holding byte `end_rel - 1`; None
    when no newline is found within the limit."""
    window = buf[:limit]
    if end_rel is not None and end_rel <= len(buf):
        nl = buf.find(b"\n", max(end_rel - 1, 0))
        if nl != -1 and nl < limit:
            window = buf[: nl + 1]
    if max_lines is not None:
        arr = np.frombuffer(window, np.uint8)
        nls = np.flatnonzero(arr == 10)
        if nls.shape[0] >= max_lines:
            return int(nls[max_lines - 1]) + 1
    last = window.rfind(b"\n")
    return last + 1 if last != -1 else None


def align_to_line(path: str, offset: int) -> tuple[int, int]:
    """For a plain file: the offset of the first line that starts at or after `offset`
    and its 1-based line number (the newlines before it are counted)."""
    if offset <= 0:
        return 0, 1
    with open(path, "rb") as f:
        lines = 0
        remaining = offset - 1  # the line starts after a newline at offset - 1 or later
        while remaining > 0:
            chunk = f.read(min(remaining, 8 << 20))
            if not chunk:
                break
            lines += chunk.count(b"\n")
            remaining -= len(chunk)
        pos = offset - 1 - remaining
        while True:
            chunk = f.read(64 << 10)
            if not chunk:
                return pos, lines + 1
            nl = chunk.find(b"\n")
            if nl != -1:
                return pos + nl + 1, lines + 2
            pos += len(chunk)


# ---------------------------------------------------------------------------------------
# Shares of processes


@dataclasses.dataclass(frozen=True)
class FilePiece:
    """One file's part of a process's share: byte range [start, end) of a plain text file
    (end None: to its end), or every `every`-th block / row group starting at `which`."""

    path: str
    index: int  # the file's position in the full file list
    start: int = 0
    end: int | None = None
    every: int = 1
    which: int = 0


def shard_files(
    files: Sequence[str], *, rank: int = 0, num_processes: int = 1, splittable: bool = True
) -> list[FilePiece]:
    """Process `rank`'s share of `files` (see the module docstring). `splittable`: plain
    text files may be split into byte ranges (False for formats read by row group)."""
    if num_processes < 1 or not 0 <= rank < num_processes:
        raise ValueError(f"need 0 <= rank < num_processes, got rank={rank} of {num_processes}")
    if len(files) >= num_processes:
        return [FilePiece(f, i) for i, f in enumerate(files) if i % num_processes == rank]
    out = []
    for i, f in enumerate(files):
        if splittable and compression(f) is None:
            size = os.path.getsize(f)
            lo, hi = size * rank // num_processes, size * (rank + 1) // num_processes
            out.append(FilePiece(f, i, start=lo, end=hi))
        else:
            out.append(FilePiece(f, i, every=num_processes, which=rank))
    return out


# ---------------------------------------------------------------------------------------
# Headers of delimited files


def delimited_header(
    files: Sequence[str], *, delimiter: str, header: bool
) -> tuple[list[str] | None, list[int]]:
    """The header of a delimited table spread over `files`, and where each file's data
    starts (bytes to skip: line 1 when it is the header, else 0).

    The first file's line 1 is the header (when `header`). A later file skips its line 1
    when it equals that header; one whose line 1 looks like a different header (it shares
    a column name with the header, or has no numeric field) raises `DataFileError` naming
    both files and the first differing column; any other later file has no header and
    is read from line 1.
    """
    if not header:
        return None, [0] * len(files)
    d = delimiter.encode()
    head = first_line(files[0])
    names = head.decode(errors="replace").split(delimiter)
    skips = [line1_bytes(files[0])]
    for f in files[1:]:
        line = first_line(f)
        if line == head:
            skips.append(line1_bytes(f))
            continue
        cells = line.split(d)
        if _looks_like_header(cells, {n.encode() for n in names}):
            other = line.decode(errors="replace").split(delimiter)
            i = next(
                k for k in range(max(len(names), len(other))) if _at(names, k) != _at(other, k)
            )
            raise DataFileError(
                f"headers disagree: {files[0]} has column {i + 1} = {_at(names, i)!r}, "
                f"{f} has {_at(other, i)!r} (line 1 of a later file must equal the first "
                f"file's header, or be data)"
            )
        skips.append(0)
    return names, skips


def starts_with_header(path: str, names: Sequence[str], *, delimiter: str) -> bool:
    """Whether line 1 of `path` is a header, judged as `delimited_header` judges a later
    file's line 1 against the first file's header `names`: it equals them, shares a
    column name with them, or has no numeric field (a data line has a label at least)."""
    line = first_line(path)
    if line.decode(errors="replace").split(delimiter) == list(names):
        return True
    return _looks_like_header(line.split(delimiter.encode()), {n.encode() for n in names})


def _at(xs: list[str], i: int) -> str | None:
    return xs[i] if i < len(xs) else None


def line1_bytes(path: str) -> int:
    """Bytes of line 1 of `path` with its newline (what a reader skips for a header)."""
    line = first_line(path)
    with open_file(path) as f:
        start = f.read(len(line) + 2)
    return len(line) + (2 if start[len(line) : len(line) + 2] == b"\r\n" else 1)


def _looks_like_header(cells: list[bytes], names: set[bytes]) -> bool:
    if any(c in names for c in cells):
        return True
    return all(c and not _is_number(c) for c in cells)


def _is_number(cell: bytes) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True
