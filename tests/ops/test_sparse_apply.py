"""sparse_apply: every optimizer vs a dense reference (optax where one exists, float64
numpy otherwise) on the touched rows; untouched rows bit-identical; in place; vmap.
Then each backend's kernels at the edges only they have (C++ threads and junk ids,
Pallas tilings, CUDA lowering with donation)."""

import functools
import zlib

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparsejax import ops

V, D, S, N = 40, 8, 6, 30
OPTIMIZERS = ref.OPTIMIZERS
STEP = 7  # with AdagradDecay's period of 3 steps: period 2, stored powers 0..2 cover all
SDS = jax.ShapeDtypeStruct
needs_cpu_ffi = pytest.mark.skipif(not ops.cpu_ffi_available(), reason="C++ extension not built")

# The grids below run in full on "xla" and "cpu_ffi". "pallas" (interpret mode here: each
# optimizer's kernel costs seconds to compile) and None (the platform's default, which
# is one of those two on a CPU) run a diagonal that meets every optimizer and every
# combiner: the combiner only shapes the coefficients computed before the update kernel
# (max adds the segment-max kernel, which test_embedding_bag checks per implementation),
# and each optimizer's Pallas update is also checked on its own by test_pallas_apply_rows
# and test_pallas_hot_id_over_many_chunks.
FULL = ["xla", pytest.param("cpu_ffi", marks=needs_cpu_ffi)]
DIAGONAL = {
    "SGD": "sqrtn",
    "Adagrad": "mean",
    "RowWiseAdagrad": "max",
    "LazyAdam": "sum",
    "FTRL": "max",
    "AdagradDecay": "mean",
}


def _impl_value(impl):
    return impl.values[0] if hasattr(impl, "values") else impl


def _impl_marks(impl):
    return impl.marks if hasattr(impl, "marks") else ()


def _grid(combiners=ops.COMBINERS):
    """(implementation, optimizer, combiner): full on FULL, the diagonal on the others."""
    cases = []
    for impl in [*FULL, "pallas", None]:
        value = _impl_value(impl)
        for opt in OPTIMIZERS:
            name = type(opt).__name__
            for combiner in combiners:
                if value in ("pallas", None) and combiner != DIAGONAL[name]:
                    continue
                cases.append(
                    pytest.param(
                        value,
                        opt,
                        combiner,
                        id=f"{value}-{combiner}-{name}",
                        marks=_impl_marks(impl),
                    )
                )
    return cases


def _by_impl(values, reduced, ids):
    """(implementation, value): every value on FULL, only `reduced` on the others."""
    return [
        pytest.param(_impl_value(impl), v, id=f"{_impl_value(impl)}-{i}", marks=_impl_marks(impl))
        for impl in [*FULL, "pallas", None]
        for v, i in zip(values, ids, strict=True)
        if _impl_value(impl) not in ("pallas", None) or i in reduced
    ]


def _batch(rng, *, cover_all=False, nnz=N):
    ids, seg = ref.random_bags(rng, vocab=V, num_segments=S, nnz=nnz)
    if cover_all:  # every row looked up at least once (for optimizers with dense momentum)
        ids = np.concatenate([ids, rng.permutation(V).astype(np.int32)])
        seg = np.concatenate([seg, np.full(V, S - 1, np.int32)])
    weights = rng.uniform(0.5, 1.5, len(ids)).astype(np.float32)
    grad = rng.normal(size=(S, D)).astype(np.float32)
    return ids, seg, weights, grad


def _dense_grad(table, ids, seg, weights, grad, combiner):
    """The dense float64 gradient of <pooled, grad> w.r.t. the table, and touched rows."""
    t = np.asarray(table, np.float64)
    g = np.zeros_like(t)
    for s in range(S):
        ks = [k for k in range(len(ids)) if seg[k] == s and 0 <= ids[k] < V]
        if not ks:
            continue
        w = np.asarray(weights, np.float64)[ks]
        if combiner == "max":
            rows = w[:, None] * t[ids[ks]]
            win = rows.argmax(0)
            for d in range(D):
                g[ids[ks][win[d]], d] += w[win[d]] * grad[s, d]
            continue
        norm = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
        for k, wk in zip(ks, w, strict=True):
            g[ids[k]] += wk / norm * grad[s]
    touched = np.zeros(V, bool)
    touched[ids[(ids >= 0) & (ids < V)]] = True
    return g, touched


