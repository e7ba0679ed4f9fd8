"""The jobs behind `sparsejax train` and `sparsejax eval`: build a run from its config
(resuming from its latest checkpoint), train it with `sparsejax.train.fit`, evaluate a
run directory's checkpoint.

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
import math
import os
import shutil
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import yaml

from ..checkpoint import Checkpointer
from ..data import Loader
from ..train import Trainer, TrainState, fit
from ._build import (
    DataBundle,
    absolute_data_paths,
    build_data,
    first_train_batch,
    model_warnings,
)
from ._config import ConfigError, schema_reference, to_dict
from ._knobs import build_trainer, run_knobs
from ._lock import LOCK_NAME, RunLock, RunLockedError
from ._report import (
    Console,
    MetricsLog,
    format_metrics,
    plain,
    plot_curves,
    tensorboard_log,
    write_summary,
)
from ._schema import RunConfig, config_from_dict, load_config, options_reference

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
    "profile_steps",
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
    if key in RESUMABLE_KEYS:
        return True
    parts = key.split(".")
    if len(parts) != 3 or parts[0] != "tables" or parts[2] not in RESUMABLE_TABLE_KEYS:
        return False
    return parts[2] != "cache_rows" or all(v not in (None, 0, _UNSET) for v in (old, new))


@dataclasses.dataclass
class Run:
    """A built run: config, data, model, trainer and state (for notebooks and tests)."""

    cfg: RunConfig
    data: DataBundle
    model: Any
    trainer: Trainer
    state: TrainState
    checkpointer: Checkpointer
    position: dict
    log_window: list = dataclasses.field(default_factory=list)
    """The losses since the last log record of the restored checkpoint (`fit`'s
    `log_window`)."""

    @property
    def total_steps(self) -> int:
        if self.cfg.steps is not None:
            return self.cfg.steps
        if self.data.steps_per_epoch is None:
            raise ConfigError("`epochs` needs file data; use `steps` for generators")
        return self.cfg.epochs * self.data.steps_per_epoch


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


def build_run(cfg: RunConfig, *, log: Callable[[str], None] = print) -> Run:
    """Data, model, trainer and the initial (or resumed) state of a run.

    Resuming reads the newest readable checkpoint: an unreadable newer one (truncated,
    corrupt) is named in a warning and moved to `RUN/checkpoints_unreadable/`.
    """
    os.makedirs(cfg.run_dir, exist_ok=True)
    data = build_data(cfg)
    if data.report:
        log(f"data: {data.report}")
    for line in model_warnings(cfg, data):
        log(f"warning: {line}")
    if not data.eval_batches:
        raise ConfigError(
            "the eval split is empty: every run evaluates (during training and at the end);"
            " give data.eval files or a split with eval rows"
        )
    model, trainer = build_trainer(cfg, data, log=log)  # knobs, mesh, plan: runner/_knobs.py
    first = first_train_batch(data)
    state = trainer.init(jax.random.key(cfg.seed), first)  # makes trainer.host_tables
    ckpt = Checkpointer(
        os.path.join(cfg.run_dir, "checkpoints"),
        trainer.layouts,  # each layer's store on the trainer's mesh
        max_to_keep=cfg.keep_checkpoints,
        **_host_kw(trainer, full_every=cfg.checkpoint_full_every),
    )
    position: dict = {"epoch": 0, "batch": 0}
    log_window: list = []
    if cfg.resume and ckpt.latest_step() is not None:
        state, meta, skipped = ckpt.restore_readable(state, warn=lambda m: log(f"warning: {m}"))
        if jax.process_index() == 0:  # the run directory is process 0's
            for s in skipped:  # out of the way of this run's next save of that step
                log(f"warning: moved unreadable checkpoint {s} to {ckpt.set_aside(s)}")
        if skipped and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("sparsejax: unreadable checkpoints set aside")
        state = trainer.put_state(state)
        position = _own_position(meta["data_position"])
        log_window = list((meta.get("extra") or {}).get("log_window", []))
        log(f"resumed from {ckpt.directory}/{int(state.step)} (data position {position})")
    return Run(cfg, data, model, trainer, state, ckpt, position, log_window)


def _own_position(position: dict | None) -> dict | None:
    """This process's data position from a checkpoint's: per process when the train
    source is split by process (streamed files; `_data_position`), else shared."""
    if isinstance(position, Mapping) and "processes" in position:
        mine = position["processes"]
        if len(mine) != jax.process_count():
            raise ConfigError(
                f"the checkpoint was saved by {len(mine)} processes streaming their own share"
                f" of the train files; resume it with {len(mine)} processes (now "
                f"{jax.process_count()})"
            )
        return mine[jax.process_index()]
    return position


def _data_position(loader: Loader) -> Callable[[], dict]:
    """What a checkpoint records of the data: the loader's position; with many
    processes streaming their own files, every process's (a collective: all call it)."""
    if jax.process_count() == 1 or not loader.streaming:
        return lambda: loader.position.to_dict()
    from jax.experimental import multihost_utils

    def gathered() -> dict:
        text = json.dumps(loader.position.to_dict()).encode()
        n = multihost_utils.process_allgather(np.array(len(text), np.int32))
        buf = np.zeros(int(np.max(n)), np.uint8)
        buf[: len(text)] = np.frombuffer(text, np.uint8)
        rows = np.asarray(multihost_utils.process_allgather(buf))
        return {
            "processes": [json.loads(bytes(r[:k]).decode()) for r, k in zip(rows, n, strict=True)]
        }

    return gathered


