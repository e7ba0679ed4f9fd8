"""C++ CPU FFI kernels (csrc/sparsejax_cpu.cc) vs numpy / jnp references."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_cpu_ffi = pytest.importorskip("sparsejax.ops._cpu_ffi")
if not _cpu_ffi.is_available():
    pytest.skip(f"C++ CPU kernels not built: {_cpu_ffi.unavailable_reason()}",
                allow_module_level=True)

from sparsejax.ops import optimizers as O  # noqa: E402

BF16 = jnp.bfloat16
I32_MIN, I32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max
EPS32 = 2.0**-24


# ---------------------------------------------------------------------------
# Input generation
# ---------------------------------------------------------------------------

def _entries(rng, n, k, s, *, sorted_segments, pad_frac=0.2):
    """(values f32, col i32, seg i32) with duplicates, weights and invalid entries.

    When sorted_segments, segment ids are non-decreasing over *valid* entries only:
    invalid entries (bad col) carry arbitrary, out-of-order segment ids.
    """
    values = rng.standard_normal(n).astype(np.float32)
    values[rng.random(n) < 0.1] = 1.0
    col = rng.integers(0, max(k, 1), n)
    if n > 4:  # force duplicates of a hot row
        col[rng.random(n) < 0.2] = col[0]
    seg = rng.integers(0, s, n)
    if s > 4:  # leave empty segments: one in the middle, two at the end
        seg = seg % (s - 2)
        seg[seg == (s - 2) // 2] += 1
    if sorted_segments:
        seg = np.sort(seg)
    bad = rng.random(n) < pad_frac
    nb = int(bad.sum())
    if nb:
        junk = np.array([-1, k, k + 7, I32_MAX, I32_MIN], np.int64)
        col[bad] = rng.choice(junk, nb)
        # Bad-col entries may carry any segment id, including valid out-of-order ones.
        seg[bad] = rng.choice(np.array([-1, s, I32_MAX, I32_MIN, 0, s - 1]), nb)
    bad_seg = (rng.random(n) < pad_frac / 4) & ~bad
    if bad_seg.any() and not sorted_segments:
        seg[bad_seg] = rng.choice(np.array([-1, s, I32_MAX, I32_MIN]), int(bad_seg.sum()))
    elif bad_seg.any():
        # Invalid segment ids keep validity-sorted order (they are not valid entries).
        seg[bad_seg] = -1
    return values, col.astype(np.int32), seg.astype(np.int32)


def _dense(rng, k, d, dtype):
    x = rng.standard_normal((k, d)).astype(np.float32)
    return x.astype(dtype)


def _valid(col, seg, k, s):
    return (col >= 0) & (col < k) & (seg >= 0) & (seg < s)


# ---------------------------------------------------------------------------
# spmm
# ---------------------------------------------------------------------------

def _spmm_ref(values, col, seg, dense, s):
    k, d = dense.shape
    m = _valid(col, seg, k, s)
    terms = values[m].astype(np.float64)[:, None] * dense[col[m]].astype(np.float64)
    out = np.zeros((s, d))
    absum = np.zeros((s, d))
    cnt = np.zeros(s)
    np.add.at(out, seg[m], terms)
    np.add.at(absum, seg[m], np.abs(terms))
    np.add.at(cnt, seg[m], 1)
    return out, absum, cnt


def _check_spmm(out, values, col, seg, dense, s):
    ref, absum, cnt = _spmm_ref(values, col, seg, dense, s)
    out = np.asarray(out).astype(np.float64)
    assert out.shape == ref.shape
    tol = 2 * (cnt[:, None] + 1) * EPS32 * absum
    if dense.dtype == BF16:
        tol = tol + 2.0**-8 * np.abs(ref)
    assert np.all(np.abs(out - ref) <= tol), np.max(np.abs(out - ref) - tol)
    # Empty segments are exactly zero.
    assert np.all(out[cnt == 0] == 0)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d", [1, 3, 64, 129])
@pytest.mark.parametrize("sorted_segments", [True, False], ids=["sorted", "unsorted"])
def test_spmm(dtype, d, sorted_segments):
    rng = np.random.default_rng(d * 7 + sorted_segments)
    k, s, n = 37, 11, 300
    values, col, seg = _entries(rng, n, k, s, sorted_segments=sorted_segments)
    dense = _dense(rng, k, d, dtype)
    out = _cpu_ffi.spmm(values, col, seg, dense, s)
    assert out.dtype == dense.dtype and out.shape == (s, d)
    _check_spmm(out, values, col, seg, dense, s)


@pytest.mark.parametrize("case", ["n0", "s1", "all_invalid", "all_col_out_of_range", "many_empty"])
def test_spmm_edge_cases(case):
    rng = np.random.default_rng(1)
    k, d, s, n = 20, 5, 7, 50
    if case == "n0":
        n = 0
    if case == "s1":
        s = 1
    values, col, seg = _entries(rng, n, k, s, sorted_segments=True)
    if case == "all_invalid":
        col[:] = -1
    if case == "all_col_out_of_range":
        col[:] = k
    if case == "many_empty":
        s = 1000
    dense = _dense(rng, k, d, np.float32)
    out = jax.jit(_cpu_ffi.spmm, static_argnums=4)(values, col, seg, dense, s)
    _check_spmm(out, values, col, seg, dense, s)


def test_spmm_threads_bit_identical(monkeypatch):
    """Threaded fast path == single thread, including few-segment splits."""
    rng = np.random.default_rng(2)
    k, d = 500, 16
    for s, n in [(1, 6000), (3, 6000), (400, 9000)]:
        values, col, seg = _entries(rng, n, k, s, sorted_segments=True)
        _check_spmm_same_on_1_2_7_threads(monkeypatch, values, col, seg,
                                          _dense(rng, k, d, np.float32), s)


def _check_spmm_same_on_1_2_7_threads(monkeypatch, values, col, seg, dense, s):
    """Right on one thread, and bit-identical on 2 and 7 (every split point tried)."""
    outs = []
    for threads in ["1", "2", "7"]:
        monkeypatch.setenv("SPARSEJAX_CPU_THREADS", threads)
        monkeypatch.setenv("SPARSEJAX_CPU_MIN_PARALLEL", "1")
        outs.append(np.asarray(_cpu_ffi.spmm(values, col, seg, dense, s)))
    _check_spmm(outs[0], values, col, seg, dense, s)
    for o in outs[1:]:
        np.testing.assert_array_equal(o.view(np.uint32), outs[0].view(np.uint32))


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sorted_segments", [True, False], ids=["sorted", "unsorted"])
def test_spmm_unit_values(dtype, sorted_segments):
    """values=None (an f32[0] operand): every value is 1, bit-identical to explicit ones."""
    rng = np.random.default_rng(5 + sorted_segments)
    k, s, n, d = 37, 11, 300, 64
    _, col, seg = _entries(rng, n, k, s, sorted_segments=sorted_segments)
    dense = _dense(rng, k, d, dtype)
    out = _cpu_ffi.spmm(None, col, seg, dense, s)
    _check_spmm(out, np.ones(n, np.float32), col, seg, dense, s)
    ones = _cpu_ffi.spmm(np.ones(n, np.float32), col, seg, dense, s)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16 if dtype == BF16 else np.uint32),
                                  np.asarray(ones).view(np.uint16 if dtype == BF16 else np.uint32))


@pytest.mark.parametrize("case", ["one_inversion", "halves_swapped", "last_entry_low"])
def test_spmm_nearly_sorted_falls_back(monkeypatch, case):
    """Sortedness is checked inside each parallel chunk; any out-of-order valid entry,
    within a chunk or across chunks, must still give the exact unsorted result."""
    rng = np.random.default_rng(6)
    k, d, s, n = 500, 16, 400, 9000
    values, col, seg = _entries(rng, n, k, s, sorted_segments=True)
    valid = np.nonzero(_valid(col, seg, k, s))[0]
    if case == "one_inversion":
        i = valid[len(valid) // 3]
        seg[i] = max(int(seg[i]) - 3, 0)
    elif case == "halves_swapped":
        h = n // 2
        values, col, seg = (np.concatenate([x[h:], x[:h]]) for x in (values, col, seg))
    else:
        seg[valid[-1]] = 0
    _check_spmm_same_on_1_2_7_threads(monkeypatch, values, col, seg,
                                      _dense(rng, k, d, np.float32), s)


def test_embedding_bag_sum_passes_no_coefficients():
    """Unweighted sum pooling hands the kernel no values array (f32[0]), so XLA computes
    no coefficients; weighted sum still passes them."""
    from sparsejax import ops

    table, ids = jnp.zeros((10, 4)), jnp.zeros(6, jnp.int32)
    seg = jnp.array([0, 0, 1, 1, 2, 2], jnp.int32)

    def spmm_operands(**kw):
        f = jax.jit(lambda t, i: ops.embedding_bag(t, i, seg, 3, implementation="cpu_ffi", **kw))
        text = f.lower(table, ids).compile().as_text()
        (line,) = [ln for ln in text.splitlines() if 'custom_call_target="sparsejax_spmm"' in ln]
        return line.split("operand_layout_constraints={")[1]

    assert spmm_operands().startswith("f32[0]")
    assert spmm_operands(weights=jnp.ones(6)).startswith("f32[6]")


# ---------------------------------------------------------------------------
# segment_max
# ---------------------------------------------------------------------------

def _segmax_ref(values, col, seg, dense, s):
    """Exact: f64 products of f32/bf16 inputs are exact; rounding to f32 = f32 multiply."""
    k, d = dense.shape
    out = np.zeros((s, d), np.float32)
    arg = np.full((s, d), -1, np.int32)
    m = _valid(col, seg, k, s)
    idx = np.nonzero(m)[0]
    prod = (values[idx].astype(np.float64)[:, None]
            * dense[col[idx]].astype(np.float64)).astype(np.float32)
    for si in range(s):
        sel = seg[idx] == si
        if not sel.any():
            continue
        p = prod[sel]
        mx = p.max(axis=0)
        first = np.argmax(p == mx[None, :], axis=0)
        arg[si] = idx[sel][first]
        out[si] = p[first, np.arange(d)]
    return out, arg


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d", [1, 3, 64, 129])
@pytest.mark.parametrize("sorted_segments", [True, False], ids=["sorted", "unsorted"])
def test_segment_max(dtype, d, sorted_segments):
    rng = np.random.default_rng(100 + d + sorted_segments)
    k, s, n = 23, 9, 250
    values, col, seg = _entries(rng, n, k, s, sorted_segments=sorted_segments)
    dense = _dense(rng, k, d, dtype)
    out, arg = _cpu_ffi.segment_max(values, col, seg, dense, s)
    ref_out, ref_arg = _segmax_ref(values, col, seg, dense, s)
    assert out.dtype == dense.dtype and arg.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(arg), ref_arg)
    np.testing.assert_array_equal(np.asarray(out), ref_out.astype(dtype))
    assert (np.asarray(arg) == -1).any()  # some empty segment / all-invalid column


def test_segment_max_ties_and_edges(monkeypatch):
    rng = np.random.default_rng(3)
    # Duplicate (value, col) pairs tie exactly: smallest k wins.
    dense = _dense(rng, 4, 3, np.float32)
    col = np.array([2, 2, 1, 2, -1, 3], np.int32)
    seg = np.array([0, 0, 0, 1, 1, 1], np.int32)
    values = np.ones(6, np.float32)
    out, arg = _cpu_ffi.segment_max(values, col, seg, dense, 3)
    ref_out, ref_arg = _segmax_ref(values, col, seg, dense, 3)
    np.testing.assert_array_equal(np.asarray(arg), ref_arg)
    np.testing.assert_array_equal(np.asarray(out), ref_out)
    assert np.all(np.asarray(arg)[2] == -1) and np.all(np.asarray(out)[2] == 0)
    # N = 0
    z = np.zeros(0, np.int32)
    out, arg = _cpu_ffi.segment_max(np.zeros(0, np.float32), z, z, dense, 2)
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(arg) == -1)
    # Threaded == reference on a large sorted input with few segments.
    for s in (1, 5):
        values, col, seg = _entries(rng, 8000, 300, s, sorted_segments=True)
        dense = _dense(rng, 300, 8, np.float32)
        monkeypatch.setenv("SPARSEJAX_CPU_THREADS", "3")
        monkeypatch.setenv("SPARSEJAX_CPU_MIN_PARALLEL", "1")
        out, arg = _cpu_ffi.segment_max(values, col, seg, dense, s)
        ref_out, ref_arg = _segmax_ref(values, col, seg, dense, s)
        np.testing.assert_array_equal(np.asarray(arg), ref_arg)
        np.testing.assert_array_equal(np.asarray(out), ref_out)


# ---------------------------------------------------------------------------
# sparse_apply
# ---------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd": O.SGD(learning_rate=0.1),
    "adagrad": O.Adagrad(learning_rate=0.1),
    "rowwise_adagrad": O.RowWiseAdagrad(learning_rate=0.1),
    "lazy_adam": O.LazyAdam(learning_rate=0.01),
    "ftrl": O.FTRL(learning_rate=0.1, l1=0.05, l2=0.01, beta=0.5),
    "adagrad_decay": O.AdagradDecay(learning_rate=0.1, accumulator_decay_step=3,
                                    accumulator_decay_rate=0.9),
}
STEP = 10  # AdagradDecay period = 10 // 3 = 3


def _init_slots(rng, opt, v, d):
    slots = {}
    for spec in opt.slots():
        shape = (v,) if spec.per_row else (v, d)
        if spec.dtype == "int32":  # decay_power: some rows behind the current period
            slots[spec.name] = rng.integers(0, STEP // 3 + 1, shape).astype(np.int32)
        elif spec.name in ("mu", "linear"):
            slots[spec.name] = rng.standard_normal(shape).astype(np.float32) * 0.1
        else:  # accumulators: positive
            slots[spec.name] = rng.uniform(0.05, 1.0, shape).astype(np.float32)
    return slots


@functools.cache
def _update_rows_jit(opt):
    return jax.jit(opt.update_rows, static_argnames="dim")


def _apply_ref(opt, table, slots, ids, seg, coef, grad, step):
    """Dedup with numpy, reduce coef*grad[seg] per unique id, update_rows, scatter."""
    v, d = table.shape
    s = grad.shape[0]
    m = (ids >= 0) & (ids < v) & (seg >= 0) & (seg < s)
    uniq, inv = np.unique(ids[m], return_inverse=True)
    g = np.zeros((len(uniq), d))
    np.add.at(g, inv, coef[m].astype(np.float64)[:, None] * grad[seg[m]].astype(np.float64))
    # Pad the row block to a power of two so the jitted reference compiles rarely;
    # padded rows are discarded.
    r = len(uniq)
    rp = max(8, 1 << (r - 1).bit_length())
    sel = np.concatenate([uniq, np.full(rp - r, uniq[0] if r else 0)]).astype(np.int64)
    g = np.concatenate([g, np.zeros((rp - r, d))])
    rows = jnp.asarray(table[sel].astype(np.float32))
    rs = {name: jnp.asarray(x[sel]) for name, x in slots.items()}
    new_rows, new_slots = _update_rows_jit(opt)(opt.hparams(), rows, rs,
                                                jnp.asarray(g, jnp.float32), jnp.int32(step),
                                                dim=d)
    out_table = table.copy()
    out_table[uniq] = np.asarray(new_rows)[:r].astype(table.dtype)
    out_slots = {}
    for name, x in slots.items():
        y = x.copy()
        y[uniq] = np.asarray(new_slots[name])[:r]
        out_slots[name] = y
    touched = np.zeros(v, bool)
    touched[uniq] = True
    return out_table, out_slots, touched


def _run_apply(opt, table, slots, ids, seg, coef, grad, step):
    names = [sp.name for sp in opt.slots()]
    t, sl = _cpu_ffi.sparse_apply(jnp.asarray(table), tuple(jnp.asarray(slots[n]) for n in names),
                                  ids, seg, coef, grad, opt.hparams(), step,
                                  optimizer_code=type(opt).code)
    return np.asarray(t), dict(zip(names, (np.asarray(x) for x in sl), strict=True))


def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _check_apply(opt, table, slots, ids, seg, coef, grad, step):
    ref_t, ref_s, touched = _apply_ref(opt, table, slots, ids, seg, coef, grad, step)
    out_t, out_s = _run_apply(opt, table, slots, ids, seg, coef, grad, step)
    assert out_t.dtype == table.dtype
    # Untouched rows (and their state) are bit-identical to the input.
    np.testing.assert_array_equal(_bits(out_t[~touched]), _bits(table[~touched]))
    for name in slots:
        np.testing.assert_array_equal(_bits(out_s[name][~touched]), _bits(slots[name][~touched]))
    # Touched rows match the jnp update_rows reference.
    if table.dtype == BF16:  # a 1-ulp f32 difference may flip a bf16 rounding
        np.testing.assert_allclose(out_t.astype(np.float32), ref_t.astype(np.float32),
                                   rtol=2.0**-7, atol=1e-6)
    else:
        np.testing.assert_allclose(out_t, ref_t, rtol=2e-5, atol=2e-6)
    for name in slots:
        if slots[name].dtype == np.int32:
            np.testing.assert_array_equal(out_s[name], ref_s[name])
        else:
            np.testing.assert_allclose(out_s[name], ref_s[name], rtol=2e-5, atol=2e-6)
    return out_t, out_s, touched


def _apply_inputs(rng, v, d, s, n, dtype):
    table = _dense(rng, v, d, dtype)
    ids = rng.integers(0, v, n)
    ids[rng.random(n) < 0.3] = ids[0] if n else 0  # duplicates
    seg = rng.integers(0, s, n)  # unsorted
    bad = rng.random(n) < 0.15
    ids[bad] = rng.choice(np.array([-1, v, v + 3, I32_MAX, I32_MIN]), int(bad.sum()))
    bad_seg = rng.random(n) < 0.05
    seg[bad_seg] = rng.choice(np.array([-1, s, I32_MAX, I32_MIN]), int(bad_seg.sum()))
    coef = rng.standard_normal(n).astype(np.float32)
    coef[rng.random(n) < 0.1] = 0.0  # touched with zero weight
    grad = rng.standard_normal((s, d)).astype(np.float32)
    return table, ids.astype(np.int32), seg.astype(np.int32), coef, grad


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype,d", [(np.float32, 1), (np.float32, 3), (np.float32, 129),
                                     (BF16, 64)], ids=["f32-d1", "f32-d3", "f32-d129", "bf16-d64"])
def test_sparse_apply(name, dtype, d):
    opt = OPTIMIZERS[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}-{d}".encode()))
    v, s, n = 60, 7, 120
    table, ids, seg, coef, grad = _apply_inputs(rng, v, d, s, n, dtype)
    slots = _init_slots(rng, opt, v, d)
    _, _, touched = _check_apply(opt, table, slots, ids, seg, coef, grad, STEP)
    assert touched.any() and not touched.all()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sparse_apply_zero_coef_row_is_touched(name):
    """A valid id is updated (slots advance) even when all its weights are 0."""
    opt = OPTIMIZERS[name]
    rng = np.random.default_rng(5)
    v, d = 10, 4
    table = _dense(rng, v, d, np.float32)
    slots = _init_slots(rng, opt, v, d)
    if "decay_power" in slots:
        slots["decay_power"][:] = 0  # row 3 must decay and advance its power
    ids = np.array([3, 5, 3], np.int32)
    coef = np.array([0.0, 1.0, 0.0], np.float32)
    seg = np.array([0, 1, 1], np.int32)
    grad = rng.standard_normal((2, d)).astype(np.float32)
    out_t, out_s, touched = _check_apply(opt, table, slots, ids, seg, coef, grad, STEP)
    assert touched[3]
    if name in ("lazy_adam", "adagrad_decay"):
        assert not np.array_equal(out_t[3], table[3]) or any(
            not np.array_equal(out_s[k][3], slots[k][3]) for k in slots)


def test_sparse_apply_threads_bit_identical(monkeypatch):
    rng = np.random.default_rng(6)
    for name in ("rowwise_adagrad", "lazy_adam", "adagrad_decay"):
        opt = OPTIMIZERS[name]
        v, d, s, n = 3000, 8, 50, 9000
        table, ids, seg, coef, grad = _apply_inputs(rng, v, d, s, n, np.float32)
        slots = _init_slots(rng, opt, v, d)
        outs = []
        for threads in ["1", "2", "5"]:
            monkeypatch.setenv("SPARSEJAX_CPU_THREADS", threads)
            monkeypatch.setenv("SPARSEJAX_CPU_MIN_PARALLEL", "1")
            if threads == "1":
                outs.append(_check_apply(opt, table, slots, ids, seg, coef, grad, STEP)[:2])
            else:
                outs.append(_run_apply(opt, table, slots, ids, seg, coef, grad, STEP))
        for t, sl in outs[1:]:
            np.testing.assert_array_equal(_bits(t), _bits(outs[0][0]))
            for k in sl:
                np.testing.assert_array_equal(_bits(sl[k]), _bits(outs[0][1][k]))


def test_sparse_apply_edge_cases():
    rng = np.random.default_rng(7)
    opt = OPTIMIZERS["adagrad"]
    v, d = 16, 3
    table = _dense(rng, v, d, np.float32)
    slots = _init_slots(rng, opt, v, d)
    grad = rng.standard_normal((1, d)).astype(np.float32)  # S = 1
    z = np.zeros(0, np.int32)
    # N = 0: nothing changes.
    out_t, out_s = _run_apply(opt, table, slots, z, z, np.zeros(0, np.float32), grad, 1)
    np.testing.assert_array_equal(_bits(out_t), _bits(table))
    # All entries invalid: nothing changes.
    ids = np.array([-1, v, I32_MAX, 2], np.int32)
    seg = np.array([0, 0, 0, 1], np.int32)  # last one: segment out of range
    out_t, out_s = _run_apply(opt, table, slots, ids, seg, np.ones(4, np.float32), grad, 1)
    np.testing.assert_array_equal(_bits(out_t), _bits(table))
    np.testing.assert_array_equal(_bits(out_s["accumulator"]), _bits(slots["accumulator"]))
    # S = 1 with duplicates.
    ids = np.array([4, 4, 9, -1], np.int32)
    _check_apply(opt, table, slots, ids, np.zeros(4, np.int32), np.ones(4, np.float32), grad, 1)


def test_sparse_apply_nan_grad_only_hits_touched_rows():
    rng = np.random.default_rng(8)
    opt = OPTIMIZERS["rowwise_adagrad"]
    v, d, s = 40, 4, 4
    table = _dense(rng, v, d, np.float32)
    slots = _init_slots(rng, opt, v, d)
    grad = rng.standard_normal((s, d)).astype(np.float32)
    grad[1] = np.nan  # used by valid entries
    grad[3] = np.nan  # used only by invalid entries
    ids = np.array([5, 6, 7, -1, v, 8], np.int32)
    seg = np.array([0, 1, 2, 3, 3, 2], np.int32)
    coef = np.ones(6, np.float32)
    out_t, out_s = _run_apply(opt, table, slots, ids, seg, coef, grad, 1)
    assert np.all(np.isnan(out_t[6])) and np.isnan(out_s["accumulator"][6])
    clean = np.ones(v, bool)
    clean[6] = False
    assert np.all(np.isfinite(out_t[clean]))
    untouched = clean.copy()
    untouched[[5, 7, 8]] = False
    np.testing.assert_array_equal(_bits(out_t[untouched]), _bits(table[untouched]))
    # Rows touched only through finite gradients match the reference.
    ids2, seg2 = ids[[0, 2, 5]], seg[[0, 2, 5]]
    ref_t, _, _ = _apply_ref(opt, table, slots, ids2, seg2, coef[:3], grad, 1)
    np.testing.assert_allclose(out_t[[5, 7, 8]], ref_t[[5, 7, 8]], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_sparse_apply_donated_in_place(dtype):
    rng = np.random.default_rng(9)
    opt = OPTIMIZERS["lazy_adam"]
    v, d, s, n = 500, 16, 8, 64
    table_np, ids, seg, coef, grad = _apply_inputs(rng, v, d, s, n, dtype)
    slots_np = _init_slots(rng, opt, v, d)
    ref_t, ref_s, _ = _apply_ref(opt, table_np, slots_np, ids, seg, coef, grad, STEP)

    @jax.jit
    def step_keep(table, mu, nu):
        return _cpu_ffi.sparse_apply(table, (mu, nu), ids, seg, coef, grad, opt.hparams(),
                                     STEP, optimizer_code=type(opt).code)

    step_donate = jax.jit(step_keep.__wrapped__, donate_argnums=(0, 1, 2))

    # Without donation the inputs stay intact (XLA copies before the in-place kernel).
    table, mu, nu = (jnp.asarray(x) for x in (table_np, slots_np["mu"], slots_np["nu"]))
    t1, _ = step_keep(table, mu, nu)
    np.testing.assert_array_equal(_bits(table), _bits(table_np))
    np.testing.assert_array_equal(_bits(mu), _bits(slots_np["mu"]))

    # With donation the kernel updates the very same buffers.
    ptrs = [x.unsafe_buffer_pointer() for x in (table, mu, nu)]
    t2, (mu2, nu2) = step_donate(table, mu, nu)
    assert [x.unsafe_buffer_pointer() for x in (t2, mu2, nu2)] == ptrs
    assert table.is_deleted()
    np.testing.assert_array_equal(_bits(t2), _bits(t1))
    tol = dict(rtol=2.0**-7, atol=1e-6) if dtype == BF16 else dict(rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(t2).astype(np.float32), ref_t.astype(np.float32), **tol)
    np.testing.assert_allclose(np.asarray(mu2), ref_s["mu"], rtol=2e-5, atol=2e-6)


def test_wrapper_validation():
    table = jnp.zeros((4, 2))
    with pytest.raises(ValueError, match="slots"):
        _cpu_ffi.sparse_apply(table, (), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                              jnp.ones(1), jnp.zeros((1, 2)), jnp.zeros(8), 1, optimizer_code=1)
    with pytest.raises(TypeError):
        _cpu_ffi.spmm(jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                      jnp.zeros((3, 2), jnp.int32), 1)


def test_sparse_apply_sgd_bit_exact_vs_f32_sequential():
    """Per-row gradients are summed in f32 in ascending k; the update is w - lr*g.

    (XLA:CPU may contract `w - lr*g` into an FMA, so the jnp reference above agrees
    to an ulp or so; against an uncontracted f32 evaluation the kernel is exact.)
    """
    rng = np.random.default_rng(10)
    opt = OPTIMIZERS["sgd"]
    v, d, s, n = 50, 9, 6, 400
    table, ids, seg, coef, grad = _apply_inputs(rng, v, d, s, n, np.float32)
    valid = (ids >= 0) & (ids < v) & (seg >= 0) & (seg < s)
    g = np.zeros((v, d), np.float32)
    for k in np.nonzero(valid)[0]:
        g[ids[k]] = g[ids[k]] + coef[k] * grad[seg[k]]
    touched = np.zeros(v, bool)
    touched[ids[valid]] = True
    ref = table.copy()
    ref[touched] = table[touched] - np.float32(opt.learning_rate) * g[touched]
    out_t, _ = _run_apply(opt, table, {}, ids, seg, coef, grad, 1)
    np.testing.assert_array_equal(_bits(out_t), _bits(ref))