def _numpy_step(opt, table, slots, g, touched, step):
    """float64 dense optimizer step, applied to touched rows only (lazy semantics)."""
    w, new = np.array(table, np.float64), {k: np.array(v, np.float64) for k, v in slots.items()}
    r = touched
    lr = opt.learning_rate
    if isinstance(opt, ops.SGD):
        w[r] -= lr * g[r]
    elif isinstance(opt, ops.Adagrad):
        acc = new["accumulator"][r] + g[r] ** 2
        w[r] -= lr * g[r] / np.sqrt(acc + opt.eps)
        new["accumulator"][r] = acc
    elif isinstance(opt, ops.RowWiseAdagrad):
        acc = new["accumulator"][r] + (g[r] ** 2).mean(1)
        w[r] -= lr * g[r] / (np.sqrt(acc)[:, None] + opt.eps)
        new["accumulator"][r] = acc
    elif isinstance(opt, ops.LazyAdam):
        mu = opt.b1 * new["mu"][r] + (1 - opt.b1) * g[r]
        nu = opt.b2 * new["nu"][r] + (1 - opt.b2) * g[r] ** 2
        w[r] -= lr * (mu / (1 - opt.b1**step)) / (np.sqrt(nu / (1 - opt.b2**step)) + opt.eps)
        new["mu"][r], new["nu"][r] = mu, nu
    elif isinstance(opt, ops.FTRL):
        n, z = new["accumulator"][r], new["linear"][r]
        n_new = n + g[r] ** 2
        z = z + g[r] - (np.sqrt(n_new) - np.sqrt(n)) / lr * w[r]
        quad = (opt.beta + np.sqrt(n_new)) / lr + 2 * opt.l2
        w[r] = np.where(np.abs(z) > opt.l1, (np.sign(z) * opt.l1 - z) / quad, 0.0)
        new["accumulator"][r], new["linear"][r] = n_new, z
    elif isinstance(opt, ops.AdagradDecay):
        # Dense form: every row decays at each period boundary; touched rows then update.
        period = step // opt.accumulator_decay_step
        if period > (step - 1) // opt.accumulator_decay_step:
            new["accumulator"] = np.maximum(
                new["accumulator"] * opt.accumulator_decay_rate, opt.initial_accumulator_value
            )
        acc = new["accumulator"][r] + g[r] ** 2
        w[r] -= lr * g[r] / np.sqrt(acc)
        new["accumulator"][r] = acc
        new.pop("decay_power", None)
    return w, new


def _effective_slots(opt, slots, step):
    """AdagradDecay decays a row's accumulator lazily, on its next touch; bring every row
    up to date so the state compares with the dense reference's."""
    slots = {k: np.asarray(v, np.float64) for k, v in slots.items()}
    if isinstance(opt, ops.AdagradDecay):
        behind = step // opt.accumulator_decay_step - slots["decay_power"]
        decayed = np.maximum(
            slots["accumulator"] * opt.accumulator_decay_rate ** behind[:, None],
            opt.initial_accumulator_value,
        )
        slots["accumulator"] = np.where(behind[:, None] > 0, decayed, slots["accumulator"])
        del slots["decay_power"]
    return slots


@pytest.mark.parametrize("implementation,opt,combiner", _grid())
def test_matches_float64_reference_over_steps(implementation, opt, combiner):
    rng = np.random.default_rng(11)
    table = rng.normal(size=(V, D)).astype(np.float32)
    slots = {k: np.asarray(v) for k, v in opt.init_slots(V, D).items()}
    want_w = table.astype(np.float64)
    want_slots = {k: v.astype(np.float64) for k, v in slots.items()}
    apply = jax.jit(
        functools.partial(
            ops.sparse_apply, optimizer=opt, combiner=combiner, implementation=implementation
        )
    )
    got_w, got_slots = jnp.asarray(table), {k: jnp.asarray(v) for k, v in slots.items()}
    for step in range(1, 6):  # crosses an AdagradDecay period; rows skip some steps
        ids, seg, weights, grad = _batch(rng)
        g, touched = _dense_grad(np.asarray(got_w), ids, seg, weights, grad, combiner)
        want_w, want_slots = _numpy_step(opt, want_w, want_slots, g, touched, step)
        got_w, got_slots = apply(
            got_w,
            got_slots,
            jnp.asarray(ids),
            jnp.asarray(seg),
            jnp.asarray(grad),
            step=step,
            weights=jnp.asarray(weights),
        )
        np.testing.assert_allclose(got_w, want_w, rtol=2e-5, atol=2e-5)
        for k, got in _effective_slots(opt, got_slots, step).items():
            np.testing.assert_allclose(got, want_slots[k], rtol=2e-5, atol=2e-5)
        want_w = np.asarray(got_w, np.float64)  # keep float32 drift from compounding


