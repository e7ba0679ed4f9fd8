"""Orbax checkpoints of a `TrainState`, with tables stored by name (not by stack).

A checkpoint holds the dense parameters and their optimizer state, every table's
weights and sparse optimizer slots under the table's name, the step, the RNG, and a
JSON record (table specs, data position, the run's config). Restoring checks the specs
first and names any table whose name or shape changed; an unreadable checkpoint (e.g.
truncated) raises `CheckpointError` naming it and leaves the others usable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from ._trainer import TrainState, layer_key, tables_by_name, tables_from_layers


class CheckpointError(RuntimeError):
    """A checkpoint cannot be restored into the current model."""


class NonFiniteStateError(FloatingPointError):
    """The state holds NaN or inf; it is not saved, so the last checkpoint stays good."""


def _first_non_finite(tree) -> str | None:
    """Path of the first float leaf holding NaN/inf (one fused pass per leaf), or None."""
    floats = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
              if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
    flags = jax.device_get([jnp.isfinite(x).all() for _, x in floats])
    for (path, _), ok in zip(floats, flags, strict=True):
        if not ok:
            return jax.tree_util.keystr(path)
    return None


class Checkpointer:
    """Saves and restores `TrainState`s under `directory/<step>/`.

    Args:
      directory: where checkpoints live (created).
      layouts: `Trainer.layouts` (set by `Trainer.init`): how each embedding layer
        stacks its tables.
      max_to_keep: older checkpoints are deleted beyond this many.
    """

    def __init__(self, directory: str | os.PathLike, layouts: Mapping, *, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.layouts = dict(layouts)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def _specs(self) -> dict:
        return {layer_key(p): {name: {"vocab_size": t.vocab_size, "dim": t.dim,
                                       "dtype": t.dtype,
                                       # the slots depend on the kind, not on the rates
                                       "optimizer": type(t.optimizer).__name__}
                                for name, t in ec.tables.items()}
                for p, ec in self.layouts.items()}

    def _payload(self, state: TrainState) -> dict:
        tables = tables_by_name(self.layouts, state.tables)
        return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
                "rng": state.rng, "tables": tables}

    def save(self, state: TrainState, *, data_position: Any = None,
             extra: Mapping | None = None) -> int:
        """Write a checkpoint at `state.step` and wait until it is on disk.

        Raises:
          NonFiniteStateError: a parameter, table or slot holds NaN/inf (named); nothing
            is written.
        """
        step = int(state.step)
        payload = self._payload(state)
        bad = _first_non_finite(payload)
        if bad is not None:
            raise NonFiniteStateError(f"not saving step {step}: {bad} holds NaN or inf; the "
                                      f"last checkpoint ({self.latest_step()}) is kept")
        meta = {"step": step, "tables": self._specs(), "data_position": data_position,
                "extra": dict(extra or {})}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(payload), meta=ocp.args.JsonSave(meta)),
            force=True)
        self.manager.wait_until_finished()
        return step

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, template: TrainState, step: int | None = None
                ) -> tuple[TrainState, dict]:
        """State at `step` (default: latest) shaped like `template`, and its JSON record.

        Raises:
          CheckpointError: no checkpoint, a table added/removed/reshaped since the
            save, or unreadable files (naming the step and the other checkpoints).
        """
        steps = self.steps()
        step = steps[-1] if step is None and steps else step
        if step is None or step not in steps:
            raise CheckpointError(f"no checkpoint {'' if step is None else step} in "
                                  f"{self.directory} (available: {steps})")
        others = [s for s in steps if s != step]
        try:
            meta = self.read_meta(step)
        except Exception as e:  # noqa: BLE001 - any read failure means the same to the user
            raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable "
                                  f"({type(e).__name__}: {e}); other checkpoints: {others}"
                                  ) from e
        self._check_specs(meta["tables"], step)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._payload(template))
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {step} in {self.directory} cannot be restored "
                                  f"({type(e).__name__}: {e}); other checkpoints: {others}"
                                  ) from e
        tables = tables_from_layers(self.layouts, {
            p: ec.state_from_tables(restored["tables"][layer_key(p)])
            for p, ec in self.layouts.items()})
        state = TrainState(step=restored["step"], params=restored["params"],
                           opt_state=restored["opt_state"], tables=tables, rng=restored["rng"])
        return state, meta

    def _check_specs(self, saved: Mapping, step: int) -> None:
        current = self._specs()
        for layer in sorted(set(saved) | set(current)):
            s, c = saved.get(layer, {}), current.get(layer, {})
            for name in sorted(set(s) | set(c)):
                if name not in s:
                    raise CheckpointError(f"checkpoint {step}: table {name!r} (layer {layer}) "
                                          f"is not in the checkpoint (saved: {sorted(s)})")
                if name not in c:
                    raise CheckpointError(f"checkpoint {step}: table {name!r} (layer {layer}) "
                                          f"was saved but the model has no such table "
                                          f"(model: {sorted(c)})")
                for key in ("vocab_size", "dim", "dtype", "optimizer"):
                    if s[name][key] != c[name][key]:
                        raise CheckpointError(
                            f"checkpoint {step}: table {name!r} was saved with {key}="
                            f"{s[name][key]!r}, the model has {key}={c[name][key]!r}")

    def close(self) -> None:
        self.manager.close()
