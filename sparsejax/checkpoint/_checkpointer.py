"""Orbax checkpoints of a train state, with tables stored by name (not by stack).

A checkpoint holds three items: `tables` (every table's weights and sparse optimizer
slots under its layer and name), `state` (the other fields of the state: step, dense
parameters, their optimizer state, RNG), and `meta` (JSON: table specs, data position,
the run's config). Restoring checks the specs first and names any table whose name or
shape changed; an unreadable checkpoint (e.g. truncated) raises
`CheckpointUnreadableError` (a `CheckpointError`) naming it and leaves the others usable:
`restore_readable` falls back to the newest readable one, and `set_aside` moves an
unreadable one out of the way of the next save of its step. Every message is one line.
`restore_tables` reads the tables alone, from the layouts alone: serving needs no
trainer and no optimizer state.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from ._layout import Layouts, layer_key, stack_tables, tables_by_name, uncovered_layer


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written from, or restored into, the current model."""


class CheckpointUnreadableError(CheckpointError):
    """A checkpoint's files cannot be read (truncated, corrupt, missing parts)."""


def _one_line(e: BaseException) -> str:
    """`Type: first line of the message` (orbax's errors run to many lines)."""
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 200:
        first = first[:200] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class NonFiniteStateError(FloatingPointError):
    """The state holds NaN or inf; it is not saved, so the last checkpoint stays good."""


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
    return jnp.stack([jnp.isfinite(x).all() for x in leaves])  # bool[len(leaves)]


def _first_non_finite(tree) -> str | None:
    """Path of the first float leaf holding NaN/inf, or None: one jitted pass over every
    leaf (compiled once per state signature, not once per leaf shape)."""
    floats = [
        (p, x)
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
    ]
    if not floats:
        return None
    leaves = [x for _, x in floats]
    try:
        flags = jax.device_get(_all_finite(leaves))
    except ValueError:  # leaves on different device sets: one check per leaf
        flags = jax.device_get([jnp.isfinite(x).all() for x in leaves])
    for (path, _), ok in zip(floats, flags, strict=True):
        if not ok:
            return jax.tree_util.keystr(path)
    return None


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    """Saves and restores train states under `directory/<step>/`.

    A state is a dataclass (e.g. `sparsejax.train.TrainState`) with a `step` and a
    `tables` field (the model's "embedding" collection); its other fields are saved as
    they are.

    Args:
      directory: where checkpoints live (created).
      layouts: `embedding_layouts(model, batch)`: how each embedding layer stacks its
        tables. A state holding tables of a layer not in `layouts` is refused (no
        checkpoint is ever written without its tables).
      max_to_keep: older checkpoints are deleted beyond this many.
    """

    def __init__(self, directory: str | os.PathLike, layouts: Layouts, *, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.layouts = dict(layouts)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
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

    def _split(self, state) -> tuple[dict, dict]:
        """(tables by name, every other field) of `state`."""
        bad = uncovered_layer(self.layouts, state.tables)
        if bad is not None:
            raise CheckpointError(
                f"the state holds table state {bad!r} of an embedding layer this checkpointer "
                f"has no layout for (layouts: {sorted(map(layer_key, self.layouts))}); build "
                f"it with embedding_layouts(model, batch)"
            )
        rest = {
            f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "tables"
        }
        return tables_by_name(self.layouts, state.tables), rest

    def save(self, state, *, data_position: Any = None, extra: Mapping | None = None) -> int:
        """Write a checkpoint at `state.step` and wait until it is on disk.

        Raises:
          CheckpointError: the state holds tables of a layer the layouts do not cover.
          NonFiniteStateError: a parameter, table or slot holds NaN/inf (named); nothing
            is written.
        """
        step = int(state.step)
        tables, rest = self._split(state)
        bad = _first_non_finite({"tables": tables, **rest})
        if bad is not None:
            raise NonFiniteStateError(
                f"not saving step {step}: {bad} holds NaN or inf; the "
                f"last checkpoint ({self.latest_step()}) is kept"
            )
        meta = {
            "step": step,
            "tables": self._specs(),
            "data_position": data_position,
            "extra": dict(extra or {}),
        }
        self.manager.save(
            step,
            args=ocp.args.Composite(
                tables=ocp.args.StandardSave(tables),
                state=ocp.args.StandardSave(rest),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        self.manager.wait_until_finished()
        return step

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]

    def _read(self, step: int | None, **items) -> tuple[int, dict, dict]:
        """(step, restored items, meta) after checking the table specs."""
        steps = self.steps()
        step = steps[-1] if step is None and steps else step
        if step is None or step not in steps:
            raise CheckpointError(
                f"no checkpoint {'' if step is None else step} in "
                f"{self.directory} (available: {steps})"
            )
        others = [s for s in steps if s != step]
        try:
            meta = self.read_meta(step)
        except Exception as e:  # noqa: BLE001 - any read failure means the same to the user
            raise CheckpointUnreadableError(
                f"checkpoint {step} in {self.directory} is unreadable "
                f"({_one_line(e)}); other checkpoints: {others}"
            ) from e
        self._check_specs(meta["tables"], step)
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    **{k: ocp.args.StandardRestore(v) for k, v in items.items()}
                ),
            )
        except Exception as e:  # noqa: BLE001
            raise CheckpointUnreadableError(
                f"checkpoint {step} in {self.directory} cannot be restored "
                f"({_one_line(e)}); other checkpoints: {others}"
            ) from e
        return step, {k: restored[k] for k in items}, meta

    def restore(self, template, step: int | None = None) -> tuple[Any, dict]:
        """State at `step` (default: latest) shaped like `template`, and its JSON record.

        Raises:
          CheckpointError: no checkpoint, a table added/removed/reshaped since the
            save, or unreadable files (naming the step and the other checkpoints).
        """
        tables, rest = self._split(template)
        _, got, meta = self._read(step, tables=_abstract(tables), state=_abstract(rest))
        state = dataclasses.replace(
            template, tables=stack_tables(self.layouts, got["tables"]), **got["state"]
        )
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
        a new save of that step); returns where it went."""
        dest_dir = self.directory.rstrip(os.sep) + "_unreadable"
        os.makedirs(dest_dir, exist_ok=True)
        dest = os.path.join(dest_dir, str(step))
        if os.path.exists(dest):
            shutil.rmtree(dest)
        shutil.move(os.path.join(self.directory, str(step)), dest)
        self.manager.reload()
        return dest

    def restore_tables(self, step: int | None = None) -> tuple[dict, dict]:
        """The "embedding" collection at `step` (default: latest), built from the layouts
        alone (no train state, no dense parameters), and the JSON record."""
        shapes = {
            layer_key(p): jax.eval_shape(store.export_tables, store.abstract_state())
            for p, store in self.layouts.items()
        }
        _, got, meta = self._read(step, tables=shapes)
        return stack_tables(self.layouts, got["tables"]), meta

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
