"""Quantized tables and quantized_embedding_bag: the row format (round-trip bound, the
step rounded up to float16, int4 nibble order, bytes per row), every implementation vs a
float64 numpy reference on fresh random inputs, vmap, jax.export, the Pallas kernel
lowered for CUDA, and bad input."""

import dataclasses
import functools

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import ops
from sparsejax.ops._cpu_ffi import QUANTIZED_BAG_TARGET
from sparsejax.ops._quantized_bag import base, pallas_triton

TOL = ref.TOL[jnp.float32]
needs_cpu_ffi = pytest.mark.skipif(not ops.cpu_ffi_available(), reason="C++ extension not built")


# ------------------------------------------------------------------ numpy references
def dequantize_f64(table):
    """The float64 [V, D] table the codes stand for, unpacked independently of sparsejax."""
    data = np.asarray(table.data).astype(np.int64)
    if table.bits == 4:
        q = np.zeros((data.shape[0], 2 * data.shape[1]), np.int64)
        q[:, 0::2], q[:, 1::2] = data & 15, data >> 4
        data = q[:, : table.dim]
    zero_point = np.asarray(table.zero_point).astype(np.int64)[:, None]
    return np.asarray(table.scale).astype(np.float64)[:, None] * (data - zero_point)


def random_weights(rng, vocab, dim):
    """Rows of very different magnitudes, all-positive and all-negative rows, a zero row."""
    w = rng.normal(size=(vocab, dim)) * 10.0 ** rng.uniform(-4, 3, (vocab, 1))
    w[1::5] = np.abs(w[1::5])
    w[2::5] = -np.abs(w[2::5])
    w[3::7] = 0.0
    return w.astype(np.float32)


def row_id_table(vocab, dim, bits):
    """Codes q[r, d] = (r + d) mod 2**bits, scale 0.5, zero point 1: row r dequantizes to
    0.5 (r + d - 1), exact, so a wrong row or column is obvious."""
    q = (np.arange(vocab)[:, None] + np.arange(dim)[None, :]) % 2**bits
    if bits == 4:
        q = np.pad(q, ((0, 0), (0, dim % 2)))
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return ops.QuantizedTable(
        data=q.astype(np.uint8),
        scale=np.full(vocab, 0.5, np.float16),
        zero_point=np.ones(vocab, np.uint8),
        bits=bits,
        dim=dim,
    )


def check_pooled(out, table, ids, seg, num_segments, combiner):
    """Unweighted "sum" (within the f32 accumulation bound of `ref.segment_spmm`, for
    long bags) or "max" (exact: every product is an f32 value) of many bags."""
    out = np.asarray(out, np.float64)
    if combiner == "sum":
        ones = np.ones(ids.shape[0])
        want, bound, _ = ref.segment_spmm(ones, ids, seg, table, num_segments, with_bound=True)
        assert np.all(np.abs(out - want) <= bound), np.max(np.abs(out - want) - bound)
        return
    valid = ref.valid_mask(ids, seg, table.shape[0], num_segments)
    want = np.full((num_segments, table.shape[1]), -np.inf)
    np.maximum.at(want, seg[valid], table[ids[valid]])
    np.testing.assert_array_equal(out, np.where(np.isneginf(want), 0.0, want))


def lookups(rng, vocab, num_segments, nnz):
    """CSR-ordered bags with duplicates, empty bags (the last one always), padding (-1)
    and ids >= V."""
    ids, seg = ref.random_bags(rng, vocab=vocab, num_segments=num_segments - 1, nnz=nnz)
    big = rng.random(nnz) < 0.05
    ids[big] = vocab + rng.integers(0, 3, int(big.sum()))
    ids[0], ids[-1] = -1, vocab + 1
    return ids, seg


