"""The run directory: which config it belongs to, what may change on resume, how a
start is recorded and how a refused start is undone.

A run directory belongs to one config. `train` locks it (`RUN/.lock`, one process at a
time), records the resolved config (`config.yaml`, data paths absolute) and its hash
(`run.json`, with a history of starts), and refuses to continue a run whose config
differs in any key but the `RESUMABLE_KEYS`, naming the keys; `restart=True`
(`sparsejax train --restart`) moves the old run aside and starts over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from . import _config
from ._config import ConfigError, schema_reference, to_dict
from ._lock import LOCK_NAME
from ._read import absolute_data_paths
from ._schema import RunConfig, config_from_dict, options_reference

RESUMABLE_KEYS = (
    "steps",
    "epochs",
    "log_every",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "checkpoint_full_every",
    "progress",
    "data.prefetch",
    "data.workers",
    "profile_steps",
    "publish",
    "sharding.devices",
    "sharding.model",
    "sharding.device_memory",
)
"""Keys that may change between runs of one run directory: the run resumes with the new
values (and `run.json` records the change). Any other change is refused. The `sharding`
keys are among them: a checkpoint stores every table by name, whole, so it restores on
any mesh (a resharding restore)."""

RESUMABLE_TABLE_KEYS = ("cache_rows", "cache_policy", "ram_bytes", "disk_dir", "placement")
"""Keys of a `tables.<name>` entry that may change on resume too: how many rows of a
tiered table the device caches and where its host rows live, and where a table's rows
live on the mesh (the training math is the same; a checkpoint of a tiered table restores
at any cache size, any table at any placement). `cache_rows` only from one size to
another: turning a table's cache on or off changes what its checkpoint holds."""

_WHERE_KEYS = ("name", "out_dir", "resume")  # where a run lives and whether to go on


def _resumable(key: str, old: Any = None, new: Any = None) -> bool:
    """Whether a change of `key` from `old` to `new` may resume (see `RESUMABLE_KEYS`,
    `RESUMABLE_TABLE_KEYS`)."""
    if key in RESUMABLE_KEYS or key.startswith("publish."):
        return True
    parts = key.split(".")
    if len(parts) != 3 or parts[0] != "tables" or parts[2] not in RESUMABLE_TABLE_KEYS:
        return False
    return parts[2] != "cache_rows" or all(v not in (None, 0, _UNSET) for v in (old, new))


def _flatten(tree: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))  # an empty mapping is no key
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


_UNSET = "<unset>"


def config_changes(old: Mapping, new: Mapping) -> list[tuple[str, Any, Any]]:
    """`(dotted key, old value, new value)` of every key whose value differs between
    two config dicts (nested mappings compared key by key; `<unset>` where absent)."""
    a, b = _flatten(old), _flatten(new)
    return [
        (k, a.get(k, _UNSET), b.get(k, _UNSET))
        for k in sorted(set(a) | set(b))
        if a.get(k, _UNSET) != b.get(k, _UNSET)
    ]


def _canonical(cfg_dict: Mapping) -> dict:
    """A config dict with its `tables` entries in one form: unset (null) options left
    out, so an entry that sets a few keys compares equal however it was written (an
    options section set to its defaults, e.g. `bloom: {}`, stays, as "{}")."""

    def prune(v):
        if not isinstance(v, Mapping):
            return v
        out = {k: prune(x) for k, x in v.items() if x is not None}
        return out or "{}"

    tables = cfg_dict.get("tables")
    if not isinstance(tables, Mapping):
        return dict(cfg_dict)
    entries = {str(k): prune(v) for k, v in tables.items()}
    return {**cfg_dict, "tables": {k: v for k, v in entries.items() if v not in ("{}", None)}}


def _identity(cfg_dict: Mapping) -> dict:
    """The keys that make a run what it is (not where it lives, not how long it goes)."""
    return {
        k: v
        for k, v in _flatten(_canonical(cfg_dict)).items()
        if k not in _WHERE_KEYS and not _resumable(k, 1, 1)
    }