@pytest.mark.parametrize(
    "implementation,pair",
    _by_impl(
        [
            (lambda: ops.SGD(learning_rate=0.3), optax.sgd(0.3)),
            (
                lambda: ops.Adagrad(learning_rate=0.3, initial_accumulator_value=0.1, eps=1e-7),
                optax.adagrad(0.3, initial_accumulator_value=0.1, eps=1e-7),
            ),
            (lambda: ops.LazyAdam(learning_rate=0.01), optax.adam(0.01)),
        ],
        reduced={"adam"},
        ids=["sgd", "adagrad", "adam"],
    ),
)
def test_matches_optax_when_every_row_is_touched(implementation, pair):
    make_opt, tx = pair
    opt = make_opt()
    rng = np.random.default_rng(4)
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
    dense, state = table, tx.init(table)
    slots = opt.init_slots(V, D)
    for step in range(1, 5):
        ids, seg, weights, grad = _batch(rng, cover_all=True)
        args = (jnp.asarray(ids), jnp.asarray(seg), S)
        g = jax.grad(
            lambda t, args=args, w=weights, g=grad: jnp.vdot(
                ops.embedding_bag_ref(t, *args, weights=w), g
            )
        )(dense)
        with jax.numpy_dtype_promotion("standard"):  # optax.adam mixes int and float
            upd, state = tx.update(g, state, dense)
        dense = optax.apply_updates(dense, upd)
        table, slots = ops.sparse_apply(
            table,
            slots,
            args[0],
            args[1],
            jnp.asarray(grad),
            optimizer=opt,
            step=step,
            weights=jnp.asarray(weights),
            implementation=implementation,
        )
        np.testing.assert_allclose(table, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "implementation,opt",
    _by_impl(OPTIMIZERS, reduced={"RowWiseAdagrad", "LazyAdam"}, ids=ref.OPT_IDS),
)
def test_untouched_rows_bit_identical_even_with_nan_grads(implementation, opt):
    rng = np.random.default_rng(7)
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.bfloat16)
    slots = opt.init_slots(V, D)
    ids = jnp.array([3, 3, 17, -1, 25], jnp.int32)
    seg = jnp.array([0, 1, 1, 2, 2], jnp.int32)
    grad = jnp.asarray(rng.normal(size=(3, D)), jnp.float32).at[1, 2].set(jnp.nan)
    new, new_slots = ops.sparse_apply(
        table, slots, ids, seg, grad, optimizer=opt, step=1, implementation=implementation
    )
    touched = np.zeros(V, bool)
    touched[[3, 17, 25]] = True
    old_bits = np.asarray(table).view(np.uint16)
    new_bits = np.asarray(new).view(np.uint16)
    np.testing.assert_array_equal(new_bits[~touched], old_bits[~touched])
    for k, v in new_slots.items():
        np.testing.assert_array_equal(np.asarray(v)[~touched], np.asarray(slots[k])[~touched])
    assert not np.isnan(np.asarray(new[25], np.float32)).any()  # bag 2 had no NaN
    if not isinstance(opt, ops.FTRL):  # FTRL's thresholding may legitimately zero NaN rows
        assert np.isnan(np.asarray(new[17], np.float32)).any()


@pytest.mark.parametrize("impl", ["xla", pytest.param("cpu_ffi", marks=needs_cpu_ffi)])
def test_update_is_in_place_under_donation(impl):
    opt = ops.RowWiseAdagrad(learning_rate=0.1)
    table = jnp.asarray(np.random.default_rng(0).normal(size=(5000, 16)), jnp.float32)
    slots = opt.init_slots(5000, 16)
    step = jax.jit(
        functools.partial(ops.sparse_apply, optimizer=opt, step=1, implementation=impl),
        donate_argnums=(0, 1),
    )
    before = (table.unsafe_buffer_pointer(), slots["accumulator"].unsafe_buffer_pointer())
    ids = jnp.array([1, 4000, 4000], jnp.int32)
    table, slots = step(
        table, slots, ids, jnp.array([0, 0, 1], jnp.int32), jnp.ones((2, 16), jnp.float32)
    )
    after = (table.unsafe_buffer_pointer(), slots["accumulator"].unsafe_buffer_pointer())
    assert before == after


def test_bad_slots_and_shapes_are_named():
    opt = ops.Adagrad(learning_rate=0.1)
    table = jnp.zeros((10, 4))
    ids = seg = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="needs slots"):
        ops.sparse_apply(table, {}, ids, seg, jnp.zeros((2, 4)), optimizer=opt, step=1)
    with pytest.raises(ValueError, match="slot 'accumulator' must be float32\\[10, 4\\]"):
        ops.sparse_apply(
            table,
            {"accumulator": jnp.zeros((10,))},
            ids,
            seg,
            jnp.zeros((2, 4)),
            optimizer=opt,
            step=1,
        )
    with pytest.raises(ValueError, match="`grad` has dim 5"):
        ops.sparse_apply(
            table, opt.init_slots(10, 4), ids, seg, jnp.zeros((2, 5)), optimizer=opt, step=1
        )