def _host_kw(trainer: Trainer, **kw) -> dict:
    """The Checkpointer's `host_tables` (and `kw`) of a trainer with tiered tables (else
    none)."""
    host = getattr(trainer, "host_tables", None)
    return {} if host is None else {"host_tables": host, **kw}


def table_stats(trainer: Trainer) -> dict | None:
    """Per tiered table ("layer/table") its host side's stats (rows live, admitted,
    rejected, evicted, lookups, cache hit rate...), for summary.json; None without
    tiered tables."""
    host = getattr(trainer, "host_tables", None)
    return None if host is None else _jsonable(host.stats())


def _tables_line(stats: Mapping[str, Mapping]) -> str:
    """The tiered tables' stats in one line (all of them are in summary.json)."""
    live = sum(int(s.get("rows_live", 0)) for s in stats.values())
    text = f"tables: {len(stats)} tiered, {live:,} rows live"
    hits = {k: s["cache_hit_rate"] for k, s in stats.items() if "cache_hit_rate" in s}
    if hits:
        low = min(hits, key=hits.get)
        text += (
            f", cache hit rate {sum(hits.values()) / len(hits):.3f} on average "
            f"(lowest {low.split('/')[-1]} {hits[low]:.3f})"
        )
    return text + " (per table: summary.json)"


def _jsonable(tree: Any) -> Any:
    """Nested stats as JSON values (numpy scalars and 0-d arrays as Python numbers)."""
    if isinstance(tree, Mapping):
        return {str(k): _jsonable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_jsonable(v) for v in tree]
    if isinstance(tree, (np.ndarray, jax.Array)):
        return _jsonable(np.asarray(tree).tolist())
    if isinstance(tree, np.generic):
        return tree.item()
    return tree


