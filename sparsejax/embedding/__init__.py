"""Embedding tables and their lifecycle: specs, stacking, and the table stores that hold
table state and do lookups and sparse updates.

`TableStore` is the interface every embedding layer talks to
(`sparsejax.sharding.make_store` picks one for a layer's specs); `sparsejax.embedding.host`
is the host runtime (tiered and host-executed tables) behind the one host-side protocol,
`HostSide`. `DeviceTableStore` is the first store (stacked tables in device memory,
replicated on a mesh) and the functional layer for users without Flax. The old name
`EmbeddingCollection` (= `DeviceTableStore`) still works for one release and warns: in
TorchRec an `EmbeddingCollection` is the unpooled (sequence) module, which this is not.
"""

from .._deprecation import alias_getattr as _alias_getattr
from . import host as host
from ._compose import Composition as Composition
from ._compose import Expansion as Expansion
from ._compose import expand as expand
from ._compose import stored_values as stored_values
from ._device_store import INIT_BLOCK_ELEMENTS as INIT_BLOCK_ELEMENTS
from ._device_store import MESH_AXES as MESH_AXES
from ._device_store import DeviceTableStore as DeviceTableStore
from ._device_store import GroupLookups as GroupLookups
from ._device_store import aligned_empty as aligned_empty
from ._device_store import apply_group_gradients as apply_group_gradients
from ._device_store import check_mesh as check_mesh
from ._device_store import fill_rows as fill_rows
from ._device_store import fill_table as fill_table
from ._device_store import init_block_rows as init_block_rows
from ._device_store import rows_on_devices as rows_on_devices
from ._memory import available_memory as available_memory
from ._memory import format_bytes as format_bytes
from ._spec import MISSING_KEY as MISSING_KEY
from ._spec import BloomAdmission as BloomAdmission
from ._spec import CountAdmission as CountAdmission
from ._spec import DynamicVocab as DynamicVocab
from ._spec import Eviction as Eviction
from ._spec import FeatureSpec as FeatureSpec
from ._spec import HostCache as HostCache
from ._spec import TableSpec as TableSpec
from ._spec import check_specs as check_specs
from ._spec import constant_init as constant_init
from ._spec import normal_init as normal_init
from ._spec import truncated_normal_init as truncated_normal_init
from ._spec import uniform_init as uniform_init
from ._stacking import ALONE_BYTES as ALONE_BYTES
from ._stacking import MAX_STACK_ROWS as MAX_STACK_ROWS
from ._stacking import Stack as Stack
from ._stacking import plan_stacks as plan_stacks
from ._stacking import row_bytes as row_bytes
from ._stacking import stack_name as stack_name
from ._store import StoreBase as StoreBase
from ._store import TableStore as TableStore
from ._store import check_saved_table as check_saved_table
from ._store import default_mesh as default_mesh
from ._store import empty_table as empty_table
from ._store import stack_shapes as stack_shapes
from ._store import subtree as subtree
from ._store import tiered_feature_key as tiered_feature_key
from ._store import with_subtree as with_subtree
from .host import HybridTableStore as HybridTableStore

__all__ = [
    "ALONE_BYTES",
    "Composition",
    "Expansion",
    "MAX_STACK_ROWS",
    "MESH_AXES",
    "MISSING_KEY",
    "BloomAdmission",
    "CountAdmission",
    "DeviceTableStore",
    "DynamicVocab",
    "Eviction",
    "FeatureSpec",
    "HostCache",
    "HybridTableStore",
    "GroupLookups",
    "Stack",
    "StoreBase",
    "TableSpec",
    "TableStore",
    "apply_group_gradients",
    "available_memory",
    "check_mesh",
    "check_saved_table",
    "check_specs",
    "constant_init",
    "default_mesh",
    "host",
    "empty_table",
    "expand",
    "INIT_BLOCK_ELEMENTS",
    "aligned_empty",
    "fill_rows",
    "fill_table",
    "rows_on_devices",
    "init_block_rows",
    "format_bytes",
    "normal_init",
    "plan_stacks",
    "row_bytes",
    "stack_shapes",
    "stack_name",
    "stored_values",
    "subtree",
    "tiered_feature_key",
    "truncated_normal_init",
    "uniform_init",
    "with_subtree",
]

_DEPRECATED = {"EmbeddingCollection": DeviceTableStore}


# Deprecated aliases (one release): the old names read wrong to a TorchRec user.
__getattr__ = _alias_getattr(__name__, _DEPRECATED)
