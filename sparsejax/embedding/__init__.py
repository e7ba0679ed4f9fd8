"""Embedding tables and their lifecycle: specs, stacked state, lookup and sparse update."""

from ._collection import EmbeddingCollection as EmbeddingCollection
from ._collection import GroupLookups as GroupLookups
from ._collection import apply_group_gradients as apply_group_gradients
from ._spec import FeatureSpec as FeatureSpec
from ._spec import TableSpec as TableSpec
from ._spec import uniform_init as uniform_init
