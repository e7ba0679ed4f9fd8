"""Inference: export a trained run as a self-contained model dir, load it, predict on
raw feature values, serve it over HTTP with dynamic batching.

- `export_run` (`sparsejax export RUN_DIR --out MODEL_DIR [--quantize int8]`): the
  model's computation (`jax.export`), its tables (fp32, fp16, bf16, row-wise int8/int4),
  its preprocessing and id maps, and `example_request.json`.
- `Predictor.load(MODEL_DIR)`: checked load, warm-up of every batch bucket;
  `predict(examples)` on raw feature values.
- `InferenceTableStore`: the read-only (quantized) table store the exported models use.
"""

from ._export import DEFAULT_BUCKETS as DEFAULT_BUCKETS
from ._export import KERNELS as KERNELS
from ._export import export_run as export_run
from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._format import ModelLoadError as ModelLoadError
from ._predictor import Predictor as Predictor
from ._preprocess import RequestError as RequestError
from ._store import QUANTIZE_CHOICES as QUANTIZE_CHOICES
from ._store import InferenceTableStore as InferenceTableStore