def config_hash(cfg: RunConfig) -> str:
    """sha256 of the config's identity: every key but the `RESUMABLE_KEYS` (and
    `RESUMABLE_TABLE_KEYS`), `name`, `out_dir` and `resume` (so a resumable change keeps
    the hash)."""
    text = json.dumps(_identity(to_dict(cfg)), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def resolved_config(cfg: RunConfig) -> RunConfig:
    """`cfg` with its data files as absolute paths (globs expanded), as `config.yaml`
    records them: evaluation then reads the same files from any directory. A missing
    file is a `ConfigError` naming the key."""
    return dataclasses.replace(cfg, data=absolute_data_paths(cfg.data))


def _short(v: Any) -> str:
    if v is _UNSET:
        return v
    text = yaml.safe_dump(v, default_flow_style=True, width=1 << 20).strip()
    text = text.removesuffix("...").strip()
    return text if len(text) <= 60 else text[:57] + "..."


def _checkpoint_steps(run_dir: str) -> list[int]:
    d = os.path.join(run_dir, "checkpoints")
    return sorted(int(p) for p in os.listdir(d) if p.isdigit()) if os.path.isdir(d) else []


def _saved_config(run_dir: str) -> dict | None:
    """The run directory's config.yaml, normalized like a fresh config when it still
    validates (defaults filled in, data paths absolute)."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    try:
        old = config_from_dict(raw)
    except ConfigError:
        return raw
    try:
        old = resolved_config(old)
    except ConfigError:
        pass
    return to_dict(old)


_KEPT = (LOCK_NAME, "launch")
"""What a restart leaves in the run directory: the lock, and `launch/` (the output of
`sparsejax launch`'s processes 1.., being written by the launch that restarts)."""


def _set_aside_run(run_dir: str) -> str:
    """Move everything in `run_dir` but `_KEPT` to `<run_dir>.replaced-<time>`."""
    dest = f"{run_dir.rstrip(os.sep)}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = f"{run_dir.rstrip(os.sep)}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    os.makedirs(dest)
    for entry in os.listdir(run_dir):
        if entry not in _KEPT:
            shutil.move(os.path.join(run_dir, entry), os.path.join(dest, entry))
    return dest


def _prepare_run_dir(cfg: RunConfig, *, restart: bool) -> tuple[list[str], dict]:
    """Check that `cfg` may use its run directory (see the module docstring); move the
    old run aside on `restart`. Returns (lines to log, the history entry of this start)."""
    run_dir, notes = cfg.run_dir, []
    steps = _checkpoint_steps(run_dir)
    entry: dict = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "pid": os.getpid()}
    if restart and any(e not in _KEPT for e in os.listdir(run_dir)):
        dest = _set_aside_run(run_dir)
        notes.append(f"--restart: moved the previous run of {run_dir} to {dest}")
        return notes, {**entry, "event": "restart", "previous_run": dest}
    if not steps:
        return notes, {**entry, "event": "start"}
    way_out = (
        f"use a new name= to keep both runs, or --restart to start over (moves the old "
        f"run to {run_dir}.replaced-<time>)"
    )
    if not cfg.resume:
        raise ConfigError(
            f"{run_dir} already holds checkpoints (latest step {steps[-1]}) and resume=false;"
            f" {way_out}, or resume=true to continue it"
        )
    old = _saved_config(run_dir)
    if old is None:
        notes.append(f"warning: {run_dir} has checkpoints but no config.yaml; not checked")
        return notes, {**entry, "event": "resume", "step": steps[-1]}
    changes = config_changes(_canonical(old), _canonical(to_dict(cfg)))
    changes = [c for c in changes if c[0] not in _WHERE_KEYS]
    blocking = [c for c in changes if not _resumable(*c)]
    if blocking:
        shown = ", ".join(f"{k}: {_short(a)} -> {_short(b)}" for k, a, b in blocking[:6])
        more = f" and {len(blocking) - 6} more" if len(blocking) > 6 else ""
        raise ConfigError(
            f"{run_dir} holds a run (checkpoint {steps[-1]}) of a different config "
            f"({shown}{more}); {way_out}. Resumable without a restart: "
            f"{', '.join(RESUMABLE_KEYS)}, tables.<name>.{{{','.join(RESUMABLE_TABLE_KEYS)}}}"
        )
    entry = {**entry, "event": "resume", "step": steps[-1]}
    if changes:
        notes.append(
            "resuming with " + ", ".join(f"{k}: {_short(a)} -> {_short(b)}" for k, a, b in changes)
        )
        entry["changed"] = {k: [a, b] for k, a, b in changes}
    return notes, entry


def _record_start(cfg: RunConfig, entry: dict) -> None:
    """config.yaml and run.json (hash, history of starts)."""
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    path = os.path.join(cfg.run_dir, "run.json")
    record: dict = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            record = {}
    record["config_sha256"] = config_hash(cfg)
    record.setdefault("history", []).append(entry)
    with open(path, "w") as f:
        json.dump(record, f, indent=2, default=str)


class _RunLogFile:
    """`RUN/run.log`: every line the run logs, with its time, and the traceback of the
    error that ended it."""

    def __init__(self, path: str):
        self.path = path

    def write(self, text: str) -> None:
        with open(self.path, "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def tee(self, log: Callable[[str], None]) -> Callable[[str], None]:
        def both(line: str) -> None:
            self.write(f"{time.strftime('%H:%M:%S')} {line}")
            log(line)

        return both


def _first_missing(path: str) -> str | None:
    """The outermost directory of `path` that does not exist yet (None: `path` exists)."""
    path, first = os.path.abspath(path), None
    while not os.path.exists(path):
        first, path = path, os.path.dirname(path)
    return first


def _no_new_checkpoint(cfg: RunConfig, entry: dict) -> bool:
    """No checkpoint newer than the one the run started from (`entry`'s step)."""
    steps = _checkpoint_steps(cfg.run_dir)
    return not steps or steps[-1] <= entry.get("step", 0)


def _remove_new(run_dir: str, made: str | None, before: set[str]) -> None:
    """Remove what a refused start created: the directories it made (`made`, the
    outermost: out_dir too when it was new), else the run directory's entries that were
    not in `before`. A previous run's files stay; its run.log keeps the refused attempt."""
    if made is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
        parent = os.path.dirname(os.path.abspath(run_dir))
        while len(parent) >= len(made) and os.path.isdir(parent) and not os.listdir(parent):
            os.rmdir(parent)  # only empty directories this start made
            parent = os.path.dirname(parent)
        return
    for name in set(os.listdir(run_dir)) - before:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def _checkpoint_steps_in(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(p) for p in os.listdir(directory) if p.isdigit())


def config_reference() -> str:
    """The config schema reference (`sparsejax config --schema`, docs/config.md),
    rendered from the dataclasses' field docs; the layering rules are `_config`'s
    module docstring."""
    layering = _config.__doc__.split("\n\n", 1)[1]  # all but the title line
    intro = "\n\n".join(
        [
            "Generated from the field docs of `sparsejax.runner.RunConfig` by `sparsejax "
            "config --schema`; regenerate with `sparsejax config --schema > docs/config.md` "
            "(a test checks it is current). `sparsejax config CONFIG.yaml key=value` prints "
            "a resolved config.",
            _markdown(layering),
            "A run directory belongs to one config: running another config under the same "
            "`name` is refused, naming the keys that differ (use a new `name=`, or "
            "`sparsejax train --restart`, which moves the old run to `RUN.replaced-<time>`). "
            "These keys may change on resume without a restart (each change is recorded in "
            "`run.json`): " + ", ".join(f"`{k}`" for k in RESUMABLE_KEYS) + ", and of a "
            "`tables.<name>` entry "
            + ", ".join(f"`{k}`" for k in RESUMABLE_TABLE_KEYS)
            + " (`cache_rows` from one size to another: the device cache of a tiered "
            "table; its checkpoint restores at any cache size). The `sharding` keys and "
            "`placement` move a run to another mesh: a checkpoint holds every table whole, "
            "by name, and restores on any mesh (a resharding restore).",
        ]
    )
    return schema_reference(RunConfig, intro=intro) + "\n" + options_reference()


def _markdown(doc: str) -> str:
    """A docstring's paragraphs as markdown: wrapped lines joined, `- ` items kept."""
    out = []
    for para in doc.strip().split("\n\n"):
        items: list[str] = []
        for line in para.strip().splitlines():
            line = line.strip()
            if line.startswith("- ") or not items:
                items.append(line)
            else:
                items[-1] += " " + line
        out.append("\n".join(items))
    return "\n\n".join(out)
