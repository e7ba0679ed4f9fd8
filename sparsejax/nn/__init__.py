"""Flax layers and models. Embedding tables train sparsely (see `_embedding.py`)."""

from ._embedding import EMBEDDING as EMBEDDING
from ._embedding import EMBEDDING_GRADS as EMBEDDING_GRADS
from ._embedding import EMBEDDING_LOOKUPS as EMBEDDING_LOOKUPS
from ._embedding import EmbeddingBagCollection as EmbeddingBagCollection
from ._embedding import StoreLookups as StoreLookups
from ._embedding import apply_embedding_gradients as apply_embedding_gradients
from ._embedding import tables_on as tables_on
from ._embedding import tables_stored_by as tables_stored_by
from ._layers import MLP as MLP
from ._layers import CrossNetwork as CrossNetwork
from ._layers import DotInteraction as DotInteraction
from ._layers import FactorizationMachine as FactorizationMachine
from ._layers import TargetAttention as TargetAttention
from ._models import DIN as DIN
from ._models import DLRM as DLRM
from ._models import MODELS as MODELS
from ._models import DCNv2 as DCNv2
from ._models import DeepFM as DeepFM
from ._models import TwoTower as TwoTower
from ._models import WideAndDeep as WideAndDeep
from ._models import linear_specs as linear_specs
from ._models import sequence_mask as sequence_mask
from ._trace import embedding_layouts as embedding_layouts
from ._trace import trace_layers as trace_layers
from ._trace import trace_layouts as trace_layouts
