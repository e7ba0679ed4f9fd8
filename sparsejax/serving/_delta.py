"""Training publishes, serving follows: full model dirs at intervals and, between them,
deltas (the rows that changed since the version before).

```
PUBLISH_DIR/
  <v>/                 a full model dir (`export_model`); its manifest's "publish" holds
                       the model id and the version v
  <v>.delta/           the arguments that changed from version v-1 (its "base") to v:
    delta.json         format, model id, version, base, step, created, per argument
                       either {"rows", "values"} (the changed rows of a table: row
                       indices and their new values, already in serving form: quantized
                       tables carry their quantized rows) or {"whole"}, and per dynamic
                       table its "keys": {"added", "rows", "removed"}
    arrays/*.npy
```

A dynamic table is published with rows to spare (`Publisher(headroom=)`): a delta puts
the keys training added in free rows (their values among the changed rows) and removes
the keys it evicted, whose rows are free again; served, an evicted key reads the default
row. When the spare rows run out, the next publish is a full one, with rows to spare
again.

A server serving version v applies `<v+1>.delta` (its base is v) in place of a reload:
the changed arguments are copied, patched and swapped in at once, so every request sees
exactly one version. Deltas are written under a temporary name and renamed, so a reader
never sees half of one. A delta for another model, a corrupt one, or one whose arrays do
not fit the served model is refused (`DeltaError`) and the served version stays.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping

import jax
import numpy as np

from ..checkpoint import read_array
from ..embedding import MAX_STACK_ROWS, aligned_empty
from ..sharding import allgather_json
from ._export import ITEM_EMBEDDINGS, KeyRows, _barrier
from ._format import (
    ModelLoadError,
    read_argument,
    read_json_manifest,
    read_own_pieces,
    write_arrays,
    write_json,
)
from ._format import read_array as read_model_array
from ._preprocess import KeyMapping, TooFewRows

DELTA = "delta.json"
DELTA_FORMAT = "sparsejax-delta"
DELTA_VERSION = 2  # 2: table rows in pieces (of several processes), dynamic keys
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


_COMPARE_BYTES = 16 << 20


def changed_rows(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The rows (first axis) whose bytes differ (NaNs compare by their bits). Compared in
    the widest words a row's bytes divide into, ~16 MiB of rows at a time, so the
    temporary stays small (a byte-wise comparison of a whole table made one as large as
    the table; 820 MiB of rows: 0.15-0.29 s, now 0.07 s)."""
    n, per = (new.shape[0], math.prod(new.shape[1:])) if new.ndim else (1, 1)
    a = np.ascontiguousarray(old).reshape(n, per).view(np.uint8)
    b = np.ascontiguousarray(new).reshape(n, per).view(np.uint8)
    width = a.shape[1]
    word = next(w for w in (8, 4, 2, 1) if width % w == 0)
    a, b = a.view(f"u{word}"), b.view(f"u{word}")
    block = max(1, _COMPARE_BYTES // max(width, 1))
    found = [
        np.flatnonzero((a[r : r + block] != b[r : r + block]).any(axis=1)) + r
        for r in range(0, n, block)
    ]
    return np.concatenate(found) if found else np.zeros(0, np.int64)


Argument = np.ndarray | list[tuple[int, np.ndarray]]
"""An argument's value: the whole array, or (a process of several) the rows it holds of a
table argument, as `[(first row, rows)]`."""


def _cut(key: str, old: Argument, new: Argument, name: str, arrays: dict) -> dict | None:
    """The delta of one argument: `{"whole": name}` or `{"pieces": [{"rows", "values"}]}`
    (names of the arrays added to `arrays`), None if it did not change."""
    whole = isinstance(new, np.ndarray)
    olds = [(0, old)] if isinstance(old, np.ndarray) else old
    news = [(0, new)] if whole else new

    def layout(blocks):
        return [(r, f"{a.dtype}{list(a.shape)}") for r, a in blocks]

    if layout(olds) != layout(news):
        raise ValueError(f"argument {key}: {layout(olds)} became {layout(news)}")
    pieces = []
    for (r0, a), (_, b) in zip(olds, news, strict=True):
        rows = changed_rows(a, b)
        if not rows.size:
            continue
        if whole and (b.ndim == 0 or 2 * rows.size > b.shape[0]):
            arrays[f"{name}.whole"] = b
            return {"whole": f"{name}.whole"}
        arrays[f"{name}.{r0}.rows"] = (rows + r0).astype(np.int64)
        arrays[f"{name}.{r0}.values"] = b[rows]
        pieces.append({"rows": f"{name}.{r0}.rows", "values": f"{name}.{r0}.values"})
    return {"pieces": pieces} if pieces else None


def write_delta(
    out: str,
    previous: Mapping[str, Argument],
    current: Mapping[str, Argument],
    *,
    model_id: str,
    version: int,
    base: int,
    step: int,
    keys: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    complete: Callable[[str, Mapping], dict[str, np.ndarray]] | None = None,
) -> dict:
    """Write the delta from `previous` to `current` (arguments by key, the same keys,
    shapes and dtypes) as `out` (through `<out>.tmp-<pid>`), with the dynamic tables'
    key changes `keys` (`{table: {"added", "rows", "removed"}}`: int64 arrays); returns
    its manifest. In a run of several processes, a collective: each writes the rows it
    holds (`serving_arguments`), process 0 the manifest.

    `complete(tmp, arguments)` (process 0 of several) makes the arguments of `previous`
    that `current` lacks, once every process's rows are written in `tmp` (`arguments`:
    their manifest entries): those made from the whole version (a retrieval model's
    catalog embeddings). `current` gains them."""
    missing = set(previous) - set(current)
    if set(current) - set(previous) or (missing and complete is None):
        raise ValueError(f"the arguments differ: {sorted(set(previous) ^ set(current))}")
    me = jax.process_index()
    tmp = f"{out}.tmp-{allgather_json(os.getpid())[0]}"  # process 0's pid
    if me == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier("delta folder")
    arguments, error = {}, None
    try:  # this process's rows; every process goes on to the collectives, even on an error
        arrays: dict[str, np.ndarray] = {}
        for i, (key, new) in enumerate(current.items()):
            got = _cut(key, previous[key], new, f"p{me}.{i}", arrays)
            if got is not None:
                arguments[key] = got
        key_parts = {}  # the same on every process (the keys are gathered): process 0's
        for j, (table, parts) in enumerate((keys or {}).items() if me == 0 else ()):
            key_parts[table] = {}
            for part in ("added", "rows", "removed"):
                arrays[f"p{me}.keys{j}.{part}"] = np.asarray(parts[part], np.int64)
                key_parts[table][part] = f"p{me}.keys{j}.{part}"
        entries = write_arrays(os.path.join(tmp, "arrays"), arrays)

        arguments, key_parts = _entries(arguments, entries), _entries(key_parts, entries)
    except Exception as e:  # noqa: BLE001 - reported on every process below
        error = f"process {me}: {type(e).__name__}: {e}"
    errors = [e for e in allgather_json(error) if e is not None]
    try:
        if errors:
            raise RuntimeError(f"delta {out} not written: {errors[0]}")
        merged: dict[str, dict] = {}
        for theirs in allgather_json(arguments):
            for key, parts in theirs.items():
                have = merged.setdefault(key, parts)
                if have is not parts:
                    have["pieces"] += parts["pieces"]
        if allgather_json(bool(missing))[0]:
            _complete(tmp, missing, previous, current, merged, complete if me == 0 else None)
        manifest = {
            "format": DELTA_FORMAT,
            "format_version": DELTA_VERSION,
            "model_id": model_id,
            "version": int(version),
            "base": int(base),
            "step": int(step),
            "created": time.time(),
            "arguments": merged,
            "keys": key_parts,
        }
        if me == 0:
            write_json(os.path.join(tmp, DELTA), manifest)
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        _barrier("delta renamed")
    except BaseException:
        if me == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _entries(x, entries: Mapping[str, dict]):
    """The array names in `x` (nested dicts and lists) as their `entries`."""
    if isinstance(x, str):
        return entries[x]
    if isinstance(x, list):
        return [_entries(v, entries) for v in x]
    return {k: _entries(v, entries) for k, v in x.items()}


def _complete(tmp: str, missing: set, previous, current, merged: dict, complete) -> None:
    """Process 0: the `missing` arguments, which `complete` makes from the version's rows
    in `tmp`, cut and written into it (`merged` and `current` gain them); every process
    learns whether that failed (a collective)."""
    error = None
    if complete is not None:
        try:
            made = complete(tmp, merged)
            if set(made) != missing:
                raise ValueError(f"made {sorted(made)}, not {sorted(missing)}")
            arrays: dict[str, np.ndarray] = {}
            cut = {}
            for i, (key, new) in enumerate(made.items()):
                got = _cut(key, previous[key], new, f"made.{i}", arrays)
                if got is not None:
                    cut[key] = got
            merged.update(_entries(cut, write_arrays(os.path.join(tmp, "arrays"), arrays)))
            current.update(made)
        except Exception as e:  # noqa: BLE001 - reported on every process below
            error = f"process 0: {type(e).__name__}: {e}"
    error = allgather_json(error)[0]
    if error is not None:
        raise RuntimeError(f"delta {tmp} not completed: {error}")


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


def _array(path: str, entry: Mapping) -> np.ndarray:
    """One of a delta's arrays, checked (a `DeltaError` if it is corrupt)."""
    return read_array(
        os.path.join(path, entry["file"]), dict(entry), error=DeltaError, what="delta"
    )


def updated_keys(
    path: str, manifest: Mapping, served: Mapping[str, KeyMapping]
) -> Mapping[str, KeyMapping]:
    """The served dynamic tables' key rows with the delta's key changes made (`served`
    itself if it makes none); a `DeltaError` names a change that does not fit."""
    if not manifest.get("keys"):
        return served
    out = dict(served)
    for table, parts in manifest["keys"].items():
        if table not in out:
            raise DeltaError(f"delta {path} changes the keys of {table!r}, not a dynamic table")
        try:
            got = {p: _array(path, e) for p, e in parts.items()}
            out[table] = out[table].updated(got["added"], got["removed"], got["rows"])
        except (KeyError, ValueError) as e:
            raise DeltaError(f"delta {path}: table {table!r}: {e}") from None
    return out


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
        old = served[key]()
        if "whole" in parts:
            new = _array(path, parts["whole"])
            if new.shape != old.shape or new.dtype != old.dtype:
                raise DeltaError(
                    f"delta {path}: argument {key} is {new.dtype}{list(new.shape)}, the model's "
                    f"is {old.dtype}{list(old.shape)}"
                )
            out[key] = new
            continue
        if not isinstance(parts.get("pieces"), list):
            raise DeltaError(f"delta {path}: argument {key} has neither whole nor pieces")
        pieces = []
        for piece in parts["pieces"]:
            rows, values = _array(path, piece["rows"]), _array(path, piece["values"])
            bad = (rows < 0) | (rows >= old.shape[0])
            if rows.ndim != 1 or values.shape != (rows.shape[0], *old.shape[1:]) or bad.any():
                raise DeltaError(
                    f"delta {path}: argument {key}: {rows.shape[0]} rows of {values.dtype}"
                    f"{list(values.shape[1:])} do not fit {old.dtype}{list(old.shape)}"
                )
            if values.dtype != old.dtype:
                raise DeltaError(
                    f"delta {path}: argument {key} values are {values.dtype}, the model's "
                    f"{old.dtype}"
                )
            pieces.append((rows, values))

        def fill(new, old=old, pieces=pieces):
            new[...] = old
            for rows, values in pieces:
                new[rows] = values

        out[key] = make(key, old.shape, old.dtype, fill)
    return out


def _own_arguments(model_dir: str, manifest: Mapping, whole: bool = False) -> dict[str, Argument]:
    """A model dir's arguments as `serving_arguments` gives them: whole in one process;
    in several, each process's own pieces of the tables, and process 0 the rest (a
    retrieval model's catalog embeddings too: it makes them). `whole`: all of them."""
    me, many = jax.process_index(), jax.process_count() > 1 and not whole
    out = {}
    for k, e in manifest["arguments"].items():
        if many and "pieces" in e:
            out[k] = read_own_pieces(model_dir, e, me)
        elif me == 0 or not many:
            out[k] = read_argument(model_dir, e)
    if (r := manifest.get("retrieval")) and (me == 0 or not many):
        entry = manifest["mapping_arrays"][r["item_embeddings"]]
        out[ITEM_EMBEDDINGS] = read_model_array(model_dir, entry)
    return out


def _written(got: dict, t0: float, on_written: Callable[[dict], object] | None) -> dict:
    got["took_s"] = time.perf_counter() - t0
    if on_written is not None:
        on_written(got)
    return got


class Publisher:
    """Publishes a training run into `directory` for `sparsejax serve` to follow: a full
    model dir first and every `full_every_s` seconds, deltas otherwise.

    `export(out, publish, key_rows)` writes a full model dir (`export_model` with
    `publish=` and `key_rows=`); `arguments(key_rows)` returns the current state's
    serving arguments (`serving_arguments` with `key_rows=`), or is None (every publish
    is a full one). A dynamic table's full version keeps `headroom` of its keys (at
    least `MIN_SPARE_ROWS` rows, at most the table's `max_rows` in all) free for the
    keys that deltas add. Old versions are pruned: the previous full model dir and the
    deltas since it are kept.

    `background` (a run of one process): `publish` returns once it has the state's
    arguments, and the delta is cut and written in a thread of its own while training
    goes on; the next `publish`, and `wait`, wait for it and raise its error. A full
    version is written in the call. Several processes write every delta in the call (its
    manifest is gathered).

    `complete(arguments, keys)` (a run of several processes) makes, on process 0, the
    arguments no process holds the rows for, from every argument of the version whole
    (`keys`: its dynamic tables' key rows): a retrieval model's catalog embeddings
    (`embed_catalog`). Process 0 then keeps the served arguments whole, patched with
    each delta's rows read back from it, as a full export reads its model dir back to
    embed the catalog."""

    MIN_SPARE_ROWS = 1024

    def __init__(
        self,
        directory: str,
        *,
        export: Callable[[str, Mapping, KeyRows], object],
        arguments: Callable[[KeyRows], dict[str, np.ndarray]] | None,
        full_every_s: float | None = 3600.0,
        headroom: float = 0.25,
        background: bool = False,
        complete: Callable[[Mapping, Mapping[str, KeyMapping]], dict[str, np.ndarray]]
        | None = None,
        log: Callable[[str], object] = print,
    ):
        self.directory = os.path.abspath(directory)
        self.export, self.arguments, self.complete = export, arguments, complete
        self._whole: dict[str, np.ndarray] = {}  # process 0, with `complete`: served, whole
        self.full_every_s = full_every_s
        self.headroom = headroom
        self.log = log
        # a run of several processes: process 0's id, and its decisions (`publish`)
        self.model_id = allgather_json(uuid.uuid4().hex)[0]
        self.version = allgather_json(self._newest())[0]
        self._full_at: float | None = None  # when the last full one was published
        self._previous: dict[str, np.ndarray] | None = None
        self._served: dict[str, KeyMapping] = {}  # the published dynamic tables' key rows
        self._next: dict[str, KeyMapping] = {}  # ... of the version being cut
        self._key_changes: dict[str, dict] = {}  # ... and what changed since the last
        self._writer = None
        if background and jax.process_count() == 1:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, "sparsejax-publish")
        self._writing: concurrent.futures.Future | None = None  # the delta being written

    def _newest(self) -> int:
        os.makedirs(self.directory, exist_ok=True)
        fulls = [int(n) for n in os.listdir(self.directory) if n.isdigit()]
        return max([*fulls, *delta_dirs(self.directory)], default=0)

    def _full_rows(self, table, keys: np.ndarray) -> KeyMapping:
        """A full version's key rows: the keys in order, then spare rows, the default."""
        n = keys.shape[0]
        rows = n + max(math.ceil(n * self.headroom), self.MIN_SPARE_ROWS)
        if table.dynamic is not None and table.dynamic.max_rows is not None:
            rows = min(rows, table.dynamic.max_rows)
        rows = max(min(rows, MAX_STACK_ROWS - 1), n)  # spare rows never make it unservable
        self._next[table.name] = got = KeyMapping(keys, rows)
        return got

    def _delta_rows(self, table, keys: np.ndarray) -> KeyMapping:
        """A delta's key rows: the kept keys where they were, the evicted ones' rows
        free, the new keys in the lowest free rows (`TooFewRows` if too few)."""
        old = self._served[table.name]
        removed = np.setdiff1d(old.keys, keys, assume_unique=True)
        added = np.setdiff1d(keys, old.keys, assume_unique=True)
        try:
            got = old.updated(added, removed)
        except TooFewRows as e:
            raise TooFewRows(f"table {table.name!r}: {e}") from None
        if added.size or removed.size:
            self._key_changes[table.name] = {"added": added, "rows": got(added), "removed": removed}
        self._next[table.name] = got
        return got

    def publish(self, step: int, on_written: Callable[[dict], object] | None = None) -> dict:
        """Publish the current state: `{"kind": "full" | "delta", "version", "path",
        "rows", "keys", "took_s"}` (a delta's rows: per argument the rows it carries;
        keys: per dynamic table the keys added and removed), also given to `on_written`
        once the version is written. With `background`, a delta's is given to it from
        the writing thread, with "in_call_s" (the time `publish` took), and `publish`
        returns `{"kind", "version", "path"}` before it is written (`wait`)."""
        t0 = time.perf_counter()
        self.wait()
        version = self.version + 1
        self._next, self._key_changes = {}, {}
        current = None
        full_due = (
            self._full_at is None
            or self.arguments is None
            or (
                self.full_every_s is not None
                and time.monotonic() - self._full_at >= self.full_every_s
            )
        )
        if not allgather_json(full_due)[0]:
            try:
                current = self.arguments(self._delta_rows)
            except TooFewRows as e:
                self.log(f"publish: {e}: version {version} is a full one, with rows to spare")
                self._next, self._key_changes = {}, {}
        if current is None:
            out = os.path.join(self.directory, str(version))
            manifest = self.export(
                out, {"model_id": self.model_id, "version": version}, self._full_rows
            )
            self.version, self._full_at, self._served = version, time.monotonic(), self._next
            self._previous = None
            if self.arguments is not None:  # what the server reads, byte for byte
                self._previous = _own_arguments(out, manifest)
                if self.complete is not None and jax.process_index() == 0:
                    self._whole = _own_arguments(out, manifest, whole=True)
            if jax.process_index() == 0:
                self._prune()
            _barrier("pruned")
            got = {"kind": "full", "version": version, "path": out}
            return _written(got, t0, on_written)
        out = os.path.join(self.directory, f"{version}.delta")
        write = functools.partial(
            self._write_delta, out, current, version, step, self._next, self._key_changes
        )
        if self._writer is None:
            return _written(write(), t0, on_written)
        in_call_s = time.perf_counter() - t0

        def write_then_tell() -> dict:
            return _written({**write(), "in_call_s": in_call_s}, t0, on_written)

        self._writing = self._writer.submit(write_then_tell)
        return {"kind": "delta", "version": version, "path": out}

    def _write_delta(self, out, current, version, step, served, key_changes) -> dict:
        m = write_delta(
            out,
            self._previous,
            current,
            model_id=self.model_id,
            version=version,
            base=self.version,
            step=step,
            keys=key_changes,
            complete=None if self.complete is None else functools.partial(self._made, served),
        )
        self.version, self._previous, self._served = version, current, served
        rows = {
            k: sum(q["rows"]["shape"][0] for q in p["pieces"]) if "pieces" in p else "all"
            for k, p in m["arguments"].items()
        }
        keys = {
            t: {"added": c["added"].shape[0], "removed": c["removed"].shape[0]}
            for t, c in key_changes.items()
        }
        return {"kind": "delta", "version": version, "path": out, "rows": rows, "keys": keys}

    def _made(self, served: Mapping[str, KeyMapping], tmp: str, arguments: Mapping) -> dict:
        """Process 0: `complete`'s arguments of the delta being written in `tmp`, from the
        served arguments patched with every process's rows of it."""
        getters = {k: functools.partial(self._whole.get, k) for k in self._whole}
        whole = {**self._whole, **patched(tmp, {"arguments": arguments}, getters)}
        made = self.complete(whole, {**self._served, **served})
        self._whole = {**whole, **made}
        return made

    def wait(self) -> dict | None:
        """Wait for the delta being written in the background; its `publish` result
        (None: none is). Raises the error that kept it from being written."""
        writing, self._writing = self._writing, None
        return None if writing is None else writing.result()

    def close(self) -> None:
        """`wait`, then stop the background thread."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown()

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
