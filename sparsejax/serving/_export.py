"""`export_model`: a trained model -> a self-contained model dir (see `_format`).

What is exported:
- the model's inference computation, `(params, tables, batch) -> scores`, serialized
  with `jax.export` once per batch bucket. `kernels="xla"` (the default) lowers every
  sparse op to plain XLA, so the model runs on any platform jax has (exported for cpu
  and cuda); `kernels="native"` keeps the platform's custom calls (the C++ CPU kernels),
  exported for cpu only, and loading checks that those kernels are registered;
- its arguments: dense parameters and the tables in their serving form (fp32, fp16,
  bf16, or row-wise int8 / int4 that the lookup dequantizes), stacked as the exported
  computation takes them. Dynamic tables become plain tables: every key the model holds
  gets a row, and a last row is the default row for keys it never saw;
- the preprocessing (`Preprocessing`): the input format, column transforms and id
  mappings (hash buckets, a vocabulary's kept ids, a dynamic table's keys), so raw
  feature values go in, and `example_request.json`, a valid /v1/predict body.

Nothing here knows of run directories or configs: the runner's `sparsejax export`
restores a run and calls `export_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import re
import shutil
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._process import pid_alive
from .._version import __version__
from ..checkpoint import layer_key, tables_from_layers
from ..data import (
    BatchPacker,
    HashMapping,
    JaggedIds,
    PaddedIds,
    RawIdMapping,
    SparseBatch,
    VocabMapping,
)
from ..embedding import MAX_STACK_ROWS, FeatureSpec, TableSpec, aligned_empty
from ..embedding.host import layer_table_key
from ..nn import EMBEDDING, tables_stored_by, trace_layouts
from ..ops import custom_call_targets
from ..sharding import allgather_json, allgather_rows
from ..train import Trainer, TrainState
from ..train import auc as auc_of
from ._format import (
    EXAMPLE_REQUEST,
    EXAMPLE_RETRIEVE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    read_argument,
    write_arrays,
    write_json,
    write_piece,
)
from ._preprocess import KeyMapping
from ._store import InferenceTableStore, quantize_table, serving_spec, storage_kind

DEFAULT_BUCKETS = (1, 4, 16, 64, 256)
"""Padded batch sizes: one compiled computation each (a request of n examples runs in
the smallest bucket >= n; larger ones in chunks of the largest)."""
KERNELS = ("xla", "native")


class ExportError(ValueError):
    """An export option is invalid; the message names it."""


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """How raw feature values become the model's batch, as the model dir records it."""

    input: Mapping[str, Any]
    """The manifest's "input": `kind` ("criteo", "delimited" or "ids": ids as they are),
    the raw `dense` and `sparse` field names, and (files) the column `transform` and the
    delimited `schema`, as `sparsejax.serving.Preprocessor` reads them."""
    mappings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Per feature name its id mapping (`sparsejax.data.HashMapping`, `VocabMapping`,
    `RawIdMapping`); a feature without one takes its ids as rows."""
    examples: Sequence[Mapping[str, Any]] = ()
    """Raw examples for `example_request.json` (/v1/predict's body)."""


# ---- the exported computation -------------------------------------------------------------
def batch_arrays(batch: SparseBatch) -> dict[str, np.ndarray]:
    """A `SparseBatch` as the flat dict the exported computation takes."""
    out = {"dense": batch.dense, "mask": batch.mask}
    for name, f in batch.features.items():
        out[f"{name}.ids"] = f.ids
        out[f"{name}.segments"] = f.segments
        if f.weights is not None:
            out[f"{name}.weights"] = f.weights
    return out


def _sparse_batch(arrays: Mapping, features: Sequence[FeatureSpec]) -> SparseBatch:
    feats = {
        f.name: PaddedIds(
            arrays[f"{f.name}.ids"], arrays[f"{f.name}.segments"], arrays.get(f"{f.name}.weights")
        )
        for f in features
    }
    mask = arrays["mask"]
    return SparseBatch(feats, arrays["dense"], jnp.zeros_like(mask), mask)


def inference_fn(model, features: Sequence[FeatureSpec], make_store, task: str) -> Callable:
    """`(params, tables, batch arrays) -> outputs`: a binary model's probabilities
    (f32[B], the sigmoid of its logits); a retrieval model's user and item tower
    embeddings (`(f32[B, E], f32[B, E])`, their dot over the temperature is the score)."""

    def forward(params, tables, arrays):
        batch = _sparse_batch(arrays, features)
        variables = {"params": params, EMBEDDING: tables}
        with tables_stored_by(make_store):
            if task == "retrieval":
                return model.apply(variables, batch, train=False, towers=True)
            out = model.apply(variables, batch, train=False)
        return jax.nn.sigmoid(out.reshape(-1).astype(jnp.float32))

    return forward


def export_computation(fn, args, *, kernels: str) -> tuple[bytes, list[str]]:
    """`fn(*args)` serialized with `jax.export` and the sparsejax custom calls it uses."""
    if kernels == "native":
        checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in custom_call_targets()]
        platforms = (jax.default_backend(),)
    else:
        checks, platforms = [], ("cpu", "cuda")
    exp = jax.export.export(jax.jit(fn), platforms=platforms, disabled_checks=checks)(*args)
    text = exp.mlir_module()
    calls = sorted(set(re.findall(r"custom_call @(sparsejax_\w+)", text)))
    return exp.serialize(), calls


