"""Tables on a ("data", "model") mesh: placements, the sharded table store, the planner
and many processes (`jax.distributed`).

- `make_mesh`, `PLACEMENTS`: the mesh and the ways a table is placed on it.
- `ShardedTableStore`: lookups and sparse updates under `shard_map` that move ids and
  pooled rows between devices, never tables.
- `shard_batch`: a batch re-padded per device, as the sharded store reads it.
- `plan_tables` / `Plan` / `comm_bytes`: placements from memory per device and bytes
  per step (`sparsejax plan`).
- `initialize_from_env` / `launch`: join a multi-process job from its environment (the
  launcher's, SLURM's, the JAX_* variables); start N local processes
  (`sparsejax launch`).
"""

from ._batch import shard_batch
from ._distributed import initialize_from_env
from ._launch import launch
from ._placement import AXES, PLACEMENTS, make_mesh
from ._planner import Plan, PlanError, comm_bytes, plan_tables
from ._store import ShardedTableStore

__all__ = [
    "AXES",
    "PLACEMENTS",
    "Plan",
    "PlanError",
    "ShardedTableStore",
    "comm_bytes",
    "initialize_from_env",
    "launch",
    "make_mesh",
    "plan_tables",
    "shard_batch",
]
