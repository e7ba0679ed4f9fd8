"""A run's data from its config (`build_data`): read or generated, split, labeled,
joined, capped, id-mapped, with the table and feature specs derived from it, packed into
batches (in many processes, each process's share of every global batch).

File data goes through these steps (each configured in `data`, see `DataConfig`):

1. files: `train` / `eval` / `test` (a path, glob or list each; or `path`), relative
   paths looked up in the working directory, then in `$SPARSEJAX_DATA_DIR`;
2. read with the format's reader (labels mapped and checked as `data.label` says);
3. split one source into train / eval / test (`data.split`, or the old `train_rows`);
4. column transforms on raw ids (`sparsejax.data.ColumnTransform`): indicator bags,
   side-table joins, `max_ids` caps;
5. id mappings fitted on train, one per table (columns sharing a table share it); a
   dynamic table's columns keep their raw ids as int64 keys (`RawIdMapping`);
6. one `TableSpec` per table and one `FeatureSpec` per sparse column, with the `tables`
   section's options (dim, hash buckets, dynamic vocabularies, device caches sized by a
   fraction of the distinct train ids; `apply_tables`).

Files and reading are `_read.py`; the `tables` section's options `_tables.py`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from typing import Any

import jax
import numpy as np

from .. import data as sd
from ..data import BatchPacker, Examples, Loader, SparseBatch
from ..embedding import FeatureSpec, TableSpec
from ._config import ConfigError
from ._data_config import (
    FILE_KINDS,
    DataConfig,
    FeatureConfig,
    _schema_or_error,
    _table_of,
    _table_options,
    _unknown,
)
from ._optim import sparse_optimizer
from ._read import (
    _dense_names,
    _key_text,
    _label_rule,
    _read_schema,
    _read_side_tables,
    _read_split,
    _read_splits,
    resolve_data_dir,
    resolve_files,
)
from ._schema import RunConfig
from ._tables import (
    _hash_buckets,
    _table_names_check,
    _with_dim,
    apply_tables,
    is_dynamic,
    table_dim,
)

DATASET = "dataset.json"
"""The description of a `sparsejax data` directory (features, tables, splits)."""

# ---------------------------------------------------------------------------------------
# Many processes: each packs its share of every global batch


def _rows(col, lo: int, hi: int):
    """Rows [lo, hi) of one feature of a host batch (`JaggedIds` or ids[B] / ids[B, k])."""
    if not isinstance(col, sd.JaggedIds):
        return np.asarray(col)[lo:hi]
    lengths = np.asarray(col.lengths)
    off = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=off[1:])
    a, b = int(off[lo]), int(off[hi])
    weights = None if col.weights is None else np.asarray(col.weights)[a:b]
    return sd.JaggedIds(lengths=lengths[lo:hi], values=np.asarray(col.values)[a:b], weights=weights)


class ProcessSharePacker:
    """A `BatchPacker` of the global batch that packs process `rank`'s share of it.

    `batch_size` is the global batch size B, so a `Loader` (or `pack_examples`) reads
    exactly the examples one process would; `pack` keeps rows `[rank * B / P,
    (rank + 1) * B / P)` of them and packs those into a batch of B / P. Put side by
    side in process order, the P shares are the single-process batch, padding included
    (a short last batch leaves the high processes' rows padded). Every other attribute
    is the global packer's.
    """

    def __init__(self, packer: BatchPacker, rank: int, num_processes: int):
        if packer.batch_size % num_processes:
            raise ValueError(
                f"a batch of {packer.batch_size} does not split over {num_processes} processes"
            )
        self.whole = packer
        self.rank, self.num_processes = rank, num_processes
        self.local = copy.copy(packer)
        self.local.batch_size = packer.batch_size // num_processes

    @property
    def batch_size(self) -> int:
        return self.whole.batch_size

    def __getattr__(self, name: str):
        return getattr(self.whole, name)

    def share_of(self, n: int) -> tuple[int, int]:
        """This process's rows `[lo, hi)` of a global batch of `n` examples."""
        b = self.local.batch_size
        return min(self.rank * b, n), min((self.rank + 1) * b, n)

    def pack(self, sparse, *, labels, dense=None, mask=None, first_example: int = 0):
        lo, hi = self.share_of(int(np.shape(labels)[0]))
        return self.local.pack(
            {k: _rows(v, lo, hi) for k, v in sparse.items()},
            labels=np.asarray(labels)[lo:hi],
            dense=None if dense is None else np.asarray(dense)[lo:hi],
            mask=None if mask is None else np.asarray(mask)[lo:hi],
            first_example=first_example + lo,
        )


def process_share() -> tuple[int, int, int]:
    """(this process's index, processes, local devices) of the job (1 process: (0, 1, n))."""
    return jax.process_index(), jax.process_count(), jax.local_device_count()


def _packers(
    d: DataConfig, tables, features, *, num_dense: int = 0, sharded_source: bool = False
) -> tuple[Any, Any]:
    """(train packer, eval packer). In many processes they pack this process's share of
    each global batch (`ProcessSharePacker`); `data.batch_size` and
    `data.eval_batch_size` stay global and must divide by processes x local devices.
    `sharded_source`: the train source already gives each process its own examples
    (`FileSource(rank=...)`): its packer takes B / P of them."""
    eval_b = d.eval_batch_size or d.batch_size
    rank, count, local = process_share()
    if count > 1:
        for key, b in (("data.batch_size", d.batch_size), ("data.eval_batch_size", eval_b)):
            if b % (count * local):
                raise ConfigError(
                    f"{key}={b} (the global batch) does not divide over {count} processes x "
                    f"{local} devices = {count * local}; use a multiple of {count * local}"
                )
    packer = BatchPacker(tables, features, batch_size=d.batch_size, num_dense=num_dense)
    eval_packer = BatchPacker(tables, features, batch_size=eval_b, num_dense=num_dense)
    if count == 1:
        return packer, eval_packer
    eval_packer = ProcessSharePacker(eval_packer, rank, count)
    if sharded_source:
        packer = ProcessSharePacker(packer, rank, count).local
    else:
        packer = ProcessSharePacker(packer, rank, count)
    return packer, eval_packer


# ---------------------------------------------------------------------------------------
# The data bundle


@dataclasses.dataclass
class DataBundle:
    """What a run trains and evaluates on."""

    tables: tuple[TableSpec, ...]
    features: tuple[FeatureSpec, ...]
    packer: BatchPacker
    train_source: Any  # Examples or a generator with batch(index, batch_size)
    eval_batches: list[SparseBatch]
    report: str | None = None  # parse summary of file data
    test_batches: list[SparseBatch] | None = None
    """The test split's batches (file data with a test split), never used in training."""
    eval_examples: Examples | None = None
    """File data: the eval split's examples (ids mapped), in batch order."""
    test_examples: Examples | None = None
    mappings: dict | None = None
    """File data: the id mapping of each sparse feature (shared by a table's features)."""
    transform: Any = None
    """File data: the `sparsejax.data.ColumnTransform` applied to raw rows (for readers
    that stream chunks)."""
    ranking: dict | None = None
    """kind=events: the candidate sets (`sparsejax.data.CandidateSets`) of the "eval" and
    "test" splits (held-out item + `eval_negatives` per user), for HR@k / NDCG@k
    (`sparsejax.train.evaluate_ranking` with `packer`); `eval_batches` hold the eval
    sets' rows as binary examples (AUC, logloss)."""
    sequences: Any = None
    """kind=events: the `sparsejax.data.SequenceData` (id maps, report)."""

    @property
    def steps_per_epoch(self) -> int | None:
        if isinstance(self.train_source, Examples | sd.PreparedData):
            return math.ceil(len(self.train_source) / self.packer.batch_size)
        return None


def build_data(cfg: RunConfig) -> DataBundle:
    """Read or generate the data and derive the table and feature specs from it."""
    d, dim = cfg.data, cfg.model.embedding_dim
    table_kw = dict(dtype=cfg.model.table_dtype, optimizer=sparse_optimizer(cfg.optimizer))
    eval_b = d.eval_batch_size or d.batch_size
    if d.kind not in (*FILE_KINDS, "prepared"):
        if d.kind == "synthetic":
            gen = sd.SyntheticCriteo(
                max_vocab=d.max_vocab, zipf_exponent=d.zipf, seed=cfg.seed, **d.synthetic_options
            )
            num_dense = gen.num_dense
        else:
            gen = sd.SyntheticBehavior(seed=cfg.seed, **d.synthetic_options)
            num_dense = 0
        tables, features = gen.specs(dim=dim, **table_kw)
        tables = [_with_dim(cfg, t) for t in tables]
        tables, note = apply_tables(cfg, tables, features, vocab_rows=getattr(gen, "vocab", None))
        packer, eval_packer = _packers(d, tables, features, num_dense=num_dense)
        eval_batches = []
        for i in range(d.eval_batches):  # numbered from 2**31 - 1 down: never trained on
            sparse, labels, dense = gen.batch(0x7FFFFFFF - i, eval_b)
            eval_batches.append(eval_packer.pack(sparse, labels=labels, dense=dense))
        return DataBundle(tuple(tables), tuple(features), packer, gen, eval_batches, report=note)
    if d.kind == "events":
        return _build_events(cfg, table_kw)
    if d.kind == "prepared":
        return _build_prepared(cfg, table_kw)
    return _build_file_data(cfg, table_kw)


def _build_events(cfg: RunConfig, table_kw: dict) -> DataBundle:
    """kind=events: the log read and made into sequence examples (`load_sequences`):
    train examples (positives and sampled negatives with their histories), eval and test
    candidate sets; tables user and item, the history reading the item table."""
    d = cfg.data
    _, count, _ = process_share()
    if count > 1:  # score_candidates reads whole eval outputs on the host
        raise ConfigError(
            f"data.kind='events' (HR@k/NDCG@k over candidate sets) trains in one process, "
            f"not {count}; use sparsejax train"
        )
    key = "data.train" if d.train is not None else "data.path"
    source = d.train if d.train is not None else d.path
    if source is None:
        raise ConfigError("data.kind='events' needs data.train (the event log)")
    files = resolve_files(source, key)
    seq, rep = sd.load_sequences(files, d.events, strict=d.strict)
    dims = _table_options(
        {
            c: fc if c != "history" else dataclasses.replace(fc, table="item")
            for c, fc in d.features.items()
        }
    )
    tables, features = seq.specs(dim=cfg.model.embedding_dim, **table_kw)
    tables = [_with_dim(cfg, t, dims.get(t.name, {}).get("dim")) for t in tables]
    _table_names_check(cfg, tables)
    packer, eval_packer = _packers(d, tables, features)
    sets = {"eval": seq.valid, "test": seq.test}
    if cfg.eval_users is not None and seq.valid is not None:  # a sample of the eval users
        sets["eval"] = seq.valid.sample(cfg.eval_users, seed=cfg.seed)
    examples = {k: None if v is None else v.to_examples() for k, v in sets.items()}
    if examples["eval"] is None or len(examples["eval"]) == 0:
        raise ConfigError(
            "data.events gives no validation users (split: time needs valid_time); the run "
            f"evaluates on them: {seq.report.summary()}"
        )
    return DataBundle(
        tuple(tables),
        tuple(features),
        packer,
        seq.train,
        sd.pack_examples(examples["eval"], eval_packer),
        report=f"{rep.summary()}; {seq.report.summary()}",
        test_batches=None
        if examples["test"] is None
        else sd.pack_examples(examples["test"], eval_packer),
        eval_examples=examples["eval"],
        test_examples=examples["test"],
        ranking={k: v for k, v in sets.items() if v is not None},
        sequences=seq,
    )


def _build_file_data(cfg: RunConfig, table_kw: dict) -> DataBundle:
    d = cfg.data
    schema, drop = _read_schema(d)
    main_schema = _schema_or_error(d.schema, "data.schema") if d.schema is not None else None
    joins, side_reports = _read_side_tables(d, main_schema)
    if d.stream:
        return _build_stream(cfg, table_kw, schema, drop, joins, side_reports)
    splits = _read_splits(cfg, schema, drop)
    caps = {c: fc.max_ids for c, fc in d.features.items() if fc.max_ids is not None}
    transform = sd.ColumnTransform(
        splits.dense_names,
        indicator_bags=d.indicator_bags,
        joins=joins,
        drop=drop,
        max_ids=caps,
    )
    parts = {"train": splits.train, "eval": splits.eval, "test": splits.test}
    try:
        parts = {k: None if v is None else transform(v) for k, v in parts.items()}
    except sd.JoinKeyError as e:
        text = _key_text(d, schema, e.key, e.raw_key) if schema is not None else e.raw_key
        raise sd.JoinKeyError(
            f"data.joins: {e.source} has no row with {e.key} = {text} (on_missing: error;"
            f" on_missing: default gives such rows the missing-id row)",
            source=e.source,
            key=e.key,
            raw_key=e.raw_key,
            row=e.row,
        ) from None
    train = parts["train"]
    for col in d.features:
        if col not in train.sparse:
            raise _unknown(f"data.features.{col}", col, train.sparse)
    mappings = _id_mappings(cfg, train)
    mapped = {k: None if v is None else v.map_ids(mappings) for k, v in parts.items()}
    present = [v for v in mapped.values() if v is not None]
    tables, features, note = _file_specs(cfg, mapped["train"], present, mappings, table_kw)
    num_dense = mapped["train"].num_dense
    packer, eval_packer = _packers(d, tables, features, num_dense=num_dense)
    reports = [r.summary() for r in (*splits.reports, *side_reports)]
    if transform.report.summary():
        reports.append(transform.report.summary())
    if note:
        reports.append(note)
    sizes = f"splits: train {len(mapped['train']):,}, eval {len(mapped['eval']):,}" + (
        f", test {len(mapped['test']):,}" if mapped["test"] is not None else ""
    )
    return DataBundle(
        tuple(tables),
        tuple(features),
        packer,
        mapped["train"],
        sd.pack_examples(mapped["eval"], eval_packer),
        report="; ".join([*reports, sizes]),
        test_batches=None
        if mapped["test"] is None
        else sd.pack_examples(mapped["test"], eval_packer),
        eval_examples=mapped["eval"],
        test_examples=mapped["test"],
        mappings=mappings,
        transform=transform,
    )


def _build_stream(cfg: RunConfig, table_kw: dict, schema, drop, joins, side_reports):
    """data.stream: the eval (and test) files in memory, the train files a
    `sparsejax.data.FileSource` whose chunks get the column transforms and the hash
    mappings in the loader's thread. A bag's `max_ids` defaults to the longest in the
    eval split; longer train rows keep their last ids, counted in `transform.report`."""
    d = cfg.data
    source = d.train if d.train is not None else d.path
    key = "data.train" if d.train is not None else "data.path"
    if source is None:
        raise ConfigError(f"data.kind={d.kind!r} needs data.train (the files to stream)")
    train_files = resolve_files(source, key)
    label = _label_rule(d)
    eval_files = resolve_files(d.eval, "data.eval")
    ev, reports = _read_split(d, eval_files, schema, label, "data.eval", train_files)
    test = None
    if d.test is not None:
        test_files = resolve_files(d.test, "data.test")
        test, r = _read_split(d, test_files, schema, label, "data.test", train_files)
        reports += r
    dense_names = _dense_names(d, schema, ev)
    plain = sd.ColumnTransform(dense_names, indicator_bags=d.indicator_bags, joins=joins, drop=drop)
    held = [plain(ev)] + ([] if test is None else [plain(test)])
    roles = _roles(d)
    caps = {}
    for name in held[0].feature_names:
        fc = d.features.get(name) or FeatureConfig()
        longest = max(int(np.max(p.sparse[name].lengths, initial=1)) for p in held)
        if fc.max_ids is not None or roles.get(name, "bag" if longest > 1 else "one") != "one":
            caps[name] = fc.max_ids or longest
    transform = sd.ColumnTransform(
        dense_names, indicator_bags=d.indicator_bags, joins=joins, drop=drop, max_ids=caps
    )
    mappings = _id_mappings(cfg, held[0])
    parts = [transform(p).map_ids(mappings) for p in (ev, *([] if test is None else [test]))]

    def chunk(ex: Examples) -> Examples:
        return transform(ex).map_ids(mappings)

    kw = {"schema": schema, "label": label, "strict": d.strict, "key": key}
    if d.field_map:
        kw["field_map"] = dict(d.field_map)
    train_source = sd.FileSource(
        train_files,
        format=d.kind,
        transform=chunk,
        rank=jax.process_index(),
        num_processes=jax.process_count(),
        **kw,
    )
    tables, features, note = _file_specs(
        cfg, parts[0], parts, mappings, table_kw, max_ids=caps, train_known=False
    )
    num_dense = parts[0].num_dense
    packer, eval_packer = _packers(d, tables, features, num_dense=num_dense, sharded_source=True)
    summaries = [r.summary() for r in (*reports, *side_reports)]
    summaries.append(f"train: streaming {train_source!r}")
    if note:
        summaries.append(note)
    return DataBundle(
        tuple(tables),
        tuple(features),
        packer,
        train_source,
        sd.pack_examples(parts[0], eval_packer),
        report="; ".join(summaries),
        test_batches=None if test is None else sd.pack_examples(parts[1], eval_packer),
        eval_examples=parts[0],
        test_examples=None if test is None else parts[1],
        mappings=mappings,
        transform=transform,
    )


def _id_mappings(cfg: RunConfig, train: Examples) -> dict:
    """One id mapping per table, fitted on the train values of all its columns: raw
    keys for a dynamic table, hash buckets or a vocabulary for a static one."""
    d = cfg.data
    opts = _table_options(d.features)
    by_table: dict[str, list[str]] = {}
    for name in train.feature_names:
        by_table.setdefault(_table_of(d, name), []).append(name)
    mappings = {}
    for table, cols in by_table.items():
        o = opts.get(table, {})
        buckets = _hash_buckets(cfg, table, o.get("hash_buckets"))
        if is_dynamic(cfg, table):
            m = sd.RawIdMapping()
        elif buckets is not None or d.id_mapping == "hash":
            m = sd.HashMapping(buckets=buckets or d.hash_buckets)
        else:
            values = np.concatenate([np.asarray(train.sparse[c].values) for c in cols])
            m = sd.VocabMapping.fit(values, o.get("min_count") or d.min_count)
        for c in cols:
            mappings[c] = m
    return mappings


def _roles(d: DataConfig) -> dict[str, str]:
    """Role of each named sparse column: "one", "bag" or "sequence"."""
    roles = {}
    schemas = [d.schema] + [j.schema for j in d.joins]
    for s in schemas:
        if not s:
            continue
        for c in s.get("categorical", ()):
            roles[c] = "one"
        for c in s.get("multi_hot", ()):
            roles[c] = "bag"
        for c in s.get("sequence", ()):
            roles[c] = "sequence"
    for bag in d.indicator_bags:
        roles[bag] = "bag"
    for j in d.joins:
        for bag in j.indicator_bags:
            roles[bag] = "bag"
    return roles


def _file_specs(
    cfg: RunConfig,
    train: Examples,
    parts: list[Examples],
    mappings,
    table_kw,
    max_ids=None,
    *,
    train_known: bool = True,
):
    """One table per table name (a column's own, or the one it shares) and one feature
    per sparse column: one-id columns as they are, bags mean-pooled (weighted bags
    summed), sequences unpooled (or as `data.features` says), each bag sized by its
    `max_ids` or the longest in the data; the `tables` section applied (`apply_tables`;
    `train` holds the train split's mapped ids when `train_known`). Returns (tables,
    features, a note for the run's log or None)."""
    d = cfg.data
    opts = _table_options(d.features)
    roles = _roles(d)
    tables: dict[str, TableSpec] = {}
    features = []
    for name in train.feature_names:
        t = _table_of(d, name)
        if t not in tables:
            vocab = mappings[name].vocab_size
            tables[t] = TableSpec(
                name=t,
                vocab_size=1 if vocab is None else int(vocab),  # dynamic: apply_tables
                dim=table_dim(cfg, t, opts.get(t, {}).get("dim")),
                **table_kw,
            )
        fc = d.features.get(name) or FeatureConfig()
        longest = max(int(np.max(p.sparse[name].lengths, initial=1)) for p in parts)
        weighted = train.sparse[name].weights is not None
        role = roles.get(name) or ("one" if longest <= 1 else "bag")
        # a weighted bag (libSVM idx:val) is summed: the weights carry the values
        combiner = {"one": "sum", "bag": "sum" if weighted else "mean", "sequence": None}[role]
        if fc.combiner is not None:
            combiner = None if fc.combiner == "sequence" else fc.combiner
        cap = fc.max_ids or (max_ids or {}).get(name)
        max_ids_ = cap or max(longest, 1)
        features.append(
            FeatureSpec(name=name, table=t, combiner=combiner, max_ids=max_ids_, weighted=weighted)
        )
    min_counts = {t: opts.get(t, {}).get("min_count") or d.min_count for t in tables}
    specs, note = apply_tables(
        cfg,
        list(tables.values()),
        features,
        train=train if train_known else None,
        min_counts=min_counts,
    )
    return specs, features, note


def _build_prepared(cfg: RunConfig, table_kw: dict) -> DataBundle:
    """data.kind=prepared: the splits `sparsejax data` wrote under `data.path`, with the
    config's `tables` section applied to the tables they were written for."""
    d = cfg.data
    if d.path is None:
        raise ConfigError("data.kind='prepared' needs data.path (a `sparsejax data` directory)")
    root = resolve_data_dir(d.path, "data.path")
    if not os.path.isfile(os.path.join(root, DATASET)):
        raise ConfigError(
            f"data.path={d.path!r}: no prepared data there (no {DATASET}); write it with "
            f"`sparsejax data CONFIG --out DIR`"
        )
    try:
        with open(os.path.join(root, DATASET)) as fh:
            info = json.load(fh)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{os.path.join(root, DATASET)}: unreadable: {e}") from None
    features = [FeatureSpec(**f) for f in info["features"]]
    train = sd.PreparedData(os.path.join(root, "train"))
    tables = [
        TableSpec(
            name=name,
            vocab_size=t["rows"] or 1,  # dynamic: apply_tables makes it so again
            dim=table_dim(cfg, name, t["dim"]),
            **table_kw,
        )
        for name, t in info["tables"].items()
    ]
    tables, note = apply_tables(cfg, tables, features, train=train)
    packer, eval_packer = _packers(d, tables, features, num_dense=info["num_dense"])
    train.check(packer)
    held = {}
    for split in ("eval", "test"):
        if split in info["splits"]:
            part = sd.PreparedData(os.path.join(root, split))
            part.check(eval_packer)
            sparse, labels, dense = part.take(np.arange(len(part)))
            held[split] = Examples(labels=labels, dense=dense, sparse=sparse)
    reports = [f"prepared {root}: train {len(train):,}, eval {len(held['eval']):,}"]
    if note:
        reports.append(note)
    return DataBundle(
        tuple(tables),
        tuple(features),
        packer,
        train,
        sd.pack_examples(held["eval"], eval_packer),
        report="; ".join(reports),
        test_batches=None if "test" not in held else sd.pack_examples(held["test"], eval_packer),
        eval_examples=held["eval"],
        test_examples=held.get("test"),
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
