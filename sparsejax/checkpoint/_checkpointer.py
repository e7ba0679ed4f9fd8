"""Orbax checkpoints of a train state, with tables stored by name (not by stack).

A checkpoint holds three items: `tables` (every table's weights and sparse optimizer
slots under its layer and name), `state` (the other fields of the state: step, dense
parameters, their optimizer state, RNG), and `meta` (JSON: table specs, data position,
the run's config). Restoring checks the specs first and names any table whose name or
shape changed; an unreadable checkpoint (e.g. truncated) raises `CheckpointError`
naming it and leaves the others usable. `restore_tables` reads the tables alone, from
the layouts alone: serving needs no trainer and no optimizer state.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from ._layout import Layouts, layer_key, stack_tables, tables_by_name, uncovered_layer


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written from, or restored into, the current model."""


class NonFiniteStateError(FloatingPointError):
    """The state holds NaN or inf; it is not saved, so the last checkpoint stays good."""


def _first_non_finite(tree) -> str | None:
    """Path of the first float leaf holding NaN/inf (one fused pass per leaf), or None."""
    floats = [
        (p, x)
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
    ]
    flags = jax.device_get([jnp.isfinite(x).all() for _, x in floats])
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
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} is unreadable "
                f"({type(e).__name__}: {e}); other checkpoints: {others}"
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
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} cannot be restored "
                f"({type(e).__name__}: {e}); other checkpoints: {others}"
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
