"""The host runtime of embedding tables: what a table does on the host between steps.

- `HostSide` / `HostSides` / `host_side`: the one host-side protocol, its composite (what
  the trainer holds) and the factory that builds it for a model's layers.
- `HostTables`: tiered tables (dynamic 64-bit keys and host-cached tables): id map,
  admission, eviction, the host row store (`HostRows`: RAM, then disk) and the device
  cache's row exchanges.
- `HybridTableStore` / `HostExecution`: host-executed tables (`placement="host"`),
  looked up and updated on the host's CPU beside a dense network on the accelerator.
- `TableSnapshot`: a tiered table's host state as checkpoints write it.
- `key_owner` / `owner_layout`: which process owns a key of a tiered table, and where
  its cache slots lie, when several processes train it.
"""

from ._factory import host_side
from ._host_rows import HostRows, HostStorageFullError
from ._host_store import HOST, ROWS, HostExecution, HybridTableStore, host_mesh, with_host_part
from ._host_table import (
    CacheCapacityError,
    DynamicTableFullError,
    HostTable,
    TieredInputError,
    keyed_rows,
)
from ._id_map import EMPTY_KEY, IdMap, unique_keys
from ._owners import BUCKETS, OWNER_HASH, OwnerLayout, key_bucket, key_owner, owner_layout
from ._protocol import HostOperationError, HostSide, HostSides
from ._snapshot import TableSnapshot
from ._tiered import HostTables, layer_table_key

__all__ = [
    "BUCKETS",
    "EMPTY_KEY",
    "HOST",
    "ROWS",
    "CacheCapacityError",
    "DynamicTableFullError",
    "HostExecution",
    "HostOperationError",
    "HostRows",
    "HostSide",
    "HostSides",
    "HostStorageFullError",
    "HostTable",
    "HostTables",
    "HybridTableStore",
    "IdMap",
    "OWNER_HASH",
    "OwnerLayout",
    "TableSnapshot",
    "TieredInputError",
    "host_mesh",
    "host_side",
    "key_bucket",
    "key_owner",
    "keyed_rows",
    "layer_table_key",
    "owner_layout",
    "unique_keys",
    "with_host_part",
]
