"""The model directory: what `sparsejax export` writes and `Predictor.load` reads.

```
MODEL_DIR/
  model.json             manifest: format version, versions, platforms, kernels,
                         features, preprocessing, tables, arrays (file, crc32, shape)
  exported/b<N>.jaxexport  the model's computation for batch size N (`jax.export`,
                         serialized): (params, tables, batch) -> scores
  arrays/*.npy           its arguments: dense parameters and stacked (maybe quantized)
                         tables, exactly as the exported computation takes them; a
                         table argument is stored in row pieces, one file per shard of
                         each table (`arguments[key]["pieces"]`: file, crc32, the rows
                         of the argument it holds, the table and the table's rows), as
                         the processes that held those shards wrote them
  mappings/*.npy         id mappings: a vocabulary's kept raw ids, a dynamic table's keys
  example_request.json   a valid /v1/predict body built from real rows
  example_retrieve.json  a valid /v1/retrieve body (retrieval models)
```

Arguments are stored leaf by leaf as the exported function takes them (keyed by pytree
path), so loading needs no model code: a later sparsejax serves an older model as long
as the format version and the batch layout match, and says which does not.

Format version 2 (this one) stores table arguments in row pieces; version 1 model dirs
(one file per argument) still load.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import zlib
from collections.abc import Mapping

import numpy as np

from .. import checkpoint
from ..embedding import aligned_empty

FORMAT = "sparsejax-model"
FORMAT_VERSION = 2
"""Bumped when a model dir written now could not be read correctly by older code."""
MANIFEST = "model.json"
EXAMPLE_REQUEST = "example_request.json"
EXAMPLE_RETRIEVE = "example_retrieve.json"
"""A /v1/retrieve body (retrieval models)."""


class ModelLoadError(RuntimeError):
    """A model dir that cannot be served here: missing, from an incompatible version or
    platform, or with a corrupt file. The message is one line naming the problem."""


def file_name(key: str) -> str:
    """A file-system-safe name for a pytree path or table name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_") or "_"


def write_arrays(directory: str, arrays: Mapping[str, np.ndarray]) -> dict[str, dict]:
    """Each array in its own `.npy` (crc32 in the entry); `{key: entry}` for the manifest."""
    os.makedirs(directory, exist_ok=True)
    entries, used = {}, set()
    for key, a in arrays.items():
        name = file_name(key)
        while name in used:
            name += "_"
        used.add(name)
        entry = checkpoint.write_array(os.path.join(directory, name + ".npy"), np.asarray(a))
        entry["file"] = os.path.join(os.path.basename(directory), entry["file"])
        entries[key] = entry
    return entries


def read_array(model_dir: str, entry: Mapping) -> np.ndarray:
    """One array of the manifest, checked (size, crc32, shape, dtype)."""
    return checkpoint.read_array(
        os.path.join(model_dir, entry["file"]), dict(entry), error=ModelLoadError, what="model"
    )


def write_piece(directory: str, name: str, a: np.ndarray, **where) -> dict:
    """One row piece of a table argument as `<directory>/<name>.npy`; its entry (file
    relative to the model dir, crc32, bytes, shape, dtype, and `where`: "rows" of the
    argument, "table", "table_rows")."""
    os.makedirs(directory, exist_ok=True)
    entry = checkpoint.write_array(os.path.join(directory, file_name(name) + ".npy"), a)
    entry["file"] = os.path.join(os.path.basename(directory), entry["file"])
    return {**entry, **where}


def _piece_error(model_dir: str, entry: Mapping, what: str) -> ModelLoadError:
    t0, t1 = entry.get("table_rows", entry["rows"])
    return ModelLoadError(
        f"model file {os.path.join(model_dir, entry['file'])} (table {entry.get('table')!r}, "
        f"rows {t0}..{t1 - 1}) {what}"
    )


def _read_piece_into(
    model_dir: str, entry: Mapping, out: np.ndarray, rows: np.ndarray | None = None
) -> None:
    """Read one piece's rows straight into `out` (its rows of the argument), checking
    the file's size, header and crc32; errors name the table, the rows and the file.
    With `rows` (of the piece, sorted), only those rows, read row by row (not memory-
    mapped: mapped pages and the kernel's read-ahead would count in the process's
    memory), and no crc32 (it needs every byte)."""
    path = os.path.join(model_dir, entry["file"])
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise _piece_error(model_dir, entry, "is missing") from None
    if size != entry["bytes"]:
        raise _piece_error(
            model_dir, entry, f"has {size} bytes, the manifest says {entry['bytes']} (truncated?)"
        )
    with open(path, "rb") as fh:
        try:
            version = np.lib.format.read_magic(fh)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read(fh)
        except (OSError, ValueError) as e:
            raise _piece_error(model_dir, entry, f"is unreadable ({e})") from None
        want = tuple(out.shape)
        if tuple(shape) != want or dtype.itemsize != out.dtype.itemsize:
            raise _piece_error(
                model_dir, entry, f"holds {dtype}{list(shape)}, expected {out.dtype}{list(want)}"
            )
        header = fh.tell()
        if rows is not None:
            row_bytes = out[:1].nbytes
            flat = out.reshape(out.shape[0], -1).view(np.uint8)
            for r in rows.tolist():
                fh.seek(header + r * row_bytes)
                if fh.readinto(flat[r]) != row_bytes:
                    raise _piece_error(model_dir, entry, "ends early")
            return
        fh.seek(0)
        crc = zlib.crc32(fh.read(header))
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < view.nbytes:
            n = fh.readinto(view[done : done + (64 << 20)])
            if not n:
                raise _piece_error(model_dir, entry, "ends early")
            crc = zlib.crc32(view[done : done + n], crc)
            done += n
    if crc != entry["crc32"]:
        raise _piece_error(model_dir, entry, "is corrupt (crc32 mismatch)")


