"""`publish`: the training run publishes its model for `sparsejax serve` to follow (a
`sparsejax.serving.Publisher` driven by a training hook)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax

from ..serving import (
    Preprocessing,
    Publisher,
    embed_catalog,
    export_model,
    serving_arguments,
)
from ..sharding import broadcast_text
from ..train import Hook, TrainState
from ._export import _input_spec, example_rows, item_catalog
from ._model import configured_model


class PublishHook(Hook):
    """Publishes after the first step, then every `publish.every_s` seconds, and at the
    end of training; one line a publish. In a run of one process, training goes on
    while a delta is written (`Publisher(background=True)`); the run ends once the last
    is written. In a run of several processes, all publish at the same step: at each
    publish, process 0 names the step of the next one from its step rate (no collective
    between publishes)."""

    def __init__(self, run, log: Callable[[str], object] = print):
        cfg, data = run.cfg, run.data
        p = cfg.publish
        self.every_s, self.log = p.every_s, log
        self._state: TrainState | None = None
        self._last: float | None = None
        self._published_step: int | None = None
        self._next_step: int | None = None  # several processes: the next publish's step
        self._rate_from: tuple[float, int] | None = None  # (time, step) of the last publish
        spec = _input_spec(cfg, data)
        common = dict(
            make_model=lambda tables: configured_model(cfg, tables, data.features),
            tables=data.tables,
            features=data.features,
            catalog=item_catalog(cfg, data, run.trainer.task, "publish"),
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

        def embed(whole, keys) -> dict:  # process 0 of several: from every process's rows
            return embed_catalog(
                run.trainer,
                self._state,
                whole,
                num_dense=data.eval_batches[0].dense.shape[1],
                quantize=p.quantize,
                keys=keys,
                **common,
            )

        several_retrieval = run.trainer.task == "retrieval" and jax.process_count() > 1
        self.publisher = Publisher(
            p.dir,
            export=export,
            arguments=arguments,
            full_every_s=p.full_every_s,
            headroom=p.key_headroom,
            background=True,
            complete=embed if several_retrieval else None,
            log=log,
        )

    def _publish(self, step: int, state: TrainState) -> None:
        self._state = state
        self.publisher.publish(step, on_written=lambda got: self._log_published(step, got))
        self._state = None
        self._last, self._published_step = time.monotonic(), step

    def _log_published(self, step: int, got: dict) -> None:
        rows, keys = got.get("rows"), got.get("keys") or {}
        changed = ""
        if rows is not None:  # rows of the arguments cut in rows, the count of those whole
            whole = sum(v == "all" for v in rows.values())
            changed = f", {sum(v for v in rows.values() if v != 'all'):,} rows"
            changed += f" and {whole} arrays whole" if whole else ""
        if keys:
            added = sum(k["added"] for k in keys.values())
            removed = sum(k["removed"] for k in keys.values())
            changed += f", keys +{added:,} -{removed:,} in {len(keys)} tables"
        in_call = got.get("in_call_s")
        stalled = "" if in_call is None else f", {in_call:.2f} s of it in the training loop"
        self.log(
            f"published step {step} as {got['kind']} version {got['version']} ({got['path']}"
            f"{changed}) in {got['took_s']:.2f} s{stalled}"
        )

    def after_step(self, step: int, state: TrainState, metrics) -> None:
        if jax.process_count() > 1:
            due = self._next_step is None or step >= self._next_step
        else:
            due = self._last is None or time.monotonic() - self._last >= self.every_s
        if due:
            self._publish(step, state)
            if jax.process_count() > 1:
                self._next_step = self._agree_next_step(step)

    def _agree_next_step(self, step: int) -> int:
        """The step of the next publish, process 0's: `every_s` at its step rate since
        the publish before (the next step after the first, which measures it)."""
        now, ahead = time.monotonic(), 1
        if self._rate_from is not None and step > self._rate_from[1]:
            per_step = (now - self._rate_from[0]) / (step - self._rate_from[1])
            ahead = max(1, round(self.every_s / max(per_step, 1e-9)))
        self._rate_from = (now, step)
        return int(broadcast_text(str(step + ahead)))

    def on_end(self, step: int, state: TrainState) -> None:
        if self._published_step != step:
            self._publish(step, state)
        self.publisher.close()  # the last delta written before the run ends