@pytest.mark.parametrize(
    "implementation,opt",
    _by_impl(
        [ref.optimizer("RowWiseAdagrad"), ref.optimizer("LazyAdam")],
        reduced={"RowWiseAdagrad"},  # the batching rule does not depend on the backend
        ids=["RowWiseAdagrad", "LazyAdam"],
    ),
)
def test_vmap_equals_a_loop_of_single_calls(implementation, opt):
    rng = np.random.default_rng(13)
    batch = [_batch(rng) for _ in range(3)]
    ids, seg, weights, grad = (jnp.asarray(np.stack([b[i] for b in batch])) for i in range(4))
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
    slots = opt.init_slots(V, D)

    def apply(t, sl, i, s, g, w):
        return ops.sparse_apply(
            t, sl, i, s, g, optimizer=opt, step=2, weights=w, implementation=implementation
        )

    # vmap over the batches with a shared table: one updated table per batch
    got_t, got_s = jax.jit(jax.vmap(apply, in_axes=(None, None, 0, 0, 0, 0)))(
        table, slots, ids, seg, grad, weights
    )
    # ... and over stacked tables too (eagerly: the batching rule outside jit)
    tables = jnp.stack([table, 2 * table, -table])
    got_t2, _ = jax.vmap(apply, in_axes=(0, None, 0, 0, 0, 0))(
        tables, slots, ids, seg, grad, weights
    )
    single = jax.jit(apply)  # the loop of single calls: one compilation for all six
    for b in range(3):
        want_t, want_s = single(table, slots, ids[b], seg[b], grad[b], weights[b])
        np.testing.assert_allclose(got_t[b], want_t, rtol=1e-6, atol=1e-6)
        for k in slots:
            np.testing.assert_allclose(got_s[k][b], want_s[k], rtol=1e-6, atol=1e-6)
        want_t2, _ = single(tables[b], slots, ids[b], seg[b], grad[b], weights[b])
        np.testing.assert_allclose(got_t2[b], want_t2, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ cpu_ffi: the C++ kernel
CPU_TOL = {
    np.dtype(np.float32): dict(rtol=2e-5, atol=2e-6),
    np.dtype(ref.BF16): dict(rtol=2.0**-7, atol=1e-6),
}  # a 1-ulp f32 difference may
# flip a bf16 rounding


def _junk_apply_inputs(rng, v, d, s, n, dtype):
    table = rng.standard_normal((v, d)).astype(np.float32).astype(dtype)
    ids = rng.integers(0, v, n)
    ids[rng.random(n) < 0.3] = ids[0] if n else 0  # duplicates
    seg = rng.integers(0, s, n)  # unsorted
    bad = rng.random(n) < 0.15
    ids[bad] = rng.choice(np.array([-1, v, v + 3, ref.I32_MAX, ref.I32_MIN]), int(bad.sum()))
    bad_seg = rng.random(n) < 0.05
    seg[bad_seg] = rng.choice(np.array([-1, s, ref.I32_MAX, ref.I32_MIN]), int(bad_seg.sum()))
    coef = rng.standard_normal(n).astype(np.float32)
    coef[rng.random(n) < 0.1] = 0.0  # touched with zero weight
    grad = rng.standard_normal((s, d)).astype(np.float32)
    return table, ids.astype(np.int32), seg.astype(np.int32), coef, grad


def _run_cpu(opt, table, slots, ids, seg, coef, grad, step):
    from sparsejax.ops._sparse_apply import cpu_ffi

    names = [sp.name for sp in opt.slots()]
    outs = cpu_ffi.sparse_apply(
        jnp.asarray(table),
        *(jnp.asarray(slots[n]) for n in names),
        ids,
        seg,
        coef,
        grad,
        opt.hparams(),
        step,
        optimizer=opt,
    )
    return np.asarray(outs[0]), {n: np.asarray(x) for n, x in zip(names, outs[1:], strict=True)}


def _check_cpu(opt, table, slots, ids, seg, coef, grad, step):
    out_t, out_s = _run_cpu(opt, table, slots, ids, seg, coef, grad, step)
    by_row = ref.row_grads(ids, seg, coef, grad, table.shape[0])
    touched = ref.check_apply(
        opt, table, slots, out_t, out_s, by_row, step, CPU_TOL[np.dtype(table.dtype)]
    )
    return out_t, out_s, touched


@needs_cpu_ffi
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=ref.OPT_IDS)
@pytest.mark.parametrize(
    "dtype,d",
    [(np.float32, 1), (np.float32, 3), (np.float32, 129), (ref.BF16, 64)],
    ids=["f32-d1", "f32-d3", "f32-d129", "bf16-d64"],
)
def test_cpu_kernel_on_junk_ids(opt, dtype, d):
    rng = np.random.default_rng(zlib.crc32(f"{type(opt).__name__}-{d}".encode()))
    v, s, n = 60, 7, 120
    table, ids, seg, coef, grad = _junk_apply_inputs(rng, v, d, s, n, dtype)
    slots = ref.random_slots(opt, v, d, rng)
    _, _, touched = _check_cpu(opt, table, slots, ids, seg, coef, grad, STEP)
    assert touched.any() and not touched.all()


@needs_cpu_ffi
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=ref.OPT_IDS)
def test_cpu_kernel_zero_coef_row_is_touched(opt):
    """A valid id is updated (slots advance) even when all its weights are 0."""
    rng = np.random.default_rng(5)
    v, d = 10, 4
    table = rng.standard_normal((v, d)).astype(np.float32)
    slots = ref.random_slots(opt, v, d, rng)
    if "decay_power" in slots:
        slots["decay_power"][:] = 0  # row 3 must decay and advance its power
    ids = np.array([3, 5, 3], np.int32)
    coef = np.array([0.0, 1.0, 0.0], np.float32)
    seg = np.array([0, 1, 1], np.int32)
    grad = rng.standard_normal((2, d)).astype(np.float32)
    out_t, out_s, touched = _check_cpu(opt, table, slots, ids, seg, coef, grad, STEP)
    assert touched[3]
    if isinstance(opt, ops.LazyAdam | ops.AdagradDecay):
        assert not np.array_equal(out_t[3], table[3]) or any(
            not np.array_equal(out_s[k][3], slots[k][3]) for k in slots
        )


