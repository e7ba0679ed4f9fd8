"""sparse_apply: public api (`api.py`), reference, XLA path and shared pieces
(`base.py`), C++ kernel (`cpu_ffi.py`), Pallas-Triton kernels (`pallas_triton.py`)."""

from .api import sparse_apply as sparse_apply
from .api import sparse_apply_p as sparse_apply_p
from .base import dedup_ids as dedup_ids
from .base import sparse_apply_ref as sparse_apply_ref
from .base import update_touched_rows as update_touched_rows