# ------------------------------------------------------------------ the format
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dim", [1, 7, 16])
def test_round_trip_within_half_a_step(bits, dim):
    rng = np.random.default_rng(bits * 100 + dim)
    w = random_weights(rng, 200, dim)
    w[4] = 3e-9  # a step below float16's smallest subnormal: rounded up to it
    w[5, 0] = 60000.0 * (2**bits - 1)  # a step of 60000, near float16's largest
    t = ops.quantize_rows(w, bits, name="user")
    assert t.data.shape == (200, dim if bits == 8 else (dim + 1) // 2) and t.data.dtype == np.uint8
    assert t.scale.dtype == np.float16 and t.zero_point.dtype == np.uint8
    scale = t.scale.astype(np.float64)
    lo, hi = np.minimum(w.min(1), 0).astype(np.float64), np.maximum(w.max(1), 0).astype(np.float64)
    step = (hi - lo) / (2**bits - 1)
    live = hi > lo
    # The step rounded up to float16: the smallest float16 that covers the range.
    assert np.all(scale[live] >= step[live])
    below = np.nextafter(t.scale[live], np.float16(0)).astype(np.float64)
    assert np.all(below < step[live])
    np.testing.assert_array_equal(scale[~live], 1.0)
    np.testing.assert_array_equal(t.zero_point[~live], 0)
    deq = ops.dequantize_rows(t)
    assert isinstance(deq, np.ndarray) and deq.dtype == np.float32 and deq.shape == w.shape
    np.testing.assert_array_equal(deq, dequantize_f64(t))  # f16 x 9-bit int: exact in f32
    err = np.abs(deq.astype(np.float64) - w)
    assert np.all(err <= scale[:, None] / 2 * (1 + 1e-6)), (err / scale[:, None]).max()
    np.testing.assert_array_equal(deq[w == 0.0], 0.0)  # the zero point is an integer
    # On the device (traced) the same numbers.
    np.testing.assert_array_equal(jax.jit(ops.dequantize_rows)(jax.device_put(t)), deq)


def test_int4_nibble_order_and_bytes_per_row():
    w = np.tile(np.arange(7, dtype=np.float32), (3, 1))  # 0..6: scale 6/15 -> codes 0,2,5,..
    w[1] = np.array([15, 0, 1, 2, 3, 4, 5], np.float32)  # scale 1: codes are the values
    t = ops.quantize_rows(w, 4)
    assert t.scale[1] == 1.0 and t.zero_point[1] == 0
    np.testing.assert_array_equal(t.data[1], [0x0F, 0x21, 0x43, 0x05])  # 2j low, 2j+1 high
    for bits, dim in [(8, 16), (8, 1), (4, 16), (4, 7), (4, 1)]:
        t = ops.quantize_rows(np.ones((11, dim), np.float32), bits)
        codes = dim if bits == 8 else (dim + 1) // 2
        assert t.nbytes == 11 * (codes + 3) == t.vocab * (t.row_bytes + 3), (bits, dim)
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
        assert spec.nbytes == t.nbytes  # from shapes alone: usable to plan memory
    assert ops.quantize_rows(np.ones((1000, 64), np.float32), 4).nbytes * 7 < 1000 * 64 * 4


def test_quantize_reads_chunks_and_any_float_dtype(monkeypatch):
    rng = np.random.default_rng(1)
    w = random_weights(rng, 50, 6)
    whole = ops.quantize_rows(w, 8)
    monkeypatch.setattr(base, "QUANTIZE_CHUNK_ELEMENTS", 6 * 7)  # 7 rows per chunk
    chunked = ops.quantize_rows(jnp.asarray(w), 8)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked), strict=True):
        np.testing.assert_array_equal(a, b)
    for dtype in (jnp.bfloat16, np.float16, np.float64):
        t = ops.quantize_rows((w[:, :4] / 1e3).astype(dtype), 4)
        assert t.data.shape == (50, 2)


def test_quantize_refuses_bad_tables():
    w = np.ones((6, 3), np.float32)
    w[4, 2] = np.nan
    with pytest.raises(ValueError, match=r"table 'user' row 4 holds nan \(column 2\)"):
        ops.quantize_rows(w, 8, name="user")
    w[4, 2] = -np.inf
    with pytest.raises(ValueError, match="table 'user' row 4 holds -inf"):
        ops.quantize_rows(w, 4, name="user")
    w[4, 2] = 1.0
    w[3, 0] = 6e4 * 15  # int4: a step of 6e4 fits float16, one of 7e4 does not
    ops.quantize_rows(w, 4)
    w[3, 0] = 7e4 * 15
    with pytest.raises(ValueError, match="table 'item' row 3 spans .* exceeds float16"):
        ops.quantize_rows(w, 4, name="item")
    with pytest.raises(ValueError, match="bits must be 8 or 4, got 2"):
        ops.quantize_rows(w, 2)
    with pytest.raises(TypeError, match="table 'item' must be a float array, got int32"):
        ops.quantize_rows(np.ones((2, 2), np.int32), 8, name="item")
    with pytest.raises(ValueError, match=r"must be \[V, D\], got shape \(4,\)"):
        ops.quantize_rows(np.ones(4, np.float32), 8)


