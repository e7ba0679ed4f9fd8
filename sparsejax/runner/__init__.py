"""The config-driven runner behind `sparsejax train` and `sparsejax eval`.

Everything here is a library function a notebook can call: `load_config` (layered
YAML + overrides -> a validated `RunConfig`, `_schema.py`), `build_data` and
`build_model` (`_data.py`, `_model.py`), `train` (`_run.py`, training through `sparsejax.train.fit`;
the run directory's rules in `_run_dir.py`), `evaluate_run` (`_evaluate.py`),
`export_run` (`_export.py`, through `sparsejax.serving.export_model`), `profile`
(`_profile.py`, through `sparsejax.train.profile_training`), reporting (`_report.py`).
The command line only parses arguments and calls them.

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
from ._config import ConfigError as ConfigError
from ._config import to_dict as to_dict
from ._data import DataBundle as DataBundle
from ._data import build_data as build_data
from ._data import first_train_batch as first_train_batch
from ._data_config import DATA_DIR_ENV as DATA_DIR_ENV
from ._data_config import DataConfig as DataConfig
from ._data_config import FeatureConfig as FeatureConfig
from ._data_config import JoinConfig as JoinConfig
from ._data_config import LabelConfig as LabelConfig
from ._data_config import SplitConfig as SplitConfig
from ._evaluate import evaluate_run as evaluate_run
from ._evaluate import write_predictions as write_predictions
from ._export import export_run as export_run
from ._lock import RunLockedError as RunLockedError
from ._model import build_model as build_model
from ._model import model_warnings as model_warnings
from ._optim import OptimizerConfig as OptimizerConfig
from ._optim import dense_optimizer as dense_optimizer
from ._optim import sparse_optimizer as sparse_optimizer
from ._plan import plan_command as plan_command
from ._prepare import prepare_data as prepare_data
from ._profile import profile as profile
from ._read import absolute_data_paths as absolute_data_paths
from ._read import resolve_data_path as resolve_data_path
from ._read import resolve_files as resolve_files
from ._report import MetricsLog as MetricsLog
from ._report import plot_curves as plot_curves
from ._run import Run as Run
from ._run import build_run as build_run
from ._run import train as train
from ._run import train_run as train_run
from ._run_dir import RESUMABLE_KEYS as RESUMABLE_KEYS
from ._run_dir import config_changes as config_changes
from ._run_dir import config_hash as config_hash
from ._run_dir import config_reference as config_reference
from ._schema import ModelConfig as ModelConfig
from ._schema import RunConfig as RunConfig
from ._schema import config_from_dict as config_from_dict
from ._schema import load_config as load_config
from ._table_config import TableConfig as TableConfig
