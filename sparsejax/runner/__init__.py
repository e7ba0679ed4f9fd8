"""The config-driven runner behind `sparsejax train` and `sparsejax eval`.

Everything here is a library function a notebook can call: `load_config` (layered
YAML + overrides -> a validated `RunConfig`, `_schema.py`), `build_data` and
`build_model` (`_build.py`), `train` and `evaluate_run` (`_run.py`, training through
`sparsejax.train.fit`), reporting (`_report.py`). The command line only parses
arguments and calls them.

A run directory (`run.out_dir/run.name`) holds `config.yaml` (the resolved config, data
paths absolute), `run.json` (its hash and a history of starts), `run.log` (what the run
logged, and the traceback of an error that ended it), `metrics.jsonl` (one JSON object
per logged step or eval), `checkpoints/`, `curves.png` and `summary.json`. Running the
same config again resumes from the latest checkpoint, bit-identically to a run that was
never interrupted; a different config is refused naming the keys that differ (only
`RESUMABLE_KEYS` may change), unless `train(..., restart=True)`. One process at a time
trains in a run directory (`RunLockedError` names the other's pid).
"""

from ..nn import MODELS as MODELS
from ..train import NonFiniteLossError as NonFiniteLossError
from ..train import Trainer as Trainer
from ._build import DataBundle as DataBundle
from ._build import absolute_data_paths as absolute_data_paths
from ._build import build_data as build_data
from ._build import build_model as build_model
from ._build import first_train_batch as first_train_batch
from ._build import model_warnings as model_warnings
from ._build import resolve_data_path as resolve_data_path
from ._build import resolve_files as resolve_files
from ._config import ConfigError as ConfigError
from ._lock import RunLockedError as RunLockedError
from ._report import MetricsLog as MetricsLog
from ._report import plot_curves as plot_curves
from ._run import RESUMABLE_KEYS as RESUMABLE_KEYS
from ._run import Run as Run
from ._run import build_run as build_run
from ._run import config_changes as config_changes
from ._run import config_hash as config_hash
from ._run import config_reference as config_reference
from ._run import evaluate_run as evaluate_run
from ._run import train as train
from ._run import train_run as train_run
from ._run import write_predictions as write_predictions
from ._schema import DATA_DIR_ENV as DATA_DIR_ENV
from ._schema import DataConfig as DataConfig
from ._schema import FeatureConfig as FeatureConfig
from ._schema import JoinConfig as JoinConfig
from ._schema import LabelConfig as LabelConfig
from ._schema import ModelConfig as ModelConfig
from ._schema import OptimizerConfig as OptimizerConfig
from ._schema import RunConfig as RunConfig
from ._schema import SplitConfig as SplitConfig
from ._schema import TableConfig as TableConfig
from ._schema import config_from_dict as config_from_dict
from ._schema import dense_optimizer as dense_optimizer
from ._schema import load_config as load_config
from ._schema import sparse_optimizer as sparse_optimizer
