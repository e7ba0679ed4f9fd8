"""embedding_bag / embedding_lookup: every implementation vs float64 numpy; then the max
kernels of each backend (exact argmax and ties) and the Pallas forward kernel's tilings."""

import functools

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import ops

TOL = ref.TOL
SDS = jax.ShapeDtypeStruct
needs_cpu_ffi = pytest.mark.skipif(not ops.cpu_ffi_available(), reason="C++ extension not built")


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
    f = jax.jit(
        lambda t, i, s, w: ops.embedding_bag(
            t, i, s, 13, weights=w, combiner=combiner, implementation=implementation
        )
    )
    out = f(table, jnp.asarray(ids), jnp.asarray(seg), w)
    assert out.dtype == dtype and out.shape == (13, 16)
    want = ref.embedding_bag(np.asarray(table.astype(jnp.float32)), ids, seg, 13, weights, combiner)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **TOL[dtype])


@pytest.mark.parametrize("vocab", [1, 2, 1000, 100_000])
@pytest.mark.parametrize("dim", [1, 3, 64, 96])
def test_vocab_and_dim_edges(implementation, vocab, dim):
    table, ids, seg, _ = _case(vocab + dim, vocab, dim, 7, 50, jnp.float32, False)
    out = ops.embedding_bag(
        table, jnp.asarray(ids), jnp.asarray(seg), 7, implementation=implementation
    )
    np.testing.assert_allclose(out, ref.embedding_bag(table, ids, seg, 7), rtol=1e-5, atol=1e-5)


def test_empty_and_all_padding_bags_give_zeros(implementation):
    table = jnp.arange(20.0, dtype=jnp.float32).reshape(10, 2) + 1.0  # row i holds i+1
    ids = jnp.array([-1, -1, 3, 3, -1], jnp.int32)  # bag 0 all padding, 1 empty, 2 dup
    seg = jnp.array([0, 0, 2, 2, 2], jnp.int32)
    for combiner in ops.COMBINERS:
        out = ops.embedding_bag(
            table, ids, seg, 4, combiner=combiner, implementation=implementation
        )
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

    got = jax.jit(
        jax.grad(
            lambda t, w: loss(
                lambda *a, **k: ops.embedding_bag(*a, implementation=implementation, **k), t, w
            ),
            argnums=(0, 1),
        )
    )(table, weights)
    want = jax.grad(lambda t, w: loss(ops.embedding_bag_ref, t, w), argnums=(0, 1))(table, weights)
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
        np.testing.assert_allclose(
            out[b],
            ref.embedding_bag(table, batch[b][0], batch[b][1], 5, combiner=combiner),
            rtol=1e-5,
            atol=1e-6,
        )
    tables = jnp.stack([table, -2.0 * table])
    out = jax.vmap(bag, in_axes=(0, None, None))(tables, ids[0], seg[0])
    for b in range(2):
        np.testing.assert_allclose(
            out[b],
            ref.embedding_bag(tables[b], batch[0][0], batch[0][1], 5, combiner=combiner),
            rtol=1e-5,
            atol=1e-6,
        )


def test_embedding_lookup(implementation):
    rng = np.random.default_rng(2)
    table = jnp.asarray(rng.normal(size=(50, 6)), jnp.float32)
    ids = rng.integers(-1, 50, (4, 7)).astype(np.int32)
    out = jax.jit(lambda t, i: ops.embedding_lookup(t, i, implementation=implementation))(
        table, jnp.asarray(ids)
    )
    assert out.shape == (4, 7, 6)
    want = np.where((ids >= 0)[..., None], np.asarray(table)[np.maximum(ids, 0)], 0.0)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    g = jax.grad(
        lambda t: jnp.sum(
            ops.embedding_lookup(t, jnp.asarray(ids), implementation=implementation) ** 2
        )
    )(table)
    g_ref = jax.grad(lambda t: jnp.sum(ops.embedding_lookup_ref(t, jnp.asarray(ids)) ** 2))(table)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)


def test_row_id_table_makes_wrong_index_obvious(implementation):
    vocab = 1000
    table = jnp.tile(jnp.arange(vocab, dtype=jnp.float32)[:, None], (1, 4))
    ids = jnp.array([999, 0, 500, 7], jnp.int32)
    out = ops.embedding_lookup(table, ids, implementation=implementation)
    np.testing.assert_array_equal(out[:, 0], [999, 0, 500, 7])