# ---- tables -------------------------------------------------------------------------------
@dataclasses.dataclass
class _Tables:
    """The run's tables in serving form: per top-level table its rows and mapping entry;
    per layer and layer table its weights: a static table's sharded `jax.Array` (the
    store's `sharded_tables`, rows maybe padded), a tiered one's fp32 rows from its host."""

    rows: dict[str, int]
    keys: dict[str, KeyMapping]  # dynamic tables: their keys' rows, the default row last
    layers: dict[tuple, dict[str, np.ndarray]]


KeyRows = Callable[[TableSpec, np.ndarray], KeyMapping]
"""Where a dynamic table's keys are served: given the table and its sorted keys, their
`KeyMapping` (its default row is the last row; the default `compact_rows`)."""


def compact_rows(table: TableSpec, keys: np.ndarray) -> KeyMapping:
    """Key i at row i, the default row right after them."""
    return KeyMapping(keys, keys.shape[0])


def _full_tables(
    trainer, state, top: Mapping[str, TableSpec], features, key_rows: KeyRows = compact_rows
) -> _Tables:
    """Every table by layer: static ones as their stores shard them, tiered ones from the
    host (a dynamic table's keys unioned over the layers that read it, at the rows
    `key_rows` gives them, the default row last)."""
    top_of_feature = {f.name: f.table for f in features}
    by_layer = {}
    for path, store in trainer.layouts.items():
        node = state.tables
        for k in path:
            node = node[k]
        # each table in its logical layout, sharded as the store keeps it (no gather)
        by_layer[path] = (store, store.sharded_tables(node))
    host_rows = trainer.host.export(state.tables)
    # which top-level table each layer table mirrors (DeepFM's "<t>_linear" reads t's ids;
    # the parts of a composed table read features of their own, not needed here)
    mirror = {}
    for path, (store, _) in by_layer.items():
        for f in store.features.values():
            if f.name in top_of_feature:
                mirror[(path, f.table)] = top_of_feature[f.name]
    keys: dict[str, list] = {}
    for path, (store, _) in by_layer.items():
        for name, t in store.tables.items():
            if t.dynamic is not None:  # each process holds the keys it owns: all of them
                got = allgather_rows(host_rows[layer_table_key(path, name)]["keys"])
                keys.setdefault(mirror[(path, name)], []).extend(got)
    keys = {t: key_rows(top[t], np.unique(np.concatenate(k))) for t, k in keys.items()}
    rows = _serving_rows(top.values(), keys)
    layers = {}
    for path, (store, exported) in by_layer.items():
        out = {}
        for name, t in store.tables.items():
            if not t.is_tiered:
                out[name] = exported[name]["weights"]  # a jax.Array, rows maybe padded
                continue
            ht = host_rows[layer_table_key(path, name)]
            got_keys, w = ht["keys"], np.asarray(ht["weights"], np.float32)
            if t.dynamic is None:  # host-cached static table: keys are its rows
                out[name] = _row_share(got_keys, w, t.vocab_size)
            else:
                served = keys[mirror[(path, name)]]
                # free rows (a publish's spare ones) are zeros: no key reads them, and a
                # trainable default row changing would change them all in every delta
                default = (served.default_row, np.asarray(ht["default"], np.float32))
                out[name] = _row_share(served(got_keys), w, served.default_row + 1, default)
        layers[path] = out
    return _Tables(rows, keys, layers)


@dataclasses.dataclass(frozen=True)
class _RowShare:
    """The rows [first, first + len(block)) of a table kept on the processes' hosts that
    this process writes (all of them in a run of one process)."""

    first: int
    block: np.ndarray


