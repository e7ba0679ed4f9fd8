"""Training: state, jitted steps, metrics, checkpoints and the training loop."""

from ._checkpoint import Checkpointer as Checkpointer
from ._checkpoint import CheckpointError as CheckpointError
from ._checkpoint import NonFiniteStateError as NonFiniteStateError
from ._metrics import auc as auc
from ._metrics import calibration as calibration
from ._metrics import logloss as logloss
from ._metrics import recall_at_k as recall_at_k
from ._trainer import LOSSES as LOSSES
from ._trainer import Trainer as Trainer
from ._trainer import TrainState as TrainState
from ._trainer import binary_loss as binary_loss
from ._trainer import retrieval_loss as retrieval_loss