def test_max_vjp_under_jit_with_constant_ids(implementation):
    """ids closed over as numpy constants of the jitted function: the max JVP indexes
    them with traced positions."""
    rng = np.random.default_rng(8)
    table = jnp.asarray(rng.normal(size=(20, 4)), jnp.float32)
    ids, seg = ref.random_bags(rng, vocab=20, num_segments=5, nnz=16)
    weights = rng.uniform(0.5, 1.5, 16).astype(np.float32)

    @jax.jit
    def f(t):
        out, vjp = jax.vjp(
            lambda t: ops.embedding_bag(
                t, ids, seg, 5, weights=weights, combiner="max", implementation=implementation
            ),
            t,
        )
        return out, vjp(jnp.ones_like(out))[0]

    out, g = f(table)
    want_g = jax.grad(
        lambda t: jnp.sum(
            ops.embedding_bag_ref(
                t,
                jnp.asarray(ids),
                jnp.asarray(seg),
                5,
                weights=jnp.asarray(weights),
                combiner="max",
            )
        )
    )(table)
    np.testing.assert_allclose(
        out, ref.embedding_bag(table, ids, seg, 5, weights, "max"), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(g, want_g, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1.0, 1e15], ids=lambda s: f"{s:g}")
def test_sqrtn_is_exact_for_tiny_and_huge_weights(implementation, scale):
    """sqrtn scales each bag's weights by their largest magnitude before squaring, so
    w**2 never underflows (or overflows): the answer only depends on weight ratios."""
    table = jnp.arange(12.0, dtype=jnp.float32).reshape(6, 2) + 1.0
    ids = jnp.array([1, 4, 2, -1, 5], jnp.int32)
    seg = jnp.array([0, 0, 1, 1, 2], jnp.int32)
    w = np.array([3.0, 4.0, -2.0, 7.0, 0.5], np.float32)
    out = ops.embedding_bag(
        table,
        ids,
        seg,
        3,
        weights=jnp.asarray(w * np.float32(scale)),
        combiner="sqrtn",
        implementation=implementation,
    )
    want = ref.embedding_bag(table, np.asarray(ids), np.asarray(seg), 3, w, "sqrtn")
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[0], (3 * table[1] + 4 * table[4]) / 5, rtol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_subnormal_weights_count_as_zero(implementation, combiner):
    """The contract every implementation keeps (XLA flushes subnormals on CPU and GPU):
    a bag whose only weight is subnormal pools to 0; a tiny normal weight is exact."""
    table = jnp.arange(1.0, 7.0, dtype=jnp.float32).reshape(3, 2)
    ids = jnp.array([0, 1, 2], jnp.int32)
    seg = jnp.array([0, 1, 1], jnp.int32)
    w = np.array([1.6e-42, 2e-38, 0.0], np.float32)  # subnormal, smallest normals
    out = ops.embedding_bag(
        table,
        ids,
        seg,
        2,
        weights=jnp.asarray(w),
        combiner=combiner,
        implementation=implementation,
    )
    want = ref.embedding_bag(table, np.asarray(ids), np.asarray(seg), 2, w, combiner)
    np.testing.assert_array_equal(np.asarray(out)[0], 0.0)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=0)
    if combiner != "sum":  # normalized: the tiny weight's row exactly
        np.testing.assert_allclose(np.asarray(out)[1], table[1], rtol=1e-6)


# ------------------------------------------------------------------ max kernels: exact
def _max_kernel(impl):
    if impl == "cpu_ffi":
        from sparsejax.ops._embedding_bag import cpu_ffi

        return cpu_ffi.segment_max
    if impl == "pallas":
        from sparsejax.ops._embedding_bag import pallas_triton

        return functools.partial(pallas_triton.segment_max, interpret=True)
    from sparsejax.ops._embedding_bag import base

    return base.segment_max


MAX_KERNELS = ["xla", "pallas", pytest.param("cpu_ffi", marks=needs_cpu_ffi)]