def read_argument(
    model_dir: str, entry: Mapping, rows: np.ndarray | None = None, out: np.ndarray | None = None
) -> np.ndarray:
    """One exported argument: a whole-array file (format 1, dense parameters) or a table
    argument read piece by piece into one preallocated array (no piece held twice); a
    missing or truncated piece names the table, its rows and the file, and rows no piece
    covers are named too. With `rows` (sorted), a table argument's other rows are left
    unread (zeros, taking no memory: for a computation that reads only `rows`). With
    `out` (of the argument's shape and dtype), a table argument is read into it."""
    if "pieces" not in entry:
        return read_array(model_dir, entry)
    shape, dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
    _check_coverage(model_dir, entry, shape[0])
    if out is None:
        out = aligned_empty(shape, dtype) if rows is None else _sparse_zeros(shape, dtype)
    for piece in entry["pieces"]:
        r0, r1 = piece["rows"]
        mine = None
        if rows is not None:
            mine = rows[np.searchsorted(rows, r0) : np.searchsorted(rows, r1)] - r0
        _read_piece_into(model_dir, piece, out[r0:r1], mine)
    return out


def read_own_pieces(model_dir: str, entry: Mapping, process: int) -> list[tuple[int, np.ndarray]]:
    """The pieces of a table argument that `process` wrote, as `[(first row, rows)]`."""
    dtype = np.dtype(entry["dtype"])
    out = []
    for piece in entry["pieces"]:
        if piece.get("process", 0) == process:
            r0, r1 = piece["rows"]
            rows = aligned_empty((r1 - r0, *entry["shape"][1:]), dtype)
            _read_piece_into(model_dir, piece, rows)
            out.append((r0, rows))
    return out


def _sparse_zeros(shape: tuple, dtype) -> np.ndarray:
    """Zeros (page-aligned) whose memory is taken only in the pages written: an
    anonymous map. numpy asks for 2 MiB huge pages for a large array, so rows written
    here and there would each take 2 MiB."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), np.uint8)[:n].view(dtype).reshape(shape)


def _check_coverage(model_dir: str, entry: Mapping, rows: int) -> None:
    """Refuse an argument whose pieces leave rows out or cover rows twice (from the
    pieces' row ranges alone: nothing per row)."""
    bad, end = [], 0
    for r0, r1 in sorted(tuple(p["rows"]) for p in entry["pieces"]):
        if r0 != end:  # a gap [end, r0) or an overlap [r0, end)
            bad += [min(r0, end), max(r0, end)]
        end = max(end, r1)
    if end != rows:
        bad += [min(end, rows), max(end, rows)]
    if bad:
        tables = sorted({str(p.get("table")) for p in entry["pieces"]})
        raise ModelLoadError(
            f"{model_dir}: rows {min(bad)}..{max(bad) - 1} of argument "
            f"{entry.get('key', '?')} (tables {tables}) are in no piece or in several: "
            f"the model dir is incomplete; export it again"
        )


def read_json_manifest(path: str, fmt: str, error: type[Exception]) -> dict:
    """The JSON object in `path` whose "format" is `fmt`; else `error(one line)`."""
    try:
        with open(path) as fh:
            m = json.load(fh)
    except (OSError, ValueError) as e:
        raise error(f"{path} is unreadable: {e}") from None
    if not isinstance(m, dict) or m.get("format") != fmt:
        raise error(f"{path} is not a {fmt} manifest")
    return m


def read_manifest(model_dir: str) -> dict:
    """The manifest of `model_dir`, its format and version checked."""
    path = os.path.join(model_dir, MANIFEST)
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f"{model_dir} is not a directory")
    if not os.path.exists(path):
        raise ModelLoadError(
            f"{model_dir} is not a sparsejax model dir (no {MANIFEST}; write one with "
            f"`sparsejax export RUN_DIR --out {model_dir}`)"
        )
    m = read_json_manifest(path, FORMAT, ModelLoadError)
    version = m.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise ModelLoadError(
            f"{model_dir}: model format version {version!r} (written by sparsejax "
            f"{m.get('sparsejax_version', '?')}); this sparsejax reads version "
            f"{FORMAT_VERSION}: export the run again with this version, or serve it with "
            f"the version that wrote it"
        )
    return m


def write_json(path: str, obj) -> None:
    """`obj` as JSON, written to a temporary file and renamed (never half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
