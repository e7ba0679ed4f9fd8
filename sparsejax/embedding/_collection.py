"""Old home of the functional layer, kept for one release: `EmbeddingCollection` is now
`DeviceTableStore` (`_device_store.py`). In TorchRec an `EmbeddingCollection` is the
unpooled (sequence) module, which this never was; the public alias in
`sparsejax.embedding` warns."""

from ._device_store import DeviceTableStore as EmbeddingCollection
from ._device_store import Group as Group
from ._device_store import GroupLookups as GroupLookups
from ._device_store import apply_group_gradients as apply_group_gradients
from ._stacking import Stack as Stack

__all__ = ["EmbeddingCollection", "Group", "GroupLookups", "Stack", "apply_group_gradients"]
