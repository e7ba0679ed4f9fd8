"""segment_spmm: every implementation vs float64 numpy; then each backend's kernel at
the edges only it has (the XLA path's chunking, the C++ threads and sortedness check,
the Pallas tiling and its CUDA lowering)."""

import functools

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import ops
from sparsejax.ops._segment_spmm import base

SDS = jax.ShapeDtypeStruct
needs_cpu_ffi = pytest.mark.skipif(not ops.cpu_ffi_available(), reason="C++ extension not built")


def _case(seed, k=60, d=5, s=9, nnz=100):
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(k, d)).astype(np.float32)
    col, seg = ref.random_bags(rng, vocab=k, num_segments=s, nnz=nnz)
    values = rng.normal(size=nnz).astype(np.float32)
    return values, col, seg, dense


# ------------------------------------------------------------------ every implementation
def test_matches_numpy(implementation):
    values, col, seg, dense = _case(0)
    out = jax.jit(lambda *a: ops.segment_spmm(*a, 9, implementation=implementation))(
        values, col, seg, dense
    )
    np.testing.assert_allclose(
        out, ref.segment_spmm(values, col, seg, dense, 9), rtol=1e-5, atol=1e-5
    )


def test_grads_wrt_values_and_dense(implementation):
    values, col, seg, dense = _case(2)
    probe = jnp.asarray(np.random.default_rng(3).normal(size=(9, 5)), jnp.float32)

    def loss(fn, v, m):
        return jnp.sum(jnp.tanh(fn(v, jnp.asarray(col), jnp.asarray(seg), m, 9)) * probe)

    got = jax.grad(
        lambda v, m: loss(lambda *a: ops.segment_spmm(*a, implementation=implementation), v, m),
        argnums=(0, 1),
    )(jnp.asarray(values), jnp.asarray(dense))
    want = jax.grad(lambda v, m: loss(ops.segment_spmm_ref, v, m), argnums=(0, 1))(
        jnp.asarray(values), jnp.asarray(dense)
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_jvp_and_vmap_of_dense():
    values, col, seg, dense = _case(4)
    f = lambda m: ops.segment_spmm(jnp.asarray(values), jnp.asarray(col), jnp.asarray(seg), m, 9)  # noqa: E731
    t = jnp.ones_like(jnp.asarray(dense))
    _, tangent = jax.jvp(f, (jnp.asarray(dense),), (t,))
    np.testing.assert_allclose(
        tangent, ref.segment_spmm(values, col, seg, np.ones_like(dense), 9), rtol=1e-5, atol=1e-5
    )
    stacked = jnp.stack([jnp.asarray(dense), 3 * jnp.asarray(dense)])
    out = jax.vmap(f)(stacked)
    np.testing.assert_allclose(
        out[1], 3 * ref.segment_spmm(values, col, seg, dense, 9), rtol=1e-5, atol=1e-5
    )


# ------------------------------------------------------------------ xla: chunking
@pytest.mark.parametrize("chunk_size", [1, 7, 32, 100, 1000])
def test_chunked_xla_path_is_exact_for_any_chunk(chunk_size):
    values, col, seg, dense = _case(1, nnz=157)
    out = base.segment_spmm(
        jnp.asarray(values),
        jnp.asarray(col),
        jnp.asarray(seg),
        jnp.asarray(dense),
        num_segments=9,
        chunk_size=chunk_size,
    )
    np.testing.assert_allclose(
        out, ref.segment_spmm(values, col, seg, dense, 9), rtol=1e-5, atol=1e-5
    )


def test_chunked_peak_memory_is_bounded():
    """The compiled chunked path never holds more than one chunk of gathered rows."""
    nnz, d, chunk = 1 << 15, 64, 1 << 10
    args = (
        SDS((nnz,), jnp.float32),
        SDS((nnz,), jnp.int32),
        SDS((nnz,), jnp.int32),
        SDS((100, d), jnp.float32),
    )
    f = jax.jit(lambda *a: base.segment_spmm(*a, num_segments=16, chunk_size=chunk))
    temp = f.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp < nnz * d * 4 / 4, temp  # well under one [nnz, D] gather (8 MiB)


# ------------------------------------------------------------------ cpu_ffi: the C++ kernel
def _check_within_f32_bound(out, values, col, seg, dense, s):
    want, tol, cnt = ref.segment_spmm(values, col, seg, dense, s, with_bound=True)
    out = ref.f64(out)
    assert out.shape == want.shape
    if dense.dtype == ref.BF16:
        tol = tol + 2.0**-8 * np.abs(want)
    assert np.all(np.abs(out - want) <= tol), np.max(np.abs(out - want) - tol)
    assert np.all(out[cnt == 0] == 0)  # empty segments are exactly zero


def _ffi_spmm(values, col, seg, dense, s, **kw):
    from sparsejax.ops._segment_spmm import cpu_ffi

    return cpu_ffi.segment_spmm(values, col, seg, dense, num_segments=s, **kw)


@needs_cpu_ffi
@pytest.mark.parametrize("dtype", [np.float32, ref.BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d", [1, 3, 64, 129])
@pytest.mark.parametrize("sorted_segments", [True, False], ids=["sorted", "unsorted"])
def test_cpu_kernel_on_junk_entries(dtype, d, sorted_segments):
    rng = np.random.default_rng(d * 7 + sorted_segments)
    k, s, n = 37, 11, 300
    values, col, seg = ref.junk_entries(rng, n, k, s, sorted_segments=sorted_segments)
    dense = rng.standard_normal((k, d)).astype(np.float32).astype(dtype)
    out = _ffi_spmm(values, col, seg, dense, s)
    assert out.dtype == dense.dtype and out.shape == (s, d)
    _check_within_f32_bound(out, values, col, seg, dense, s)


@needs_cpu_ffi
@pytest.mark.parametrize("case", ["n0", "s1", "all_invalid", "all_col_out_of_range", "many_empty"])
def test_cpu_kernel_edge_cases(case):
    rng = np.random.default_rng(1)
    k, d, s, n = 20, 5, 7, 50
    if case == "n0":
        n = 0
    if case == "s1":
        s = 1
    values, col, seg = ref.junk_entries(rng, n, k, s, sorted_segments=True)
    if case == "all_invalid":
        col[:] = -1
    if case == "all_col_out_of_range":
        col[:] = k
    if case == "many_empty":
        s = 1000
    dense = rng.standard_normal((k, d)).astype(np.float32)
    out = jax.jit(_ffi_spmm, static_argnums=4)(values, col, seg, dense, s)
    _check_within_f32_bound(out, values, col, seg, dense, s)


def _check_same_on_1_2_7_threads(monkeypatch, values, col, seg, dense, s):
    """Right on one thread, and bit-identical on 2 and 7 (every split point tried)."""
    outs = []
    for threads in ["1", "2", "7"]:
        monkeypatch.setenv("SPARSEJAX_CPU_THREADS", threads)
        monkeypatch.setenv("SPARSEJAX_CPU_MIN_PARALLEL", "1")
        outs.append(np.asarray(_ffi_spmm(values, col, seg, dense, s)))
    _check_within_f32_bound(outs[0], values, col, seg, dense, s)
    for o in outs[1:]:
        np.testing.assert_array_equal(ref.bits(o), ref.bits(outs[0]))


@needs_cpu_ffi
def test_cpu_kernel_threads_bit_identical(monkeypatch):
    """Threaded fast path == single thread, including few-segment splits."""
    rng = np.random.default_rng(2)
    k, d = 500, 16
    for s, n in [(1, 6000), (3, 6000), (400, 9000)]:
        values, col, seg = ref.junk_entries(rng, n, k, s, sorted_segments=True)
        _check_same_on_1_2_7_threads(
            monkeypatch, values, col, seg, rng.standard_normal((k, d)).astype(np.float32), s
        )


@needs_cpu_ffi
@pytest.mark.parametrize("dtype", [np.float32, ref.BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sorted_segments", [True, False], ids=["sorted", "unsorted"])
def test_cpu_kernel_unit_values(dtype, sorted_segments):
    """unit_values (an f32[0] operand): every value is 1, bit-identical to explicit ones."""
    rng = np.random.default_rng(5 + sorted_segments)
    k, s, n, d = 37, 11, 300, 64
    _, col, seg = ref.junk_entries(rng, n, k, s, sorted_segments=sorted_segments)
    dense = rng.standard_normal((k, d)).astype(np.float32).astype(dtype)
    ones = np.ones(n, np.float32)
    out = _ffi_spmm(np.zeros(n, np.float32), col, seg, dense, s, unit_values=True)
    _check_within_f32_bound(out, ones, col, seg, dense, s)
    np.testing.assert_array_equal(ref.bits(out), ref.bits(_ffi_spmm(ones, col, seg, dense, s)))


@needs_cpu_ffi
@pytest.mark.parametrize("case", ["one_inversion", "halves_swapped", "last_entry_low"])
def test_cpu_kernel_nearly_sorted_falls_back(monkeypatch, case):
    """Sortedness is checked inside each parallel chunk; any out-of-order valid entry,
    within a chunk or across chunks, must still give the exact unsorted result."""
    rng = np.random.default_rng(6)
    k, d, s, n = 500, 16, 400, 9000
    values, col, seg = ref.junk_entries(rng, n, k, s, sorted_segments=True)
    valid = np.nonzero(ref.valid_mask(col, seg, k, s))[0]
    if case == "one_inversion":
        i = valid[len(valid) // 3]
        seg[i] = max(int(seg[i]) - 3, 0)
    elif case == "halves_swapped":
        h = n // 2
        values, col, seg = (np.concatenate([x[h:], x[:h]]) for x in (values, col, seg))
    else:
        seg[valid[-1]] = 0
    _check_same_on_1_2_7_threads(
        monkeypatch, values, col, seg, rng.standard_normal((k, d)).astype(np.float32), s
    )


@needs_cpu_ffi
def test_unweighted_sum_bag_passes_no_coefficients():
    """Unweighted sum pooling hands the kernel no values array (f32[0]), so XLA computes
    no coefficients; weighted sum still passes them."""
    table, ids = jnp.zeros((10, 4)), jnp.zeros(6, jnp.int32)
    seg = jnp.array([0, 0, 1, 1, 2, 2], jnp.int32)

    def spmm_operands(**kw):
        f = jax.jit(lambda t, i: ops.embedding_bag(t, i, seg, 3, implementation="cpu_ffi", **kw))
        text = f.lower(table, ids).compile().as_text()
        (line,) = [ln for ln in text.splitlines() if 'custom_call_target="sparsejax_spmm"' in ln]
        return line.split("operand_layout_constraints={")[1]

    assert spmm_operands().startswith("f32[0]")
    assert spmm_operands(weights=jnp.ones(6)).startswith("f32[6]")


@needs_cpu_ffi
def test_cpu_wrapper_validation():
    with pytest.raises(TypeError, match="dense must be float32 or bfloat16"):
        _ffi_spmm(
            jnp.ones(1),
            jnp.zeros(1, jnp.int32),
            jnp.zeros(1, jnp.int32),
            jnp.zeros((3, 2), jnp.int32),
            1,
        )


# ------------------------------------------------------------------ pallas: the Triton kernel
def _pallas():
    from sparsejax.ops._segment_spmm import pallas_triton

    return pallas_triton


@pytest.mark.parametrize(
    "dim,dtype",
    [
        (8, jnp.float32),
        (64, jnp.float32),
        (96, jnp.float32),
        (128, jnp.float32),
        (96, jnp.bfloat16),
    ],
)
def test_pallas_kernel_hot_row_over_chunks(dim, dtype):
    rng = np.random.default_rng(dim)
    num_k, chunk = 30, 32
    lengths = ref.bag_lengths(rng, 10, long=110)  # the hot row spans > 3 chunks of 32
    col, seg, val = ref.make_lookups(rng, lengths, num_k, n_bad=12)
    assert col.shape[0] % chunk != 0
    dense = jnp.asarray(rng.normal(size=(num_k, dim)), dtype)
    f = jax.jit(functools.partial(_pallas().spmm, num_segments=10, chunk=chunk, interpret=True))
    out = f(jnp.asarray(val), jnp.asarray(col), jnp.asarray(seg), dense)
    assert out.shape == (10, dim) and out.dtype == dtype
    np.testing.assert_allclose(
        ref.f64(out), ref.segment_spmm(val, col, seg, dense, 10), **ref.TOL[dtype]
    )


@pytest.mark.parametrize(
    "case", ["tiny_chunk", "one_chunk", "one_row", "all_invalid", "column_blocks"]
)
def test_pallas_kernel_tilings(case):
    rng = np.random.default_rng(1)
    num_k, dim, chunk, block_d = 20, 64, 8, None
    lengths = {
        "tiny_chunk": [0, 30, 1, 0, 27, 5],  # every row spans several chunks of 8
        "one_chunk": [2, 0, 1, 1],  # nnz < C
        "one_row": [0, 0, 37],
        "all_invalid": [0, 0, 0],
        "column_blocks": [3, 0, 12, 1, 9],  # D = 128 in two 64-column blocks
    }[case]
    num_segments = len(lengths)
    col, seg, val = ref.make_lookups(rng, lengths, num_k, n_bad=5)
    if case == "one_chunk":
        chunk = 32
    if case == "column_blocks":
        dim, block_d = 128, 64
    dense = jnp.asarray(rng.normal(size=(num_k, dim)), jnp.float32)
    f = jax.jit(
        functools.partial(
            _pallas().spmm, num_segments=num_segments, chunk=chunk, block_d=block_d, interpret=True
        )
    )
    out = f(jnp.asarray(val), jnp.asarray(col), jnp.asarray(seg), dense)
    np.testing.assert_allclose(
        np.asarray(out),
        ref.segment_spmm(val, col, seg, dense, num_segments),
        **ref.TOL[jnp.float32],
    )


def test_pallas_kernel_empty():
    dense = jnp.ones((5, 8), jnp.float32)
    e = jnp.zeros((0,), jnp.int32)
    out = _pallas().spmm(jnp.zeros((0,), jnp.float32), e, e, dense, 3, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((3, 8)))
    assert _pallas().spmm(
        jnp.ones(2), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), dense, 0, interpret=True
    ).shape == (0, 8)


def test_pallas_heuristic_config():
    cfg = _pallas().get_heuristic_config
    assert cfg(96) == _pallas().Config(block_d=128, num_warps=1)
    assert cfg(8).block_d == 8 and cfg(1000).block_d == 128


@pytest.mark.parametrize("dim,dtype", [(128, jnp.float32), (96, jnp.bfloat16), (256, jnp.float32)])
def test_pallas_kernel_lowers_for_cuda(dim, dtype):
    n, s, v = 4096, 256, 100_000
    i = SDS((n,), jnp.int32)
    txt = ref.lower_for_cuda(
        functools.partial(_pallas().segment_spmm, num_segments=s),
        SDS((n,), jnp.float32),
        i,
        i,
        SDS((v, dim), dtype),
    )
    assert "__gpu$xla.gpu.triton" in txt
