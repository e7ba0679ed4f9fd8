"""Placements of tables on a ("data", "model") mesh: who holds which rows and columns.

One table's placement decides the mesh axes its rows (or columns) are split over, the
"shard" axes, and the axes it is copied over, the "replica" axes. Every device of the
mesh holds exactly one shard of a table (or nothing, for a table-wise table that lives
on another index of "model"), so a placement is also a memory cost per device, which the
planner adds up before anything is allocated.

| placement        | split over                          | copied over |
|------------------|-------------------------------------|-------------|
| "replicated"     | nothing                             | every device |
| "table_wise"     | whole table on one index of "model" | "data"      |
| "column_wise"    | columns over "model"                | "data"      |
| "table_row_wise" | rows over "model"                   | "data"      |
| "row_wise"       | rows over every device              | nothing     |
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from ..embedding import row_bytes

AXES = ("data", "model")
PLACEMENTS = ("replicated", "table_wise", "column_wise", "table_row_wise", "row_wise")

_SHARD_AXES = {
    "replicated": (),
    "table_wise": ("model",),
    "column_wise": ("model",),
    "table_row_wise": ("model",),
    "row_wise": ("data", "model"),
}


def make_mesh(model: int | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh over `devices` (default: all of them, in process order):
    "model" of size `model` (default: the devices of one process), "data" the rest. A
    process's devices stay together along "model", so table-row-wise traffic stays inside
    a host."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if model is None:
        model = jax.local_device_count() if n % jax.local_device_count() == 0 else n
    if not isinstance(model, int) or model < 1 or n % model:
        raise ValueError(
            f"make_mesh: the model axis ({model!r}) must be a positive divisor of the {n} devices"
        )
    devices.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(n // model, model), AXES)


def check_placement(placement: str, owner: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"{owner}: placement {placement!r} is not one of {PLACEMENTS}")


def shard_axes(placement: str) -> tuple[str, ...]:
    """Mesh axes a table of `placement` is split over (rows, or columns for column-wise)."""
    return _SHARD_AXES[placement]


def replica_axes(placement: str) -> tuple[str, ...]:
    """Mesh axes a table of `placement` is copied over."""
    return tuple(a for a in AXES if a not in _SHARD_AXES[placement])


def axis_size(mesh_shape: Mapping[str, int], axes: tuple[str, ...]) -> int:
    return math.prod(int(mesh_shape.get(a, 1)) for a in axes)


def num_shards(placement: str, mesh_shape: Mapping[str, int]) -> int:
    """Pieces the table is cut into (1 for replicated; the "model" size for table-wise,
    whose pieces are whole tables of the same stack)."""
    return axis_size(mesh_shape, shard_axes(placement))


def device_rows_and_dim(
    placement: str, rows: int, dim: int, mesh_shape: Mapping[str, int]
) -> tuple[int, int]:
    """`(rows, dim)` of the largest piece one device holds of a `rows` x `dim` table
    (row-wise splits pad the rows up to a multiple of the shards)."""
    s = num_shards(placement, mesh_shape)
    if placement in ("row_wise", "table_row_wise"):
        return -(-rows // s), dim
    if placement == "column_wise":
        return rows, dim // s
    return rows, dim


def table_device_bytes(spec, placement: str, mesh_shape: Mapping[str, int]) -> int:
    """Bytes of `spec` on the device holding its largest piece: weights plus optimizer
    slots, for its device rows (a tiered table's cache plus its default row)."""
    rows = spec.device_rows + 1 if spec.is_tiered else spec.vocab_size
    rows, dim = device_rows_and_dim(placement, rows, spec.dim, mesh_shape)
    return rows * row_bytes(spec, dim)


def assign_table_wise(sizes: Mapping[str, int], shards: int) -> dict[str, int]:
    """Each table-wise table's index on "model": largest first onto the least-loaded
    shard (ties: the lower index; tables of one size by name), so the same tables give
    the same assignment in every process and every run."""
    load = [0] * shards
    out = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        s = min(range(shards), key=lambda i: (load[i], i))
        out[name] = s
        load[s] += sizes[name]
    return out