# ------------------------------------------------------------------ the bag vs numpy
# (name, bits, vocab, dim, num_segments, nnz); "rowid" uses row_id_table and a long bag.
CASES = [
    ("rowid4", 4, 9, 3, 12, None),
    ("int8", 8, 97, 16, 13, 120),
    ("int4_V1", 4, 1, 5, 6, 30),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_numpy(implementation, case, monkeypatch):
    # The C++ kernel splits even these few lookups into chunks of a few bags each.
    monkeypatch.setenv("SPARSEJAX_CPU_MIN_PARALLEL", "4")
    name, bits, vocab, dim, num_segments, nnz = case
    rng = np.random.default_rng(CASES.index(case))
    if name.startswith("rowid"):
        table = row_id_table(vocab, dim, bits)
        lengths = ref.bag_lengths(rng, num_segments, long=40)  # L >> R = 16
        ids, seg, _ = ref.make_lookups(rng, lengths, vocab, n_bad=6, dup_id=2)
    else:
        table = ops.quantize_rows(random_weights(rng, vocab, dim), bits)
        ids, seg = lookups(rng, vocab, num_segments, nnz)
    weights = rng.uniform(0.1, 2.0, ids.shape[0]).astype(np.float32)
    runs = [(c, weights) for c in ops.COMBINERS] + [("sum", None)]

    @jax.jit  # one compilation for every run (Pallas in interpret mode compiles slowly)
    def bags(table, ids, seg, weights):
        return [
            ops.quantized_embedding_bag(
                table,
                ids,
                seg,
                num_segments,
                weights=None if w is None else weights,
                combiner=c,
                implementation=implementation,
            )
            for c, w in runs
        ]

    outs = bags(jax.device_put(table), jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(weights))
    float_table = dequantize_f64(table)
    valid = (ids >= 0) & (ids < vocab) & (seg >= 0) & (seg < num_segments)
    empty = ~np.isin(np.arange(num_segments), seg[valid])
    assert empty.any() and (~valid).any()
    for (combiner, w), out in zip(runs, outs, strict=True):
        assert out.dtype == jnp.float32 and out.shape == (num_segments, dim)
        want = ref.embedding_bag(float_table, ids, seg, num_segments, w, combiner)
        np.testing.assert_allclose(out, want, **TOL, err_msg=f"{combiner} weighted={w is not None}")
        np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)


def test_same_as_reference_function_and_eager(implementation):
    rng = np.random.default_rng(7)
    table = jax.device_put(ops.quantize_rows(random_weights(rng, 40, 8), 4))
    ids, seg = ref.random_bags(rng, vocab=40, num_segments=9, nnz=50)
    args = (table, jnp.asarray(ids), jnp.asarray(seg), 9)
    got = ops.quantized_embedding_bag(*args, combiner="sqrtn", implementation=implementation)
    refs = jax.jit(
        lambda t, i, s: (
            ops.quantized_embedding_bag_ref(t, i, s, 9, combiner="sqrtn"),
            ops.embedding_bag(ops.dequantize_rows(t), i, s, 9, combiner="sqrtn"),
        )
    )(*args[:3])
    np.testing.assert_allclose(got, refs[0], **TOL)
    np.testing.assert_allclose(refs[0], refs[1], **TOL)


def test_vmap_over_lookups_and_over_tables(implementation):
    rng = np.random.default_rng(5)
    tables = [ops.quantize_rows(random_weights(rng, 30, 4), 8) for _ in range(2)]
    batch = [lookups(rng, 30, 5, 20) for _ in range(3)]
    ids = jnp.asarray(np.stack([b[0] for b in batch]))
    seg = jnp.asarray(np.stack([b[1] for b in batch]))

    def bag(t, i, s):
        return ops.quantized_embedding_bag(
            t, i, s, 5, combiner="max", implementation=implementation
        )

    out = jax.jit(jax.vmap(bag, in_axes=(None, 0, 0)))(jax.device_put(tables[0]), ids, seg)
    for b in range(3):
        want = ref.embedding_bag(dequantize_f64(tables[0]), *batch[b], 5, combiner="max")
        np.testing.assert_allclose(out[b], want, **TOL)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *tables)
    out = jax.jit(jax.vmap(bag, in_axes=(0, None, None)))(stacked, ids[0], seg[0])
    for b in range(2):
        want = ref.embedding_bag(dequantize_f64(tables[b]), *batch[0], 5, combiner="max")
        np.testing.assert_allclose(out[b], want, **TOL)


