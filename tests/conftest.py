"""One strict test environment: strict dtype promotion, several fake CPU devices (so
mesh tests run anywhere), float32 by default, warnings as errors (pyproject.toml),
derandomized hypothesis, and one compilation cache for the whole run."""

import os
import shutil
import tempfile

# XLA's backend at -O0 for the whole suite (the processes the tests start too, through
# tests/_cli.py's `one_device_env`): a fifth of the suite's CPU time is compiling small
# programs once, and the tests check what programs compute, not how fast.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)

# One persistent compilation cache for the run, made before the test workers start, so
# they and every `sparsejax` process a test starts share it: the same small models are
# built again and again in new processes, and a third of such a process's CPU time is
# compiling. Programs that compile in under 0.1 s are not worth a file.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="sparsejax-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

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


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
