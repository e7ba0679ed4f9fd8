"""A run's model from its config: the Flax model over the data's specs
(`build_model`), with the run's embedding initializer and dropout (`configured_model`),
and the options it would ignore on the data (`model_warnings`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..embedding import FeatureSpec, TableSpec
from ..nn import MODELS
from ._config import ConfigError
from ._data import DataBundle
from ._schema import EmbeddingInitConfig, RunConfig

_STACKED_MODELS = ("dlrm", "deepfm", "wide_deep", "dcnv2")
"""Models that stack the pooled embeddings (`[B, F, D]`): one dim for every table."""


def build_model(
    cfg: RunConfig,
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    *,
    dropout: float = 0.0,
):
    """The configured Flax model over the given specs (`dropout`: its rate, see
    `configured_model` for the run's)."""
    m = cfg.model
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in m.options.items()}
    if m.name in _STACKED_MODELS:
        dims = {t.name: t.dim for t in tables}
        pooled = {f.table for f in features if not f.is_sequence}
        odd = sorted(t for t in pooled if dims[t] != m.embedding_dim)
        if odd and m.mixed_dims is None:
            raise ConfigError(
                f"model.name={m.name!r} stacks the embeddings, so every table needs dim "
                f"model.embedding_dim={m.embedding_dim}, but table {odd[0]!r} has dim "
                f"{dims[odd[0]]} (data.features.*.dim); set model.mixed_dims to project "
                f"it (din and two_tower take mixed dims as they are)"
            )
        if m.mixed_dims is not None:
            opts["embedding_dim"] = m.embedding_dim
    cls = MODELS[m.name]
    if m.name == "dlrm" and "bottom" not in opts:  # as _schema.OPTION_DEFAULTS says
        opts["bottom"] = (64, m.embedding_dim)
    dtype = None if m.dtype == "float32" else m.dtype
    return cls(
        tables=tuple(tables),
        features=tuple(features),
        dtype=dtype,
        implementation=m.implementation,
        dropout=dropout,
        **opts,
    )


def init_tables(cfg: RunConfig, tables: Sequence[TableSpec]) -> tuple[TableSpec, ...]:
    """`tables` with the initializer `model.embedding_init` sets (unset: the tables keep
    the ones they were built with)."""
    if cfg.model.embedding_init == EmbeddingInitConfig():
        return tuple(tables)
    init = cfg.model.embedding_init.initializer()
    return tuple(dataclasses.replace(t, initializer=init) for t in tables)


def configured_model(cfg: RunConfig, tables: Sequence[TableSpec], features: Sequence[FeatureSpec]):
    """The model a run trains over `tables` (placed or not, see `runner._plan`) and
    `features`: `build_model`'s, with `model.embedding_init` on every table and
    `model.dropout`."""
    return build_model(cfg, init_tables(cfg, tables), features, dropout=cfg.model.dropout)


def model_warnings(cfg: RunConfig, data: DataBundle) -> list[str]:
    """Options the configured model will ignore on `data` (one line each, for the log):
    DLRM's `bottom` MLP reads the dense features, so without any it is unused."""
    bottom = cfg.model.options.get("bottom")
    if cfg.model.name == "dlrm" and bottom is not None and data.packer.num_dense == 0:
        return [
            f"model.options.bottom={list(bottom)} is ignored: the data has no dense "
            f"columns, which DLRM's bottom MLP reads (the top MLP takes the embeddings' "
            f"dot products alone, or the one embedding itself)"
        ]
    return []