def _row_share(at: np.ndarray, w: np.ndarray, rows: int, default=None) -> _RowShare:
    """This process's share of a host-kept table of `rows` rows, whose rows `at` this
    process holds as `w` (the other processes hold the others; rows no process holds are
    zeros; `default`: `(row, value)` of process 0, for the row a key without one reads).
    Process p writes rows [rows * p / P, rows * (p + 1) / P): the rows go to their
    share's process in P rounds, so no process holds more than about a share and its own
    rows at once (a collective: all call it)."""
    me, n = jax.process_index(), jax.process_count()
    bounds = [rows * p // n for p in range(n + 1)]
    if default is not None:
        row, value = default
        value = allgather_rows(value[None])[0][0]  # process 0's
    share = None
    for p in range(n):
        if n == 1:
            got_at, got_w = [at], [w]
        else:
            mine = (at >= bounds[p]) & (at < bounds[p + 1])
            got_at, got_w = allgather_rows(at[mine]), allgather_rows(w[mine])
        if p != me:
            continue
        share = np.zeros((bounds[p + 1] - bounds[p], w.shape[1]), np.float32)
        if default is not None and bounds[p] <= row < bounds[p + 1]:
            share[row - bounds[p]] = value
        for a, x in zip(got_at, got_w, strict=True):
            share[a - bounds[p]] = x
    return _RowShare(bounds[me], share)


def _row_blocks(name: str, w, rows: int):
    """`(first, stop, f32[stop - first, dim])` of the rows < `rows` of a table that this
    process holds: each row shard's replica 0 (its column pieces joined), in row order;
    a host-kept table's share is one block."""
    if isinstance(w, _RowShare):
        stop = min(w.first + w.block.shape[0], rows)
        if stop > w.first:
            yield w.first, stop, w.block[: stop - w.first]
        return
    by_rows: dict[tuple[int, int], list] = {}
    for shard in w.addressable_shards:
        if shard.replica_id != 0:
            continue
        r = shard.index[0]
        r0, r1 = r.start or 0, w.shape[0] if r.stop is None else r.stop
        c0 = shard.index[1].start or 0 if len(shard.index) > 1 else 0
        by_rows.setdefault((r0, r1), []).append((c0, shard))
    for (r0, r1), parts in sorted(by_rows.items()):
        stop = min(r1, rows)
        if stop <= r0:
            continue
        cols = [np.asarray(s.data)[: stop - r0] for _, s in sorted(parts, key=lambda p: p[0])]
        block = cols[0] if len(cols) == 1 else np.concatenate(cols, axis=1)
        if block.shape[1] != w.shape[1]:
            raise ExportError(
                f"table {name!r}: rows {r0}..{stop - 1} are split by columns over processes; "
                f"export needs each row's columns on one process"
            )
        yield r0, stop, np.asarray(block, np.float32)


class _Arg:
    """A table argument of the exported computation: one array (`kind`) of one stack of
    an embedding layer's serving store; its value is written in row pieces."""

    def __init__(self, path: tuple, stack: str, kind: str, shape: tuple, dtype):
        self.path, self.stack, self.kind = path, stack, kind
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)


def _markers(layouts) -> dict:
    """`{path: {stack: {kind: _Arg}}}`: every table argument of the serving layouts."""
    return {
        path: {
            sname: {k: _Arg(path, sname, k, sd.shape, sd.dtype) for k, sd in arrays.items()}
            for sname, arrays in store.abstract_state().items()
        }
        for path, store in layouts.items()
    }


def _table_blocks(layouts, full: _Tables, kind: str, table_info: dict):
    """Every layer's tables in serving form, block by block of the rows this process
    holds, each block quantized on its own (row-wise quantization is per row): yields
    `(path, stack, kind, table name, table rows (r0, r1), the stack's offset of the
    table, array)`; `table_info` gains each table's rows, dim and bytes."""
    for path, store in layouts.items():
        for sname, stack in store.stacks.items():
            offset = 0
            for t in stack.tables:
                w = full.layers[path].get(t.name)
                if w is None:
                    have = sorted(full.layers[path])
                    raise KeyError(f"no arrays for table {t.name!r} (have {have})")
                info = table_info.setdefault(
                    f"{layer_key(path)}/{t.name}",
                    {"rows": int(t.vocab_size), "dim": int(t.dim), "fp32_bytes": 0, "bytes": 0},
                )
                for r0, r1, block in _row_blocks(t.name, w, t.vocab_size):
                    info["fp32_bytes"] += int(block.nbytes)
                    for k, a in quantize_table(block, kind, t.name).items():
                        info["bytes"] += int(a.nbytes)
                        yield path, sname, k, t.name, (r0, r1), offset, a
                offset += t.vocab_size


def _write_tables(tmp: str, layouts, full: _Tables, kind: str) -> tuple[dict, dict, dict]:
    """Every layer's tables in serving form, written shard by shard (`_table_blocks`):
    each block is a piece of its stack's argument. Returns `({(path, stack, kind):
    [piece entries]}, table_info, {path: {stack: {kind: _Arg}}})`."""
    pieces: dict[tuple, list] = {}
    table_info: dict[str, dict] = {}
    directory = os.path.join(tmp, "arrays")
    for path, sname, k, name, (r0, r1), offset, a in _table_blocks(layouts, full, kind, table_info):
        pieces.setdefault((path, sname, k), []).append(
            write_piece(
                directory,
                f"{layer_key(path)}.{name}.{k}.{r0}-{r1}",
                a,
                rows=[offset + r0, offset + r1],
                table=name,
                table_rows=[r0, r1],
            )
            | {"process": jax.process_index()}  # the process that wrote it
        )
    return pieces, table_info, _markers(layouts)


