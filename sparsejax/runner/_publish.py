"""`publish`: the training run publishes its model for `sparsejax serve` to follow (a
`sparsejax.serving.Publisher` driven by a training hook)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import numpy as np

from ..serving import Preprocessing, Publisher, export_model, serving_arguments
from ..train import Hook, TrainState
from ._config import ConfigError
from ._export import _input_spec, example_rows
from ._model import configured_model


class PublishHook(Hook):
    """Publishes after the first step, then every `publish.every_s` seconds, and at the
    end of training; one line a publish."""

    def __init__(self, run, log: Callable[[str], object] = print):
        cfg, data = run.cfg, run.data
        p = cfg.publish
        host = [t.name for t in data.tables if t.is_tiered]
        if jax.process_count() > 1 and host:
            raise ConfigError(
                f"publish: tables {host[:3]}{'...' if len(host) > 3 else ''} are kept on each "
                f"process's host (tiered or dynamic), and a run of {jax.process_count()} "
                f"processes cannot publish them yet; train in one process, or export the "
                f"checkpoints (`sparsejax export`) into the serving folder"
            )
        self.every_s, self.log = p.every_s, log
        self._state: TrainState | None = None
        self._last: float | None = None
        self._published_step: int | None = None
        spec = _input_spec(cfg, data)
        common = dict(
            make_model=lambda tables: configured_model(cfg, tables, data.features),
            tables=data.tables,
            features=data.features,
        )

        def export(out: str, publish, key_rows) -> dict:
            return export_model(
                out,
                run.trainer,
                self._state,
                preprocessing=Preprocessing(
                    input=spec, mappings=data.mappings or {}, examples=example_rows(cfg, data, spec)
                ),
                eval_batches=data.eval_batches,
                model_name=cfg.model.name,
                source={"run_dir": os.path.abspath(cfg.run_dir)},
                quantize=p.quantize,
                kernels=p.kernels,
                buckets=p.buckets,
                overwrite=True,
                publish=publish,
                key_rows=key_rows,
                **common,
            )

        def arguments(key_rows) -> dict:
            return serving_arguments(
                run.trainer,
                self._state,
                num_dense=data.eval_batches[0].dense.shape[1],
                quantize=p.quantize,
                key_rows=key_rows,
                **common,
            )

        if run.trainer.task == "retrieval":
            raise ConfigError("publish: retrieval models are not published yet; export them")
        self.publisher = Publisher(
            p.dir,
            export=export,
            arguments=arguments,
            full_every_s=p.full_every_s,
            headroom=p.key_headroom,
            log=log,
        )

    def _publish(self, step: int, state: TrainState) -> None:
        self._state = state
        t0 = time.perf_counter()
        got = self.publisher.publish(step)
        self._state = None
        self._last, self._published_step = time.monotonic(), step
        rows, keys = got.get("rows"), got.get("keys") or {}
        changed = "" if rows is None else f", {sum(v for v in rows.values() if v != 'all'):,} rows"
        if keys:
            added = sum(k["added"] for k in keys.values())
            removed = sum(k["removed"] for k in keys.values())
            changed += f", keys +{added:,} -{removed:,} in {len(keys)} tables"
        self.log(
            f"published step {step} as {got['kind']} version {got['version']} ({got['path']}"
            f"{changed}) in {time.perf_counter() - t0:.2f} s"
        )

    def after_step(self, step: int, state: TrainState, metrics) -> None:
        due = self._last is None or time.monotonic() - self._last >= self.every_s
        if jax.process_count() > 1:  # all processes publish together, when process 0 says
            from jax.experimental import multihost_utils

            due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
        if due:
            self._publish(step, state)

    def on_end(self, step: int, state: TrainState) -> None:
        if self._published_step != step:
            self._publish(step, state)
