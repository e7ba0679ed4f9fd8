"""quantized_embedding_bag: embedding bags over row-wise int8 / int4 tables (inference).
The row format, quantize_rows / dequantize_rows, the reference and the XLA path
(`base.py`), the public function and its primitive (`api.py`), the C++ kernel
(`cpu_ffi.py`, csrc/quantized_bag.cc) and the Pallas-Triton kernel (`pallas_triton.py`)."""

from .api import quantized_bag_p as quantized_bag_p
from .api import quantized_embedding_bag as quantized_embedding_bag
from .base import QuantizedTable as QuantizedTable
from .base import dequantize_rows as dequantize_rows
from .base import quantize_rows as quantize_rows
from .base import quantized_embedding_bag_ref as quantized_embedding_bag_ref