@needs_cpu_ffi
def test_cpu_kernel_threads_bit_identical(monkeypatch):
    rng = np.random.default_rng(6)
    for name in ("RowWiseAdagrad", "LazyAdam", "AdagradDecay"):
        opt = ref.optimizer(name)
        v, d, s, n = 3000, 8, 50, 9000
        table, ids, seg, coef, grad = _junk_apply_inputs(rng, v, d, s, n, np.float32)
        slots = ref.random_slots(opt, v, d, rng)
        outs = []
        # pool "xla": the threads of XLA's intra-op pool (the FFI call's), else ours
        for threads, pool in [("1", "own"), ("2", "own"), ("5", "own"), ("2", "xla"), ("5", "xla")]:
            monkeypatch.setenv("SPARSEJAX_CPU_THREADS", threads)
            monkeypatch.setenv("SPARSEJAX_CPU_MIN_PARALLEL", "1")
            monkeypatch.setenv("SPARSEJAX_CPU_POOL", pool)
            if threads == "1":
                outs.append(_check_cpu(opt, table, slots, ids, seg, coef, grad, STEP)[:2])
            else:
                outs.append(_run_cpu(opt, table, slots, ids, seg, coef, grad, STEP))
        for t, sl in outs[1:]:
            np.testing.assert_array_equal(ref.bits(t), ref.bits(outs[0][0]))
            for k in sl:
                np.testing.assert_array_equal(ref.bits(sl[k]), ref.bits(outs[0][1][k]))


@needs_cpu_ffi
def test_cpu_kernel_edge_cases():
    rng = np.random.default_rng(7)
    opt = ref.optimizer("Adagrad")
    v, d = 16, 3
    table = rng.standard_normal((v, d)).astype(np.float32)
    slots = ref.random_slots(opt, v, d, rng)
    grad = rng.standard_normal((1, d)).astype(np.float32)  # S = 1
    z = np.zeros(0, np.int32)
    # N = 0: nothing changes.
    out_t, out_s = _run_cpu(opt, table, slots, z, z, np.zeros(0, np.float32), grad, 1)
    np.testing.assert_array_equal(ref.bits(out_t), ref.bits(table))
    # All entries invalid: nothing changes.
    ids = np.array([-1, v, ref.I32_MAX, 2], np.int32)
    seg = np.array([0, 0, 0, 1], np.int32)  # last one: segment out of range
    out_t, out_s = _run_cpu(opt, table, slots, ids, seg, np.ones(4, np.float32), grad, 1)
    np.testing.assert_array_equal(ref.bits(out_t), ref.bits(table))
    np.testing.assert_array_equal(ref.bits(out_s["accumulator"]), ref.bits(slots["accumulator"]))
    # S = 1 with duplicates.
    ids = np.array([4, 4, 9, -1], np.int32)
    _check_cpu(opt, table, slots, ids, np.zeros(4, np.int32), np.ones(4, np.float32), grad, 1)


@needs_cpu_ffi
def test_cpu_kernel_nan_grad_only_hits_touched_rows():
    rng = np.random.default_rng(8)
    opt = ref.optimizer("RowWiseAdagrad")
    v, d, s = 40, 4, 4
    table = rng.standard_normal((v, d)).astype(np.float32)
    slots = ref.random_slots(opt, v, d, rng)
    grad = rng.standard_normal((s, d)).astype(np.float32)
    grad[1] = np.nan  # used by valid entries
    grad[3] = np.nan  # used only by invalid entries
    ids = np.array([5, 6, 7, -1, v, 8], np.int32)
    seg = np.array([0, 1, 2, 3, 3, 2], np.int32)
    coef = np.ones(6, np.float32)
    out_t, out_s = _run_cpu(opt, table, slots, ids, seg, coef, grad, 1)
    assert np.all(np.isnan(out_t[6])) and np.isnan(out_s["accumulator"][6])
    clean = np.ones(v, bool)
    clean[6] = False
    assert np.all(np.isfinite(out_t[clean]))
    untouched = clean.copy()
    untouched[[5, 7, 8]] = False
    np.testing.assert_array_equal(ref.bits(out_t[untouched]), ref.bits(table[untouched]))
    # Rows touched only through finite gradients match the reference.
    by_row = ref.row_grads(ids[[0, 2, 5]], seg[[0, 2, 5]], coef[:3], grad, v)
    want_t, _ = ref.apply_row_grads(opt, table, slots, by_row, 1)
    np.testing.assert_allclose(out_t[[5, 7, 8]], want_t[[5, 7, 8]], rtol=2e-5, atol=2e-6)


@needs_cpu_ffi
@pytest.mark.parametrize("dtype", [np.float32, ref.BF16], ids=["f32", "bf16"])
def test_cpu_kernel_donated_in_place(dtype):
    from sparsejax.ops._sparse_apply import cpu_ffi

    rng = np.random.default_rng(9)
    opt = ref.optimizer("LazyAdam")
    v, d, s, n = 500, 16, 8, 64
    table_np, ids, seg, coef, grad = _junk_apply_inputs(rng, v, d, s, n, dtype)
    slots_np = ref.random_slots(opt, v, d, rng)
    want_t, want_s = ref.apply_row_grads(
        opt, table_np, slots_np, ref.row_grads(ids, seg, coef, grad, v), STEP
    )

    @jax.jit
    def step_keep(table, mu, nu):
        return cpu_ffi.sparse_apply(
            table, mu, nu, ids, seg, coef, grad, opt.hparams(), STEP, optimizer=opt
        )

    step_donate = jax.jit(step_keep.__wrapped__, donate_argnums=(0, 1, 2))

    # Without donation the inputs stay intact (XLA copies before the in-place kernel).
    table, mu, nu = (jnp.asarray(x) for x in (table_np, slots_np["mu"], slots_np["nu"]))
    t1 = step_keep(table, mu, nu)[0]
    np.testing.assert_array_equal(ref.bits(table), ref.bits(table_np))
    np.testing.assert_array_equal(ref.bits(mu), ref.bits(slots_np["mu"]))

    # With donation the kernel updates the very same buffers.
    ptrs = [x.unsafe_buffer_pointer() for x in (table, mu, nu)]
    t2, mu2, nu2 = step_donate(table, mu, nu)
    assert [x.unsafe_buffer_pointer() for x in (t2, mu2, nu2)] == ptrs
    assert table.is_deleted()
    np.testing.assert_array_equal(ref.bits(t2), ref.bits(t1))
    np.testing.assert_allclose(ref.f64(t2), ref.f64(want_t), **CPU_TOL[np.dtype(dtype)])
    np.testing.assert_allclose(np.asarray(mu2), want_s["mu"], rtol=2e-5, atol=2e-6)