@pytest.mark.parametrize("impl", ["xla", pytest.param("cpu_ffi", marks=needs_cpu_ffi)])
def test_out_of_order_bags_and_many_threads(impl):
    """Bags out of CSR order (one thread in C++), then enough lookups for several threads
    with a hot bag spanning chunks; XLA's chunked loop too."""
    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 12, 1000)
    lengths[300] = 3000
    many = ref.make_lookups(rng, lengths, 500, n_bad=20, dup_id=7)[:2]
    shuffled = lookups(rng, 500, 40, 300)
    shuffled = (shuffled[0], rng.permutation(shuffled[1]))
    cases = [(*shuffled, 40), (*many, 1000)]

    @functools.partial(jax.jit, static_argnums=0)
    def bags(cases, table, *lookups):
        return [
            ops.quantized_embedding_bag(
                table, ids, seg, n_seg, combiner=combiner, implementation=impl
            )
            for (_, _, n_seg), ids, seg in zip(cases, lookups[::2], lookups[1::2], strict=True)
            for combiner in ("sum", "max")
        ]

    for bits, dim in [(8, 16), (4, 64), (8, 128), (4, 9)]:  # the C++ fixed widths, and not
        t = ops.quantize_rows(random_weights(rng, 500, dim), bits)
        flat = [jnp.asarray(x) for ids, seg, _ in cases for x in (ids, seg)]
        spec = tuple((None, None, n) for *_, n in cases)
        outs = iter(bags(spec, jax.device_put(t), *flat))
        for ids, seg, n_seg in cases:
            for combiner in ("sum", "max"):
                check_pooled(next(outs), dequantize_f64(t), ids, seg, n_seg, combiner)
        if impl != "xla" or dim != 9:  # XLA's chunked loop: once
            continue
        ids, seg = many
        for combiner in ("sum", "max"):
            chunked = base.quantized_bag(
                jnp.ones(ids.shape, jnp.float32),
                jnp.asarray(ids),
                jnp.asarray(seg),
                *(jnp.asarray(x) for x in (t.data, t.scale, t.zero_point)),
                num_segments=1000,
                bits=bits,
                dim=dim,
                combiner=combiner,
                chunk_size=1000,
            )
            check_pooled(chunked, dequantize_f64(t), ids, seg, 1000, combiner)


# ------------------------------------------------------------------ export and lowering
def _export_case():
    rng = np.random.default_rng(3)
    table = jax.device_put(ops.quantize_rows(random_weights(rng, 60, 6), 4))
    ids, seg = lookups(rng, 60, 8, 40)
    return table, jnp.asarray(ids), jnp.asarray(seg)


@pytest.mark.parametrize("impl", ["xla", pytest.param("cpu_ffi", marks=needs_cpu_ffi)])
def test_export_round_trip(impl):
    """The table travels as a pytree argument; "xla" exports for CPU and CUDA with every
    safety check on, "cpu_ffi" for CPU with its custom call allowed by name."""
    table, ids, seg = _export_case()
    weights = jnp.linspace(0.5, 1.5, ids.shape[0], dtype=jnp.float32)

    def f(t, i, s, w):
        return ops.quantized_embedding_bag(
            t, i, s, 8, weights=w, combiner="mean", implementation=impl
        )

    if impl == "xla":
        exported = jax.export.export(jax.jit(f), platforms=["cpu", "cuda"])(
            table, ids, seg, weights
        )
    else:
        with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
            jax.export.export(jax.jit(f), platforms=["cpu"])(table, ids, seg, weights)
        check = jax.export.DisabledSafetyCheck.custom_call(QUANTIZED_BAG_TARGET)
        exported = jax.export.export(jax.jit(f), platforms=["cpu"], disabled_checks=[check])(
            table, ids, seg, weights
        )
    has_call = f"custom_call @{QUANTIZED_BAG_TARGET}(" in exported.mlir_module()
    assert has_call == (impl == "cpu_ffi")
    again = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(
        again.call(table, ids, seg, weights), jax.jit(f)(table, ids, seg, weights)
    )


