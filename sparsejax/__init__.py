"""sparsejax: JAX-native training and inference for large sparse (recommendation) models.

Layers: `ops` (primitives and sparse optimizers), `embedding` (specs, stacked tables),
`data` (SparseBatch, readers, loader), `nn` (Flax layers and models), `train` (trainer,
metrics, the training loop `fit`), `checkpoint` (checkpoints with tables by name),
`runner` (the config-driven `sparsejax train`).

Subpackages load on first use (`sparsejax.nn` imports Flax, `sparsejax.ops` does not),
so `import sparsejax.ops` pulls in no Flax, Orbax or matplotlib.
"""

import importlib

from ._cpu_runtime import tune_allocator as _tune_allocator
from ._version import __version__ as __version__

# Before any JAX computation can run: XLA:CPU then reuses its per-step buffers instead of
# page-faulting fresh memory every step (see `_cpu_runtime`; SPARSEJAX_MALLOC_TUNING=0).
_tune_allocator()

_SUBPACKAGES = ("checkpoint", "data", "embedding", "nn", "ops", "runner", "train")
__all__ = ["__version__", *_SUBPACKAGES]


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBPACKAGES})
