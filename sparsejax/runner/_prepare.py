"""Prepared data for a config: `prepare_data` (the `sparsejax data` command) writes the
config's splits as the table rows its id mappings give, once; a run with `data.kind:
prepared` and `data.path: DIR` trains from them (`_data.build_prepared`) with nothing to
parse or map, each batch a gather from memory-mapped columns
(`sparsejax.data.PreparedData`).

    DIR/dataset.json     the features, the tables' rows and dims, the splits' sizes and
                         the config's data section that made them
    DIR/train/, DIR/eval/, DIR/test/   one prepared directory per split
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator

from .. import data as sd
from ._config import ConfigError
from ._data import DATASET, DataBundle, build_data
from ._schema import RunConfig

_FEATURE_FIELDS = ("name", "table", "combiner", "max_ids", "capacity", "weighted")
_CHUNK_ROWS = 1 << 16


def prepare_data(
    cfg: RunConfig, out: str, *, rows: int | None = None, log: Callable[[str], None] = print
) -> dict:
    """Write the config's data (train, eval and test splits, as its run would read and
    map them) to a new directory `out`; `rows`: the train rows of generated data
    (default: the run's steps x batch size). Returns the dataset's description."""
    d = cfg.data
    if d.kind in ("prepared", "events", "behavior"):
        raise ConfigError(
            f"sparsejax data: data.kind={d.kind!r} cannot be prepared (criteo, delimited, "
            f"libsvm, parquet and synthetic data can)"
        )
    out = os.path.abspath(out)
    if os.path.exists(out):
        raise ConfigError(f"sparsejax data: {out} exists; prepared data goes to a new directory")
    t0 = time.perf_counter()
    bundle = build_data(cfg)
    tables, features = bundle.tables, bundle.features
    base = {t.name: t for t in tables}
    splits = {"train": _train_chunks(cfg, bundle, rows)}
    if d.kind == "synthetic":
        gen, eval_b = bundle.train_source, d.eval_batch_size or d.batch_size
        splits["eval"] = iter(  # the run's eval batches, numbered from 2**31 - 1 down
            [_examples(gen.batch(0x7FFFFFFF - i, eval_b)) for i in range(d.eval_batches)]
        )
    else:
        splits["eval"] = iter([bundle.eval_examples])
        if bundle.test_examples is not None:
            splits["test"] = iter([bundle.test_examples])
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        sizes = {}
        for split, chunks in splits.items():
            sizes[split] = len(
                sd.write_prepared(os.path.join(tmp, split), chunks, tables, features)
            )
            log(f"{split}: {sizes[split]:,} rows")
        info = {
            "features": [{k: getattr(f, k) for k in _FEATURE_FIELDS} for f in features],
            "tables": {
                t.name: {"rows": t.vocab_size if t.dynamic is None else None, "dim": t.dim}
                for t in base.values()
            },
            "num_dense": bundle.packer.num_dense,
            "splits": sizes,
            "source": _plain(dataclasses.asdict(d)),
        }
        with open(os.path.join(tmp, DATASET), "w") as fh:
            json.dump(info, fh, indent=1)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"prepared {out} in {time.perf_counter() - t0:.1f} s")
    return info


def _examples(batch: sd.HostBatch) -> sd.Examples:
    sparse, labels, dense = batch
    return sd.Examples(labels=labels, dense=dense, sparse=sparse)


def _train_chunks(cfg: RunConfig, bundle: DataBundle, rows: int | None) -> Iterator[sd.Examples]:
    """The train split in chunks, in the order the run reads it unshuffled."""
    source, b = bundle.train_source, cfg.data.batch_size
    if isinstance(source, sd.Examples):
        for a in range(0, len(source), _CHUNK_ROWS):
            yield source[a : a + _CHUNK_ROWS]
    elif callable(getattr(source, "batch", None)):  # generated: the run's batches 0, 1, ...
        total = rows if rows is not None else cfg.steps * b
        for i in range(-(-total // b)):
            ex = _examples(source.batch(i, b))
            yield ex if (i + 1) * b <= total else ex[: total - i * b]
    else:  # a stream of files
        for chunk in source.chunks(None):
            yield chunk.examples


def _plain(x):
    """A config value as JSON takes it."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (str, int, float, bool, type(None))) else repr(x)
