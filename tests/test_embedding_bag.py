"""embedding_bag / embedding_lookup, every implementation vs float64 numpy."""

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import ops

TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _case(seed, vocab, dim, num_segments, nnz, dtype, weighted):
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.normal(size=(vocab, dim)), dtype)
    ids, seg = ref.random_bags(rng, vocab=vocab, num_segments=num_segments, nnz=nnz)
    weights = rng.uniform(0.1, 2.0, nnz).astype(np.float32) if weighted else None
    return table, ids, seg, weights


@pytest.mark.parametrize("combiner", ops.COMBINERS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_matches_numpy(implementation, combiner, dtype, weighted):
    table, ids, seg, weights = _case(0, 97, 16, 13, 120, dtype, weighted)
    w = None if weights is None else jnp.asarray(weights)
    f = jax.jit(lambda t, i, s, w: ops.embedding_bag(
        t, i, s, 13, weights=w, combiner=combiner, implementation=implementation))
    out = f(table, jnp.asarray(ids), jnp.asarray(seg), w)
    assert out.dtype == dtype and out.shape == (13, 16)
    want = ref.embedding_bag(np.asarray(table.astype(jnp.float32)), ids, seg, 13, weights,
                             combiner)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **TOL[dtype])


@pytest.mark.parametrize("vocab", [1, 2, 1000, 100_000])
@pytest.mark.parametrize("dim", [1, 3, 64, 96])
def test_vocab_and_dim_edges(implementation, vocab, dim):
    table, ids, seg, _ = _case(vocab + dim, vocab, dim, 7, 50, jnp.float32, False)
    out = ops.embedding_bag(table, jnp.asarray(ids), jnp.asarray(seg), 7,
                            implementation=implementation)
    np.testing.assert_allclose(out, ref.embedding_bag(table, ids, seg, 7), rtol=1e-5, atol=1e-5)


def test_empty_and_all_padding_bags_give_zeros(implementation):
    table = jnp.arange(20.0, dtype=jnp.float32).reshape(10, 2) + 1.0  # row i holds i+1
    ids = jnp.array([-1, -1, 3, 3, -1], jnp.int32)  # bag 0 all padding, 1 empty, 2 dup
    seg = jnp.array([0, 0, 2, 2, 2], jnp.int32)
    for combiner in ops.COMBINERS:
        out = ops.embedding_bag(table, ids, seg, 4, combiner=combiner,
                                implementation=implementation)
        np.testing.assert_array_equal(out[0], 0.0)
        np.testing.assert_array_equal(out[1], 0.0)
        np.testing.assert_array_equal(out[3], 0.0)
        scale = {"sum": 2.0, "mean": 1.0, "sqrtn": np.sqrt(2.0), "max": 1.0}[combiner]
        np.testing.assert_allclose(out[2], np.array([7.0, 8.0]) * scale, rtol=1e-6)


def test_no_lookups_at_all(implementation):
    table = jnp.ones((5, 4), jnp.float32)
    empty = jnp.zeros((0,), jnp.int32)
    out = ops.embedding_bag(table, empty, empty, 3, implementation=implementation)
    np.testing.assert_array_equal(out, np.zeros((3, 4)))


@pytest.mark.parametrize("combiner", ops.COMBINERS)
def test_grad_wrt_table_and_weights(implementation, combiner):
    table, ids, seg, weights = _case(3, 40, 8, 9, 60, jnp.float32, True)
    ids, seg, weights = jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(weights)
    probe = jnp.asarray(np.random.default_rng(9).normal(size=(9, 8)), jnp.float32)

    def loss(bag_fn, t, w):
        return jnp.sum(jnp.sin(bag_fn(t, ids, seg, 9, weights=w, combiner=combiner)) * probe)

    got = jax.jit(jax.grad(lambda t, w: loss(
        lambda *a, **k: ops.embedding_bag(*a, implementation=implementation, **k), t, w),
        argnums=(0, 1)))(table, weights)
    want = jax.grad(lambda t, w: loss(ops.embedding_bag_ref, t, w), argnums=(0, 1))(
        table, weights)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combiner", ops.COMBINERS)
def test_vmap_over_batches_of_bags_and_tables(implementation, combiner):
    rng = np.random.default_rng(5)
    table = jnp.asarray(rng.normal(size=(30, 4)), jnp.float32)
    batch = [ref.random_bags(rng, vocab=30, num_segments=5, nnz=20) for _ in range(3)]
    ids = jnp.asarray(np.stack([b[0] for b in batch]))
    seg = jnp.asarray(np.stack([b[1] for b in batch]))

    def bag(t, i, s):
        return ops.embedding_bag(t, i, s, 5, combiner=combiner, implementation=implementation)

    out = jax.jit(jax.vmap(bag, in_axes=(None, 0, 0)))(table, ids, seg)
    for b in range(3):
        np.testing.assert_allclose(out[b], ref.embedding_bag(table, batch[b][0], batch[b][1], 5,
                                                             combiner=combiner), rtol=1e-5,
                                   atol=1e-6)
    tables = jnp.stack([table, -2.0 * table])
    out = jax.vmap(bag, in_axes=(0, None, None))(tables, ids[0], seg[0])
    for b in range(2):
        np.testing.assert_allclose(out[b], ref.embedding_bag(tables[b], batch[0][0],
                                                             batch[0][1], 5, combiner=combiner),
                                   rtol=1e-5, atol=1e-6)


def test_embedding_lookup(implementation):
    rng = np.random.default_rng(2)
    table = jnp.asarray(rng.normal(size=(50, 6)), jnp.float32)
    ids = rng.integers(-1, 50, (4, 7)).astype(np.int32)
    out = jax.jit(lambda t, i: ops.embedding_lookup(t, i, implementation=implementation))(
        table, jnp.asarray(ids))
    assert out.shape == (4, 7, 6)
    want = np.where((ids >= 0)[..., None], np.asarray(table)[np.maximum(ids, 0)], 0.0)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    g = jax.grad(lambda t: jnp.sum(ops.embedding_lookup(t, jnp.asarray(ids),
                                                        implementation=implementation) ** 2))(
        table)
    g_ref = jax.grad(lambda t: jnp.sum(ops.embedding_lookup_ref(t, jnp.asarray(ids)) ** 2))(table)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)


def test_row_id_table_makes_wrong_index_obvious(implementation):
    vocab = 1000
    table = jnp.tile(jnp.arange(vocab, dtype=jnp.float32)[:, None], (1, 4))
    ids = jnp.array([999, 0, 500, 7], jnp.int32)
    out = ops.embedding_lookup(table, ids, implementation=implementation)
    np.testing.assert_array_equal(out[:, 0], [999, 0, 500, 7])