def train(cfg: RunConfig, *, restart: bool = False, log: Callable[[str], None] = print) -> dict:
    """Train (or resume) a run to `cfg.steps`, evaluating and checkpointing on the way.

    The run directory is locked for the duration, and checked before any data is read:
    a run of a different config there is refused naming the keys that differ (only the
    `RESUMABLE_KEYS` may change on resume); `restart=True` moves the old run aside to
    `RUN.replaced-<time>` and starts over. Everything logged goes to `RUN/run.log` too,
    with the traceback of an error that ends the run (its path in the exception's
    `run_log` attribute). A start refused before it trains (a config or data error)
    removes what it created: the run directory when it made it, else the entries it
    added (a previous run's files stay; its run.log keeps the refused attempt).

    In many processes (`sparsejax launch`, `jax.distributed`) every process calls this
    with the same config: process 0 locks and checks the run directory and writes its
    files (run.json, config.yaml, run.log, metrics.jsonl, tensorboard/, summary.json,
    curves.png, the console), then tells the others whether the run starts (they raise
    its error when it does not); every process builds the same run, feeds its share of
    each global batch and takes part in every checkpoint save.

    Returns the summary, as summary.json: `step`, `last_eval` and `best_eval` (each
    with its step; the best also by which metric, and where it was kept), throughput. Raises
    `NonFiniteLossError` naming the step when the loss becomes NaN/inf; the run
    directory keeps the last good checkpoint. `RunLockedError` when another process
    trains in the run directory; `ConfigError` for the config problems above.
    """
    cfg = resolved_config(cfg)
    primary = jax.process_index() == 0
    lock = RunLock(cfg.run_dir, log=log) if primary else None
    notes, entry, failure = [], {}, None
    made, before = _first_missing(cfg.run_dir), set()  # what a refused start removes
    if lock is not None:  # process 0 owns the run directory
        try:
            lock.acquire()
            notes, entry = _prepare_run_dir(cfg, restart=restart)
            before = set(os.listdir(cfg.run_dir)) - {LOCK_NAME} if made is None else set()
        except Exception as e:
            lock.release()
            failure = e
    _agree_on_start(failure)  # the others learn process 0's outcome (and raise its error)
    if failure is not None:
        raise failure
    run_log = _RunLogFile(os.path.join(cfg.run_dir, "run.log")) if primary else None
    run = None
    try:
        if run_log is not None:
            log = run_log.tee(log)
        many = jax.process_count()
        log(
            f"sparsejax train: pid {os.getpid()}, config sha256 {config_hash(cfg)[:12]}"
            + (f", process {jax.process_index()} of {many}" if many > 1 else "")
        )
        for line in notes:
            log(line)
        run = build_run(cfg, log=log)
        if primary:
            _record_start(cfg, {**entry, "processes": many} if many > 1 else entry)
        try:
            return train_run(run, log=log)
        finally:
            run.checkpointer.close()
    except BaseException as e:
        if run_log is not None:
            try:
                run_log.write("".join(traceback.format_exception(e)))
                e.run_log = run_log.path  # type: ignore[attr-defined]
            except OSError:  # e.g. the disk is full: the error may be that one; keep it
                pass
        # refused (a config or data error) before it trained, as opposed to a failure
        # in training or a bug, whose traceback stays in run.log
        refused = isinstance(e, ValueError) and (run is None or isinstance(e, ConfigError))
        if primary and refused and _no_new_checkpoint(cfg, entry):
            _remove_new(cfg.run_dir, made, before)
            if made is not None:
                e.run_log = None  # type: ignore[attr-defined]  # removed with the run
        raise
    finally:
        if lock is not None:
            lock.release()


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


def _agree_on_start(failure: BaseException | None) -> None:
    """Many processes: process 0 (which locks and checks the run directory) tells the
    others whether the run starts; when it does not, they raise the same error (a
    `RunLockedError` or `ConfigError` with process 0's message), so no process waits
    for a run that never comes. One process: nothing."""
    if jax.process_count() == 1:
        return
    from ..sharding._distributed import broadcast_text

    text = None
    if failure is not None:
        text = f"{type(failure).__name__}\n{' '.join(str(failure).split())}"
    got = broadcast_text(text)
    if got is None or jax.process_index() == 0:
        return
    kind, _, message = got.partition("\n")
    if kind == "RunLockedError":
        raise RunLockedError(message)
    if kind in ("ConfigError", "ValueError"):
        raise ConfigError(message)
    raise RuntimeError(f"process 0 could not start the run: {kind}: {message}")


