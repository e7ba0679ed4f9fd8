"""pairwise_dots: public api (`api.py`), XLA path = reference (`base.py`), C++ kernels
(`cpu_ffi.py`); no Pallas kernel (the "pallas" choice runs XLA)."""

from .api import pairwise_dots as pairwise_dots
from .api import pairwise_dots_bwd_p as pairwise_dots_bwd_p
from .api import pairwise_dots_p as pairwise_dots_p
from .base import pairwise_dots_ref as pairwise_dots_ref
