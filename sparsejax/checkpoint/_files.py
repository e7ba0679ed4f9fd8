"""Checkpoint files: the errors a save or a restore raises, and checksummed array files
(`write_array` / `read_array`) that host-table steps and model directories are made of."""

from __future__ import annotations

import os
import zlib

import numpy as np

_CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written from, or restored into, the current model."""


class CheckpointUnreadableError(CheckpointError):
    """A checkpoint's files cannot be read (truncated, corrupt, missing parts)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, no permission, ...); its partial
    files were removed and the checkpoints before it are kept."""


class NonFiniteStateError(FloatingPointError):
    """The state holds NaN or inf; it is not saved, so the last checkpoint stays good."""


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _CrcWriter:
    """A file object that checksums what `np.lib.format.write_array` writes through it
    (not a real file to numpy, so it writes in chunks via `write`)."""

    def __init__(self, fh):
        self.fh, self.crc, self.size = fh, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(memoryview(data).cast("B"))
        return self.fh.write(data)


def write_array(path: str, a: np.ndarray) -> dict:
    """Write `a` to `path` (`.npy`, fsynced); its manifest entry (file, crc32, bytes,
    shape, dtype) for `read_array`."""
    a = np.asarray(a)
    if a.dtype.hasobject:
        raise TypeError(f"{path}: object arrays cannot be saved")
    with open(path, "wb") as fh:
        w = _CrcWriter(fh)
        np.lib.format.write_array(w, a, allow_pickle=False)
        fh.flush()
        os.fsync(fh.fileno())
    return {
        "file": os.path.basename(path),
        "crc32": w.crc,
        "bytes": w.size,
        "shape": list(a.shape),
        "dtype": str(a.dtype),
    }


def read_array(path: str, entry: dict, *, error=None, what: str = "host-table") -> np.ndarray:
    """The array in `path`, after checking its size, crc32, shape and dtype against the
    manifest's `entry`; memory-mapped copy-on-write when large (writable, never written
    back). A failed check raises `error(one line)` (default: `CheckpointUnreadableError`)."""
    error = CheckpointUnreadableError if error is None else error
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise error(f"{what} file {path} is missing") from None
    if size != entry["bytes"]:
        raise error(f"{what} file {path} has {size} bytes, the manifest says {entry['bytes']}")
    crc, buf = 0, bytearray(min(_CHUNK, max(size, 1)))
    view = memoryview(buf)
    with open(path, "rb") as fh:
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    if crc != entry["crc32"]:
        raise error(f"{what} file {path} is corrupt (crc32 mismatch)")
    shape, dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
    try:
        big = dtype.itemsize * int(np.prod(shape)) >= (1 << 20)
        a = np.load(path, mmap_mode="c" if big else None, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise error(f"{what} file {path} is unreadable ({type(e).__name__}: {e})") from e
    if a.dtype != dtype and a.dtype.itemsize == dtype.itemsize and a.dtype.kind == "V":
        a = a.view(dtype)  # bfloat16 and other ml_dtypes are saved as raw bytes
    if a.shape != shape or a.dtype != dtype:
        raise error(
            f"{what} file {path} holds {a.dtype}{list(a.shape)}, the manifest says "
            f"{dtype}{list(shape)}"
        )
    return a
