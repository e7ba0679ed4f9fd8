"""segment_spmm vs float64 numpy; chunking bounds memory without changing results."""

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import ops
from sparsejax.ops._segment_spmm import xla_segment_spmm


def _case(seed, k=60, d=5, s=9, nnz=100):
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(k, d)).astype(np.float32)
    col, seg = ref.random_bags(rng, vocab=k, num_segments=s, nnz=nnz)
    values = rng.normal(size=nnz).astype(np.float32)
    return values, col, seg, dense


def test_matches_numpy(implementation):
    values, col, seg, dense = _case(0)
    out = jax.jit(lambda *a: ops.segment_spmm(*a, 9, implementation=implementation))(
        values, col, seg, dense)
    np.testing.assert_allclose(out, ref.segment_spmm(values, col, seg, dense, 9), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 7, 32, 100, 1000])
def test_chunked_xla_path_is_exact_for_any_chunk(chunk_size):
    values, col, seg, dense = _case(1, nnz=157)
    out = xla_segment_spmm(jnp.asarray(values), jnp.asarray(col), jnp.asarray(seg),
                           jnp.asarray(dense), num_segments=9, chunk_size=chunk_size)
    np.testing.assert_allclose(out, ref.segment_spmm(values, col, seg, dense, 9), rtol=1e-5,
                               atol=1e-5)


def test_chunked_peak_memory_is_bounded():
    """The compiled chunked path never holds more than one chunk of gathered rows."""
    nnz, d, chunk = 1 << 15, 64, 1 << 10
    args = (jax.ShapeDtypeStruct((nnz,), jnp.float32), jax.ShapeDtypeStruct((nnz,), jnp.int32),
            jax.ShapeDtypeStruct((nnz,), jnp.int32), jax.ShapeDtypeStruct((100, d), jnp.float32))
    f = jax.jit(lambda *a: xla_segment_spmm(*a, num_segments=16, chunk_size=chunk))
    temp = f.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp < nnz * d * 4 / 4, temp  # well under one [nnz, D] gather (8 MiB)


def test_grads_wrt_values_and_dense(implementation):
    values, col, seg, dense = _case(2)
    probe = jnp.asarray(np.random.default_rng(3).normal(size=(9, 5)), jnp.float32)

    def loss(fn, v, m):
        return jnp.sum(jnp.tanh(fn(v, jnp.asarray(col), jnp.asarray(seg), m, 9)) * probe)

    got = jax.grad(lambda v, m: loss(
        lambda *a: ops.segment_spmm(*a, implementation=implementation), v, m), argnums=(0, 1))(
        jnp.asarray(values), jnp.asarray(dense))
    want = jax.grad(lambda v, m: loss(ops.segment_spmm_ref, v, m), argnums=(0, 1))(
        jnp.asarray(values), jnp.asarray(dense))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_jvp_and_vmap_of_dense():
    values, col, seg, dense = _case(4)
    f = lambda m: ops.segment_spmm(jnp.asarray(values), jnp.asarray(col), jnp.asarray(seg), m, 9)  # noqa: E731
    t = jnp.ones_like(jnp.asarray(dense))
    _, tangent = jax.jvp(f, (jnp.asarray(dense),), (t,))
    np.testing.assert_allclose(tangent, ref.segment_spmm(values, col, seg, np.ones_like(dense), 9),
                               rtol=1e-5, atol=1e-5)
    stacked = jnp.stack([jnp.asarray(dense), 3 * jnp.asarray(dense)])
    out = jax.vmap(f)(stacked)
    np.testing.assert_allclose(out[1], 3 * ref.segment_spmm(values, col, seg, dense, 9),
                               rtol=1e-5, atol=1e-5)
