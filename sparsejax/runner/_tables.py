"""A run's table specs from its config: each table's dim (`table_dim`, mixed dims), and
the `tables` section applied to the specs the data gives (`apply_tables`: composition,
dynamic vocabularies, device caches sized by a fraction of the distinct train ids)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from ..data import Examples
from ..embedding import (
    MISSING_KEY,
    Composition,
    FeatureSpec,
    HostCache,
    TableSpec,
    stored_values,
    uniform_init,
)
from ._config import ConfigError
from ._schema import RunConfig
from ._table_config import _dynamic_vocab, _unknown_table, resolve_table


def table_dim(cfg: RunConfig, name: str, data_dim: int | None = None) -> int:
    """Row width of table `name`: `tables.<name>.dim`, else the one its columns set
    (`data.features.<column>.dim`, `data_dim`), else `tables."*".dim`, else
    `model.embedding_dim`."""
    own, star = cfg.tables.get(name), cfg.tables.get("*")
    for v in (own and own.dim, data_dim, star and star.dim):
        if v:
            return v
    return cfg.model.embedding_dim


def _hash_buckets(cfg: RunConfig, name: str, data_buckets: int | None) -> int | None:
    """Hash buckets of static table `name` (`tables.<name>.vocab_size`, else its
    columns' `hash_buckets`, else `tables."*".vocab_size`), or None (`data.id_mapping`)."""
    tc = resolve_table(cfg.tables, name)
    own = cfg.tables.get(name)
    if tc.dynamic:
        return None
    for v in (own and own.vocab_size, data_buckets, tc.vocab_size):
        if v:
            return v
    return None


def is_dynamic(cfg: RunConfig, name: str) -> bool:
    """Whether the `tables` section makes table `name` dynamic."""
    return bool(cfg.tables) and bool(resolve_table(cfg.tables, name).dynamic)


def _table_names_check(cfg: RunConfig, tables: Sequence[TableSpec]) -> None:
    """Every table the `tables` section names exists (the data's own tables)."""
    names = {t.name for t in tables}
    for name in cfg.tables:
        if name != "*" and name not in names:
            raise _unknown_table(name, names)


def _batch_ids(cfg: RunConfig, features: Sequence[FeatureSpec], table: str) -> int:
    """Ids one batch (train or eval) can hold for `table`: a cache this size or the
    table's distinct ids, whichever is fewer, fits every batch."""
    b = max(cfg.data.batch_size, cfg.data.eval_batch_size or 0)
    return sum(f.capacity_for(b) for f in features if f.table == table)


def _distinct(values: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids, their counts) of a table's columns."""
    if not values:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.unique(np.concatenate([np.asarray(v) for v in values]), return_counts=True)


def composed_table(cfg: RunConfig, spec: TableSpec) -> TableSpec:
    """`spec` with `tables.<name>.compose` applied (a ConfigError naming the key when
    its parts would not fit in the full table, or the options are inconsistent)."""
    tc = resolve_table(cfg.tables, spec.name)
    if tc.compose is None or spec.is_tiered:
        return spec
    opts = {k: v for k, v in dataclasses.asdict(tc.compose).items() if v is not None}
    own = cfg.tables.get(spec.name)
    mine = own is not None and own.compose is not None
    try:
        comp = Composition(**opts)
        if not mine:  # from "*": a table it cannot shrink stays whole
            try:
                smaller = stored_values(spec, comp)
            except ValueError:
                return spec
            if smaller >= spec.vocab_size * spec.dim:
                return spec
        return dataclasses.replace(spec, compose=comp)
    except ValueError as e:
        raise ConfigError(f"tables.{spec.name if mine else '*'}.compose: {e}") from None


def tiered_options(
    cfg: RunConfig,
    spec: TableSpec,
    features: Sequence[FeatureSpec],
    *,
    train_ids: Sequence[np.ndarray] | None = None,
    vocab_rows: int | None = None,
    min_count: int = 1,
) -> tuple[TableSpec, str | None]:
    """`spec` (a static table built from the data) with the `tables` section's dynamic
    and cache options applied, and the initializer scale of a tiered table. `train_ids`: the
    table's train ids (after the id mapping; raw keys for a dynamic table) when the data
    is in memory; `vocab_rows`: the rows of the data's static table (generated data).
    Returns (spec, a short note for the run's log or None)."""
    if not cfg.tables:
        return spec, None
    name = spec.name
    tc = resolve_table(cfg.tables, name)
    kw: dict = {}
    if not tc.dynamic and not tc.cache_rows:
        return spec, None
    uniq = counts = None
    if train_ids is not None:
        uniq, counts = _distinct(train_ids)
    n_init = spec.vocab_size
    if tc.dynamic:
        kw["dynamic"] = _dynamic_vocab(tc, name)
        kw["vocab_size"] = None
        if uniq is not None:  # the rows a vocabulary of the train ids would have
            n_init = int(((counts >= min_count) & (uniq != MISSING_KEY)).sum()) + 1
        elif vocab_rows is not None:
            n_init = vocab_rows
        else:
            n_init = tc.max_rows or (tc.cache_rows if isinstance(tc.cache_rows, int) else None)
    note = None
    if tc.cache_rows:
        rows = tc.cache_rows
        if isinstance(rows, float):
            distinct = int(uniq.shape[0])
            rows = max(math.ceil(rows * distinct), min(distinct, _batch_ids(cfg, features, name)))
            rows = max(1, min(rows, tc.max_rows or rows))
            note = f"{name} {rows:,}/{distinct:,}"
        disk_dir = tc.disk_dir
        if disk_dir is None and tc.ram_bytes is not None:
            disk_dir = "host_rows"
        if disk_dir is not None:
            disk_dir = os.path.join(os.path.abspath(cfg.run_dir), disk_dir)
        cache = {"policy": tc.cache_policy, "ram_bytes": tc.ram_bytes, "disk_dir": disk_dir}
        kw["cache"] = HostCache(rows=rows, **{k: v for k, v in cache.items() if v is not None})
        if n_init is None:
            n_init = rows
    if spec.initializer == uniform_init() and n_init:  # the scale of the static table
        kw["initializer"] = uniform_init(math.sqrt(1.0 / n_init))
    try:
        return dataclasses.replace(spec, **kw), note
    except (TypeError, ValueError) as e:
        raise ConfigError(f"tables.{name}: {e}") from None


def _with_dim(cfg: RunConfig, spec: TableSpec, data_dim: int | None = None) -> TableSpec:
    dim = table_dim(cfg, spec.name, data_dim)
    return spec if dim == spec.dim else dataclasses.replace(spec, dim=dim)


def mixed_dims(cfg: RunConfig, tables: Sequence[TableSpec]) -> list[TableSpec]:
    """`tables` with `model.mixed_dims.alpha` applied: each static table without a dim
    of its own (`tables.<name>.dim`, `data.features.<column>.dim`) gets
    `embedding_dim * (V_min / V) ** alpha`, a multiple of `multiple` within
    [`min_dim`, `embedding_dim`]."""
    md = cfg.model.mixed_dims
    if md is None or md.alpha is None:
        return list(tables)
    d = cfg.model.embedding_dim
    own = {n for n, tc in cfg.tables.items() if tc.dim is not None}
    sized = {t.name for t in tables if t.vocab_size is not None and t.dim == d} - own
    if not sized:
        return list(tables)
    v_min = min(t.vocab_size for t in tables if t.vocab_size is not None)
    out = []
    for t in tables:
        if t.name in sized:
            dim = d * (v_min / t.vocab_size) ** md.alpha
            dim = md.multiple * math.ceil(dim / md.multiple)
            t = dataclasses.replace(t, dim=int(min(d, max(md.min_dim, dim))))
        out.append(t)
    return out


def apply_tables(
    cfg: RunConfig,
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    *,
    train: Examples | None = None,
    vocab_rows: Mapping[str, int] | None = None,
    min_counts: Mapping[str, int] | None = None,
) -> tuple[list[TableSpec], str | None]:
    """The data's table specs with the `tables` section's dynamic and cache options
    (`tiered_options`): `train` holds the train split's mapped ids (file data in memory),
    `vocab_rows` the generator's rows per table. Returns (tables, a note for the run's
    log: the tiered tables and their cache rows, or None)."""
    tables = mixed_dims(cfg, tables)
    if not cfg.tables:
        return list(tables), None
    _table_names_check(cfg, tables)
    cols: dict[str, list[str]] = {}
    for f in features:
        cols.setdefault(f.table, []).append(f.name)
    out, notes, dynamic, cached = [], [], 0, 0
    for t in tables:
        t = composed_table(cfg, t)
        ids = None if train is None else [train.sparse[c].values for c in cols.get(t.name, ())]
        spec, note = tiered_options(
            cfg,
            t,
            features,
            train_ids=ids,
            vocab_rows=None if vocab_rows is None else vocab_rows.get(t.name),
            min_count=(min_counts or {}).get(t.name, 1),
        )
        out.append(spec)
        dynamic += spec.dynamic is not None
        cached += spec.cache is not None
        if note:
            notes.append(note)
    lines = []
    composed = [t for t in out if t.compose is not None]
    if composed:
        full = sum(t.vocab_size * t.dim for t in out if not t.is_tiered)
        stored = sum(stored_values(t) for t in out if not t.is_tiered)
        kinds = ", ".join(sorted({t.compose.kind for t in composed}))
        lines.append(
            f"tables: {len(composed)} composed ({kinds}): static tables store {stored:,} "
            f"values, {100 * stored / full:.1f}% of {full:,} whole"
        )
    if dynamic or cached:
        text = f"tables: {dynamic} dynamic, {cached} with a device cache"
        if notes:
            text += " (cache rows/distinct train ids: " + ", ".join(notes) + ")"
        lines.append(text)
    return out, "; ".join(lines) or None
