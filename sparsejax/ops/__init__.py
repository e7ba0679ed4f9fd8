"""Sparse embedding primitives: lookups, segmented SpMM, fused sparse optimizers and
DLRM's pairwise-dot interaction.

Every op has a pure-jnp reference exported beside it (`*_ref`, same signature) and
an `implementation=` switch ("xla", "cpu_ffi", "pallas", or None for the platform's
best; `default_implementation()` tells which).

Layout: one private package per op (`_segment_spmm/`, `_embedding_bag/`,
`_sparse_apply/`, `_pairwise_dots/`), each with `api.py` (the public function and its
primitive), `base.py` (reference and XLA path), `cpu_ffi.py` and `pallas_triton.py`
(one file per backend). Shared: `_primitive.py` (how a primitive is defined and
registered), `_dispatch.py`, `_checks.py`, `_cpu_ffi.py` (loading the C++
extension), `_pallas_common.py` and `optimizers.py`.
"""

from . import optimizers as optimizers
from ._checks import check_lookups as check_lookups
from ._checks import checks as checks
from ._checks import checks_enabled as checks_enabled
from ._checks import set_checks as set_checks
from ._checks import surface_check_errors as surface_check_errors
from ._cpu_ffi import custom_call_targets as custom_call_targets
from ._dispatch import IMPLEMENTATIONS as IMPLEMENTATIONS
from ._dispatch import cpu_ffi_available as cpu_ffi_available
from ._dispatch import cpu_ffi_unavailable_reason as cpu_ffi_unavailable_reason
from ._dispatch import default_implementation as default_implementation
from ._dispatch import resolve_implementation as resolve_implementation
from ._embedding_bag import COMBINERS as COMBINERS
from ._embedding_bag import embedding_bag as embedding_bag
from ._embedding_bag import embedding_bag_ref as embedding_bag_ref
from ._embedding_bag import embedding_lookup as embedding_lookup
from ._embedding_bag import embedding_lookup_ref as embedding_lookup_ref
from ._embedding_bag import pooling_coefficients as pooling_coefficients
from ._pairwise_dots import pairwise_dots as pairwise_dots
from ._pairwise_dots import pairwise_dots_ref as pairwise_dots_ref
from ._quantized_bag import QuantizedTable as QuantizedTable
from ._quantized_bag import dequantize_rows as dequantize_rows
from ._quantized_bag import quantize_rows as quantize_rows
from ._quantized_bag import quantized_embedding_bag as quantized_embedding_bag
from ._quantized_bag import quantized_embedding_bag_ref as quantized_embedding_bag_ref
from ._segment_spmm import segment_spmm as segment_spmm
from ._segment_spmm import segment_spmm_ref as segment_spmm_ref
from ._sparse_apply import dedup_ids as dedup_ids
from ._sparse_apply import sparse_apply as sparse_apply
from ._sparse_apply import sparse_apply_ref as sparse_apply_ref
from .optimizers import FTRL as FTRL
from .optimizers import SGD as SGD
from .optimizers import Adagrad as Adagrad
from .optimizers import AdagradDecay as AdagradDecay
from .optimizers import LazyAdam as LazyAdam
from .optimizers import RowWiseAdagrad as RowWiseAdagrad
from .optimizers import SparseOptimizer as SparseOptimizer
