"""Inference: export a trained run as a self-contained model dir, load it, predict on
raw feature values, serve it over HTTP with dynamic batching.

- `export_model`: a trained model as a model dir: its computation (`jax.export`), its
  tables (fp32, fp16, bf16, row-wise int8/int4), its preprocessing and id maps, and
  `example_request.json` (`sparsejax export RUN_DIR --out MODEL_DIR` calls it for a run).
- `Predictor.load(MODEL_DIR)`: checked load, warm-up of every batch bucket;
  `predict(examples)` on raw feature values, `retrieve(users, k)` for two-tower models.
- `DynamicBatcher`: groups concurrent requests into one model call (max batch, max wait).
- `make_app` / `serve` (`sparsejax serve MODEL_DIR`, the `[serve]` extra): the aiohttp
  server; imported on first use, so the rest works without aiohttp.
- `InferenceTableStore`: the read-only (quantized) table store the exported models use.
- `Publisher`: a training run publishes full model dirs and, between them, deltas (the
  rows changed since the version before) that `Predictor.with_delta` and the server
  apply in place (`_delta`).
"""

from ._batching import DynamicBatcher as DynamicBatcher
from ._delta import DeltaError as DeltaError
from ._delta import Publisher as Publisher
from ._export import DEFAULT_BUCKETS as DEFAULT_BUCKETS
from ._export import KERNELS as KERNELS
from ._export import ExportError as ExportError
from ._export import Preprocessing as Preprocessing
from ._export import check_export as check_export
from ._export import check_servable as check_servable
from ._export import embed_catalog as embed_catalog
from ._export import export_model as export_model
from ._export import serving_arguments as serving_arguments
from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._format import ModelLoadError as ModelLoadError
from ._predictor import Predictor as Predictor
from ._preprocess import RequestError as RequestError
from ._store import QUANTIZE_CHOICES as QUANTIZE_CHOICES
from ._store import InferenceTableStore as InferenceTableStore
from ._workers import serve_workers as serve_workers
from ._workers import usable_cores as usable_cores
from ._workers import worker_label as worker_label

_SERVER_NAMES = ("make_app", "serve", "SERVER_KEY")


def __getattr__(name: str):
    if name in _SERVER_NAMES:
        from . import _server

        return getattr(_server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SERVER_NAMES])