def run_evaluator(run: Run) -> Callable[[TrainState], dict]:
    """What the evals during training compute: the trainer's metrics on the eval batches;
    on the eval split's candidate sets when the data has them, hr@k/ndcg@k/mrr/gauc (k
    from `eval_ks`; early stopping can watch them) and only those row metrics that mean
    something on sampled candidates (`sparsejax.train._ranking.candidate_eval`)."""
    sets = (getattr(run.data, "ranking", None) or {}).get("eval")

    def evaluate(state: TrainState) -> dict:
        if sets is None:
            return run.trainer.evaluate(state, run.data.eval_batches)
        from ..train._ranking import candidate_eval

        return candidate_eval(
            run.trainer, state, sets, run.data.packer, run.data.eval_batches, ks=run.cfg.eval_ks
        )

    return evaluate


def train_loader(run: Run, *, epochs: int | None, position: dict | None = None) -> Loader:
    """The run's train batches as its config says (shuffle, prefetch), from `position`."""
    cfg = run.cfg
    return Loader(
        run.data.train_source,
        run.data.packer,
        shuffle=cfg.data.shuffle,
        seed=cfg.seed,
        epochs=epochs,
        prefetch=cfg.data.prefetch,
        shuffle_buffer=cfg.data.shuffle_buffer,
        # tiered tables: the host maps the raw int64 ids to cache slots first;
        # host-executed tables: the host looks their ids up; tables placed on a mesh:
        # the trainer splits the host batch per device
        device_put=getattr(run.trainer, "host_tables", None) is None
        and getattr(run.trainer, "host_exec", None) is None
        and not run.trainer.shards_batch,
        position=position,
    )


def _profile_window(run: Run, log: Callable[[str], None]) -> list:
    """The `profile_steps` hook of a run (process 0's), if set."""
    window = run.cfg.profile_steps
    if window is None or jax.process_index() != 0:
        return []
    from ._profile import ProfileWindow

    if any(t.is_tiered for t in run.data.tables):
        raise ConfigError(
            "profile_steps: a run with dynamic or host-cached tables cannot be traced by "
            "step (its batches are remapped on the host); use `sparsejax profile`"
        )
    first, count = window
    out = os.path.join(run.cfg.run_dir, f"profile_steps_{first}")
    return [ProfileWindow(run.trainer, first, count, out, log=log)]


def train_run(run: Run, *, log: Callable[[str], None] = print) -> dict:
    """Train a built `Run` to its total steps with `sparsejax.train.fit`, writing the run
    directory's metrics, curves and summary (see `train`); returns the summary."""
    cfg = run.cfg
    total, start = run.total_steps, int(run.state.step)
    metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
    tiered = sum(t.is_tiered for t in run.data.tables)
    primary, many = jax.process_index() == 0, jax.process_count()
    log(
        f"training {cfg.model.name} for {total} steps (from step {start}), batch "
        f"{cfg.data.batch_size}"
        + (f" ({cfg.data.batch_size // many} per process)" if many > 1 else "")
        + f", {len(run.data.features)} sparse features, "
        f"{sum(t.device_rows for t in run.data.tables):,} device table rows"
        + (f" ({tiered} tiered tables)" if tiered else "")
        + f", run dir {cfg.run_dir}"
    )
    metrics_log = MetricsLog(metrics_path, start) if primary else None  # past `start` dropped
    if many > 1:  # the others read metrics.jsonl (early stopping's replay) once it is cut
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("sparsejax: metrics.jsonl ready")
    knobs = run_knobs(run, log)  # training knobs (runner/_knobs.py): eval_every, early stop
    epochs = (
        None
        if run.data.steps_per_epoch is None
        else math.ceil(total / run.data.steps_per_epoch) + 1
    )
    loader = train_loader(run, epochs=epochs, position=run.position)
    # the run directory's files and the terminal are process 0's
    console = Console(log, progress=cfg.progress and primary, total=total, start=start)
    board = tensorboard_log(cfg.run_dir, start, log) if primary else None  # RUN/tensorboard/
    reports = [r for r in (metrics_log, board, console) if r is not None] if primary else []
    windows = _profile_window(run, log)
    try:
        result = fit(
            run.trainer,
            run.state,
            loader,
            steps=total,
            eval_batches=run.data.eval_batches,
            eval_every=knobs.eval_every,
            checkpointer=run.checkpointer,
            checkpoint_every=cfg.checkpoint_every,
            data_position=_data_position(loader),
            checkpoint_extra={"config": to_dict(cfg), "config_sha256": config_hash(cfg)},
            log_every=cfg.log_every,
            hooks=[*reports, knobs, *windows],
            evaluate=run_evaluator(run),
            log_window=run.log_window,
        )
    finally:
        loader.close()
        console.close()
        if board is not None:
            board.close()
        knobs.close()
        for w in windows:  # a run that fails inside the window leaves no partial trace
            w.close()
    run.state = result.state
    step = int(result.state.step)
    summary = {
        "step": step,
        **knobs.summary(step, plain(result.eval)),  # last_eval, best_eval (by what metric)
        "train_samples_per_s": result.samples_per_s,
        "run_dir": os.path.abspath(cfg.run_dir),
    }
    stats = table_stats(run.trainer)
    if stats is not None:
        summary["tables"] = stats
        log(_tables_line(stats))
    if primary:
        write_summary(os.path.join(cfg.run_dir, "summary.json"), summary)
        plot_curves(metrics_path, os.path.join(cfg.run_dir, "curves.png"))
    log(
        f"done: step {summary['step']}, run dir {cfg.run_dir} (metrics.jsonl, curves.png, "
        + ("tensorboard/, " if board is not None else "")
        + "checkpoints/)"
    )
    return summary