def serving_arguments(
    trainer: Trainer,
    state: TrainState,
    *,
    make_model: Callable[[Sequence[TableSpec]], Any],
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    num_dense: int,
    quantize: str | None = None,
    key_rows: KeyRows = compact_rows,
    catalog: Mapping | None = None,
) -> dict[str, np.ndarray | list[tuple[int, np.ndarray]]]:
    """The arguments a model dir of `state` holds (`export_model` with `quantize` and
    `key_rows`), in memory and keyed as its manifest's "arguments": what a delta is cut
    from. In a run of several processes (a collective: all call it), each gets the rows
    it holds of each table argument, as `[(first row, rows)]` in the pieces an export
    writes (a table kept on the hosts, tiered or dynamic: its `_row_share`), and process
    0 the dense parameters too. A retrieval model (its `catalog` as `export_model` takes
    it) adds its catalog's embeddings as `ITEM_EMBEDDINGS` in a run of one process; in
    several, no process holds every table, and process 0 embeds the catalog once it has
    the version's arguments whole (`embed_catalog`)."""
    if trainer.task == "retrieval" and catalog is None:
        raise ExportError("a retrieval model's serving arguments need its item catalog (catalog=)")
    kind = storage_kind(quantize)
    features = tuple(features)
    full = _full_tables(trainer, state, {t.name: t for t in tables}, features, key_rows)
    serving_tables, model, layouts, markers = _serving_layout(
        make_model, tables, full.rows, features, num_dense, kind
    )
    values: dict[tuple, np.ndarray | list] = {}
    for path, sname, k, _, (r0, r1), offset, a in _table_blocks(layouts, full, kind, {}):
        if jax.process_count() > 1:
            values.setdefault((path, sname, k), []).append((offset + r0, a))
            continue
        arr = values.get((path, sname, k))
        if arr is None:
            m = markers[path][sname][k]
            arr = values[(path, sname, k)] = aligned_empty(m.shape, m.dtype)
        arr[offset + r0 : offset + r1] = a
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        (jax.device_get(state.params), tables_from_layers(layouts, markers))
    )
    out = {}
    for p, a in flat:
        if isinstance(a, _Arg):
            out[jax.tree_util.keystr(p)] = values.get((a.path, a.stack, a.kind), [])
        elif jax.process_index() == 0:  # the dense parameters: the same on every process
            out[jax.tree_util.keystr(p)] = np.array(a)  # a copy: the state is donated
    if trainer.task == "retrieval" and jax.process_count() == 1:
        args = jax.tree_util.tree_unflatten(treedef, list(out.values()))
        fn = _catalog_tower(trainer, model, kind, serving_tables, features, num_dense)
        _, out[ITEM_EMBEDDINGS] = _embed_catalog(
            fn, args, serving_tables, features, num_dense, catalog
        )
    return out


def embed_catalog(
    trainer: Trainer,
    state: TrainState,
    arguments: Mapping[str, np.ndarray],
    *,
    make_model: Callable[[Sequence[TableSpec]], Any],
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    num_dense: int,
    catalog: Mapping,
    keys: Mapping[str, KeyMapping],
    quantize: str | None = None,
) -> dict[str, np.ndarray]:
    """A retrieval model's catalog embeddings, `{ITEM_EMBEDDINGS: f32[items, E]}`, from
    `arguments`: every argument of the version whole (keyed as `serving_arguments` gives
    them; `keys`, its dynamic tables' key rows). What process 0 of a run of several
    processes computes for a delta, once it has read every process's rows of it."""
    kind = storage_kind(quantize)
    features = tuple(features)
    serving_tables, model, layouts, markers = _serving_layout(
        make_model, tables, _serving_rows(tables, keys), features, num_dense, kind
    )
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        (state.params, tables_from_layers(layouts, markers))
    )
    args = jax.tree_util.tree_unflatten(
        treedef, [arguments[jax.tree_util.keystr(p)] for p, _ in flat]
    )
    fn = _catalog_tower(trainer, model, kind, serving_tables, features, num_dense)
    return {
        ITEM_EMBEDDINGS: _embed_catalog(fn, args, serving_tables, features, num_dense, catalog)[1]
    }


def _serving_rows(tables, keys: Mapping[str, KeyMapping]) -> dict[str, int]:
    """Each table's rows in serving: a dynamic table's served keys and its default row
    (`keys`), any other its vocabulary."""
    return {
        t.name: keys[t.name].default_row + 1 if t.name in keys else t.vocab_size for t in tables
    }


def _serving_layout(make_model, tables, rows: Mapping[str, int], features, num_dense, kind):
    """(serving table specs, the serving model, its layer layouts, their markers) of a
    model whose tables serve `rows` rows each, stored as `kind`."""
    serving_tables = [serving_spec(t, rows[t.name]) for t in tables]
    model = make_model(serving_tables).clone(implementation="xla")
    packer = BatchPacker(serving_tables, features, batch_size=1, num_dense=num_dense)
    with tables_stored_by(InferenceTableStore.factory(kind, "xla")):
        layouts, _ = trace_layouts(model, _pad_batch(packer))
    return serving_tables, model, layouts, _markers(layouts)


def _catalog_tower(trainer, model, kind: str, serving_tables, features, num_dense: int):
    """The inference function a retrieval model's catalog is embedded with: the same
    function object for the same serving layout, so its compiled call is reused."""
    towers = _CATALOG_TOWERS.setdefault(trainer, {})
    layout = (kind, tuple(serving_tables), tuple(features), num_dense)
    if layout not in towers:
        towers[layout] = inference_fn(
            model, features, InferenceTableStore.factory(kind, "xla"), "retrieval"
        )
    return towers[layout]


