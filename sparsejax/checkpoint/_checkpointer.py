"""Orbax checkpoints of a train state, with tables stored by name (not by stack).

A checkpoint holds three items: `tables` (every table's weights and sparse optimizer
slots under its layer and name, each in its logical layout `[rows, dim]`, sharded as
its store holds it: each process writes only its rows), `state` (the other fields of
the state: step, dense parameters, their optimizer state, RNG), and `meta` (JSON:
format, table specs, data position, the run's config, and a checksum per block of rows
of every array: `_verify`). Restoring checks the specs first and names any table whose
name or shape changed, then that this process has room for what it will read; an
unreadable checkpoint (truncated, a data file missing, data that does not match its
checksums) raises `CheckpointUnreadableError` (a `CheckpointError`) naming the table,
array, rows and folder, and leaves the others usable: `restore_readable` falls back to
the newest readable one, and `set_aside` moves an unreadable one out of the way of the
next save of its step. Every message is one line. `restore_tables` reads the tables
alone, from the layouts alone: serving needs no trainer and no optimizer state.

Resharding: a checkpoint restores on any processes, mesh and placements (4 processes
to 2, 8 devices to 1, row-wise to table-wise, and back). Each table is read as the
restoring store holds it (`abstract_sharded_tables`: its sharding and padded row
count), each process reading only its rows (`_sharded.read_sharded`, or orbax's
restore), and handed to `import_sharded_tables`. Checkpoints of the previous format
(tables whole, no checksums) restore the same way, unverified.

Tiered tables (dynamic keys or a host cache; `host=`) are not in the orbax items
(their store's `export_tables` leaves them out: their device state is a cache). Their
rows, slots and metadata are the host side's `TableSnapshot`s, written beside the orbax
steps in `host_tables/<step>/` (`_host_tables.py`), full or as a delta against the
previous save; restoring a step reads its chain (the last full save and the deltas
after it) and hands it to `host.restore`. A corrupt or missing file of a chain
makes the checkpoints built on it unreadable (named) while older ones restore.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

from ..embedding import available_memory, format_bytes, subtree
from ..embedding.host import HostSide
from . import _host_tables, _sharded, _verify
from ._files import (
    CheckpointError,
    CheckpointUnreadableError,
    CheckpointWriteError,
    NonFiniteStateError,
)
from ._layout import Layouts, layer_key, tables_from_layers, uncovered_layer


def _one_line(e: BaseException) -> str:
    """`Type: first line of the message` (orbax's errors run to many lines)."""
    text = str(e).strip().splitlines()
    first = text[0].split(" See full TensorStore details")[0] if text else ""
    if len(first) > 200:
        first = first[:200] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


SAVE_HOST_GB = 1
"""Gigabytes of tables orbax copies to the host at a time while saving (its default:
all of them at once)."""

_ORBAX_TEMP = re.compile(r"^\d+\.orbax-checkpoint-tmp(-\d+)?$")  # a save under way or failed


def _is_closed_loop_noise(u) -> bool:
    """An orbax read or write that fails ends its asyncio loop while tensorstore still
    completes the other reads or writes of that call; each completion then finds the
    loop closed and raises in a tensorstore thread (hundreds of "Event loop is closed"
    tracebacks after the error itself), and each of the call's other coroutines, left
    unfinished, raises its own copy of the read error when it is collected ("Exception
    ignored in: <coroutine object _read_array_index_and_device_put>", thousands of
    lines after a fallback to an older checkpoint)."""
    code = getattr(u.object, "cr_code", None)
    if code is not None:
        return f"{os.sep}orbax{os.sep}" in code.co_filename
    if u.object is not None or not isinstance(u.exc_value, RuntimeError):
        return False
    if str(u.exc_value) != "Event loop is closed":
        return False
    frames = traceback.extract_tb(u.exc_traceback)
    return any(f.name == "call_soon_threadsafe" for f in frames)


def _quiet_closed_loops() -> None:
    """Drop the closed-loop noise of a failed orbax call (`_is_closed_loop_noise`): the
    failure itself is raised as a `CheckpointError`. Other unraisable exceptions go to
    the hook that was installed before. Once per process."""
    previous = sys.unraisablehook
    if getattr(previous, "_sparsejax_quiet", False):
        return

    def hook(u) -> None:
        if not _is_closed_loop_noise(u):
            previous(u)

    hook._sparsejax_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    """Saves and restores train states under `directory/<step>/`.

    A state is a dataclass (e.g. `sparsejax.train.TrainState`) with a `step` and a
    `tables` field (the model's "embedding" collection); its other fields are saved as
    they are.

    Args:
      directory: where checkpoints live (created).
      layouts: `sparsejax.nn.embedding_layouts(model, batch)`: how each embedding layer stacks its
        tables. A state holding tables of a layer not in `layouts` is refused (no
        checkpoint is ever written without its tables).
      max_to_keep: older checkpoints are deleted beyond this many (with the host steps
        no kept checkpoint's chain reads).
      host: the model's host side (`trainer.host`, a `sparsejax.embedding.host.HostSide`).
        When it holds rows (`saves_rows`: tiered tables), they are saved from its
        `snapshot(state_tables, *, incremental) -> {"layer/table": TableSnapshot}` into
        `directory/host_tables/<step>/`, not by orbax (the stores' `export_tables`
        leave tiered tables out; `import_tables` gives them an empty device cache), and
        restored with its `restore(chain)`; `mark_saved()` follows each save.
      full_every: with host rows, every `full_every`-th save is full and the ones
        between are deltas against the previous save. The first save of a checkpointer
        is full, and so is a save of a step not after the one this checkpointer last
        saved or restored.
      tracks_changes: whether this checkpointer's saves are the ones the host side's
        change tracking counts from (it calls `host.mark_saved()` after each).
        False for a second checkpointer of the same host tables (e.g. the best state's
        of early stopping): its saves are all full and leave the tracking alone, so the
        first one's deltas stay complete.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        layouts: Layouts,
        *,
        max_to_keep: int = 3,
        host: HostSide | None = None,
        full_every: int = 1,
        tracks_changes: bool = True,
    ):
        if not (isinstance(full_every, int) and full_every >= 1):
            raise ValueError(f"Checkpointer: full_every must be an int >= 1, got {full_every!r}")
        self.directory = os.path.abspath(directory)
        self.layouts = dict(layouts)
        self.host = host if host is not None and host.saves_rows else None
        """The host side whose rows this checkpointer saves; None when it has none."""
        self.full_every = full_every if tracks_changes else 1
        self.tracks_changes = tracks_changes
        self._host_previous: int | None = None  # last host step saved or restored here
        self._owners: dict[int, int | None] = {}  # a checkpoint's host-table writers
        self._host_deltas = 0  # deltas since that step's full save
        self._cleaned = False  # leftovers of killed saves removed (before the first save)
        _quiet_closed_loops()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            item_handlers={
                # orbax copies what it saves to the host first: at most 1 GB at a time
                # (else every table at once, doubling the state's memory during a save)
                "tables": ocp.PyTreeCheckpointHandler(save_device_host_concurrent_gb=SAVE_HOST_GB),
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def _specs(self) -> dict:
        return {
            layer_key(p): {
                name: {
                    "vocab_size": t.vocab_size,
                    "dim": t.dim,
                    "dtype": t.dtype,
                    # the slots depend on the kind, not on the rates
                    "optimizer": type(t.optimizer).__name__,
                }
                for name, t in store.tables.items()
            }
            for p, store in self.layouts.items()
        }

    def _sharded_tables(self, tables: Mapping) -> dict:
        """`{layer_key: {table: {"weights", "slots"}}}` of an "embedding" collection, each
        leaf a `jax.Array` in the table's logical layout, sharded as its store holds it
        (`store.sharded_tables`: no table gathered)."""
        return {
            layer_key(p): store.sharded_tables(subtree(tables, p))
            for p, store in self.layouts.items()
        }

    def _rows_of(self, key: str, leaf) -> int:
        """The rows of leaf `key` a checksum covers: a table's vocabulary (its padding
        rows are left out), else the leaf's first dimension (1 for a scalar)."""
        t = _sharded.table_of(key)
        if t is not None:
            for p, store in self.layouts.items():
                if layer_key(p) == t[0] and t[1] in store.tables:
                    return int(store.tables[t[1]].vocab_size)
        shape = getattr(leaf, "shape", None)
        if shape is None:
            shape = jnp.shape(leaf)
        return int(shape[0]) if len(shape) else 1

    def _checksums(self, items: Mapping, *, finite: bool = False) -> tuple[dict, list, dict]:
        """Block checksums of every leaf of `items` (`{"tables": ..., "state": ...}`),
        combined over processes, the leaves holding NaN/inf (with `finite`), and the
        rows each leaf's checksum covers."""
        arrays = {}
        for name, tree in items.items():
            arrays.update(_sharded.leaves(tree, name))
        rows = {k: self._rows_of(k, v) for k, v in arrays.items()}
        local, bad = _verify.local_sums(arrays, rows, finite=finite)
        return (*_verify.combine(local, dict.fromkeys(bad, True)), rows)

    @staticmethod
    def _describe(key: str) -> str:
        """A leaf's key as a reader names it: "table 'C1' (layer embedding) weights",
        "state params/dense/kernel"."""
        t = _sharded.table_of(key)
        if t is not None:
            return f"table {t[1]!r} (layer {t[0]}) {t[2]}"
        return f"state {key.split('/', 1)[1]}" if key.startswith("state/") else key

    def _where(self, step: int, key: str) -> str:
        """Where leaf `key` is in checkpoint `step`: its orbax item folder and the array's
        name in it (OCDBT: the data files under it hold many arrays' chunks)."""
        item, rest = key.split("/", 1)
        if item == "tables":
            t = _sharded.table_of(key)
            name = ".".join([t[0], t[1], *key.split(f"/{t[1]}/", 1)[1].split("/")])
        else:
            name = rest.replace("/", ".")
        return f"array {name!r} of {os.path.join(self.directory, str(step), item)}"

    def _rest(self, state) -> dict:
        """Every field of `state` but its tables (which the layouts must cover)."""
        bad = uncovered_layer(self.layouts, state.tables)
        if bad is not None:
            raise CheckpointError(
                f"the state holds table state {bad!r} of an embedding layer this checkpointer "
                f"has no layout for (layouts: {sorted(map(layer_key, self.layouts))}); build "
                f"it with embedding_layouts(model, batch)"
            )
        return {
            f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "tables"
        }

    def save(self, state, *, data_position: Any = None, extra: Mapping | None = None) -> int:
        """Write a checkpoint at `state.step` and wait until it is on disk.

        With host rows: `host.snapshot(state.tables, incremental=...)` is
        written to `host_tables/<step>/` first, then the orbax checkpoint, then
        `host.mark_saved()`; host steps no kept checkpoint reads are deleted.

        A save that fails leaves no partial files (its orbax temp folder and host step
        are removed, the checkpoints before it are kept); the first save of a
        checkpointer also removes the temp folders of saves killed midway.

        Raises:
          CheckpointError: the state holds tables of a layer the layouts do not cover.
          CheckpointWriteError: the files could not be written (disk full, ...).
          NonFiniteStateError: a parameter, table, slot or host array holds NaN/inf
            (named); nothing is written.
          StepAlreadyExistsError (a ValueError): a checkpoint of this step exists.
        """
        step = int(state.step)
        rest = self._rest(state)
        tables = self._sharded_tables(state.tables)
        sums, bad, rows = self._checksums({"tables": tables, "state": rest}, finite=True)
        if bad:
            raise NonFiniteStateError(
                f"not saving step {step}: {self._describe(bad[0])} holds NaN or inf; the "
                f"last checkpoint ({self.latest_step()}) is kept"
            )
        if step in self.steps():  # before anything is written (a host step, a temp folder)
            raise StepAlreadyExistsError(f"checkpoint {step} already exists in {self.directory}")
        if not self._cleaned:
            self._remove_temp_folders()
            self._cleaned = True
        writing_orbax = False
        try:
            host = None if self.host is None else self._save_host(state, step)
            meta = {
                "format": _sharded.FORMAT,
                "step": step,
                "tables": self._specs(),
                "data_position": data_position,
                "extra": dict(extra or {}),
                "host_tables": host,
                "checksums": {
                    k: {"rows": rows[k], "sums": [int(x) for x in v]} for k, v in sums.items()
                },
            }
            # no "tables" item when every table is tiered (orbax refuses an empty item)
            args = {}
            if jax.tree.leaves(tables):
                args["tables"] = ocp.args.PyTreeSave(
                    tables,
                    save_args=jax.tree.map(
                        lambda _: ocp.SaveArgs(chunk_byte_size=_sharded.READ_BYTES), tables
                    ),
                    # OCDBT keeps a data file's chunks in memory until the file is
                    # written: by default a whole array (0.75 GiB for a 1 GiB table),
                    # with files of about one chunk a few chunks
                    ocdbt_target_data_file_size=_sharded.READ_BYTES,
                )
            if jax.tree.leaves(rest):
                args["state"] = ocp.args.StandardSave(rest)
            writing_orbax = True
            self.manager.save(
                step, args=ocp.args.Composite(**args, meta=ocp.args.JsonSave(meta)), force=True
            )
            self.manager.wait_until_finished()
        except Exception as e:
            self._discard(step)
            # tensorstore reports a failed write (e.g. RESOURCE_EXHAUSTED) as a ValueError
            if isinstance(e, OSError) or (writing_orbax and isinstance(e, ValueError)):
                kept = self.latest_step()
                raise CheckpointWriteError(
                    f"checkpoint {step} could not be written to {self.directory} "
                    f"({_one_line(e)}); its partial files were removed"
                    + ("" if kept is None else f", the newest checkpoint is {kept}")
                ) from e
            raise
        if host is not None:
            if self.tracks_changes:
                self.host.mark_saved()
            full = host["kind"] == "full"
            self._host_previous = step
            self._host_deltas = 0 if full else self._host_deltas + 1
        self.prune_host_tables()
        return step

    def _remove_temp_folders(self, step: int | None = None) -> None:
        """Delete orbax's temp folders (of `step`, or all): saves that failed or were
        killed midway. Process 0's job (it writes the folders); a save is never under
        way meanwhile (saves wait until they are on disk)."""
        if jax.process_index() != 0 or not os.path.isdir(self.directory):
            return
        for name in os.listdir(self.directory):
            if _ORBAX_TEMP.match(name) and (step is None or name.split(".")[0] == str(step)):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def _discard(self, step: int) -> None:
        """Remove what a failed save of `step` wrote: orbax's temp folder, the step's
        folder if orbax got as far as naming it (`save` refuses a step that exists, so
        it is this save's), and the host step no kept checkpoint reads."""
        try:
            self.manager.wait_until_finished()  # the failed save's threads are done
        except Exception:  # noqa: BLE001, S110 - the error being handled is this one's
            pass
        self._remove_temp_folders(step)
        if jax.process_index() == 0:
            shutil.rmtree(os.path.join(self.directory, str(step)), ignore_errors=True)
        self.manager.reload()
        self.prune_host_tables()

    def _save_host(self, state, step: int) -> dict:
        """Snapshot the host tables and write them as host step `step` (before the orbax
        save: a checkpoint is never listed without its host tables); its record."""
        prev = self._host_previous
        incremental = (
            self.tracks_changes
            and prev is not None
            and step > prev
            and self._host_deltas + 1 < self.full_every
            and self._host_base_readable(prev)
        )
        snaps = self.host.snapshot(state.tables, incremental=incremental)
        if not incremental and any(s.kind != "full" for s in snaps.values()):
            bad = sorted(k for k, s in snaps.items() if s.kind != "full")
            raise CheckpointError(
                f"step {step}: a full save was asked of the host tables, {bad} gave deltas"
            )
        m = _host_tables.write_step(self._part(), step, snaps, previous=prev)
        owners = jax.process_count()
        return {
            "kind": m["kind"],
            "previous": m["previous"],
            "tables": sorted(snaps),
            "owners": owners,
        }

    def _part(self, owners: int | None = None) -> str:
        """Where this process writes (and reads first) its host steps."""
        owners = jax.process_count() if owners is None else owners
        return _host_tables.part_root(self.directory, jax.process_index(), owners)

    def _host_base_readable(self, step: int) -> bool:
        """Whether host step `step` can be built on (else the next save is full)."""
        try:
            _host_tables.read_manifest(self._part(), step)
        except CheckpointUnreadableError:
            return False
        return True

    def _owners_of(self, step: int) -> int | None:
        """How many processes wrote checkpoint `step`'s host tables (None: none)."""
        if step not in self._owners:
            try:
                host = self.read_meta(step).get("host_tables")
            except Exception:  # noqa: BLE001 - unreadable: its host steps are kept
                return None
            self._owners[step] = None if host is None else int(host.get("owners", 1))
        return self._owners[step]

    def prune_host_tables(self) -> list[int]:
        """Delete the host steps no kept checkpoint's chain reads (this process's part;
        process 0 also the parts of process counts no kept checkpoint has), and temp
        folders of saves killed midway; returns the steps deleted (`save` calls this)."""
        steps = self.steps()
        owners = jax.process_count()
        by_count = {s: self._owners_of(s) for s in steps}
        keep = [s for s, n in by_count.items() if n in (owners, None)]
        gone = _host_tables.prune(self._part(), keep)
        if jax.process_index() == 0:
            for n in set(_host_tables.part_counts(self.directory)) - {owners}:
                if not any(c in (n, None) for c in by_count.values()):
                    shutil.rmtree(
                        os.path.dirname(_host_tables.part_root(self.directory, 0, n)),
                        ignore_errors=True,
                    )
            if owners > 1:  # the one-process steps no kept checkpoint reads
                _host_tables.prune(
                    self.directory, [s for s, n in by_count.items() if n in (1, None)]
                )
        return gone

    def read_host_chain(self, step: int | None = None) -> list[dict]:
        """The host tables' chain of checkpoint `step` (default: latest): the
        `{"layer/table": TableSnapshot}` of its last full save and of each delta after
        it, oldest first, checksums verified; what `host.restore` takes (serving
        a tiered table needs it besides `restore_tables`).

        Raises:
          CheckpointUnreadableError: a file missing or corrupt (named).
          CheckpointError: no such checkpoint, or one saved without host tables.
        """
        step = self._step(step)
        host = self.read_meta(step).get("host_tables")
        if host is None:
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} was saved without host tables"
            )
        return _host_tables.read_parts(self.directory, step, int(host.get("owners", 1)))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]

    def _step(self, step: int | None) -> int:
        steps = self.steps()
        step = steps[-1] if step is None and steps else step
        if step is None or step not in steps:
            raise CheckpointError(
                f"no checkpoint {'' if step is None else step} in "
                f"{self.directory} (available: {steps})"
            )
        return step

    def _read(self, step: int | None, rest=None) -> tuple[int, dict, Any, dict, list | None]:
        """(step, the "embedding" collection, the other state fields shaped like `rest`
        (abstract; None: not read), meta, host chain) after checking the table specs
        and the memory a restore needs, every array read verified against its
        checksums; the chain is read (verified) when this checkpointer has host rows,
        else None."""
        step = self._step(step)
        others = [s for s in self.steps() if s != step]
        try:
            meta = self.read_meta(step)
        except Exception as e:  # noqa: BLE001 - any read failure means the same to the user
            raise CheckpointUnreadableError(
                f"checkpoint {step} in {self.directory} is unreadable "
                f"({_one_line(e)}); other checkpoints: {others}"
            ) from e
        host_keys = (meta.get("host_tables") or {}).get("tables", [])
        self._check_specs(meta["tables"], step)
        if host_keys and self.host is None:
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} holds tiered tables {host_keys} "
                f"whose rows are on the host side: give the Checkpointer host= "
                f"(trainer.host) to restore them"
            )
        if self.host is not None and meta.get("host_tables") is None:
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} was saved without host tables "
                f"(this checkpointer has host rows)"
            )
        self._check_memory(step, rest)
        got_rest = None
        if rest is not None:
            got_rest = self._read_state(step, rest, others) if jax.tree.leaves(rest) else rest
        layers, local = {}, {}
        for path, store in self.layouts.items():
            layers[path] = self._read_layer(step, path, store, local, others)
        if got_rest is not None:
            arrays = dict(_sharded.leaves(got_rest, "state"))
            rows = {k: self._rows_of(k, v) for k, v in arrays.items()}
            local.update(_verify.local_sums(arrays, rows)[0])
        self._verify(step, meta, local, others)
        tables = tables_from_layers(self.layouts, layers)
        chain = None
        if self.host is not None:
            owners = int((meta.get("host_tables") or {}).get("owners", 1))
            try:
                chain = _host_tables.read_parts(self.directory, step, owners)
            except CheckpointUnreadableError as e:
                raise CheckpointUnreadableError(
                    f"checkpoint {step} in {self.directory} cannot be restored ({e}); "
                    f"other checkpoints: {others}"
                ) from e
        return step, tables, got_rest, meta, chain

    def _read_state(self, step: int, rest, others: list[int]):
        """The non-table fields, shaped and placed like `rest` (abstract)."""
        try:
            got = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(rest))
            )
        except Exception as e:  # noqa: BLE001 - any read failure means the same to the user
            raise CheckpointUnreadableError(
                f"checkpoint {step} in {self.directory} cannot be restored: its state "
                f"(dense parameters, optimizer state) in "
                f"{os.path.join(self.directory, str(step), 'state')} does not read "
                f"({_one_line(e)}); other checkpoints: {others}"
            ) from e
        return got["state"]

    def _read_layer(self, step: int, path, store, local: dict, others: list[int]):
        """Layer `path`'s state: its tables read in groups (`_sharded.groups`) as the
        store will hold them (each process its rows: `abstract_sharded_tables`, padded
        or cut to its row count), their checksums added to `local`, and handed to
        `store.import_sharded_tables`."""
        key = layer_key(path)
        abstract = store.abstract_sharded_tables()
        restored: dict = {}
        for group in _sharded.groups(abstract):
            item = {key: {name: abstract[name] for name in group}}
            try:
                got = self._read_direct(step, item)[key]
            except Exception:  # noqa: BLE001 - orbax's restore reads it, or names the error
                try:
                    got = self._restore_tables(step, item)[key]
                except Exception as e:  # noqa: BLE001
                    raise self._unreadable_table(step, item, e, others) from e
            arrays = dict(_sharded.leaves({key: got}, "tables"))
            rows = {k: self._rows_of(k, v) for k, v in arrays.items()}
            local.update(_verify.local_sums(arrays, rows)[0])
            restored.update(got)
            del got, arrays
        return store.import_sharded_tables(restored)

    def _read_direct(self, step: int, item: Mapping) -> dict:
        """`_restore_tables` without orbax's copy of every array it reads
        (`_sharded.read_sharded`); raises on anything else than the OCDBT zarr arrays
        orbax writes."""
        item_dir = os.path.join(self.directory, str(step), "tables")
        arrays = [
            _sharded.read_sharded(item_dir, self._where(step, key).split("'")[1], sds)
            for key, sds in _sharded.leaves(item, "tables")
        ]
        return jax.tree.unflatten(jax.tree.structure(item), arrays)

    def _restore_tables(self, step: int, item: Mapping) -> dict:
        """The arrays of `item` (`{layer: {table: tree of ShapeDtypeStruct}}`, a part of
        the "tables" item) read as their shardings say, padded or cut to their rows."""
        args = jax.tree.map(
            lambda s: ocp.ArrayRestoreArgs(
                sharding=s.sharding, global_shape=s.shape, dtype=s.dtype, strict=False
            ),
            item,
        )
        return self.manager.restore(
            step,
            args=ocp.args.Composite(
                tables=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True)
            ),
        )["tables"]

    def _unreadable_table(self, step: int, item: Mapping, e: Exception, others) -> Exception:
        """The error of a group of tables that does not read: its first array that does not
        read alone named (table, array, folder), with the innermost error (tensorstore's
        names the file)."""
        keys = dict(_sharded.leaves(item, "tables"))
        bad = None
        if len(keys) > 1:
            for key in keys:
                t = _sharded.table_of(key)
                sub = item[t[0]][t[1]]
                part = sub["weights"] if t[2] == "weights" else sub["slots"][key.rsplit("/", 1)[1]]
                leaf = {t[0]: {t[1]: {"weights": part}}} if t[2] == "weights" else None
                if leaf is None:
                    leaf = {t[0]: {t[1]: {"slots": {key.rsplit("/", 1)[1]: part}}}}
                try:
                    self._restore_tables(step, leaf)
                except Exception as inner:  # noqa: BLE001
                    bad, e = key, inner
                    break
        bad = bad or next(iter(keys))
        cause: BaseException = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        item_dir = os.path.join(self.directory, str(step), "tables")
        name = self._where(step, bad).split("'")[1]
        files = _sharded.array_files(item_dir, name)
        missing = sorted({f for f in files.values() if not os.path.exists(f)})
        chunk = re.search(r'Error reading "([^"]+)"', str(cause))
        if missing:
            why = f"its data file {missing[0]} is missing"
        elif chunk and chunk.group(1) in files:
            why = (
                f"its chunk {chunk.group(1).split('/')[-1]} in data file "
                f"{files[chunk.group(1)]} is corrupt: {_one_line(cause)}"
            )
        else:
            why = _one_line(cause)
        return CheckpointUnreadableError(
            f"checkpoint {step} in {self.directory} cannot be restored: "
            f"{self._describe(bad)} does not read ({self._where(step, bad)}: {why}); "
            f"other checkpoints: {others}"
        )

    def _verify(self, step: int, meta: Mapping, local: dict, others: list[int]) -> None:
        """Compare the checksums of what was read (`local`, this process's part; added up
        over processes here) with those saved (format 2; older checkpoints have none)."""
        saved = meta.get("checksums")
        if saved is None:
            return
        got, _ = _verify.combine(local, {})
        for key in sorted(got):
            if key not in saved:
                raise CheckpointUnreadableError(
                    f"checkpoint {step} in {self.directory} has no checksum of "
                    f"{self._describe(key)}; other checkpoints: {others}"
                )
            bad = _verify.first_mismatch(saved[key]["sums"], got[key], saved[key]["rows"])
            if bad is not None:
                raise CheckpointUnreadableError(
                    f"checkpoint {step} in {self.directory} is corrupt: "
                    f"{self._describe(key)} rows [{bad[0]}, {bad[1]}) differ from what "
                    f"was saved (checksum mismatch in {self._where(step, key)}); "
                    f"other checkpoints: {others}"
                )

    def _check_memory(self, step: int, rest) -> None:
        """Refuse a restore this process has no room for, before reading anything: its
        shards of every table (what the state will hold), what importing a layer's
        tables allocates beside them (the largest layer's `import_copy_bytes`), the
        other fields and one read's buffer, against the host's available memory (CPU
        devices) or each device's."""
        layers = [
            sum(_sharded.local_bytes(s) for s in jax.tree.leaves(store.abstract_sharded_tables()))
            for store in self.layouts.values()
        ]
        copies = [store.import_copy_bytes() for store in self.layouts.values()]
        dense = sum(_sharded.local_bytes(s) for s in jax.tree.leaves(rest or {}))
        need = sum(layers) + max(copies, default=0) + dense + _sharded.READ_BYTES
        devices = jax.local_devices()
        cpu = all(d.platform == "cpu" for d in devices)
        have = available_memory([] if cpu else devices)
        if not cpu and have is not None:  # per device: its share of the need
            need = -(-need // max(1, len(devices)))
        if have is not None and need > have[0]:
            raise CheckpointError(
                f"checkpoint {step} in {self.directory}: restoring needs "
                f"{format_bytes(need)} in process {jax.process_index()} "
                f"({'' if cpu else 'per device: '}its shards of the tables and state, and "
                f"its largest layer's tables while they are imported), "
                f"{format_bytes(have[0])} is available ({have[1]})"
            )

    def _restore_host(self, step: int, chain: list | None) -> None:
        """Hand the chain to the host side (after the orbax restore succeeded)."""
        if chain is None:
            return
        try:
            self.host.restore(chain)
        except (KeyError, ValueError) as e:  # a tiered table added, removed or reshaped
            why = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise CheckpointError(f"checkpoint {step} in {self.directory}: {why}") from e
        self._host_previous = step
        # the deltas since this part's full save (a part of another process count is
        # no base: the next save is full)
        self._host_deltas = sum(
            1 for c in chain if any(s.kind == "delta" for s in c.values())
        ) // max(1, sum(1 for c in chain if all(s.kind == "full" for s in c.values())))

    def restore(self, template, step: int | None = None) -> tuple[Any, dict]:
        """State at `step` (default: latest) shaped like `template`, and its JSON record.

        The checkpoint may come from any processes and mesh: its tables are read by name,
        each process its rows as this checkpointer's layouts place them
        (`import_sharded_tables`), and verified; the other fields take `template`'s
        shardings (a template of real arrays is not freed meanwhile: pass an abstract
        one to restore a state larger than half the memory). `template` may be abstract (e.g.
        `jax.ShapeDtypeStruct`s with shardings): only its structure, shapes, dtypes and
        shardings are read.

        With host rows, the host tables' chain of `step` is read (checksums
        verified) and handed to `host.restore` once everything else read.

        Raises:
          CheckpointError: no checkpoint, a table added/removed/reshaped since the
            save, too little memory for it (naming the need and what is available),
            or unreadable files (`CheckpointUnreadableError`, naming the step, the
            other checkpoints, and the table, array, rows and file or folder).
        """
        rest = self._rest(template)
        step, tables, got, meta, chain = self._read(step, _abstract(rest))
        state = dataclasses.replace(template, tables=tables, **got)
        self._restore_host(step, chain)
        return state, meta

    def restore_readable(
        self, template, *, warn: Callable[[str], None] = print
    ) -> tuple[Any, dict, list[int]]:
        """The newest checkpoint that reads (see `restore`): an unreadable one is skipped
        for the one before it, and `warn` says so naming both.

        Returns:
          (state, JSON record, the unreadable steps skipped, newest first).

        Raises:
          CheckpointUnreadableError: no checkpoint reads.
          CheckpointError: none, or the newest readable one does not fit the model.
        """
        skipped: list[int] = []
        errors: list[str] = []
        for step in reversed(self.steps()):
            try:
                state, meta = self.restore(template, step)
            except CheckpointUnreadableError as e:
                skipped.append(step)
                errors.append(str(e))
                continue
            if skipped:
                warn(
                    f"checkpoint{'s' * (len(skipped) > 1)} {', '.join(map(str, skipped))} "
                    f"in {self.directory} unreadable ({errors[0]}); using checkpoint {step}"
                )
            return state, meta, skipped
        if skipped:
            raise CheckpointUnreadableError(
                f"no checkpoint in {self.directory} is readable (steps "
                f"{', '.join(map(str, sorted(skipped)))}; newest: {errors[0]})"
            )
        raise CheckpointError(f"no checkpoint in {self.directory}")

    def set_aside(self, step: int) -> str:
        """Move checkpoint `step` to `<directory>_unreadable/<step>` (out of the way of
        a new save of that step), and its host step to
        `<directory>_unreadable/host_tables/<step>` unless a kept checkpoint's chain
        reads it; returns where the checkpoint went."""
        dest_dir = self.directory.rstrip(os.sep) + "_unreadable"
        os.makedirs(dest_dir, exist_ok=True)
        dest = os.path.join(dest_dir, str(step))
        if os.path.exists(dest):
            shutil.rmtree(dest)
        shutil.move(os.path.join(self.directory, str(step)), dest)
        self.manager.reload()
        host = _host_tables.step_dir(self.directory, step)
        if os.path.isdir(host) and step not in _host_tables.needed_steps(
            self.directory, self.steps()
        ):
            host_dest = _host_tables.step_dir(dest_dir, step)
            os.makedirs(os.path.dirname(host_dest), exist_ok=True)
            if os.path.exists(host_dest):
                shutil.rmtree(host_dest)
            shutil.move(host, host_dest)
        return dest

    def restore_tables(self, step: int | None = None) -> tuple[dict, dict]:
        """The "embedding" collection at `step` (default: latest), built from the layouts
        alone (no train state, no dense parameters), and the JSON record.

        Tiered tables: their device state comes back as an empty cache, and their rows
        go to `host.restore` (the checkpointer needs `host`: a serving process builds
        the host side too; `read_host_chain` reads the chain alone)."""
        step, tables, _, meta, chain = self._read(step)
        self._restore_host(step, chain)
        return tables, meta

    def _check_specs(self, saved: Mapping, step: int) -> None:
        current = self._specs()
        for layer in sorted(set(saved) | set(current)):
            s, c = saved.get(layer, {}), current.get(layer, {})
            for name in sorted(set(s) | set(c)):
                if name not in s:
                    raise CheckpointError(
                        f"checkpoint {step}: table {name!r} (layer {layer}) "
                        f"is not in the checkpoint (saved: {sorted(s)})"
                    )
                if name not in c:
                    raise CheckpointError(
                        f"checkpoint {step}: table {name!r} (layer {layer}) "
                        f"was saved but the model has no such table "
                        f"(model: {sorted(c)})"
                    )
                for key in ("vocab_size", "dim", "dtype", "optimizer"):
                    if s[name][key] != c[name][key]:
                        raise CheckpointError(
                            f"checkpoint {step}: table {name!r} was saved with {key}="
                            f"{s[name][key]!r}, the model has {key}={c[name][key]!r}"
                        )

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
