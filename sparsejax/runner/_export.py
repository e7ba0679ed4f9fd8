"""`sparsejax export RUN_DIR --out MODEL_DIR`: a trained run directory as a model dir.

The run's config, data, trainer and checkpoint are restored (`restore_run`); from them
this builds what `sparsejax.serving.export_model` takes (the model for the serving
tables, the feature schema, the preprocessing: the input format, column transforms, id
mappings and a few raw rows of the run's data for `example_request.json`) and calls it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..checkpoint import CheckpointUnreadableError
from ..data import CATEGORICAL_NAMES, DENSE_NAMES, open_text
from ..serving import (
    DEFAULT_BUCKETS,
    ExportError,
    Preprocessing,
    check_export,
    check_servable,
    export_model,
)
from ._config import ConfigError
from ._evaluate import restore_run
from ._model import configured_model
from ._read import _read_schema, resolve_files
from ._run_dir import _checkpoint_steps_in

_FILE_KINDS = ("criteo", "delimited")
_MAX_EXAMPLE_ROWS = 8


def item_catalog(cfg, data, task: str, command: str):
    """A retrieval model's item catalog (the items whose embeddings are served; a
    ConfigError if the data has none), None for other models."""
    if task != "retrieval":
        return None
    catalog = getattr(data.train_source, "catalog", None)
    if catalog is None:
        raise ConfigError(
            f"{command}: model.name={cfg.model.name!r} ranks items, and data.kind="
            f"{cfg.data.kind!r} has no item catalog to embed (synthetic behavior data has)"
        )
    return catalog()


def export_run(
    run_dir: str,
    out: str,
    *,
    step: int | str | None = None,
    quantize: str | None = None,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    kernels: str = "xla",
    overrides: Sequence[str] = (),
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Export a run directory's checkpoint as a model dir (`sparsejax.serving.export_model`).

    Args:
      run_dir: the run directory.
      out: the model dir to write (refused if it exists, unless `overwrite`). A
        numbered subfolder of a serving folder (`models/3`) is a new version for a
        running `sparsejax serve models` to pick up.
      step: the checkpoint step: None (the newest; refused when it is unreadable),
        a number, "last" (the newest readable: an unreadable newer one is skipped with
        a warning) or "best" (kept by `early_stopping`).
      quantize: table storage: fp32 (None), fp16, bf16, int8 or int4 (row-wise).
      buckets: the padded batch sizes compiled at load.
      kernels: "xla" (portable) or "native" (this platform's custom calls).
      overrides: `key=value` config overrides for reading the run's data.

    Returns:
      The manifest written (also `out/model.json`), with "check": the exported model's
      agreement with the run's own model on the eval split.
    """
    options = dict(quantize=quantize, buckets=buckets, kernels=kernels, overwrite=overwrite)
    try:  # before any work
        check_export(out, **options)
    except ExportError as e:  # a config error, as the command has always said
        raise ConfigError(str(e)) from None
    t0 = time.perf_counter()
    cfg, data, trainer, state = _restore(run_dir, step, overrides, log)
    catalog = item_catalog(cfg, data, trainer.task, "export")
    spec = _input_spec(cfg, data)
    manifest = export_model(
        out,
        trainer,
        state,
        make_model=lambda tables: configured_model(cfg, tables, data.features),
        tables=data.tables,
        features=data.features,
        preprocessing=Preprocessing(
            input=spec, mappings=data.mappings or {}, examples=example_rows(cfg, data, spec)
        ),
        eval_batches=data.eval_batches,
        catalog=catalog,
        model_name=cfg.model.name,
        source={"run_dir": os.path.abspath(run_dir)},
        **options,
    )
    mem, check = manifest["memory"], manifest["check"]
    share = mem["tables_bytes"] / max(mem["tables_fp32_bytes"], 1)
    log(
        f"exported {run_dir} @ step {manifest['source']['step']} to {out} in "
        f"{time.perf_counter() - t0:.1f} s: {manifest['quantize']} tables "
        f"{mem['tables_bytes'] / 2**20:.2f} MiB ({share:.1%} of fp32), kernels "
        f"{manifest['kernels']}, buckets {manifest['buckets']}; on "
        f"{check['examples']:,} eval examples max |score - score_run| "
        f"{check['max_abs_diff']:.2e}"
        + (
            f", AUC {check['auc']:.5f} (the run's model {check['auc_train_model']:.5f})"
            if check["auc"] is not None
            else ""
        )
    )
    return manifest


def _servable(data) -> None:
    """Refuse, before a restore, tables a serving store cannot hold (a config error)."""
    try:
        check_servable(data.tables)
    except ExportError as e:
        raise ConfigError(str(e)) from None


