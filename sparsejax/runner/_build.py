"""Building a run from its config: the data (read or generated, with the table and
feature specs derived from it), the model and the optimizers."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import data as sd
from ..data import BatchPacker, Examples, Loader, SparseBatch
from ..embedding import FeatureSpec, TableSpec
from ..nn import MODELS
from ._config import ConfigError
from ._schema import DATA_DIR_ENV, DataConfig, RunConfig, sparse_optimizer


def resolve_data_path(path: str | os.PathLike, key: str = "data.path") -> str:
    """The file `path` names: as given if absolute; else in the working directory, then
    in `$SPARSEJAX_DATA_DIR`. A missing file is a `ConfigError` naming `key`, the path
    and where it looked."""
    path = os.fspath(path)
    places = [path] if os.path.isabs(path) else [os.path.abspath(path)]
    data_dir = os.environ.get(DATA_DIR_ENV)
    if not os.path.isabs(path) and data_dir:
        places.append(os.path.abspath(os.path.join(data_dir, path)))
    for p in places:
        if os.path.isfile(p):
            return p
    unset = "" if os.path.isabs(path) or data_dir else f"; ${DATA_DIR_ENV} is not set"
    raise ConfigError(f"{key}={path!r}: no such file (looked for {', '.join(places)}){unset}")


@dataclasses.dataclass
class DataBundle:
    """What a run trains and evaluates on."""

    tables: tuple[TableSpec, ...]
    features: tuple[FeatureSpec, ...]
    packer: BatchPacker
    train_source: Any  # Examples or a generator with batch(index, batch_size)
    eval_batches: list[SparseBatch]
    report: str | None = None  # parse summary of file data

    @property
    def steps_per_epoch(self) -> int | None:
        if isinstance(self.train_source, Examples):
            return math.ceil(len(self.train_source) / self.packer.batch_size)
        return None


def build_data(cfg: RunConfig) -> DataBundle:
    """Read or generate the data and derive the table and feature specs from it."""
    d, dim = cfg.data, cfg.model.embedding_dim
    table_kw = dict(dtype=cfg.model.table_dtype, optimizer=sparse_optimizer(cfg.optimizer))
    eval_b = d.eval_batch_size or d.batch_size
    report = None
    if d.kind in ("synthetic", "behavior"):
        if d.kind == "synthetic":
            gen = sd.SyntheticCriteo(
                max_vocab=d.max_vocab, zipf_exponent=d.zipf, seed=cfg.seed, **d.synthetic_options
            )
            num_dense = gen.num_dense
        else:
            gen = sd.SyntheticBehavior(seed=cfg.seed, **d.synthetic_options)
            num_dense = 0
        tables, features = gen.specs(dim=dim, **table_kw)
        train_source = gen
        eval_packer = BatchPacker(tables, features, batch_size=eval_b, num_dense=num_dense)
        eval_batches = []
        for i in range(d.eval_batches):  # numbered from 2**31 - 1 down: never trained on
            sparse, labels, dense = gen.batch(0x7FFFFFFF - i, eval_b)
            eval_batches.append(eval_packer.pack(sparse, labels=labels, dense=dense))
    else:
        if d.path is None:
            raise ConfigError(f"data.kind={d.kind!r} needs data.path")
        path = resolve_data_path(d.path)
        if d.kind == "criteo":
            examples, rep = sd.read_criteo(path, strict=d.strict)
        else:
            if d.schema is None:
                raise ConfigError("data.kind='delimited' needs data.schema")
            examples, rep = sd.read_delimited(
                path, sd.TableSchema.from_dict(d.schema), strict=d.strict
            )
        report = rep.summary()
        n_train = d.train_rows if d.train_rows is not None else int(0.8 * len(examples))
        if not 0 < n_train < len(examples):
            raise ConfigError(
                f"data.train_rows={n_train} must leave both splits non-empty ({len(examples)} rows)"
            )
        train, held = examples.split(n_train)
        names = train.feature_names
        if d.id_mapping == "vocab":
            mappings = sd.fit_vocab(train, min_count=d.min_count)
        else:
            mappings = {n: sd.HashMapping(buckets=d.hash_buckets) for n in names}
        train, held = train.map_ids(mappings), held.map_ids(mappings)
        tables, features = _file_specs(d, train, sd.vocab_sizes(mappings), dim, table_kw)
        num_dense = train.num_dense
        train_source = train
        eval_packer = BatchPacker(tables, features, batch_size=eval_b, num_dense=num_dense)
        eval_batches = sd.pack_examples(held, eval_packer)
    packer = BatchPacker(tables, features, batch_size=d.batch_size, num_dense=num_dense)
    return DataBundle(tuple(tables), tuple(features), packer, train_source, eval_batches, report)


def _file_specs(d: DataConfig, train: Examples, vocab: dict, dim: int, table_kw: dict):
    """One table per sparse column; multi-hot columns mean-pooled, sequences unpooled,
    each sized by the longest bag in train."""
    schema = sd.TableSchema.from_dict(d.schema) if d.schema else None
    multi = set(getattr(schema, "multi_hot", None) or ())
    seq = set(getattr(schema, "sequence", None) or ())
    tables, features = [], []
    for name in train.feature_names:
        tables.append(TableSpec(name=name, vocab_size=int(vocab[name]), dim=dim, **table_kw))
        longest = int(np.max(train.sparse[name].lengths, initial=1))
        if name in seq:
            features.append(
                FeatureSpec(name=name, table=name, combiner=None, max_ids=max(longest, 1))
            )
        elif name in multi:
            features.append(
                FeatureSpec(name=name, table=name, combiner="mean", max_ids=max(longest, 1))
            )
        else:
            features.append(FeatureSpec(name=name, table=name))
    return tables, features


def build_model(cfg: RunConfig, tables: Sequence[TableSpec], features: Sequence[FeatureSpec]):
    """The configured Flax model over the given specs."""
    m = cfg.model
    cls = MODELS[m.name]
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in m.options.items()}
    if m.name == "dlrm" and "bottom" not in opts:
        opts["bottom"] = (64, m.embedding_dim)
    dtype = None if m.dtype == "float32" else m.dtype
    return cls(
        tables=tuple(tables),
        features=tuple(features),
        dtype=dtype,
        implementation=m.implementation,
        **opts,
    )


def first_train_batch(data: DataBundle) -> SparseBatch:
    """The first training batch, in order (fixes the shapes of a model's init)."""
    with Loader(
        data.train_source,
        data.packer,
        shuffle=False,
        epochs=None if not isinstance(data.train_source, Examples) else 1,
        prefetch=1,
    ) as loader:
        return next(iter(loader))
