"""embedding_bag / embedding_lookup: public api (`api.py`), pooling coefficients,
references and the XLA max pooling (`base.py`), C++ max kernel (`cpu_ffi.py`),
Pallas-Triton forward kernel (`pallas_triton.py`). Sum, mean and sqrtn pooling run
`segment_spmm`."""

from .api import COMBINERS as COMBINERS
from .api import embedding_bag as embedding_bag
from .api import embedding_lookup as embedding_lookup
from .api import segment_max_p as segment_max_p
from .api import validate_bag as validate_bag
from .base import embedding_bag_ref as embedding_bag_ref
from .base import embedding_lookup_ref as embedding_lookup_ref
from .base import pooling_coefficients as pooling_coefficients
