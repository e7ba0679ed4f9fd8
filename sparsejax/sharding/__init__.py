"""Tables on a ("data", "model") mesh: placements, the sharded table store, the planner
and many processes (`jax.distributed`).

- `make_mesh`, `PLACEMENTS`: the mesh and the ways a table is placed on it.
- `ShardedTableStore`: lookups and sparse updates under `shard_map` that move ids and
  pooled rows between devices, never tables.
- `shard_batch`: a batch re-padded per device, as the sharded store reads it.
"""

from ._batch import shard_batch
from ._placement import AXES, PLACEMENTS, make_mesh
from ._store import ShardedTableStore

__all__ = ["AXES", "PLACEMENTS", "ShardedTableStore", "make_mesh", "shard_batch"]
