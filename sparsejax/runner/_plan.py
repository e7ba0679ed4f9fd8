"""The run's table plan: the devices a run trains on, its ("data", "model") mesh, and
each table's placement on it (`sparsejax.sharding.plan_tables`), for `build_trainer` (at
the start of a run, printed through the run's log) and `sparsejax plan CONFIG` (without
training, for this machine or for a mesh described by its size).

Placement is a function of the table specs: `place_tables` gives the specs with their
placements (and the mesh), and the model is built over them.

A run shards its tables when it has more than one device (`sharding.devices`; on CPU,
one device per process unless set or given by `sparsejax launch --devices-per-process`)
or a table is pinned (`tables.<name>.placement`); otherwise every table keeps the
single-device store (placement "device").
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..data import SyntheticCriteo
from ..embedding import FeatureSpec, TableSpec, available_memory, stored_values
from ..nn import MODELS, DeepFM, WideAndDeep, linear_specs
from ..sharding import ENV_LOCAL_DEVICES, Plan, TableShape, make_mesh, plan_tables
from ._config import ConfigError
from ._data import build_data
from ._model import configured_model
from ._optim import sparse_optimizer
from ._options import parse_bytes
from ._schema import RunConfig, load_config
from ._table_config import resolve_table
from ._tables import _with_dim, apply_tables

_INT32_ROWS = 2**31 - 2
"""Rows of the static stand-in of a dynamic table of synthetic raw ids (as
`SyntheticCriteo.specs`)."""


def run_devices(cfg: RunConfig) -> list[jax.Device]:
    """The devices a run of `cfg` trains on, in process order: `sharding.devices` of
    them (the same number from each process), else every device, except on CPU one per
    process (CPU devices of one process share its memory and cores) unless
    `SPARSEJAX_LOCAL_DEVICES` (`sparsejax launch --devices-per-process`) asked for them."""
    by_process: dict[int, list] = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(d.process_index, []).append(d)
    procs = len(by_process)
    want = cfg.sharding.devices
    if want is None:
        one = jax.devices()[0].platform == "cpu" and not os.environ.get(ENV_LOCAL_DEVICES)
        return [d for ds in by_process.values() for d in (ds[:1] if one else ds)]
    have = min(len(ds) for ds in by_process.values())
    if want % procs or want // procs > have:
        raise ConfigError(
            f"sharding.devices={want}: "
            + (f"{procs} processes have" if procs > 1 else "the process has")
            + f" {have} device{'s' * (have != 1)}"
            + (f" each; give a multiple of {procs} up to {have * procs}" if procs > 1 else "")
        )
    return [d for ds in by_process.values() for d in ds[: want // procs]]


def pinned_placements(cfg: RunConfig, names: Sequence[str]) -> dict[str, str]:
    """`{table: placement}` of the tables `tables.<name>.placement` (or `"*"`) pins."""
    if not cfg.tables:
        return {}
    out = {}
    for name in names:
        p = resolve_table(cfg.tables, name).placement
        if p not in (None, "auto"):
            out[name] = p
    return out


def planned_tables(
    cfg: RunConfig, tables: Sequence[TableSpec], features: Sequence[FeatureSpec]
) -> tuple[list, list, dict[str, str]]:
    """Every table and feature of `cfg`'s model over `tables` and `features` (each
    embedding layer's), and `{table: leader}` of the tables placed with another: DeepFM's
    and Wide & Deep's 1-dim first-order tables (`linear_specs`) take their table's
    placement."""
    # a composed table is planned as the memory its parts take (they share its placement)
    planned = [
        t if t.compose is None
        else dataclasses.replace(t, vocab_size=-(-stored_values(t) // t.dim), compose=None)
        for t in tables
    ]  # fmt: skip
    features = list(features)
    follow: dict[str, str] = {}
    if issubclass(MODELS[cfg.model.name], (DeepFM, WideAndDeep)):
        lin_tables, lin_features = linear_specs(tables, features)
        by_name = {f"{t.name}_linear": t.name for t in tables}
        follow = {t.name: by_name[t.name] for t in lin_tables}
        planned += lin_tables
        features += lin_features
    return planned, features, follow


def memory_per_device(cfg: RunConfig, devices: Sequence[jax.Device], given=None) -> int:
    """Bytes of one device for the plan: `given` (e.g. "80GB", from `--device-memory`),
    else `sharding.device_memory`, else measured: the least free memory of this
    process's `devices` (CPU: the host's available memory shared among them), the least
    over all processes (every process must make the same plan)."""
    if given is not None:
        return parse_bytes(given, "--device-memory")
    if cfg.sharding.device_memory is not None:
        return parse_bytes(cfg.sharding.device_memory, "sharding.device_memory")
    mine = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    measured = available_memory(mine)
    value = -1 if measured is None else int(measured[0])
    if jax.process_count() > 1:
        kib = np.int32(-1 if value < 0 else min(value >> 10, 2**31 - 1))  # int32: no x64
        values = np.asarray(multihost_utils.process_allgather(kib))
        value = -1 if (values < 0).any() else int(values.min()) << 10
    if value < 0:
        raise ConfigError(
            "sharding.device_memory: the devices do not report their memory; set it, "
            "e.g. sharding.device_memory=80GB"
        )
    return value


def plan_specs(
    cfg: RunConfig,
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    *,
    mesh_shape: dict[str, int],
    hosts: int,
    device_memory: int,
) -> Plan:
    """The plan of the tables of `cfg`'s model over `tables` and `features` (every
    embedding layer's, `planned_tables`) on a mesh of `mesh_shape` over `hosts` hosts,
    for the config's batch and pinned placements. Tables pinned to the host
    (`placement: host`) take no device memory and are left out."""
    names = [t.name for t in tables]
    pinned = pinned_placements(cfg, names)
    if hosts > 1:  # each process holds the cache slots of the keys it owns
        for t in tables:
            if t.is_tiered and pinned.setdefault(t.name, "row_wise") != "row_wise":
                raise ConfigError(
                    f"tables.{t.name}.placement: {pinned[t.name]}, but a dynamic or "
                    f"host-cached table in {hosts} processes is split row_wise (each "
                    f"process caches the keys it owns); drop the placement"
                )
    tables, features, follow = planned_tables(cfg, tables, features)
    host = {n for n, p in pinned.items() if p == "host"}
    if host:
        tables = [t for t in tables if follow.get(t.name, t.name) not in host]
        kept = {t.name for t in tables}
        features = [f for f in features if f.table in kept]
        pinned = {n: p for n, p in pinned.items() if n not in host}
    plan = plan_tables(
        tables,
        features,
        batch_size=cfg.data.batch_size,
        mesh_shape=mesh_shape,
        device_memory=device_memory,
        hosts=hosts,
        pinned=pinned,
        follow={t: lead for t, lead in follow.items() if lead not in host},
    )
    return dataclasses.replace(plan, on_host=tuple(sorted(host)))


def place_tables(
    cfg: RunConfig,
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    *,
    log: Callable[[str], None] = print,
):
    """`(tables, mesh)` for a run over `tables` and `features`: with more than one device
    or a pinned table, the mesh of the run's devices ("model" of `sharding.model`,
    default the devices of one process) and `tables` with their planned placements (the
    plan logged), which the model is then built over; else `(tables, None)`,
    unchanged."""
    devices = run_devices(cfg)
    pinned = pinned_placements(cfg, [t.name for t in tables])
    host = sorted(n for n, p in pinned.items() if p == "host")
    if host:
        return _on_host(tables, host, pinned, devices)
    if len(devices) <= 1 and not pinned:
        return tables, None
    procs = jax.process_count()
    size = cfg.sharding.model or len(devices) // procs
    if len(devices) % size:
        raise ConfigError(f"sharding.model={size} does not divide the run's {len(devices)} devices")
    mesh = make_mesh(model=size, devices=devices)
    plan = plan_specs(
        cfg,
        tables,
        features,
        mesh_shape=dict(mesh.shape),
        hosts=procs,
        device_memory=memory_per_device(cfg, devices),
    )
    log(plan.table())
    return plan.apply(tables), mesh


def _on_host(tables: Sequence[TableSpec], host: list[str], pinned: dict, devices):
    """`place_tables` of a run with host-executed tables (`placement: host`): those
    tables on the host, the others whole on every device (data parallel over the
    run's devices; the planner's placements do not combine with host tables)."""
    placed = sorted(n for n, p in pinned.items() if p != "host")
    if placed:
        raise ConfigError(
            f"tables {host} have placement 'host' and tables {placed} a mesh placement; "
            f"host tables work beside tables whole on the device only (drop the placement "
            f"of {placed})"
        )
    if jax.process_count() > 1:
        raise ConfigError(
            f"tables {host} have placement 'host': they train in one process; place them "
            f"on the devices to train across processes"
        )
    tables = tuple(
        dataclasses.replace(t, placement="host") if t.name in host else t for t in tables
    )
    return tables, (make_mesh(model=1, devices=devices) if len(devices) > 1 else None)


def _specs(cfg: RunConfig) -> tuple[list, list]:
    """The run's table and feature specs, without any table or batch: synthetic data's
    from its generator (as `build_data`, tables as `TableShape`s so a plan may hold
    tables of more than 2**31 rows), other data's from `build_data` (file data is read
    for its vocabularies)."""
    d = cfg.data
    if d.kind != "synthetic":
        data = build_data(cfg)
        return list(data.tables), list(data.features)
    gen = SyntheticCriteo(
        max_vocab=d.max_vocab, zipf_exponent=d.zipf, seed=cfg.seed, **d.synthetic_options
    )
    kw = dict(dtype=cfg.model.table_dtype, optimizer=sparse_optimizer(cfg.optimizer))
    dim = cfg.model.embedding_dim
    tables, features = [], []
    for name, rows in gen.vocab.items():
        rows = min(rows, _INT32_ROWS) if gen.id_space is not None else rows
        tables.append(_with_dim(cfg, TableShape(name=name, vocab_size=int(rows), dim=dim, **kw)))
        features.append(FeatureSpec(name=name, table=name, combiner="sum"))
    tables, _ = apply_tables(cfg, tables, features, vocab_rows=gen.vocab)
    return tables, features


def plan_config(
    cfg: RunConfig,
    *,
    devices: int | None = None,
    hosts: int | None = None,
    devices_per_host: int | None = None,
    device_memory: int | str | None = None,
) -> Plan:
    """The plan of `cfg`'s model on a mesh: `devices` devices of one host, or `hosts` x
    `devices_per_host`, or (neither) the devices a run of `cfg` takes on this machine;
    "model" of `sharding.model`, default the devices of one host. `device_memory`
    (bytes or "80GB") overrides `sharding.device_memory`; unset, the memory is measured
    on the run's devices here (a mesh given by its size: on one device of this
    machine). Builds the specs and the model only: no table is allocated, no batch
    made (file data is read for its vocabularies)."""
    if devices is not None and (hosts is not None or devices_per_host is not None):
        raise ConfigError("plan: give devices, or hosts with devices_per_host, not both")
    if (hosts is None) != (devices_per_host is None):
        raise ConfigError("plan: hosts and devices_per_host go together")
    local = jax.local_devices()[:1]  # a mesh described by its size: measured on one
    if devices is not None:
        hosts, per_host = 1, devices
    elif hosts is not None:
        per_host = devices_per_host
    else:
        local = run_devices(cfg)
        hosts = jax.process_count()
        per_host = len(local) // hosts
    n = hosts * per_host
    model_size = cfg.sharding.model or per_host
    if n % model_size:
        raise ConfigError(f"sharding.model={model_size} does not divide the {n} devices")
    memory = memory_per_device(cfg, local, device_memory)
    tables, features = _specs(cfg)
    model = configured_model(cfg, tables, features)
    return plan_specs(
        cfg,
        model.tables,
        model.features,
        mesh_shape={"data": n // model_size, "model": model_size},
        hosts=hosts,
        device_memory=memory,
    )


def plan_command(
    config_paths: list[str],
    overrides: list[str],
    *,
    devices: int | None = None,
    hosts: int | None = None,
    devices_per_host: int | None = None,
    device_memory: int | str | None = None,
) -> int:
    """`sparsejax plan CONFIG [key=value ...] [--devices N | --hosts H --devices-per-host
    D] [--device-memory 80GB]`: print the plan table of the config's model; 0. A plan
    that cannot fit raises `PlanError` (a user error: one line, exit 2)."""
    cfg = load_config(config_paths, overrides)
    plan = plan_config(
        cfg,
        devices=devices,
        hosts=hosts,
        devices_per_host=devices_per_host,
        device_memory=device_memory,
    )
    print(plan.table())
    if devices is None and hosts is None and plan.devices == 1:
        pinned = pinned_placements(cfg, list(plan.placements))
        if not pinned:
            print(
                "note: a run of this config here has one device and no pinned table: its "
                'tables stay whole on the device (placement "device"), not planned'
            )
    return 0
