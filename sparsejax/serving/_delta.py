"""Training publishes, serving follows: full model dirs at intervals and, between them,
deltas (the rows that changed since the version before).

```
PUBLISH_DIR/
  <v>/                 a full model dir (`export_model`); its manifest's "publish" holds
                       the model id and the version v
  <v>.delta/           the arguments that changed from version v-1 (its "base") to v:
    delta.json         format, model id, version, base, step, created, and per argument
                       either {"rows", "values"} (the changed rows of a table: row
                       indices and their new values, already in serving form: quantized
                       tables carry their quantized rows) or {"whole"}
    arrays/*.npy
```

A server serving version v applies `<v+1>.delta` (its base is v) in place of a reload:
the changed arguments are copied, patched and swapped in at once, so every request sees
exactly one version. Deltas are written under a temporary name and renamed, so a reader
never sees half of one. A delta for another model, a corrupt one, or one whose arrays do
not fit the served model is refused (`DeltaError`) and the served version stays.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping

import numpy as np

from ..checkpoint import read_array
from ..embedding import aligned_empty
from ._format import (
    ModelLoadError,
    read_argument,
    read_json_manifest,
    write_arrays,
    write_json,
)

DELTA = "delta.json"
DELTA_FORMAT = "sparsejax-delta"
DELTA_VERSION = 1
_DELTA_DIR = re.compile(r"^(\d+)\.delta$")


class DeltaError(ModelLoadError):
    """A delta that cannot be applied to the served model; the message is one line
    naming the delta and why."""


def delta_dirs(directory: str) -> dict[int, str]:
    """`{version: path}` of the complete deltas in a publish dir."""
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    out = {}
    for n in names:
        m = _DELTA_DIR.match(n)
        if m and os.path.isfile(os.path.join(directory, n, DELTA)):
            out[int(m.group(1))] = os.path.join(directory, n)
    return out


def changed_rows(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The rows (first axis) whose bytes differ (NaNs compare by their bits)."""
    n = new.shape[0] if new.ndim else 1
    a = np.ascontiguousarray(old).reshape(n, -1).view(np.uint8)
    b = np.ascontiguousarray(new).reshape(n, -1).view(np.uint8)
    return np.flatnonzero(np.any(a != b, axis=1))


def write_delta(
    out: str,
    previous: Mapping[str, np.ndarray],
    current: Mapping[str, np.ndarray],
    *,
    model_id: str,
    version: int,
    base: int,
    step: int,
) -> dict:
    """Write the delta from `previous` to `current` (arguments by key, the same keys,
    shapes and dtypes) as `out` (through `<out>.tmp-<pid>`); returns its manifest."""
    if set(previous) != set(current):
        raise ValueError(f"the arguments differ: {sorted(set(previous) ^ set(current))}")
    arrays, arguments = {}, {}
    for i, (key, new) in enumerate(current.items()):
        old = previous[key]
        if old.shape != new.shape or old.dtype != new.dtype:
            raise ValueError(
                f"argument {key}: {old.dtype}{list(old.shape)} became {new.dtype}{list(new.shape)}"
            )
        rows = changed_rows(old, new)
        if not rows.size:
            continue
        if new.ndim == 0 or 2 * rows.size > new.shape[0]:
            arrays[f"{i}.whole"] = new
            arguments[key] = {"whole": f"{i}.whole"}
        else:
            arrays[f"{i}.rows"] = rows.astype(np.int64)
            arrays[f"{i}.values"] = new[rows]
            arguments[key] = {"rows": f"{i}.rows", "values": f"{i}.values"}
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        entries = write_arrays(os.path.join(tmp, "arrays"), arrays)
        manifest = {
            "format": DELTA_FORMAT,
            "format_version": DELTA_VERSION,
            "model_id": model_id,
            "version": int(version),
            "base": int(base),
            "step": int(step),
            "created": time.time(),
            "arguments": {
                key: {part: entries[name] for part, name in parts.items()}
                for key, parts in arguments.items()
            },
        }
        write_json(os.path.join(tmp, DELTA), manifest)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def read_delta(path: str) -> dict:
    """A delta's manifest, its format checked (a `DeltaError` names what is wrong)."""
    file = os.path.join(path, DELTA)
    m = read_json_manifest(file, DELTA_FORMAT, DeltaError)
    if m.get("format_version") != DELTA_VERSION:
        raise DeltaError(
            f"delta {path}: format version {m.get('format_version')!r}; this sparsejax "
            f"reads version {DELTA_VERSION}"
        )
    for k in ("model_id", "version", "base", "arguments"):
        if k not in m:
            raise DeltaError(f"{file} has no {k!r}")
    return m