# ---- preprocessing ------------------------------------------------------------------------
def _mapping_entry(mapping, table: str, keys: Mapping[str, KeyMapping], arrays: dict) -> dict:
    """A feature's id mapping as a manifest entry (its arrays added to `arrays`)."""
    if table in keys:
        served = keys[table]
        arrays[f"keys/{table}"] = served.keys
        entry = {
            "kind": "keys",
            "array": f"keys/{table}",
            "default_row": int(served.default_row),
            "raw_keys": isinstance(mapping, RawIdMapping),
        }
        if served.rows is not None:
            arrays[f"key_rows/{table}"] = served.rows
            entry["rows"] = f"key_rows/{table}"
        return entry
    if isinstance(mapping, HashMapping):
        return {"kind": "hash", "buckets": mapping.buckets}
    if isinstance(mapping, VocabMapping):
        arrays[f"vocab/{table}"] = mapping.values
        return {"kind": "vocab", "array": f"vocab/{table}"}
    return {"kind": "identity"}


# ---- the export ---------------------------------------------------------------------------
def check_servable(tables: Sequence[TableSpec]) -> None:
    """Refuse tables no serving store can hold: a plain one of more than
    `MAX_STACK_ROWS` rows (a serving store keeps a table in one stack addressed by
    int32 rows; training splits such a table row-wise over devices, serving does not
    yet). Dynamic tables are counted by their keys, composed ones by their parts."""
    for t in tables:
        if t.dynamic is None and t.compose is None and t.vocab_size > MAX_STACK_ROWS:
            raise ExportError(
                f"export: table {t.name!r} has {t.vocab_size:,} rows; a serving store holds "
                f"at most {MAX_STACK_ROWS:,} rows a table (int32 row ids), and serving does "
                f"not split a table over devices yet (its checkpoints train and restore on "
                f"any number of processes)"
            )


def check_export(
    out: str,
    *,
    quantize: str | None = None,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    kernels: str = "xla",
    overwrite: bool = False,
) -> tuple[str, tuple[int, ...]]:
    """`export_model`'s options checked (before any work): the table storage kind and
    the sorted buckets; an `ExportError` (or `ValueError`) naming a bad one."""
    kind = storage_kind(quantize)
    if kernels not in KERNELS:
        raise ExportError(f"--kernels {kernels!r}: expected one of {KERNELS}")
    got = sorted({int(b) for b in buckets})
    if not got or got[0] < 1:
        raise ExportError(f"--buckets {list(buckets)}: give batch sizes >= 1")
    if os.path.exists(out) and os.listdir(out) and not overwrite:
        raise ExportError(f"--out {out} exists and is not empty (give another, or --overwrite)")
    return kind, tuple(got)


_TEMP = re.compile(r"^(.+)\.tmp-(\d+)$")  # <version>.tmp-<pid>: an export under way


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"sparsejax export: {name}")