@needs_cpu_ffi
def test_cpu_wrapper_validation_and_codes():
    from sparsejax.ops import _cpu_ffi, optimizers
    from sparsejax.ops._sparse_apply import cpu_ffi

    with pytest.raises(ValueError, match="takes 1 slots, got 0"):
        cpu_ffi.sparse_apply(
            jnp.zeros((4, 2)),
            jnp.zeros(1, jnp.int32),
            jnp.zeros(1, jnp.int32),
            jnp.ones(1),
            jnp.zeros((1, 2)),
            jnp.zeros(8),
            1,
            optimizer=ref.optimizer("Adagrad"),
        )
    # optimizers.py is the one Python source of codes and slot counts.
    assert _cpu_ffi.NUM_SLOTS == {0: 0, 1: 1, 2: 1, 3: 2, 4: 2, 5: 2}
    assert {c: cls.__name__ for c, cls in optimizers.OPTIMIZERS_BY_CODE.items()} == {
        0: "SGD",
        1: "Adagrad",
        2: "RowWiseAdagrad",
        3: "LazyAdam",
        4: "FTRL",
        5: "AdagradDecay",
    }


@needs_cpu_ffi
def test_cpu_kernel_sgd_bit_exact_vs_f32_sequential():
    """Per-row gradients are summed in f32 in ascending k; the update is w - lr*g.

    (XLA:CPU may contract `w - lr*g` into an FMA, so the jnp reference agrees to an ulp
    or so; against an uncontracted f32 evaluation the kernel is exact.)
    """
    rng = np.random.default_rng(10)
    opt = ref.optimizer("SGD")
    v, d, s, n = 50, 9, 6, 400
    table, ids, seg, coef, grad = _junk_apply_inputs(rng, v, d, s, n, np.float32)
    valid = ref.valid_mask(ids, seg, v, s)
    g = np.zeros((v, d), np.float32)
    for k in np.nonzero(valid)[0]:
        g[ids[k]] = g[ids[k]] + coef[k] * grad[seg[k]]
    touched = np.zeros(v, bool)
    touched[ids[valid]] = True
    want = table.copy()
    want[touched] = table[touched] - np.float32(opt.learning_rate) * g[touched]
    out_t, _ = _run_cpu(opt, table, {}, ids, seg, coef, grad, 1)
    np.testing.assert_array_equal(ref.bits(out_t), ref.bits(want))


# ------------------------------------------------------------------ pallas: the Triton kernels
def _pallas():
    from sparsejax.ops._sparse_apply import pallas_triton

    return pallas_triton


def _slot_tuple(opt, slots):
    return tuple(jnp.asarray(slots[s.name]) for s in opt.slots())


def _slot_dict(opt, slots):
    return {s.name: v for s, v in zip(opt.slots(), slots, strict=True)}


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=ref.OPT_IDS)
def test_pallas_apply_rows(opt):
    rng = np.random.default_rng(0)
    vocab, num_u, dim = 50, 29, 96
    uids = rng.permutation(vocab)[:num_u].astype(np.int32)
    uids[[3, 11, 12, 28]] = [-1, vocab, -7, vocab + 100]  # skipped, anywhere
    grads = rng.normal(size=(num_u, dim)).astype(np.float32)
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32)
    slots = ref.random_slots(opt, vocab, dim, rng)
    f = jax.jit(functools.partial(_pallas().apply_rows, optimizer=opt, interpret=True))
    new_table, new_slots = f(
        table,
        _slot_tuple(opt, slots),
        jnp.asarray(uids),
        jnp.asarray(grads),
        opt.hparams(),
        jnp.int32(STEP),
    )
    by_row = {int(u): grads[i].astype(np.float64) for i, u in enumerate(uids) if 0 <= u < vocab}
    ref.check_apply(
        opt, table, slots, new_table, _slot_dict(opt, new_slots), by_row, STEP, ref.TOL[jnp.float32]
    )