def test_pallas_kernel_lowers_for_cuda():
    """Power-of-two blocks, supported ops and indexers (no GPU needed)."""
    table, ids, seg = _export_case()  # int4, D = 6: padded to 8 columns, 3 bytes per row
    table8 = jax.device_put(ops.quantize_rows(np.ones((60, 6), np.float32), 8))

    def f(t4, t8, i, s):
        return [
            ops.quantized_embedding_bag(t, i, s, 8, combiner=c, implementation="pallas")
            for t in (t4, t8)
            for c in ("sum", "max")
        ]

    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (table, table8, ids, seg))
    text = ref.lower_for_cuda(f, *spec)
    assert text.count("__gpu$xla.gpu.triton") == 4


def test_dispatch_picks_the_platform_kernel(caplog):
    table, ids, seg = _export_case()
    want = "cpu_ffi" if ops.cpu_ffi_available() else "xla"
    with caplog.at_level("DEBUG", logger="sparsejax"):
        jax.jit(functools.partial(ops.quantized_embedding_bag, num_segments=8))(table, ids, seg)
    assert f"quantized_embedding_bag on cpu: requested None -> {want}" in caplog.text
    with pytest.raises(ValueError, match="runs only on CPU"):
        ref.lower_for_cuda(
            functools.partial(
                ops.quantized_embedding_bag, num_segments=8, implementation="cpu_ffi"
            ),
            table,
            ids,
            seg,
        )


def test_pallas_tilings():
    """R = 4 lookups per step (several steps per bag, the id prefetch crossing bags)."""
    table, ids, seg = _export_case()
    want = ref.embedding_bag(dequantize_f64(table), np.asarray(ids), np.asarray(seg), 8)
    bag = functools.partial(
        pallas_triton.quantized_bag_forward,
        num_segments=8,
        bits=4,
        dim=6,
        rows_per_step=4,
        interpret=True,
    )
    out = jax.jit(bag)(jnp.ones(ids.shape, jnp.float32), ids, seg, *jax.tree.leaves(table))
    np.testing.assert_allclose(out, want, **TOL)
    with pytest.raises(ValueError, match="rows_per_step must be a power of two"):
        pallas_triton.quantized_bag_forward(
            jnp.ones(ids.shape),
            ids,
            seg,
            *jax.tree.leaves(table),
            8,
            bits=4,
            dim=6,
            rows_per_step=3,
        )


# ------------------------------------------------------------------ bad input
def test_bad_tables_and_arguments_are_named():
    table, ids, seg = _export_case()
    bag = functools.partial(ops.quantized_embedding_bag, ids=ids, segment_ids=seg, num_segments=8)
    f32 = jnp.float32
    cases = [
        (table.data, TypeError, "`user` must be a QuantizedTable .* got ArrayImpl"),
        (
            dataclasses.replace(table, scale=table.scale.astype(f32)),
            TypeError,
            "user.scale must be float16, got float32",
        ),
        (
            dataclasses.replace(table, data=table.data.astype(jnp.int8)),
            TypeError,
            "user.data must be uint8, got int8",
        ),
        (
            dataclasses.replace(table, zero_point=table.zero_point[:5]),
            ValueError,
            r"user.zero_point must have one entry per row \(60\)",
        ),
        (
            dataclasses.replace(table, dim=9),
            ValueError,
            r"user.data must have 5 columns for bits=4, dim=9",
        ),
    ]
    for t, err, match in cases:
        with pytest.raises(err, match=match):
            bag(t, name="user")
    with pytest.raises(TypeError, match="`ids` must be an integer array"):
        ops.quantized_embedding_bag(table, ids.astype(f32), seg, 8)
    with pytest.raises(TypeError, match="`weights` must be a float array"):
        bag(table, weights=ids)
    with pytest.raises(ValueError, match="combiner='min' is not one of"):
        bag(table, combiner="min")
    with pytest.raises(ValueError, match="bits must be 8 or 4, got 5"):
        dataclasses.replace(table, bits=5)
    # Eager calls check values: an id >= V names the table and the position.
    bad = jnp.where(ids >= 60, -1, ids).at[3].set(60)
    with pytest.raises(IndexError, match="table 'user', vocab 60.*id 60 at position 3"):
        ops.quantized_embedding_bag(table, bad, seg, 8, name="user")


def test_inference_only():
    table, ids, seg = _export_case()
    w = jnp.ones(ids.shape, jnp.float32)

    def loss(w):
        return ops.quantized_embedding_bag(
            table, ids, seg, 8, weights=w, implementation="xla"
        ).sum()

    with pytest.raises(TypeError, match="inference-only"):
        jax.jit(jax.grad(loss))(w)