def _host_value(a) -> np.ndarray:
    """A (maybe multi-process) jax array's whole value on this host (small arrays only)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable and not a.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)


@contextlib.contextmanager
def _temp_dir(out: str):
    """`<out>.tmp-<pid>`, the folder the model dir is written in before it is renamed
    to `out`; removed when the export fails. First, the temp folders beside it of
    exports whose process is gone (killed) are removed."""
    parent, base = os.path.split(os.path.abspath(out))
    for name in os.listdir(parent) if os.path.isdir(parent) else ():
        m = _TEMP.match(name)
        stale = os.path.join(parent, name)
        if m and not pid_alive(int(m.group(2))) and os.path.isdir(os.path.join(stale, "exported")):
            shutil.rmtree(stale, ignore_errors=True)
    # several processes: process 0's pid names the one folder they all write
    pid = allgather_json(os.getpid())[0]
    tmp = os.path.join(parent, f"{base}.tmp-{pid}")
    if jax.process_index() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "exported"))
    _barrier("temp dir")
    try:
        yield tmp
    except BaseException as e:
        if jax.process_index() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.filename is None:  # e.g. a full disk: name where
            raise OSError(e.errno, f"{e.strerror} (writing {out})") from e
        raise


def export_model(
    out: str,
    trainer: Trainer,
    state: TrainState,
    *,
    make_model: Callable[[Sequence[TableSpec]], Any],
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    preprocessing: Preprocessing,
    eval_batches: Sequence[SparseBatch],
    catalog: Mapping | None = None,
    model_name: str = "",
    source: Mapping[str, Any] | None = None,
    quantize: str | None = None,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    kernels: str = "xla",
    overwrite: bool = False,
    publish: Mapping[str, Any] | None = None,
    key_rows: KeyRows = compact_rows,
) -> dict:
    """Export a trained model as a model dir (see the module docstring).

    Args:
      out: the model dir to write (refused if it exists, unless `overwrite`), through
        `<out>.tmp-<pid>`: a failed export leaves nothing.
      trainer, state: the trained model (its layers' tables, whole, by name; a dynamic
        table's keys from its host side) and its state, placed.
      make_model: the same model over other tables (`tables` with the serving row
        counts: a dynamic table's keys plus a default row), for inference.
      tables, features: the model's table and feature specs.
      preprocessing: how raw values become batches (input format, id mappings) and
        the example request.
      eval_batches: batches of the model's own data (nonempty): the exported model is
        checked against `trainer` on them; the first gives the dense width.
      catalog: a retrieval model's item catalog (its items' features by name), whose
        item tower embeddings the model dir holds.
      model_name, source: recorded in the manifest (`source` gains the state's step).
      quantize: table storage: fp32 (None), fp16, bf16, int8 or int4 (row-wise).
      buckets: the padded batch sizes compiled at load.
      kernels: "xla" (portable) or "native" (this platform's custom calls).
      publish: recorded as the manifest's "publish" (`Publisher`: the model id and
        version that deltas name as their base).
      key_rows: where each dynamic table's keys are served (`Publisher`: with rows
        free for the keys its deltas add).

    Returns:
      The manifest written (also `out/model.json`), with "check": the exported model's
      agreement with `trainer` on `eval_batches`.
    """
    kind, buckets = check_export(
        out, quantize=quantize, buckets=buckets, kernels=kernels, overwrite=overwrite
    )
    if trainer.task == "retrieval" and catalog is None:
        raise ExportError("export: a retrieval model needs its item catalog (catalog=)")
    top = {t.name: t for t in tables}
    features = tuple(features)
    full = _full_tables(trainer, state, top, features, key_rows)
    serving_tables = [serving_spec(t, full.rows[t.name]) for t in tables]
    check_servable(serving_tables)
    keys = full.keys
    impl = "xla" if kernels == "xla" else None
    model = make_model(serving_tables).clone(implementation=impl)
    make_store = InferenceTableStore.factory(kind, impl)
    num_dense = eval_batches[0].dense.shape[1]
    packers = {
        b: BatchPacker(serving_tables, features, batch_size=b, num_dense=num_dense) for b in buckets
    }
    # the serving layout of every embedding layer
    arrays: dict[str, np.ndarray] = {}
    example = _pad_batch(packers[buckets[0]])
    with tables_stored_by(make_store):
        layouts, _ = trace_layouts(model, example)
    params = jax.device_get(state.params)
    fn = inference_fn(model, features, make_store, trainer.task)
    # write: into <out>.tmp-<pid>, renamed to <out> once complete
    with _temp_dir(out) as tmp:
        # the tables in serving form, shard by shard (no table gathered in one place)
        pieces, table_info, markers = _write_tables(tmp, layouts, full, kind)
        del full
        if jax.process_count() > 1:  # every process wrote its own pieces: gather entries
            pieces, table_info = _gather_pieces(pieces, table_info)
        first = jax.process_index() == 0
        flat, treedef = jax.tree_util.tree_flatten_with_path(
            (params, tables_from_layers(layouts, markers))
        )
        dense = {jax.tree_util.keystr(p): np.asarray(a) for p, a in flat if not isinstance(a, _Arg)}
        # dense parameters are replicated: process 0 writes them, the others wait
        dense_entries = allgather_json(
            write_arrays(os.path.join(tmp, "arrays"), dense) if first else None
        )[0]
        arguments = {}
        for p, a in flat:
            key = jax.tree_util.keystr(p)
            if not isinstance(a, _Arg):
                arguments[key] = dense_entries[key]
                continue
            mine = pieces.get((a.path, a.stack, a.kind), [])
            arguments[key] = {
                "key": key,
                "shape": list(a.shape),
                "dtype": str(a.dtype),
                "pieces": sorted(mine, key=lambda e: e["rows"]),
            }
        abstract = jax.tree_util.tree_unflatten(
            treedef, [jax.ShapeDtypeStruct(a.shape, a.dtype) for _, a in flat]
        )
        exported, custom_calls = {}, set()
        for b in buckets:
            fname = f"exported/b{b}.jaxexport"
            exported[str(b)] = fname
            if not first:
                continue
            blob, calls = export_computation(
                fn, (*abstract, batch_arrays(_pad_batch(packers[b]))), kernels=kernels
            )
            custom_calls |= set(calls)
            with open(os.path.join(tmp, fname), "wb") as fh:
                fh.write(blob)
        _barrier("arrays written")

        def read_args(touched: Mapping | None = None):
            """The model dir's own arguments, read back as serving reads them; with
            `touched` (`_touched_rows`), a large table argument only the rows there."""
            leaves = []
            for (_, a), e in zip(flat, arguments.values(), strict=True):
                rows = None
                if touched is not None and isinstance(a, _Arg):
                    if math.prod(a.shape) * a.dtype.itemsize > _WHOLE_BYTES:
                        rows = touched.get((a.path, a.stack))
                leaves.append(read_argument(tmp, e, rows))
            return jax.tree_util.tree_unflatten(treedef, leaves)

        mappings = {}
        for f in features:
            if f.table not in mappings:
                mappings[f.table] = _mapping_entry(
                    preprocessing.mappings.get(f.name), f.table, keys, arrays
                )
        retrieval = None
        if trainer.task == "retrieval":
            # the catalog through the item tower on the model dir's own arguments (process
            # 0 reads every process's pieces, its tables whole) and written with its mappings
            items = None
            if first:
                tower = fn  # with XLA's kernels, the one the deltas use: compiled once
                if impl == "xla":
                    tower = _catalog_tower(
                        trainer, model, kind, serving_tables, features, num_dense
                    )
                items, embeddings = _embed_catalog(
                    tower, read_args(), serving_tables, features, num_dense, catalog
                )
                arrays["items/ids"], arrays["items/embeddings"] = items, embeddings
            retrieval = {
                "temperature": float(model.temperature),
                "item_ids": "items/ids",
                "item_embeddings": "items/embeddings",
                "items": allgather_json(None if items is None else int(items.shape[0]))[0],
                "user_features": list(model.user_features),
                "item_features": list(model.item_features),
            }
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "sparsejax_version": __version__,
            "jax_version": jax.__version__,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "version": os.path.basename(os.path.abspath(out)),
            "source": {**(source or {}), "step": int(state.step)},
            "model": model_name,
            "task": trainer.task,
            "kernels": kernels,
            "platforms": ["cpu", "cuda"] if kernels == "xla" else [jax.default_backend()],
            "custom_calls": sorted(custom_calls),
            "quantize": kind,
            "buckets": list(buckets),
            "exported": exported,
            "input": dict(preprocessing.input),
            "features": [
                {
                    "name": f.name,
                    "table": f.table,
                    "combiner": f.combiner,
                    "max_ids": f.max_ids,
                    "weighted": f.weighted,
                }
                for f in features
            ],
            "tables": {t.name: {"rows": t.vocab_size, "dim": t.dim} for t in serving_tables},
            "table_arrays": table_info,
            "num_dense": int(num_dense),
            "mappings": mappings,
            "arguments": arguments,
            "mapping_arrays": write_arrays(os.path.join(tmp, "mappings"), arrays) if first else {},
            "retrieval": retrieval,
            "publish": None if publish is None else dict(publish),
        }
        manifest["memory"] = {
            "tables_bytes": sum(v["bytes"] for v in table_info.values()),
            "tables_fp32_bytes": sum(v["fp32_bytes"] for v in table_info.values()),
        }
        manifest["check"] = _check(
            trainer, state, eval_batches, features, fn, read_args if first else None, keys, layouts
        )
        manifest["processes"] = jax.process_count()
        if first:
            write_json(os.path.join(tmp, MANIFEST), manifest)
            rows = [dict(r) for r in preprocessing.examples]
            write_json(os.path.join(tmp, EXAMPLE_REQUEST), {"examples": rows})
            if retrieval is not None and rows:
                user = {k: v for k, v in rows[0].items() if k in retrieval["user_features"]}
                write_json(os.path.join(tmp, EXAMPLE_RETRIEVE), {"user": user, "k": 10})
            if os.path.exists(out):
                shutil.rmtree(out)
            os.replace(tmp, out)
        _barrier("model dir renamed")  # no process returns before the model dir is complete
        manifest["check"] = allgather_json(manifest["check"])[0]
    return manifest


def _gather_pieces(pieces: dict, table_info: dict) -> tuple[dict, dict]:
    """Every process's piece entries (by argument) and table byte counts, combined."""
    keys = sorted(pieces, key=repr)
    mine = {"pieces": [[repr(k), pieces[k]] for k in keys], "info": table_info}
    got: dict[tuple, list] = {}
    by_repr = {repr(k): k for k in keys}
    info: dict[str, dict] = {}
    for proc in allgather_json(mine):
        for rk, entries in proc["pieces"]:
            k = by_repr.get(rk)
            if k is None:  # an argument this process holds no rows of
                k = _key_from_repr(rk)
                by_repr[rk] = k
            got.setdefault(k, []).extend(entries)
        for name, v in proc["info"].items():
            have = info.setdefault(name, {**v, "fp32_bytes": 0, "bytes": 0})
            have["fp32_bytes"] += v["fp32_bytes"]
            have["bytes"] += v["bytes"]
    return got, info


def _key_from_repr(text: str) -> tuple:
    import ast

    return ast.literal_eval(text)


def _pad_batch(packer: BatchPacker) -> SparseBatch:
    """A batch of padding only: the shapes of `packer`'s batches."""
    none = np.zeros(0, np.int64)
    sparse = {
        f.name: JaggedIds(none, none, np.zeros(0, np.float32) if f.weighted else None)
        for f in packer.features
    }
    return packer.pack(
        sparse, labels=np.zeros(0, np.float32), dense=np.zeros((0, packer.num_dense), np.float32)
    )


ITEM_EMBEDDINGS = "retrieval.item_embeddings"
"""A retrieval model's catalog embeddings among the arguments `serving_arguments` gives
and a delta carries (the model dir keeps them with its mapping arrays)."""

_CATALOG_TOWERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per trainer and serving layout, the inference function `serving_arguments` embeds the
catalog with: the same function object at each publish, so its compile is reused (0.3 s
of the 0.4 s that 50k items took)."""

_CATALOG_CHUNK = 256
"""Items embedded per call: the same for every export and publish of a model, so the
embeddings of the same state are the same bits."""


def _embed_catalog(fn, args, tables, features, num_dense: int, catalog: Mapping) -> tuple:
    """(raw item ids, f32[N, E] item tower embeddings) of every catalog item, in chunks
    of `_CATALOG_CHUNK` (user-side features empty)."""
    packer = BatchPacker(tables, features, batch_size=_CATALOG_CHUNK, num_dense=num_dense)
    jitted = jax.jit(fn)
    ids = np.asarray(catalog["item"].values, np.int64)
    n, b, out = ids.shape[0], packer.batch_size, []
    none = np.zeros(0, np.int64)
    for start in range(0, n, b):
        k = min(b, n - start)
        sparse = {
            f.name: JaggedIds(np.zeros(k, np.int64), none)
            if f.name not in catalog
            else JaggedIds(
                catalog[f.name].lengths[start : start + k],
                catalog[f.name].values[start : start + k],
            )
            for f in packer.features
        }
        dense = np.zeros((k, num_dense), np.float32)
        batch = packer.pack(sparse, labels=np.zeros(k, np.float32), dense=dense)
        _, item = jitted(*args, batch_arrays(batch))
        out.append(np.asarray(item)[:k])
    return ids, np.concatenate(out).astype(np.float32)


def _scores(out, task: str, temperature: float | None = None) -> np.ndarray:
    """Per example: a binary model's probability; a retrieval model's score of its own
    item (the diagonal of the in-batch scores)."""
    if task == "retrieval":
        user, item = (np.asarray(x, np.float64) for x in out)
        return (user * item).sum(-1) / temperature
    return np.asarray(out, np.float64).reshape(-1)


_WHOLE_BYTES = 64 << 20
"""A table argument larger than this is read for the export's check only in the rows
its batches look up (the model dir is otherwise read whole by one process)."""


def _touched_rows(layouts, arrays: list[Mapping]) -> dict[tuple, np.ndarray | None]:
    """`{(layer path, stack): sorted stack rows}` that batches (`batch_arrays`, ids
    mapped to serving rows) look up in the serving layouts; None where a stack holds a
    table no batch feature reads directly (e.g. a composed table's parts: read whole)."""
    out: dict[tuple, np.ndarray | None] = {}
    for path, store in layouts.items():
        for name, stack in store.stacks.items():
            rows: list[np.ndarray] | None = [np.zeros(0, np.int64)]
            for t in stack.tables:
                fs = [f.name for f in store.features.values() if f.table == t.name]
                if not fs or any(f"{f}.ids" not in a for f in fs for a in arrays):
                    rows = None
                    break
                for a in arrays:
                    for f in fs:
                        ids = np.asarray(a[f"{f}.ids"], np.int64).reshape(-1)
                        ids = ids[(ids >= 0) & (ids < t.vocab_size)]
                        rows.append(stack.offset_of(t.name) + ids)
            out[(path, name)] = None if rows is None else np.unique(np.concatenate(rows))
    return out


def _check(trainer, state, batches, features, fn, read_args, keys, layouts) -> dict:
    """The exported computation on the model dir's own arguments (`read_args`, process
    0's; a large table read in the rows the batches look up) against the run's own
    model on the eval split's batches (a dynamic table's keys mapped to serving rows):
    max |score - score_run| (binary: probabilities) and, for binary models, both AUCs."""
    key_maps = {f.name: keys[f.table] for f in features if f.table in keys}
    temperature = getattr(trainer.model, "temperature", None)
    theirs, labels, masks, inputs = [], [], [], []
    for batch in batches:
        mask = np.asarray(batch.mask) > 0
        # every process runs the run's eval step (a collective); process 0 the export's
        run = _host_value(trainer.eval_step(state, batch)).astype(np.float64)
        n, procs = mask.shape[0], jax.process_count()
        if procs > 1 and run.shape[0] == n * procs:  # the global batch: this process's share
            run = run[jax.process_index() * n : (jax.process_index() + 1) * n]
        if trainer.task == "retrieval":
            theirs.append(np.diagonal(run)[mask])
        else:
            theirs.append(1.0 / (1.0 + np.exp(-run.reshape(-1)[mask])))
        labels.append(np.asarray(batch.labels, np.float64).reshape(-1)[mask])
        arrays = batch_arrays(jax.tree.map(np.asarray, batch))
        for name, m in key_maps.items():
            ids = arrays[f"{name}.ids"]
            arrays[f"{name}.ids"] = np.where(ids >= 0, m(ids), -1).astype(np.int32)
        masks.append(mask)
        inputs.append(arrays)
    if read_args is None:  # not process 0: it reports the check
        return {}
    args = read_args(_touched_rows(layouts, inputs))
    jitted = jax.jit(fn)
    ours = [
        _scores(jitted(*args, arrays), trainer.task, temperature)[mask]
        for arrays, mask in zip(inputs, masks, strict=True)
    ]
    p, q, y = np.concatenate(ours), np.concatenate(theirs), np.concatenate(labels)
    binary = trainer.task == "binary" and y.size
    return {
        "examples": int(y.shape[0]),
        "max_abs_diff": float(np.max(np.abs(p - q), initial=0.0)),
        "auc": float(auc_of(y, p)) if binary else None,
        "auc_train_model": float(auc_of(y, q)) if binary else None,
    }
