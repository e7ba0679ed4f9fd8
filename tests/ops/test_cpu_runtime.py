"""`tune_allocator`: XLA:CPU's per-execution temporary buffer is reused without page faults."""

import json
import os
import subprocess
import sys

import pytest

# One fresh process per setting: the tuning acts on the whole process and only before
# JAX's threads start (the test process gets it from `import sparsejax`, not from here).
# The jitted function's temporaries take tens of MB (above every glibc mmap threshold);
# the first calls settle the heap, so faults are counted from the 11th call on.
_PROBE = r"""
import json, os, resource, sys
from sparsejax._cpu_runtime import tune_allocator
applied = tune_allocator()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sin(x @ x).sum(0) + jnp.cos(x).sum(0))
x = jnp.ones((2048, 2048), jnp.float32) * 1e-3
for _ in range(10):
    f(x).block_until_ready()
def faults_per_call(n=3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        f(x).block_until_ready()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n
faults = min(faults_per_call() for _ in range(4))  # a late one-time heap growth aside
print(json.dumps({"applied": applied, "again": tune_allocator(), "faults": faults}))
"""


def _probe(tuning: str) -> dict:
    env = dict(os.environ, SPARSEJAX_MALLOC_TUNING=tuning, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_tuned_allocator_reuses_the_temporary_buffer():
    off, on = _probe("0"), _probe("1")
    assert off["applied"] is False and on["applied"] is True
    assert off["again"] is False and on["again"] is True  # idempotent
    # a 4 KiB fault per page of every temporary, each call, without the tuning...
    assert off["faults"] > 5_000, off
    # ...and (almost) none with it
    assert on["faults"] < 500, on
