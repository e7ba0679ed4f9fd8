"""The host side of tiered embedding tables on disk: one folder per saved step, full or
a delta against the step before, each file checksummed.

Layout, under a checkpoint directory (orbax's `CheckpointManager` lists only numeric
entries, so it neither sees nor deletes `host_tables/`):

    host_tables/<step>/manifest.json          written last: kind, previous step, every
                                              array's file, crc32, shape, dtype, bytes
    host_tables/<step>/<table>/<array>.npy    one file per `TableSnapshot.arrays` entry

A job of N > 1 processes writes one such tree per process, of the keys it owns
(`part_root`: `host_parts/<N>/<process>/host_tables/...`), each with its own chain of
full saves and deltas; a restore on any process count reads every part (`read_parts`)
and each process keeps the keys it now owns.

`<table>` and `<array>` are the names percent-encoded ("embedding/user" ->
"embedding%2Fuser", "slot/accum" -> "slot%2Faccum.npy"); the manifest maps names to
files, so nothing is ever decoded. A step is written into `host_tables/.tmp-<step>-...`,
every file and folder fsynced, then renamed to `<step>`: a process killed mid-save
leaves a temp folder (ignored, removed by the next `prune`), never a half step that
looks complete.

A delta names the step it builds on and that save's random id, so `read_chain` notices
a base that was replaced by another save of the same step (a run restored from an
older checkpoint and trained on) instead of mixing two histories.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from urllib.parse import quote

import numpy as np

from ..embedding.host import TableSnapshot
from ._files import (
    CheckpointError,
    CheckpointUnreadableError,
    NonFiniteStateError,
    fsync_dir,
    read_array,
    write_array,
)

HOST_DIR = "host_tables"
"""The folder of the host steps, inside a checkpoint directory."""

MANIFEST = "manifest.json"
_FORMAT = 1
_CHUNK = 16 << 20
_TEMP = re.compile(r"^\.(tmp|old)-(\d+)-(\d+)-[0-9a-f]+$")  # .tmp-<step>-<pid>-<hex>


PARTS_DIR = "host_parts"
"""Where, inside a checkpoint directory, the processes of a multi-process job write their
own host steps: `host_parts/<processes>/<process>/host_tables/<step>/...`."""


def part_root(directory: str | os.PathLike, owner: int, owners: int) -> str:
    """The directory whose `host_tables/` holds owner `owner`'s host steps of a job of
    `owners` processes (the checkpoint directory itself for one process)."""
    if owners == 1:
        return os.fspath(directory)
    return os.path.join(os.fspath(directory), PARTS_DIR, str(owners), str(owner))


def part_counts(directory: str | os.PathLike) -> list[int]:
    """The process counts whose parts are on disk (`host_parts/<n>`)."""
    root = os.path.join(os.fspath(directory), PARTS_DIR)
    if not os.path.isdir(root):
        return []
    return sorted(int(n) for n in os.listdir(root) if n.isdigit())


def read_parts(directory: str | os.PathLike, step: int, owners: int) -> list[dict]:
    """`read_chain` of every owner's part of `step` (saved by `owners` processes), one
    after another: what `HostSide.restore` takes, each owner's chain starting with its
    full save."""
    return [c for p in range(owners) for c in read_chain(part_root(directory, p, owners), step)]


def host_dir(directory: str | os.PathLike) -> str:
    return os.path.join(os.fspath(directory), HOST_DIR)


def step_dir(directory: str | os.PathLike, step: int) -> str:
    return os.path.join(host_dir(directory), str(int(step)))


def _fs_name(name: str) -> str:
    """`name` as one safe path component: percent-encoded, never "", "." or ".."."""
    q = quote(name, safe="")
    return "%2E" + q[1:] if q.startswith(".") else q or "%00"


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON")


def _non_finite(a: np.ndarray) -> bool:
    """Whether a float array holds NaN/inf (checked in slices: no full-size temporary)."""
    a = np.asarray(a)
    if a.dtype.kind != "f" and a.dtype.name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return False
    flat = a.reshape(-1)
    step = max(1, _CHUNK // max(a.dtype.itemsize, 1))
    for i in range(0, flat.size, step):
        part = flat[i : i + step]
        if not np.isfinite(part if part.dtype.kind == "f" else part.astype(np.float32)).all():
            return True
    return False


def write_step(
    directory: str | os.PathLike,
    step: int,
    snapshots: Mapping[str, TableSnapshot],
    *,
    previous: int | None,
) -> dict:
    """Write one step's snapshots to `host_tables/<step>/` atomically; returns its manifest.

    A delta step (any snapshot of kind "delta") needs `previous`, the step it builds on,
    whose manifest must be readable. Replaces an existing `<step>` (only once the new
    one is complete on disk).

    Raises:
      NonFiniteStateError: a float array holds NaN/inf (named); nothing is written.
      CheckpointError: a delta without a previous step, or a bad snapshot.
    """
    step = int(step)
    kinds = {k: s.kind for k, s in snapshots.items()}
    for key, snap in snapshots.items():
        if snap.kind not in ("full", "delta"):
            raise CheckpointError(
                f"host table {key!r}: snapshot kind {snap.kind!r} (not full/delta)"
            )
        for name, a in snap.arrays.items():
            if _non_finite(a):
                raise NonFiniteStateError(
                    f"not saving step {step}: host table {key!r} array {name!r} holds NaN or inf"
                )
    kind = "delta" if "delta" in kinds.values() else "full"
    manifest: dict = {
        "format": _FORMAT,
        "step": step,
        "kind": kind,
        "previous": None,
        "previous_id": None,
        "id": uuid.uuid4().hex,
        "tables": {},
    }
    if kind == "delta":
        if previous is None:
            delta = sorted(k for k, v in kinds.items() if v == "delta")
            raise CheckpointError(
                f"step {step}: host tables {delta} gave delta snapshots but there is no "
                f"previous save to build on"
            )
        if not int(previous) < step:
            raise CheckpointError(
                f"step {step}: a delta must build on an earlier step, got {previous}"
            )
        manifest["previous"] = int(previous)
        manifest["previous_id"] = read_manifest(directory, int(previous))["id"]

    root = host_dir(directory)
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp-{step}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        for key, snap in snapshots.items():
            folder = _fs_name(key)
            os.makedirs(os.path.join(tmp, folder))
            arrays = {}
            for name, a in snap.arrays.items():
                arrays[name] = write_array(os.path.join(tmp, folder, _fs_name(name) + ".npy"), a)
            fsync_dir(os.path.join(tmp, folder))
            manifest["tables"][key] = {
                "dir": folder,
                "kind": snap.kind,
                "step": int(snap.step),
                "meta": snap.meta,
                "arrays": arrays,
            }
        text = json.dumps(manifest, indent=1, default=_json_default)
        with open(os.path.join(tmp, MANIFEST), "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)
        final = os.path.join(root, str(step))
        old = None
        if os.path.lexists(final):
            old = os.path.join(root, f".old-{step}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return manifest


def host_steps(directory: str | os.PathLike) -> list[int]:
    """The complete host steps on disk (temp folders of unfinished saves excluded)."""
    root = host_dir(directory)
    if not os.path.isdir(root):
        return []
    return sorted(int(n) for n in os.listdir(root) if n.isdigit())


def read_manifest(directory: str | os.PathLike, step: int) -> dict:
    """The manifest of host step `step`.

    Raises:
      CheckpointUnreadableError: missing or not a manifest (naming the file).
    """
    path = os.path.join(step_dir(directory, step), MANIFEST)
    try:
        with open(path) as fh:
            m = json.load(fh)
    except FileNotFoundError:
        what = "missing" if os.path.isdir(step_dir(directory, step)) else "missing (no such step)"
        raise CheckpointUnreadableError(f"host-table file {path} is {what}") from None
    except (OSError, ValueError) as e:
        raise CheckpointUnreadableError(
            f"host-table file {path} is unreadable ({type(e).__name__}: {e})"
        ) from e
    ok = (
        isinstance(m, dict)
        and m.get("format") == _FORMAT
        and m.get("step") == int(step)
        and m.get("kind") in ("full", "delta")
        and isinstance(m.get("tables"), dict)
        and isinstance(m.get("id"), str)
        and (m["kind"] == "full" or isinstance(m.get("previous"), int))
    )
    if not ok:
        raise CheckpointUnreadableError(f"host-table file {path} is not a manifest of step {step}")
    return m


def chain_steps(directory: str | os.PathLike, step: int) -> list[int]:
    """The host steps a restore of `step` reads: its last full save, then every delta
    up to `step`, oldest first (manifests only; no array is read).

    Raises:
      CheckpointUnreadableError: a manifest missing or corrupt, or a delta whose base was
        replaced by another save of that step (naming the file).
    """
    steps = [int(step)]
    m = read_manifest(directory, step)
    while m["kind"] == "delta":
        prev = m["previous"]
        if not prev < steps[-1]:
            raise CheckpointUnreadableError(
                f"host-table file {os.path.join(step_dir(directory, steps[-1]), MANIFEST)} "
                f"builds on step {prev}, not an earlier one"
            )
        pm = read_manifest(directory, prev)
        if pm["id"] != m["previous_id"]:
            raise CheckpointUnreadableError(
                f"host-table step {steps[-1]} builds on a save of step {prev} that was since "
                f"replaced ({os.path.join(step_dir(directory, prev), MANIFEST)} is another save)"
            )
        steps.append(prev)
        m = pm
    return steps[::-1]


def read_step(directory: str | os.PathLike, step: int) -> dict[str, TableSnapshot]:
    """Host step `step` as `{"layer/table": TableSnapshot}`, every checksum verified."""
    m = read_manifest(directory, step)
    folder = step_dir(directory, step)
    out = {}
    for key, t in m["tables"].items():
        arrays = {
            name: read_array(os.path.join(folder, t["dir"], e["file"]), e)
            for name, e in t["arrays"].items()
        }
        out[key] = TableSnapshot(kind=t["kind"], step=t["step"], arrays=arrays, meta=t["meta"])
    return out


def read_chain(directory: str | os.PathLike, step: int) -> list[dict[str, TableSnapshot]]:
    """What a host side's `restore` takes for `step`: the snapshots of its last full save,
    then of each delta up to `step`, oldest first, every file's checksum, size, shape
    and dtype verified before any is returned.

    Raises:
      CheckpointUnreadableError: a missing or corrupt manifest or array file (one line
        naming the file, whose path holds the step).
    """
    return [read_step(directory, s) for s in chain_steps(directory, step)]


def needed_steps(directory: str | os.PathLike, keep: Iterable[int]) -> set[int]:
    """The host steps the chains of checkpoints `keep` read. A chain that cannot be
    followed (a manifest unreadable) keeps every host step up to its checkpoint."""
    have = host_steps(directory)
    needed: set[int] = set()
    for s in keep:
        try:
            needed.update(chain_steps(directory, s))
        except Exception:  # noqa: BLE001 - unreadable: keep what it might need
            needed.update(h for h in have if h <= s)
    return needed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # saves are synchronous: a temp folder of ours is a failed save's
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def prune(directory: str | os.PathLike, keep: Iterable[int]) -> list[int]:
    """Delete the host steps no chain of checkpoints `keep` needs, and the temp folders
    of saves whose process is gone (killed mid-save). Returns the steps deleted."""
    root = host_dir(directory)
    if not os.path.isdir(root):
        return []
    needed = needed_steps(directory, keep)
    gone = [s for s in host_steps(directory) if s not in needed]
    for s in gone:
        shutil.rmtree(os.path.join(root, str(s)), ignore_errors=True)
    for name in os.listdir(root):
        m = _TEMP.match(name)
        if m and not _alive(int(m.group(3))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return gone