def patched(
    path: str,
    manifest: Mapping,
    served: Mapping[str, Callable[[], np.ndarray]],
    make: Callable | None = None,
) -> dict[str, np.ndarray]:
    """The served arguments a delta changes, as new arrays (copies of the served ones,
    patched; the served ones are left as they are). `served` gives each argument's
    current host value by key. Every array is checked before anything is patched.
    `make(key, shape, dtype, fill)` returns a new array filled by `fill(array)` (default:
    page-aligned memory of this process; `serve --workers`: shared by the workers)."""
    if make is None:

        def make(key, shape, dtype, fill):
            out = aligned_empty(shape, dtype)
            fill(out)
            return out

    out = {}
    for key, parts in manifest["arguments"].items():
        if key not in served:
            raise DeltaError(f"delta {path} changes argument {key}, which the model does not have")
        got = {
            p: read_array(os.path.join(path, e["file"]), dict(e), error=DeltaError, what="delta")
            for p, e in parts.items()
        }
        old = served[key]()
        if "whole" in got:
            new = got["whole"]
            if new.shape != old.shape or new.dtype != old.dtype:
                raise DeltaError(
                    f"delta {path}: argument {key} is {new.dtype}{list(new.shape)}, the model's "
                    f"is {old.dtype}{list(old.shape)}"
                )
            out[key] = new
            continue
        rows, values = got.get("rows"), got.get("values")
        if rows is None or values is None:
            raise DeltaError(f"delta {path}: argument {key} has neither whole nor rows+values")
        bad = (rows < 0) | (rows >= old.shape[0])
        if rows.ndim != 1 or values.shape != (rows.shape[0], *old.shape[1:]) or bad.any():
            raise DeltaError(
                f"delta {path}: argument {key}: {rows.shape[0]} rows of {values.dtype}"
                f"{list(values.shape[1:])} do not fit {old.dtype}{list(old.shape)}"
            )
        if values.dtype != old.dtype:
            raise DeltaError(
                f"delta {path}: argument {key} values are {values.dtype}, the model's {old.dtype}"
            )

        def fill(new, old=old, rows=rows, values=values):
            new[...] = old
            new[rows] = values

        out[key] = make(key, old.shape, old.dtype, fill)
    return out


class Publisher:
    """Publishes a training run into `directory` for `sparsejax serve` to follow: a full
    model dir first and every `full_every_s` seconds, deltas otherwise.

    `export(out, publish)` writes a full model dir (`export_model` with `publish=`);
    `arguments()` returns the current state's serving arguments (`serving_arguments`),
    or raises `ExportError` when deltas cannot be cut (dynamic tables: every publish is
    then a full one). Old versions are pruned: the previous full model dir and the
    deltas since it are kept."""

    def __init__(
        self,
        directory: str,
        *,
        export: Callable[[str, Mapping], object],
        arguments: Callable[[], dict[str, np.ndarray]] | None,
        full_every_s: float | None = 3600.0,
        log: Callable[[str], object] = print,
    ):
        self.directory = os.path.abspath(directory)
        self.export, self.arguments = export, arguments
        self.full_every_s = full_every_s
        self.log = log
        self.model_id = uuid.uuid4().hex
        self.version = self._newest()
        self._full_at: float | None = None  # when the last full one was published
        self._previous: dict[str, np.ndarray] | None = None

    def _newest(self) -> int:
        os.makedirs(self.directory, exist_ok=True)
        fulls = [int(n) for n in os.listdir(self.directory) if n.isdigit()]
        return max([*fulls, *delta_dirs(self.directory)], default=0)

    def publish(self, step: int) -> dict:
        """Publish the current state: `{"kind": "full" | "delta", "version", "path",
        "rows"}` (rows: per argument the rows a delta carries)."""
        full_due = (
            self._full_at is None
            or self.arguments is None
            or (
                self.full_every_s is not None
                and time.monotonic() - self._full_at >= self.full_every_s
            )
        )
        version = self.version + 1
        if full_due:
            out = os.path.join(self.directory, str(version))
            manifest = self.export(out, {"model_id": self.model_id, "version": version})
            self.version, self._full_at = version, time.monotonic()
            self._previous = None
            if self.arguments is not None:  # what the server reads, byte for byte
                self._previous = {
                    k: read_argument(out, e) for k, e in manifest["arguments"].items()
                }
            self._prune()
            return {"kind": "full", "version": version, "path": out}
        current = self.arguments()
        out = os.path.join(self.directory, f"{version}.delta")
        m = write_delta(
            out,
            self._previous,
            current,
            model_id=self.model_id,
            version=version,
            base=self.version,
            step=step,
        )
        self.version, self._previous = version, current
        rows = {
            k: p["rows"]["shape"][0] if "rows" in p else "all" for k, p in m["arguments"].items()
        }
        return {"kind": "delta", "version": version, "path": out, "rows": rows}

    def _prune(self) -> None:
        """Remove the versions older than the full one before the newest full one."""
        fulls = sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())
        if len(fulls) < 2:
            return
        keep_from = fulls[-2]
        for v in fulls[:-2]:
            shutil.rmtree(os.path.join(self.directory, str(v)), ignore_errors=True)
        for v, path in delta_dirs(self.directory).items():
            if v <= keep_from:
                shutil.rmtree(path, ignore_errors=True)
