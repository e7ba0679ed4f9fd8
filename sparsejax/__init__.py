"""sparsejax: JAX-native training and inference for large sparse (recommendation) models.

Layers: `ops` (primitives and sparse optimizers), `embedding` (specs, stacked tables),
`data` (SparseBatch, readers, loader), `nn` (Flax layers and models), `train` (trainer,
metrics, checkpoints), `runner` (the config-driven `sparsejax train`).
"""

from . import data as data
from . import embedding as embedding
from . import nn as nn
from . import ops as ops
from . import train as train

__version__ = "0.1.0"
