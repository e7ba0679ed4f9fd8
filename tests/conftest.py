"""One strict test environment: strict dtype promotion, several fake CPU devices (so
mesh tests run anywhere), float32 by default, warnings as errors (pyproject.toml),
derandomized hypothesis."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

# Hypothesis: the same examples on every run (derandomized) and no example database, so a
# failure is reproducible and no stored failing example is left behind.
settings.register_profile("sparsejax", derandomize=True, database=None, deadline=None)
settings.load_profile("sparsejax")

from sparsejax import ops  # noqa: E402

CPU_IMPLEMENTATIONS = [
    "xla",
    "pallas",
    pytest.param(
        "cpu_ffi",
        marks=pytest.mark.skipif(not ops.cpu_ffi_available(), reason="C++ extension not built"),
    ),
    None,
]


@pytest.fixture(params=CPU_IMPLEMENTATIONS, ids=lambda p: str(p))
def implementation(request):
    """Every implementation that runs on this CPU (Pallas in interpret mode)."""
    return request.param