def evaluate_run(
    run_dir: str,
    *,
    step: int | str | None = None,
    split: str = "eval",
    predictions: str | os.PathLike | None = None,
    ks: Sequence[int] = (10,),
    overrides: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> dict:
    """Evaluate a run directory's checkpoint on a split of its data.

    Args:
      run_dir: the run directory (its config.yaml names the data by absolute paths,
        so this works from any directory).
      step: a checkpoint step, "last" / None (the newest readable checkpoint; an
        unreadable newer one is skipped with a warning), or "best" (the best eval's
        state, kept by `early_stopping`).
      split: "eval" (the split evaluated during training) or "test".
      predictions: also write one row per example (`row`: its index in the split,
        `label`, `score`: the predicted probability, or a retrieval model's score of
        the example's own item) to this `.parquet` (needs pyarrow), `.csv` or `.tsv`
        file (`.gz`: compressed).
      ks: the k of HR@k / NDCG@k, for data with candidate sets (data.kind=events).
      overrides: `key=value` config overrides (e.g. `data.eval_batch_size=4096`).

    Returns:
      `{"step", "split", metrics...}` (and `"predictions"`: the file written).
    """
    if split not in ("eval", "test"):
        raise ConfigError(f"--split {split!r}: expected eval or test")
    if predictions is not None:
        _check_predictions_path(os.fspath(predictions))
    cfg, data, trainer, state = restore_run(run_dir, step=step, overrides=overrides, log=log)
    batches = data.eval_batches if split == "eval" else data.test_batches
    if not batches:
        raise ConfigError(
            f"--split {split}: the run's data has no {split} split"
            + (
                " (set data.test, or data.split with an eval part that leaves a test part)"
                if split == "test"
                else ""
            )
        )
    sets = (getattr(data, "ranking", None) or {}).get(split)
    if sets is not None:  # candidate sets: HR@k, NDCG@k, MRR, GAUC
        from ..train._ranking import candidate_eval

        result = candidate_eval(trainer, state, sets, data.packer, batches, ks=tuple(ks))
    else:
        result = trainer.evaluate(state, batches)
    label = f"{split} of {run_dir} @ step {int(state.step)}" + (" (best)" if step == "best" else "")
    log(f"{label}: {format_metrics(result)}")
    out = {"step": int(state.step), "split": split, **plain(result)}
    if predictions is not None:
        rows = getattr(data, f"{split}_rows", None)
        n = write_predictions(os.fspath(predictions), trainer, state, batches, rows=rows)
        log(f"wrote {n:,} predictions to {predictions}")
        out["predictions"] = os.path.abspath(predictions)
    return out


def restore_run(
    run_dir: str,
    *,
    step: int | str | None = None,
    overrides: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> tuple[RunConfig, DataBundle, Trainer, TrainState]:
    """A run directory's config, data, trainer and a checkpoint's state (placed): what
    `evaluate_run` and `sparsejax.serving.export_run` start from. `step`: a checkpoint
    step, "last" / None (the newest readable one; an unreadable newer one is skipped
    with a warning) or "best" (kept by `early_stopping`)."""
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(cfg_path):
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    best_dir = os.path.join(run_dir, _best_dir())
    if step == "best" and not _checkpoint_steps_in(best_dir):
        raise ConfigError(
            f"--step best: {run_dir} has no best checkpoint ({best_dir} is empty or missing; "
            f"it is kept by early_stopping with keep_best: true)"
        )
    where = best_dir if step == "best" else os.path.join(run_dir, "checkpoints")
    if not _checkpoint_steps_in(where):
        raise ConfigError(f"{run_dir} has no checkpoint yet ({where} is empty or missing)")
    cfg = load_config([cfg_path], [*overrides, "resume=false"])
    data = build_data(cfg)
    _, trainer = build_trainer(cfg, data, log=log)  # knobs, mesh, plan: runner/_knobs.py
    template = trainer.init(jax.random.key(cfg.seed), data.eval_batches[0])
    ckpt = Checkpointer(where, trainer.layouts, **_host_kw(trainer))
    try:
        if step in (None, "last", "best"):
            state, _, _ = ckpt.restore_readable(template, warn=lambda m: log(f"warning: {m}"))
        else:
            state, _ = ckpt.restore(template, int(step))
    finally:
        ckpt.close()
    return cfg, data, trainer, trainer.put_state(state)


def _best_dir() -> str:
    """Where `early_stopping.keep_best` keeps the best state (runner/_knobs.py)."""
    try:
        from ._knobs import BEST_DIR
    except ImportError:
        return "checkpoints_best"
    return BEST_DIR


def _checkpoint_steps_in(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(p) for p in os.listdir(directory) if p.isdigit())


def _check_predictions_path(path: str) -> None:
    """Before any work: a file name `sparsejax.train.write_predictions` can write."""
    base = path.removesuffix(".gz")
    if base.endswith(".parquet"):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"--predictions {path}: writing Parquet needs pyarrow (pip install pyarrow);"
                f" or give a .csv path"
            ) from None
    elif not base.endswith((".csv", ".tsv")):
        raise ConfigError(f"--predictions {path}: expected a .parquet, .csv or .tsv file name")


def predictions(trainer: Trainer, state: TrainState, batches, rows=None) -> dict[str, np.ndarray]:
    """Per-example `row` (index in the split, or `rows[i]`), `label` and `score` (the
    probability of a binary model; a retrieval model's score of the example's own item,
    the diagonal of its in-batch scores) over `batches`, padded rows left out."""
    labels, scores = [], []
    for batch in batches:
        out = np.asarray(trainer.eval_step(state, batch), np.float64)
        mask = np.asarray(batch.mask) > 0
        if trainer.task == "binary":
            score = 1.0 / (1.0 + np.exp(-out.reshape(len(mask))))
        else:
            score = np.diagonal(out)
        labels.append(np.asarray(batch.labels, np.float64).reshape(len(mask))[mask])
        scores.append(score[mask])
    label, score = np.concatenate(labels), np.concatenate(scores)
    row = np.arange(len(label)) if rows is None else np.asarray(rows)[: len(label)]
    return {"row": row.astype(np.int64), "label": label.astype(np.float32), "score": score}


def write_predictions(path: str, trainer: Trainer, state: TrainState, batches, *, rows=None) -> int:
    """Write `predictions(...)` with `sparsejax.train.write_predictions` (Parquet, CSV or
    TSV by the file's extension); returns the number of rows."""
    from ..train import write_predictions as write_columns

    cols = predictions(trainer, state, batches, rows)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_columns(path, cols)
    return len(cols["row"])


def config_reference() -> str:
    """The config schema reference (`sparsejax config --schema`, docs/config.md),
    rendered from the dataclasses' field docs; the layering rules are `_config`'s
    module docstring."""
    from . import _config

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
