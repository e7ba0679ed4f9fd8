"""Checkpoints of train states with tables stored by name, read and written through the
embedding layers' layouts (`Layouts`, passed in as data: `sparsejax.nn.embedding_layouts`
traces them from a model). Depends on the embedding layer only: serving restores tables
without a trainer (`Checkpointer.restore_tables`)."""

from ._checkpointer import Checkpointer as Checkpointer
from ._files import CheckpointError as CheckpointError
from ._files import CheckpointUnreadableError as CheckpointUnreadableError
from ._files import CheckpointWriteError as CheckpointWriteError
from ._files import NonFiniteStateError as NonFiniteStateError
from ._files import read_array as read_array
from ._files import write_array as write_array
from ._layout import Layouts as Layouts
from ._layout import layer_key as layer_key
from ._layout import stack_tables as stack_tables
from ._layout import tables_by_name as tables_by_name
from ._layout import tables_from_layers as tables_from_layers
from ._layout import uncovered_layer as uncovered_layer
