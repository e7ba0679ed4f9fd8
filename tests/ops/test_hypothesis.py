"""Random jagged batches (hypothesis): bag lengths from 0 to many, padding, duplicates,
weights of any magnitude (tiny ones included: sqrtn must not underflow)."""

import _reference as ref
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsejax import ops


@st.composite
def jagged_batches(draw):
    vocab = draw(st.integers(1, 300))
    dim = draw(st.sampled_from([1, 2, 5, 8, 16]))
    lengths = draw(st.lists(st.integers(0, 12), min_size=1, max_size=10))
    ids = draw(st.lists(st.integers(-1, vocab - 1), min_size=sum(lengths), max_size=sum(lengths)))
    weights = draw(
        st.none()
        | st.lists(st.floats(-2, 2, width=32), min_size=sum(lengths), max_size=sum(lengths))
    )
    if weights is not None and draw(st.booleans()):  # every weight of the batch tiny
        weights = [w * 1e-20 for w in weights]
    combiner = draw(st.sampled_from(ops.COMBINERS))
    seed = draw(st.integers(0, 2**31 - 1))
    seg = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    return vocab, dim, np.asarray(ids, np.int32), seg, len(lengths), weights, combiner, seed


def _check(implementation_name, batch):
    vocab, dim, ids, seg, num_segments, weights, combiner, seed = batch
    table = np.random.default_rng(seed).normal(size=(vocab, dim)).astype(np.float32)
    w = None if weights is None else np.asarray(weights, np.float32)
    out = ops.embedding_bag(
        jnp.asarray(table),
        jnp.asarray(ids),
        jnp.asarray(seg),
        num_segments,
        weights=None if w is None else jnp.asarray(w),
        combiner=combiner,
        implementation=implementation_name,
    )
    want = ref.embedding_bag(table, ids, seg, num_segments, w, combiner)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("implementation_name", ["xla", "cpu_ffi"])
@settings(max_examples=20, suppress_health_check=[HealthCheck.too_slow])
@given(batch=jagged_batches())
def test_embedding_bag_on_random_jagged_batches(implementation_name, batch):
    if implementation_name == "cpu_ffi" and not ops.cpu_ffi_available():
        pytest.skip("C++ extension not built")
    _check(implementation_name, batch)


# Pallas runs in interpret mode here and compiles anew for every shape (about two seconds
# an example), so it sees fewer examples; its edges are also covered per implementation
# by test_embedding_bag (empty and all-padding bags, tiny/huge sqrtn weights, subnormal
# weights) and test_segment_spmm (tilings, hot rows over chunks).
@settings(max_examples=5, suppress_health_check=[HealthCheck.too_slow])
@given(batch=jagged_batches())
def test_pallas_embedding_bag_on_random_jagged_batches(batch):
    _check("pallas", batch)