@pytest.mark.parametrize("impl", MAX_KERNELS)
@pytest.mark.parametrize("dtype", [np.float32, ref.BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d", [1, 3, 64, 129])
def test_max_kernel_on_junk_entries(impl, dtype, d):
    rng = np.random.default_rng(100 + d + 1)
    k, s, n = 23, 9, 250
    values, col, seg = ref.junk_entries(rng, n, k, s, sorted_segments=True)
    dense = rng.standard_normal((k, d)).astype(np.float32).astype(dtype)
    out, arg = jax.jit(functools.partial(_max_kernel(impl), num_segments=s))(
        values, col, seg, dense
    )
    want, want_arg = ref.segment_max(values, col, seg, dense, s)
    assert out.dtype == dense.dtype and arg.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(arg), want_arg)
    np.testing.assert_array_equal(np.asarray(out), want.astype(dtype))
    assert (np.asarray(arg) == -1).any()  # some empty segment / all-invalid column


@needs_cpu_ffi
@pytest.mark.parametrize("dtype", [np.float32, ref.BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d", [1, 3, 64, 129])
def test_cpu_max_kernel_unsorted_segments(dtype, d):
    rng = np.random.default_rng(100 + d)
    k, s, n = 23, 9, 250
    values, col, seg = ref.junk_entries(rng, n, k, s, sorted_segments=False)
    dense = rng.standard_normal((k, d)).astype(np.float32).astype(dtype)
    out, arg = _max_kernel("cpu_ffi")(values, col, seg, dense, num_segments=s)
    want, want_arg = ref.segment_max(values, col, seg, dense, s)
    np.testing.assert_array_equal(np.asarray(arg), want_arg)
    np.testing.assert_array_equal(np.asarray(out), want.astype(dtype))


@needs_cpu_ffi
def test_cpu_max_kernel_ties_and_threads(monkeypatch):
    rng = np.random.default_rng(3)
    kernel = _max_kernel("cpu_ffi")
    # Duplicate (value, col) pairs tie exactly: smallest k wins.
    dense = rng.standard_normal((4, 3)).astype(np.float32)
    col = np.array([2, 2, 1, 2, -1, 3], np.int32)
    seg = np.array([0, 0, 0, 1, 1, 1], np.int32)
    values = np.ones(6, np.float32)
    out, arg = kernel(values, col, seg, dense, num_segments=3)
    want, want_arg = ref.segment_max(values, col, seg, dense, 3)
    np.testing.assert_array_equal(np.asarray(arg), want_arg)
    np.testing.assert_array_equal(np.asarray(out), want)
    assert np.all(np.asarray(arg)[2] == -1) and np.all(np.asarray(out)[2] == 0)
    z = np.zeros(0, np.int32)  # N = 0
    out, arg = kernel(np.zeros(0, np.float32), z, z, dense, num_segments=2)
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(arg) == -1)
    # Threaded == reference on a large sorted input with few segments.
    for s in (1, 5):
        values, col, seg = ref.junk_entries(rng, 8000, 300, s, sorted_segments=True)
        dense = rng.standard_normal((300, 8)).astype(np.float32)
        monkeypatch.setenv("SPARSEJAX_CPU_THREADS", "3")
        monkeypatch.setenv("SPARSEJAX_CPU_MIN_PARALLEL", "1")
        want, want_arg = ref.segment_max(values, col, seg, dense, s)
        for pool in ("own", "xla"):  # our worker pool, XLA's intra-op pool
            monkeypatch.setenv("SPARSEJAX_CPU_POOL", pool)
            out, arg = kernel(values, col, seg, dense, num_segments=s)
            np.testing.assert_array_equal(np.asarray(arg), want_arg)
            np.testing.assert_array_equal(np.asarray(out), want)


# ------------------------------------------------------------------ Pallas forward kernel
def _bag_forward():
    from sparsejax.ops._embedding_bag import pallas_triton

    return pallas_triton


@pytest.mark.parametrize(
    "dim,dtype,rows_per_step,bags",
    [
        (8, jnp.float32, 16, 1),
        (64, jnp.float32, 4, 3),
        (96, jnp.float32, 16, 1),
        (128, jnp.float32, 8, 2),
        (96, jnp.bfloat16, 16, 2),
    ],
)
def test_pallas_forward_sum(dim, dtype, rows_per_step, bags):
    rng = np.random.default_rng(dim + bags)
    vocab, num_segments = 40, 9
    lengths = ref.bag_lengths(rng, num_segments, long=45)
    ids, seg, coef = ref.make_lookups(rng, lengths, vocab, n_bad=10)
    ids[seg == num_segments - 2] = -1  # an all-padding bag
    table = jnp.asarray(rng.normal(size=(vocab, dim)), dtype)
    f = jax.jit(
        functools.partial(
            _bag_forward().bag_forward,
            num_segments=num_segments,
            rows_per_step=rows_per_step,
            bags_per_program=bags,
            interpret=True,
        )
    )
    out = f(jnp.asarray(coef), jnp.asarray(ids), jnp.asarray(seg), table)
    assert out.shape == (num_segments, dim) and out.dtype == dtype
    np.testing.assert_allclose(
        ref.f64(out), ref.segment_spmm(coef, ids, seg, table, num_segments), **TOL[dtype]
    )


@pytest.mark.parametrize(
    "dim,dtype,rows_per_step,bags",
    [
        (8, jnp.float32, 4, 1),
        (96, jnp.float32, 16, 2),
        (128, jnp.bfloat16, 8, 1),
    ],
)
def test_pallas_forward_max_with_ties(dim, dtype, rows_per_step, bags):
    rng = np.random.default_rng(7 * dim)
    vocab, num_segments = 12, 8
    lengths = ref.bag_lengths(rng, num_segments, long=30)
    ids, seg, coef = ref.make_lookups(rng, lengths, vocab, n_bad=8)
    ids[seg == 2] = -1  # an all-padding bag
    # Small integers and coefficients in {-1, 1, 2}: ties everywhere, and repeated ids.
    table = jnp.asarray(rng.integers(-3, 4, (vocab, dim)), dtype)
    coef = rng.choice(np.array([-1.0, 1.0, 2.0], np.float32), coef.shape[0])
    f = jax.jit(
        functools.partial(
            _bag_forward().bag_forward,
            num_segments=num_segments,
            combiner="max",
            rows_per_step=rows_per_step,
            bags_per_program=bags,
            interpret=True,
        )
    )
    out, arg = f(jnp.asarray(coef), jnp.asarray(ids), jnp.asarray(seg), table)
    want, want_arg = ref.segment_max(coef, ids, seg, table, num_segments)
    assert out.dtype == dtype and arg.dtype == jnp.int32
    np.testing.assert_array_equal(ref.f64(out), want)
    np.testing.assert_array_equal(np.asarray(arg), want_arg)
    assert (want_arg[0] == -1).all() and (want_arg[2] == -1).all()  # empty, all padding


def test_pallas_forward_degenerate_inputs():
    bag_forward = _bag_forward().bag_forward
    table = jnp.ones((5, 8), jnp.float32)
    e = jnp.zeros((0,), jnp.int32)
    out = bag_forward(jnp.zeros((0,)), e, e, table, 3, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((3, 8)))
    out, arg = bag_forward(jnp.zeros((0,)), e, e, table, 3, combiner="max", interpret=True)
    np.testing.assert_array_equal(np.asarray(arg), -np.ones((3, 8)))
    with pytest.raises(ValueError, match="power of two"):
        bag_forward(jnp.zeros((0,)), e, e, table, 3, rows_per_step=12)
    with pytest.raises(ValueError, match="combiner"):
        bag_forward(jnp.zeros((0,)), e, e, table, 3, combiner="mean")
    assert _bag_forward().get_heuristic_config(128).num_warps == 2


@pytest.mark.parametrize("combiner", ["sum", "max"])
@pytest.mark.parametrize("dim,dtype,bags", [(128, jnp.float32, 1), (96, jnp.bfloat16, 3)])
def test_pallas_forward_lowers_for_cuda(combiner, dim, dtype, bags):
    n, s, v = 4096, 256, 100_000
    i = SDS((n,), jnp.int32)
    f = functools.partial(
        _bag_forward().bag_forward, num_segments=s, combiner=combiner, bags_per_program=bags
    )
    txt = ref.lower_for_cuda(f, SDS((n,), jnp.float32), i, i, SDS((v, dim), dtype))
    assert "__gpu$xla.gpu.triton" in txt
