"""sparse_apply: every optimizer vs a dense reference (optax where one exists, float64
numpy otherwise) on the touched rows; untouched rows bit-identical; in place."""

import functools

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparsejax import ops

V, D, S, N = 40, 8, 6, 30
OPTIMIZERS = [
    ops.SGD(learning_rate=0.1),
    ops.Adagrad(learning_rate=0.1),
    ops.RowWiseAdagrad(learning_rate=0.1),
    ops.LazyAdam(learning_rate=0.05),
    ops.FTRL(learning_rate=0.2, l1=0.01, l2=0.1, beta=0.5),
    ops.AdagradDecay(learning_rate=0.1, accumulator_decay_step=2, accumulator_decay_rate=0.5),
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
            new["accumulator"] = np.maximum(new["accumulator"] * opt.accumulator_decay_rate,
                                            opt.initial_accumulator_value)
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
        decayed = np.maximum(slots["accumulator"] * opt.accumulator_decay_rate ** behind[:, None],
                             opt.initial_accumulator_value)
        slots["accumulator"] = np.where(behind[:, None] > 0, decayed, slots["accumulator"])
        del slots["decay_power"]
    return slots


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("combiner", ops.COMBINERS)
def test_matches_float64_reference_over_steps(implementation, opt, combiner):
    rng = np.random.default_rng(11)
    table = rng.normal(size=(V, D)).astype(np.float32)
    slots = {k: np.asarray(v) for k, v in opt.init_slots(V, D).items()}
    want_w = table.astype(np.float64)
    want_slots = {k: v.astype(np.float64) for k, v in slots.items()}
    apply = jax.jit(functools.partial(ops.sparse_apply, optimizer=opt, combiner=combiner,
                                      implementation=implementation))
    got_w, got_slots = jnp.asarray(table), {k: jnp.asarray(v) for k, v in slots.items()}
    for step in range(1, 6):  # crosses AdagradDecay periods; rows skip some steps
        ids, seg, weights, grad = _batch(rng)
        g, touched = _dense_grad(np.asarray(got_w), ids, seg, weights, grad, combiner)
        want_w, want_slots = _numpy_step(opt, want_w, want_slots, g, touched, step)
        got_w, got_slots = apply(got_w, got_slots, jnp.asarray(ids), jnp.asarray(seg),
                                 jnp.asarray(grad), step=step, weights=jnp.asarray(weights))
        np.testing.assert_allclose(got_w, want_w, rtol=2e-5, atol=2e-5)
        for k, got in _effective_slots(opt, got_slots, step).items():
            np.testing.assert_allclose(got, want_slots[k], rtol=2e-5, atol=2e-5)
        want_w = np.asarray(got_w, np.float64)  # keep float32 drift from compounding


@pytest.mark.parametrize("make_opt,tx", [
    (lambda: ops.SGD(learning_rate=0.3), optax.sgd(0.3)),
    (lambda: ops.Adagrad(learning_rate=0.3, initial_accumulator_value=0.1, eps=1e-7),
     optax.adagrad(0.3, initial_accumulator_value=0.1, eps=1e-7)),
    (lambda: ops.LazyAdam(learning_rate=0.01), optax.adam(0.01)),
], ids=["sgd", "adagrad", "adam"])
def test_matches_optax_when_every_row_is_touched(implementation, make_opt, tx):
    opt = make_opt()
    rng = np.random.default_rng(4)
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
    dense, state = table, tx.init(table)
    slots = opt.init_slots(V, D)
    for step in range(1, 5):
        ids, seg, weights, grad = _batch(rng, cover_all=True)
        args = (jnp.asarray(ids), jnp.asarray(seg), S)
        g = jax.grad(lambda t, args=args, w=weights, g=grad: jnp.vdot(
            ops.embedding_bag_ref(t, *args, weights=w), g))(dense)
        with jax.numpy_dtype_promotion("standard"):  # optax.adam mixes int and float
            upd, state = tx.update(g, state, dense)
        dense = optax.apply_updates(dense, upd)
        table, slots = ops.sparse_apply(table, slots, args[0], args[1], jnp.asarray(grad),
                                        optimizer=opt, step=step, weights=jnp.asarray(weights),
                                        implementation=implementation)
        np.testing.assert_allclose(table, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_untouched_rows_bit_identical_even_with_nan_grads(implementation, opt):
    rng = np.random.default_rng(7)
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.bfloat16)
    slots = opt.init_slots(V, D)
    ids = jnp.array([3, 3, 17, -1, 25], jnp.int32)
    seg = jnp.array([0, 1, 1, 2, 2], jnp.int32)
    grad = jnp.asarray(rng.normal(size=(3, D)), jnp.float32).at[1, 2].set(jnp.nan)
    new, new_slots = ops.sparse_apply(table, slots, ids, seg, grad, optimizer=opt, step=1,
                                      implementation=implementation)
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


@pytest.mark.parametrize("impl", ["xla", pytest.param("cpu_ffi", marks=pytest.mark.skipif(
    not ops.cpu_ffi_available(), reason="C++ extension not built"))])
def test_update_is_in_place_under_donation(impl):
    opt = ops.RowWiseAdagrad(learning_rate=0.1)
    table = jnp.asarray(np.random.default_rng(0).normal(size=(5000, 16)), jnp.float32)
    slots = opt.init_slots(5000, 16)
    step = jax.jit(functools.partial(ops.sparse_apply, optimizer=opt, step=1,
                                     implementation=impl), donate_argnums=(0, 1))
    before = (table.unsafe_buffer_pointer(), slots["accumulator"].unsafe_buffer_pointer())
    ids = jnp.array([1, 4000, 4000], jnp.int32)
    table, slots = step(table, slots, ids, jnp.array([0, 0, 1], jnp.int32),
                        jnp.ones((2, 16), jnp.float32))
    after = (table.unsafe_buffer_pointer(), slots["accumulator"].unsafe_buffer_pointer())
    assert before == after


def test_bad_slots_and_shapes_are_named():
    opt = ops.Adagrad(learning_rate=0.1)
    table = jnp.zeros((10, 4))
    ids = seg = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="needs slots"):
        ops.sparse_apply(table, {}, ids, seg, jnp.zeros((2, 4)), optimizer=opt, step=1)
    with pytest.raises(ValueError, match="slot 'accumulator' must be float32\\[10, 4\\]"):
        ops.sparse_apply(table, {"accumulator": jnp.zeros((10,))}, ids, seg, jnp.zeros((2, 4)),
                         optimizer=opt, step=1)
    with pytest.raises(ValueError, match="`grad` has dim 5"):
        ops.sparse_apply(table, opt.init_slots(10, 4), ids, seg, jnp.zeros((2, 5)),
                         optimizer=opt, step=1)
