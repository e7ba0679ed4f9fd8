"""Training: state, jitted steps, metrics and the training loop (`fit`, `Hook`).

Checkpoints live in `sparsejax.checkpoint` (re-exported here)."""

from ..checkpoint import Checkpointer as Checkpointer
from ..checkpoint import CheckpointError as CheckpointError
from ..checkpoint import NonFiniteStateError as NonFiniteStateError
from ..checkpoint import embedding_layouts as embedding_layouts
from ._early_stopping import EarlyStopping as EarlyStopping
from ._loop import FitResult as FitResult
from ._loop import Hook as Hook
from ._loop import NonFiniteLossError as NonFiniteLossError
from ._loop import fit as fit
from ._metrics import auc as auc
from ._metrics import calibration as calibration
from ._metrics import full_corpus_recall as full_corpus_recall
from ._metrics import gauc as gauc
from ._metrics import hit_rate_at_k as hit_rate_at_k
from ._metrics import logloss as logloss
from ._metrics import ndcg_at_k as ndcg_at_k
from ._metrics import ranking_metrics as ranking_metrics
from ._metrics import recall_at_k as recall_at_k
from ._ranking import candidate_predictions as candidate_predictions
from ._ranking import evaluate_ranking as evaluate_ranking
from ._ranking import evaluate_retrieval as evaluate_retrieval
from ._ranking import ranking_report as ranking_report
from ._ranking import score_candidates as score_candidates
from ._ranking import tower_embeddings as tower_embeddings
from ._ranking import write_predictions as write_predictions
from ._schedules import Schedule as Schedule
from ._trainer import LOSSES as LOSSES
from ._trainer import Trainer as Trainer
from ._trainer import TrainState as TrainState
from ._trainer import binary_loss as binary_loss
from ._trainer import retrieval_loss as retrieval_loss
from ._trainer import retrieval_queries as retrieval_queries
