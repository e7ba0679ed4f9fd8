"""segment_spmm: public api (`api.py`), reference and XLA path (`base.py`), C++ kernel
(`cpu_ffi.py`), Pallas-Triton kernel (`pallas_triton.py`)."""

from .api import fold_vmapped_lookups as fold_vmapped_lookups
from .api import segment_spmm as segment_spmm
from .api import segment_spmm_p as segment_spmm_p
from .api import static_count as static_count
from .base import DEFAULT_CHUNK_SIZE as DEFAULT_CHUNK_SIZE
from .base import segment_spmm_ref as segment_spmm_ref
from .base import valid_entries as valid_entries