def _restore(run_dir: str, step: int | str | None, overrides: Sequence[str], log) -> tuple:
    """`restore_run` of the step to export. By default the newest checkpoint, and only
    it: when it is unreadable the export is refused (an older model is exported only
    when named: `--step N`, or `--step last` for the newest readable one)."""
    newest = _checkpoint_steps_in(os.path.join(run_dir, "checkpoints"))[-1:]
    kw = dict(overrides=overrides, log=log, check=_servable)
    if step is not None or not newest:
        return restore_run(run_dir, step=step, **kw)
    try:
        return restore_run(run_dir, step=newest[0], **kw)
    except CheckpointUnreadableError as e:
        raise CheckpointUnreadableError(
            f"export: the newest checkpoint is unreadable: {e}; an older one is exported "
            f"only when named (--step N, or --step last: the newest readable)"
        ) from e


def _input_spec(cfg, data) -> dict:
    """The manifest's "input": the raw fields and how they become `Examples`."""
    d = cfg.data
    if d.kind in ("synthetic", "behavior", "prepared"):  # ids are table rows (or keys)
        gen_dense = data.eval_batches[0].dense.shape[1]
        return {
            "kind": "ids",
            "dense": [f"dense{i}" for i in range(gen_dense)],
            "sparse": [f.name for f in data.features],
        }
    if d.kind not in _FILE_KINDS:
        raise ConfigError(
            f"export: data.kind={d.kind!r} is not exportable yet (criteo, delimited and "
            f"synthetic data are)"
        )
    if d.joins:
        raise ConfigError("export: data.joins (side tables) are not exportable yet")
    t = data.transform
    transform = {
        "dense_names": list(t.dense_names),
        "indicator_bags": {k: list(v) for k, v in t.indicator_bags.items()},
        "drop": list(t.drop),
        "max_ids": dict(t.max_ids),
    }
    if d.kind == "criteo":
        return {
            "kind": "criteo",
            "dense": list(DENSE_NAMES),
            "sparse": list(CATEGORICAL_NAMES),
            "transform": transform,
        }
    schema, _ = _read_schema(d)
    s = dataclasses.asdict(schema)
    used = [*schema.dense, *schema.sparse_columns]
    s.update(columns=used, label=None, header=False)
    return {
        "kind": "delimited",
        "dense": list(schema.dense),
        "sparse": list(schema.sparse_columns),
        "schema": s,
        "transform": transform,
    }


def example_rows(cfg, data, spec: Mapping, n: int = _MAX_EXAMPLE_ROWS) -> list[dict]:
    """Up to `n` raw examples from the run's data, as /v1/predict takes them."""
    fields = (*spec["dense"], *spec["sparse"])
    if spec["kind"] == "ids":
        b = data.eval_batches[0]
        per = {f.name: f.bags_per_example() for f in data.features}
        rows = []
        for i in range(min(n, int(np.sum(b.mask > 0)))):
            ex = {f"dense{j}": float(x) for j, x in enumerate(np.asarray(b.dense[i]))}
            for name, f in b.features.items():
                ids, segs = np.asarray(f.ids), np.asarray(f.segments) // per[name]
                mine = ids[(segs == i) & (ids >= 0)]
                if mine.shape[0] == 1 and per[name] == 1:
                    ex[name] = int(mine[0])
                elif mine.shape[0]:
                    ex[name] = [int(x) for x in mine]
            rows.append(ex)
        return rows
    d = cfg.data
    source = d.eval if d.eval is not None else (d.path if d.path is not None else d.train)
    files = resolve_files(source, "data.eval")
    rows = []
    with open_text(files[0], "rt") as fh:
        if spec["kind"] == "criteo":
            names = ("label", *DENSE_NAMES, *CATEGORICAL_NAMES)
            delim = "\t"
        else:
            schema = cfg.data.schema or {}
            delim = schema.get("delimiter", ",")
            header = schema.get("header", True)
            names = tuple(schema.get("columns") or ())
            if header:
                first = fh.readline().rstrip("\r\n").split(delim)
                names = names or tuple(first)
        for line in fh:
            parts = line.rstrip("\r\n").split(delim)
            if len(parts) != len(names):
                continue
            ex = {}
            for k, v in zip(names, parts, strict=True):
                if k not in fields or v == "":
                    continue
                if spec["kind"] == "criteo" and k in DENSE_NAMES:
                    try:
                        ex[k] = int(v)
                    except ValueError:
                        break
                else:
                    ex[k] = v
            else:
                rows.append(ex)
            if len(rows) >= n:
                break
    return rows
