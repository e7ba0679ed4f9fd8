"""Tables on a ("data", "model") mesh: placements, the sharded table store, the planner
and many processes (`jax.distributed`).

- `make_mesh`, `PLACEMENTS`: the mesh and the ways a table is placed on it.
- `make_store`: the table store a layer's specs and placements call for.
- `ShardedTableStore`: lookups and sparse updates under `shard_map` that move ids and
  pooled rows between devices, never tables.
- `shard_batch`: a batch re-padded per device, as the sharded store reads it.
- `plan_tables` / `Plan` / `comm_bytes`: placements from memory per device and bytes
  per step (`sparsejax plan`).
- `initialize_from_env` / `launch`: join a multi-process job from its environment (the
  launcher's, SLURM's, the JAX_* variables); start N local processes
  (`sparsejax launch`).
"""

from ._batch import exchange_bytes, padding_batch, shard_batch
from ._distributed import (
    ENV_LOCAL_DEVICES,
    allgather_json,
    allgather_rows,
    broadcast_text,
    initialize_from_env,
    process_of_many,
)
from ._launch import LOG_DIR, launch
from ._make import make_store
from ._placement import AXES, PLACEMENTS, make_mesh
from ._planner import Plan, PlanError, TableShape, comm_bytes, plan_tables
from ._store import ShardedTableStore

__all__ = [
    "AXES",
    "ENV_LOCAL_DEVICES",
    "LOG_DIR",
    "PLACEMENTS",
    "Plan",
    "PlanError",
    "ShardedTableStore",
    "TableShape",
    "allgather_json",
    "allgather_rows",
    "broadcast_text",
    "comm_bytes",
    "exchange_bytes",
    "initialize_from_env",
    "launch",
    "make_mesh",
    "make_store",
    "padding_batch",
    "plan_tables",
    "process_of_many",
    "shard_batch",
]