def test_pallas_apply_rows_bf16_table():
    rng = np.random.default_rng(5)
    opt, vocab, dim = ref.optimizer("RowWiseAdagrad"), 40, 64
    uids = np.array([3, -1, 17, 39, 0, 40], np.int32)
    grads = rng.normal(size=(6, dim)).astype(np.float32)
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.bfloat16)
    slots = ref.random_slots(opt, vocab, dim, rng)
    f = jax.jit(
        functools.partial(_pallas().apply_rows, optimizer=opt, rows_per_step=4, interpret=True)
    )
    new_table, new_slots = f(
        table,
        _slot_tuple(opt, slots),
        jnp.asarray(uids),
        jnp.asarray(grads),
        opt.hparams(),
        jnp.int32(1),
    )
    by_row = {int(u): grads[i].astype(np.float64) for i, u in enumerate(uids) if 0 <= u < vocab}
    ref.check_apply(
        opt, table, slots, new_table, _slot_dict(opt, new_slots), by_row, 1, ref.TOL[jnp.bfloat16]
    )


def _pallas_apply(opt, table, slots, ids, seg, coef, grad, step, config=None):
    f = jax.jit(
        functools.partial(_pallas().sparse_apply, optimizer=opt, config=config, interpret=True)
    )
    outs = f(
        table,
        *_slot_tuple(opt, slots),
        jnp.asarray(ids),
        jnp.asarray(seg),
        jnp.asarray(coef),
        jnp.asarray(grad),
        opt.hparams(),
        jnp.int32(step),
    )
    return outs[0], _slot_dict(opt, outs[1:])


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=ref.OPT_IDS)
def test_pallas_hot_id_over_many_chunks(opt):
    rng = np.random.default_rng(11)
    vocab, num_segments, dim = 40, 10, 96
    lengths = ref.bag_lengths(rng, num_segments, long=220)
    # id 5 is hot: about half of all lookups, so its run spans > 3 chunks of 32.
    ids, seg, coef = ref.make_lookups(rng, lengths, vocab, n_bad=10, dup_id=5)
    assert np.sum((ids == 5) & ref.valid_mask(ids, seg, vocab, num_segments)) > 3 * 32
    coef[np.flatnonzero(ids == 9)] = 0.0  # touched with a zero gradient
    grad = rng.normal(size=(num_segments, dim)).astype(np.float32)
    grad[0] = np.nan  # bag 0 is empty: its gradient must never leak anywhere
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32)
    slots = ref.random_slots(opt, vocab, dim, rng)
    new_table, new_slots = _pallas_apply(opt, table, slots, ids, seg, coef, grad, STEP)
    by_row = ref.row_grads(ids, seg, coef, grad, vocab)
    assert 5 in by_row and np.isfinite(np.asarray(new_table)).all()
    ref.check_apply(opt, table, slots, new_table, new_slots, by_row, STEP, ref.TOL[jnp.float32])


def test_pallas_bf16_table_small_dim_and_chunk():
    rng = np.random.default_rng(12)
    opt, vocab, num_segments, dim = ref.optimizer("Adagrad"), 25, 7, 8
    ids, seg, coef = ref.make_lookups(
        rng, ref.bag_lengths(rng, num_segments, long=30), vocab, n_bad=6
    )
    grad = rng.normal(size=(num_segments, dim)).astype(np.float32)
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.bfloat16)
    slots = ref.random_slots(opt, vocab, dim, rng)
    new_table, new_slots = _pallas_apply(
        opt, table, slots, ids, seg, coef, grad, 2, config=_pallas().Config(chunk=8)
    )
    ref.check_apply(
        opt,
        table,
        slots,
        new_table,
        new_slots,
        ref.row_grads(ids, seg, coef, grad, vocab),
        2,
        ref.TOL[jnp.bfloat16],
    )


def test_pallas_nothing_valid():
    opt = ref.optimizer("LazyAdam")
    table = jnp.arange(40.0, dtype=jnp.float32).reshape(5, 8)
    slots = opt.init_slots(5, 8)
    ids = np.array([-1, 5, 9, 2], np.int32)
    seg = np.array([0, 1, 1, 4], np.int32)  # id 2 is valid but its segment is not
    new_table, new_slots = _pallas_apply(
        opt, table, slots, ids, seg, np.ones(4, np.float32), np.ones((3, 8), np.float32), 1
    )
    np.testing.assert_array_equal(np.asarray(new_table), np.asarray(table))
    for k in slots:
        np.testing.assert_array_equal(np.asarray(new_slots[k]), np.asarray(slots[k]))


def _slot_structs(opt, vocab, dim):
    return tuple(
        SDS((vocab,) if s.per_row else (vocab, dim), jnp.dtype(s.dtype)) for s in opt.slots()
    )


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=ref.OPT_IDS)
def test_pallas_kernels_lower_for_cuda_with_donation(opt):
    n, s, v, dim = 4096, 256, 100_000, 96
    table = SDS((v, dim), jnp.float32)
    slots = _slot_structs(opt, v, dim)
    hp, step = SDS((8,), jnp.float32), SDS((), jnp.int32)
    i = SDS((n,), jnp.int32)
    n_state = 1 + len(slots)
    txt = ref.lower_for_cuda(
        functools.partial(_pallas().apply_rows, optimizer=opt),
        table,
        slots,
        i,
        SDS((n, dim), jnp.float32),
        hp,
        step,
        donate_argnums=(0, 1),
    )
    assert "__gpu$xla.gpu.triton" in txt
    # Donated table and slots alias the jit outputs and, inside, the kernel's outputs:
    # the update is in place.
    assert txt.count("tf.aliasing_output") == n_state
    assert txt.count("stablehlo.output_operand_alias<") == n_state
    txt = ref.lower_for_cuda(
        lambda t, sl, *a: _pallas().sparse_apply(t, *sl, *a, optimizer=opt),
        table,
        slots,
        i,
        i,
        SDS((n,), jnp.float32),
        SDS((s, dim), jnp.float32),
        hp,
        step,
        donate_argnums=(0, 1),
    )
    assert txt.count("__gpu$xla.gpu.triton") >= 2  # spmm + apply_rows
    assert txt.count("tf.aliasing_output") == n_state


