"""`HostRows`: the rows of one tiered table on the host, in RAM and then on disk.

A table's rows (weights in the storage dtype, plus the optimizer's slots in f32) are
addressed by a row index and stored in fixed-size blocks of `block_rows` rows. Each row
is one record (weights, then every slot, side by side), so moving a row between the host
and the device cache is one contiguous copy, whether the row lies in RAM or in a page of
the disk tier. Blocks go to RAM while the table's RAM budget (`ram_bytes`) allows, then
to memory-mapped files in `disk_dir`: the third tier, for tables larger than RAM.

Disk space is reserved (`os.posix_fallocate`) when a disk block is created, so a full
disk is a `HostStorageFullError` at allocation time, never a SIGBUS when the kernel
later fails to write a page back. `release_pages` drops the disk tier's pages from the
process's resident memory, so memory stays flat while the disk tier grows.

Every operation is vectorized per block: a call loops over the blocks its rows touch
(one numpy copy each), never over rows.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence

import numpy as np

from .._memory import format_bytes

__all__ = ["HostRows", "HostStorageFullError", "storage_dtype"]

_PAGE = mmap.PAGESIZE
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class HostStorageFullError(OSError):
    """The disk tier of a table cannot grow: one line naming the table, the directory,
    the bytes needed and the bytes free. Nothing already stored is lost."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def storage_dtype(dtype) -> np.dtype:
    """The numpy dtype of a weight storage dtype: "float32" / "bfloat16" (ml_dtypes),
    or anything `np.dtype` takes (`jnp.bfloat16`, `np.float32`)."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    dt = np.dtype(dtype)
    if dt.name not in ("float32", "bfloat16"):
        raise ValueError(f"HostRows: weights dtype must be float32 or bfloat16, got {dt.name}")
    return dt


def _slot_tuple(slot) -> tuple[str, bool, float]:
    """(name, per_row, init) from a tuple or a `SlotSpec`."""
    if isinstance(slot, tuple):
        name, per_row, init = slot
    else:
        name, per_row, init = slot.name, slot.per_row, slot.init
    return str(name), bool(per_row), float(init)


class _Block:
    """One block of `block_rows` records: a structured array over RAM or an mmap."""

    __slots__ = ("records", "raw", "fields", "mm", "path")

    def __init__(self, records: np.ndarray, mm: mmap.mmap | None, path: str | None):
        self.records = records  # rec[B] (structured)
        self.raw = records.view(np.dtype((np.void, records.dtype.itemsize)))  # void[B]
        self.fields = {name: records[name] for name in records.dtype.names}  # views
        self.mm = mm
        self.path = path


def _close_disk(blocks: list, directory: list) -> None:
    """Unmap the disk blocks and delete their files and directory (also run by a
    finalizer when a `HostRows` is collected without `close()`)."""
    for blk in blocks:
        blk.records = blk.raw = blk.fields = None
        try:
            blk.mm.close()
        except BufferError:  # a view still exported: the mapping dies with it
            pass
        try:
            os.unlink(blk.path)
        except FileNotFoundError:
            pass
    blocks.clear()
    if directory:
        shutil.rmtree(directory.pop(), ignore_errors=True)


class HostRows:
    """Rows and optimizer slots of one table on the host, addressed by row index.

    Args:
      name: the table's name (in error messages and the disk tier's file names).
      dim: row width.
      dtype: storage dtype of the weights, float32 or bfloat16 (slots are f32).
      slots: `(name, per_row, init)` of each optimizer slot (or the `SlotSpec`s of
        `SparseOptimizer.slots()`): per_row slots are `[R]`, the others `[R, dim]`.
      ram_bytes: bytes of RAM the rows may take (None: unbounded); blocks beyond it
        are memory-mapped files in `disk_dir`.
      disk_dir: directory of the disk tier (each table makes its own subdirectory,
        deleted by `close()`); needed when `ram_bytes` is set.
      block_rows: rows per block (a power of two is fastest). Each disk block is one
        mapping and the kernel allows about 65k per process (`vm.max_map_count`), so
        a table with a large disk tier wants large blocks.

    New rows hold zero weights and their slots' init values. Row ids given to
    `gather`/`scatter`/`reset_slots`/`norms` must lie in `[0, capacity)`; `scatter`
    rows should be unique (of duplicates, the last one's values are stored).

    Example:
      >>> rows = HostRows("t", 4, "float32", [("accumulator", True, 0.0)])
      >>> rows.ensure(10)
      >>> rows.scatter(np.arange(3), np.ones((3, 4), np.float32), {"accumulator": np.ones(3)})
      >>> w, s = rows.gather(np.array([2, 5]))
      >>> w.tolist(), s["accumulator"].tolist()
      ([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]], [1.0, 0.0])
      >>> rows.close()
    """

    def __init__(
        self,
        name: str,
        dim: int,
        dtype,
        slots: Sequence = (),
        *,
        ram_bytes: int | None = None,
        disk_dir: str | None = None,
        block_rows: int = 1 << 16,
    ):
        if int(dim) < 1:
            raise ValueError(f"HostRows {name!r}: dim must be >= 1, got {dim}")
        if int(block_rows) < 1:
            raise ValueError(f"HostRows {name!r}: block_rows must be >= 1, got {block_rows}")
        if ram_bytes is not None and int(ram_bytes) < 0:
            raise ValueError(f"HostRows {name!r}: ram_bytes must be >= 0, got {ram_bytes}")
        if ram_bytes is not None and disk_dir is None:
            raise ValueError(
                f"HostRows {name!r}: ram_bytes={ram_bytes} needs a disk_dir for the rows beyond it"
            )
        self.name = name
        self.dim = int(dim)
        self.dtype = storage_dtype(dtype)
        self.slots = tuple(_slot_tuple(s) for s in slots)
        names = [s[0] for s in self.slots]
        if len(set(names)) != len(names):
            raise ValueError(f"HostRows {name!r}: duplicate slot names {names}")
        self.ram_bytes = None if ram_bytes is None else int(ram_bytes)
        self.disk_dir = disk_dir
        self.block_rows = int(block_rows)
        # One record per row: "w" the weights, "s<i>" slot i (internal names, so no slot
        # name can clash with the weights).
        fields = [("w", self.dtype, (self.dim,))]
        for i, (_, per_row, _) in enumerate(self.slots):
            fields.append((f"s{i}", np.float32) if per_row else (f"s{i}", np.float32, (self.dim,)))
        self._rec = np.dtype(fields, align=True)
        self._field = {s[0]: f"s{i}" for i, s in enumerate(self.slots)}
        self.row_bytes = self._rec.itemsize
        self.block_bytes = self.block_rows * self.row_bytes
        self._disk_block_bytes = -(-self.block_bytes // _PAGE) * _PAGE
        pow2 = self.block_rows & (self.block_rows - 1) == 0
        self._shift = self.block_rows.bit_length() - 1 if pow2 else None
        self._blocks: list[_Block] = []
        self._num_ram = 0
        self._disk: list[_Block] = []  # the disk blocks (shared with the finalizer)
        self._dir: list[str] = []  # the table's disk subdirectory, once made
        self._touched: set[int] = set()  # disk blocks touched since `release_pages`
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_disk, self._disk, self._dir)

    # -- size ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Rows allocated."""
        return len(self._blocks) * self.block_rows

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def ram_bytes_used(self) -> int:
        """Bytes of the RAM blocks (allocated; pages are committed as rows are written)."""
        return self._num_ram * self.block_bytes

    @property
    def disk_bytes_used(self) -> int:
        """Bytes reserved on disk by the disk blocks."""
        return len(self._disk) * self._disk_block_bytes

    def __len__(self) -> int:
        return self.capacity

    def __repr__(self) -> str:
        return (
            f"HostRows({self.name!r}, dim={self.dim}, dtype={self.dtype.name}, "
            f"capacity={self.capacity}, ram={format_bytes(self.ram_bytes_used)}, "
            f"disk={format_bytes(self.disk_bytes_used)})"
        )

    def ensure(self, rows: int) -> None:
        """Grow until `capacity >= rows`: new blocks in RAM while `ram_bytes` allows,
        then on disk. Disk space for all the new disk blocks is checked first and
        reserved block by block, so a full disk raises `HostStorageFullError` here
        (blocks made before the error stay; no stored row is touched)."""
        self._check_open()
        need = max(0, -(-int(rows) // self.block_rows) - len(self._blocks))
        if need == 0:
            return
        ram_blocks = need
        if self.ram_bytes is not None:
            fit = max(0, self.ram_bytes // self.block_bytes - self._num_ram)
            # once a block went to disk, RAM never takes one again (the tiers stay in order)
            ram_blocks = 0 if self._disk else min(need, fit)
        disk_blocks = need - ram_blocks
        if disk_blocks:
            self._check_free(disk_blocks)
        for _ in range(ram_blocks):
            records = np.zeros(self.block_rows, self._rec)  # calloc: pages on first write
            self._init_slots(records)
            self._blocks.append(_Block(records, None, None))
            self._num_ram += 1
        for _ in range(disk_blocks):
            self._blocks.append(self._new_disk_block(disk_blocks))

    def _init_slots(self, records: np.ndarray) -> None:
        for i, (_, _, init) in enumerate(self.slots):
            if init != 0.0:
                records[f"s{i}"] = np.float32(init)

    def _directory(self) -> str:
        if not self._dir:
            os.makedirs(self.disk_dir, exist_ok=True)
            prefix = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name)[:64] + "-"
            self._dir.append(tempfile.mkdtemp(prefix=prefix, dir=self.disk_dir))
        return self._dir[0]

    def _full_error(self, needed: int, free: int, blocks: int) -> HostStorageFullError:
        return HostStorageFullError(
            f"table {self.name!r}: the disk tier in {self.disk_dir} is full: {blocks} more "
            f"block(s) of {self.block_rows} rows need {format_bytes(needed)} ({needed} bytes), "
            f"{format_bytes(free)} ({free} bytes) free; free disk space, point disk_dir at a "
            f"larger disk or raise ram_bytes"
        )

    def _free_bytes(self) -> int:
        st = os.statvfs(self._directory())
        return st.f_bavail * st.f_frsize

    def _check_free(self, blocks: int) -> None:
        needed = blocks * self._disk_block_bytes
        free = self._free_bytes()
        if needed > free:
            raise self._full_error(needed, free, blocks)

    def _new_disk_block(self, blocks_wanted: int) -> _Block:
        directory = self._directory()
        path = os.path.join(directory, f"block{len(self._blocks):07d}.rows")
        nbytes = self._disk_block_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                _reserve(fd, nbytes)
            except OSError as e:
                if e.errno in _FULL_ERRNOS:
                    raise self._full_error(nbytes, self._free_bytes(), blocks_wanted) from None
                raise
            mm = mmap.mmap(fd, nbytes)  # MAP_SHARED, read/write
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the file open
        records = np.frombuffer(mm, self._rec, count=self.block_rows)
        self._init_slots(records)
        blk = _Block(records, mm, path)
        self._disk.append(blk)
        self._touched.add(len(self._blocks))
        return blk

    # -- addressing --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"HostRows {self.name!r} is closed")

    def _rows(self, rows) -> np.ndarray:
        self._check_open()
        rows = np.asarray(rows)
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise TypeError(
                f"HostRows {self.name!r}: rows must be a 1-d integer array, "
                f"got {rows.dtype}{list(rows.shape)}"
            )
        rows = rows.astype(np.int64, copy=False)
        if rows.size and (rows.min() < 0 or rows.max() >= self.capacity):
            bad = rows[(rows < 0) | (rows >= self.capacity)][0]
            raise IndexError(
                f"HostRows {self.name!r}: row {bad} is outside [0, {self.capacity}) "
                f"(call ensure() first)"
            )
        return rows

    def _plan(self, rows: np.ndarray):
        """(order, groups): `groups` lists `(block, start, stop, offsets)` over the rows
        sorted by block (`rows[order]`); order None when one block holds them all."""
        if self._shift is not None:
            blk, off = rows >> self._shift, rows & (self.block_rows - 1)
        else:
            blk, off = np.divmod(rows, self.block_rows)
        n = rows.size
        if n == 0:
            return None, []
        lo, hi = int(blk.min()), int(blk.max())
        if lo == hi:
            if lo >= self._num_ram:
                self._touched.add(lo)
            return None, [(lo, 0, n, off)]
        order = np.argsort(blk, kind="stable")
        sblk, soff = blk[order], off[order]
        cuts = np.flatnonzero(sblk[1:] != sblk[:-1]) + 1
        starts = np.concatenate([[0], cuts]).tolist()
        stops = np.concatenate([cuts, [n]]).tolist()
        blocks = sblk[starts].tolist()
        if hi >= self._num_ram:
            self._touched.update(b for b in blocks if b >= self._num_ram)
        groups = [(b, s, e, soff[s:e]) for b, s, e in zip(blocks, starts, stops, strict=True)]
        return order, groups

    def _take(self, rows) -> np.ndarray:
        """The records of `rows` (structured `[n]`), in the order of `rows`: one
        contiguous copy per row (np.take on a block's raw records; a strided field view
        would make np.take copy the whole block first)."""
        order, groups = self._plan(rows)
        out = np.empty(rows.size, np.dtype((np.void, self.row_bytes)))
        if order is None:
            for b, _, _, off in groups:
                np.take(self._blocks[b].raw, off, out=out, mode="wrap")  # offsets checked
        else:
            tmp = np.empty_like(out)
            for b, s, e, off in groups:
                np.take(self._blocks[b].raw, off, out=tmp[s:e], mode="wrap")
            out[order] = tmp
        return out.view(self._rec)

    def _put(self, rows, field: str | None, values: np.ndarray) -> None:
        """Write records (field None, void) or one field (or a scalar) at `rows`."""
        order, groups = self._plan(rows)
        scalar = np.ndim(values) == 0
        if order is not None and not scalar:
            values = values[order]
        for b, s, e, off in groups:
            dst = self._blocks[b].raw if field is None else self._blocks[b].fields[field]
            dst[off] = values if scalar else values[s:e]

    # -- rows --------------------------------------------------------------------------

    def gather(self, rows) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The weights (`[n, dim]`, storage dtype) and slots (`{name: f32[n] or
        [n, dim]}`) of `rows` (int[n], duplicates allowed), as new arrays."""
        rows = self._rows(rows)
        rec = self._take(rows)
        weights = np.ascontiguousarray(rec["w"])
        slots = {name: np.ascontiguousarray(rec[f]) for name, f in self._field.items()}
        return weights, slots

    def scatter(self, rows, weights, slots: Mapping[str, np.ndarray] | None = None) -> None:
        """Store `weights` (`[n, dim]`, cast to the storage dtype; None keeps them) and
        the given `slots` (`{name: [n] or [n, dim]}`; slots not given are kept) at
        `rows` (int[n], unique)."""
        rows = self._rows(rows)
        slots = {} if slots is None else dict(slots)
        unknown = set(slots) - set(self._field)
        if unknown:
            raise KeyError(
                f"HostRows {self.name!r}: unknown slot(s) {sorted(unknown)} "
                f"(slots: {sorted(self._field)})"
            )
        n = rows.size
        values = {} if weights is None else {"w": weights}
        values.update({self._field[k]: v for k, v in slots.items()})
        for f, v in values.items():
            want = (n, *self._rec.fields[f][0].shape)
            if np.shape(v) != want:
                what = "weights" if f == "w" else f"slot {self.slots[int(f[1:])][0]!r}"
                raise ValueError(
                    f"HostRows {self.name!r}: {what} must have shape {list(want)}, "
                    f"got {list(np.shape(v))}"
                )
        if len(values) == len(self._rec.names):  # whole records: one copy per block
            rec = np.empty(n, self._rec)
            for f, v in values.items():
                rec[f] = v
            self._put(rows, None, rec.view(np.dtype((np.void, self.row_bytes))))
            return
        for f, v in values.items():
            self._put(rows, f, np.asarray(v).astype(self._rec.fields[f][0].base, copy=False))

    def reset_slots(self, rows) -> None:
        """Set the slots of `rows` back to their init values (new or reused rows)."""
        rows = self._rows(rows)
        for i, (_, _, init) in enumerate(self.slots):
            self._put(rows, f"s{i}", np.float32(init))

    def norms(self, rows) -> np.ndarray:
        """f32[n]: the L2 norm of each row's weights."""
        rows = self._rows(rows)
        w = self._take(rows)["w"].astype(np.float32)
        return np.sqrt(np.einsum("ij,ij->i", w, w))

    # -- memory ------------------------------------------------------------------------

    def release_pages(self, *, flush: bool = True) -> None:
        """Drop the pages of the disk blocks touched since the last call from the
        process's resident memory: write them back (`flush`, msync) then
        `madvise(MADV_DONTNEED)`; the data stays in the files (and the page cache),
        read back on the next access. RAM blocks are untouched."""
        self._check_open()
        for b in sorted(self._touched):
            blk = self._blocks[b]
            if flush:
                blk.mm.flush()
            blk.mm.madvise(mmap.MADV_DONTNEED)
        self._touched.clear()

    def close(self) -> None:
        """Free the RAM blocks, unmap the disk blocks and delete their files (and the
        table's disk subdirectory). Idempotent; the rows are gone afterwards."""
        if self._closed:
            return
        self._closed = True
        self._blocks.clear()
        self._num_ram = 0
        self._touched.clear()
        self._finalizer()

    def __enter__(self) -> HostRows:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate `nbytes` of disk blocks for the file now (an OSError such as ENOSPC if
    the disk cannot hold them), so writes through the mapping never fault later."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        fallocate(fd, 0, nbytes)
        return
    chunk = bytes(min(nbytes, 1 << 20))  # no posix_fallocate (macOS): write zeros
    done = 0
    while done < nbytes:
        done += os.pwrite(fd, chunk[: nbytes - done], done)