def test_pallas_bf16_table_optimizer_lowers_for_cuda():
    opt, n, s, v = ref.optimizer("LazyAdam"), 4096, 256, 100_000
    i = SDS((n,), jnp.int32)
    txt = ref.lower_for_cuda(
        lambda t, sl, *a: _pallas().sparse_apply(t, *sl, *a, optimizer=opt),
        SDS((v, 128), jnp.bfloat16),
        _slot_structs(opt, v, 128),
        i,
        i,
        SDS((n,), jnp.float32),
        SDS((s, 128), jnp.float32),
        SDS((8,), jnp.float32),
        SDS((), jnp.int32),
        donate_argnums=(0, 1),
    )
    assert "__gpu$xla.gpu.triton" in txt


def test_pallas_heuristic_config():
    cfg = _pallas().get_heuristic_config
    assert cfg(96) == _pallas().Config(chunk=32, rows_per_step=8)
    assert cfg(1000).rows_per_step == 4


# ---------------------------------------------------------------------------------------
# stochastic rounding of bf16 tables


@pytest.mark.parametrize("sr", [False, True])
def test_stochastic_rounding_is_unbiased_and_every_backend_writes_the_same_bits(sr):
    """Updates below half a bf16 step: rounding to nearest drops them (and biases larger
    ones); stochastic rounding keeps their mean. XLA, C++ and Pallas agree bit for bit."""
    v, d, steps = 64, 16, 60
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.uniform(0.5, 2.0, (v, d)), jnp.bfloat16)
    ids = jnp.arange(v, dtype=jnp.int32)
    g = jnp.asarray(rng.uniform(2e-4, 2e-3, (v, d)), jnp.float32)  # the step: 2**-7 at 1..2
    opt = ops.SGD(learning_rate=1.0, stochastic_rounding=sr)
    impls = ["xla", "pallas"] + (["cpu_ffi"] if ops.cpu_ffi_available() else [])
    got = {}
    for impl in impls:
        t = table
        for step in range(1, steps + 1):
            t, _ = ops.sparse_apply(
                t, {}, ids, ids, g, optimizer=opt, step=step, implementation=impl
            )
        got[impl] = np.asarray(t.astype(jnp.float32))
    for impl in impls:
        np.testing.assert_array_equal(got[impl], got["xla"], err_msg=impl)
    exact = np.asarray(table, np.float64) - steps * np.asarray(g, np.float64)
    bias = float(np.mean(got["xla"] - exact))
    if sr:  # unbiased: the mean error is a small fraction of the drift (60 x ~1e-3)
        assert abs(bias) < 2e-3
        assert not np.array_equal(got["xla"], np.asarray(table, np.float32))
    else:  # most updates round away: the table lags far behind
        assert bias > 0.02


def test_stochastic_rounding_leaves_f32_tables_and_untouched_rows_alone():
    rng = np.random.default_rng(1)
    t32 = jnp.asarray(rng.normal(size=(20, 4)), jnp.float32)
    ids, seg = jnp.array([2, 5], jnp.int32), jnp.array([0, 1], jnp.int32)
    g = jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)
    a, _ = ops.sparse_apply(t32, {}, ids, seg, g, optimizer=ops.SGD(learning_rate=0.1), step=3)
    b, _ = ops.sparse_apply(
        t32, {}, ids, seg, g, optimizer=ops.SGD(learning_rate=0.1, stochastic_rounding=True), step=3
    )
    np.testing.assert_array_equal(a, b)
    t16 = t32.astype(jnp.bfloat16)
    c, _ = ops.sparse_apply(
        t16, {}, ids, seg, g, optimizer=ops.SGD(learning_rate=0.1, stochastic_rounding=True), step=3
    )
    untouched = np.setdiff1d(np.arange(20), [2, 5])
    np.testing.assert_array_equal(np.asarray(c)[untouched], np.asarray(t16)[untouched])


def test_pallas_stochastic_rounding_lowers_for_cuda():
    opt = ops.RowWiseAdagrad(learning_rate=0.1, stochastic_rounding=True)
    n, s, v = 1024, 64, 10_000
    i = SDS((n,), jnp.int32)
    txt = ref.lower_for_cuda(
        lambda t, sl, *a: _pallas().sparse_apply(t, *sl, *a, optimizer=opt),
        SDS((v, 64), jnp.bfloat16),
        _slot_structs(opt, v, 64),
        i,
        i,
        SDS((n,), jnp.float32),
        SDS((s, 64), jnp.float32),
        SDS((8,), jnp.float32),
        SDS((), jnp.int32),
        donate_argnums=(0, 1),
    )
    assert "__gpu$xla.gpu.triton" in txt
