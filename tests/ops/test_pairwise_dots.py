"""pairwise_dots (DLRM's dot interaction) vs float64 numpy: values, grads, vmap, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import ops

SHAPES = [
    (5, 27, 64),
    (3, 1, 8),
    (4, 2, 3),
    (7, 13, 17),
    (2, 9, 40),
    (3, 30, 100),
    (6, 5, 1),
    (1, 11, 12),
    (0, 4, 8),
]


def _x(seed, shape, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def _numpy_dots(x):
    x = np.asarray(x, np.float64)
    i, j = np.triu_indices(x.shape[1], k=1)
    return np.einsum("bfd,bgd->bfg", x, x)[:, i, j]


def _numpy_vjp(x, g):
    """dx[b, i] = sum_{j != i} g[b, pair(i, j)] * x[b, j]."""
    x, g = np.asarray(x, np.float64), np.asarray(g, np.float64)
    b, f, _ = x.shape
    s = np.zeros((b, f, f))
    i, j = np.triu_indices(f, k=1)
    s[:, i, j] = g
    s[:, j, i] = g
    return np.einsum("bfg,bgd->bfd", s, x)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_numpy(implementation, shape):
    x = _x(sum(shape), shape)
    out = jax.jit(lambda x: ops.pairwise_dots(x, implementation=implementation))(x)
    b, f, _ = shape
    assert out.shape == (b, f * (f - 1) // 2) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, _numpy_dots(x), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ops.pairwise_dots_ref(x), _numpy_dots(x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_vjp_matches_numpy(implementation, shape):
    x = _x(100 + sum(shape), shape)
    b, f, _ = shape
    g = _x(200 + sum(shape), (b, f * (f - 1) // 2))
    _, vjp = jax.vjp(lambda x: ops.pairwise_dots(x, implementation=implementation), jnp.asarray(x))
    (dx,) = jax.jit(vjp)(jnp.asarray(g))
    assert dx.shape == shape and dx.dtype == jnp.float32
    np.testing.assert_allclose(dx, _numpy_vjp(x, g), rtol=1e-5, atol=1e-4)


def test_grad_matches_the_reference_grad(implementation):
    x = jnp.asarray(_x(1, (6, 10, 24)))
    probe = jnp.asarray(_x(2, (6, 45)))

    def loss(fn, x):
        return jnp.sum(jnp.tanh(fn(x)) * probe)

    got = jax.jit(
        jax.grad(lambda x: loss(lambda v: ops.pairwise_dots(v, implementation=implementation), x))
    )(x)
    want = jax.grad(lambda x: loss(ops.pairwise_dots_ref, x))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_accumulates_in_float32(implementation):
    shape = (4, 12, 33)
    x = jnp.asarray(_x(3, shape), jnp.bfloat16)
    out = jax.jit(lambda x: ops.pairwise_dots(x, implementation=implementation))(x)
    assert out.dtype == jnp.bfloat16
    want = _numpy_dots(np.asarray(x, np.float32))  # exact dots of the bf16 inputs
    # f32 accumulation, then one bf16 rounding (relative 2^-8) of the result.
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2**-8, atol=1e-3)
    g = jnp.asarray(_x(4, (4, 66)), jnp.bfloat16)
    (dx,) = jax.vjp(lambda x: ops.pairwise_dots(x, implementation=implementation), x)[1](g)
    assert dx.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(dx, np.float32),
        _numpy_vjp(np.asarray(x, np.float32), np.asarray(g, np.float32)),
        rtol=2**-8,
        atol=1e-2,
    )


def test_vmap_over_an_extra_leading_axis(implementation):
    x = jnp.asarray(_x(5, (3, 4, 7, 9)))
    fn = jax.vmap(lambda x: ops.pairwise_dots(x, implementation=implementation))
    out = jax.jit(fn)(x)
    want = np.stack([_numpy_dots(x[n]) for n in range(3)])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
    # ...and the vmapped grad, with the mapped axis not in front.
    xt = jnp.moveaxis(x, 0, 2)  # [4, 7, 3, 9]: vmap over axis 2
    probe = jnp.asarray(_x(6, (3, 4, 21)))

    def loss(fn, xt):
        out = jax.vmap(fn, in_axes=2)(xt)
        return jnp.sum(out * probe)

    got = jax.grad(
        lambda v: loss(lambda y: ops.pairwise_dots(y, implementation=implementation), v)
    )(xt)
    want = jax.grad(lambda v: loss(ops.pairwise_dots_ref, v))(xt)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_eager_call_and_pair_order():
    x = jnp.asarray([[[1.0, 0.0], [1.0, 2.0], [3.0, 4.0]]])
    for impl in [None, "xla"]:
        np.testing.assert_array_equal(ops.pairwise_dots(x, implementation=impl), [[1.0, 3.0, 11.0]])


def test_other_float_dtypes_run_xla_by_default():
    x = jnp.asarray(_x(7, (2, 5, 6)), jnp.float16)
    out = ops.pairwise_dots(x)
    assert out.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(out, np.float32), _numpy_dots(x), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not ops.cpu_ffi_available(), reason="C++ extension not built")
def test_cpu_ffi_rejects_other_float_dtypes():
    with pytest.raises(TypeError, match="`x` must be float32 or bfloat16"):
        ops.pairwise_dots(jnp.ones((2, 3, 4), jnp.float16), implementation="cpu_ffi")


@pytest.mark.parametrize(
    "x,error,match",
    [
        (jnp.ones((3, 4)), ValueError, r"`x` must have rank 3, got shape \(3, 4\)"),
        (jnp.ones((2, 3, 4, 5)), ValueError, "`x` must have rank 3"),
        (jnp.ones((2, 3, 4), jnp.int32), TypeError, "`x` must be a float array, got int32"),
        ([[[1.0]]], TypeError, "`x` must be an array"),
    ],
)
def test_trace_time_errors_name_the_argument(x, error, match):
    with pytest.raises(error, match=match):
        jax.jit(ops.pairwise_dots).lower(x) if hasattr(x, "shape") else ops.pairwise_dots(x)


def test_unknown_implementation_is_an_error():
    with pytest.raises(ValueError, match="is not one of"):
        ops.pairwise_dots(jnp.ones((2, 3, 4)), implementation="cuda")


def test_choice_is_logged_and_pallas_runs_xla(caplog):
    import logging

    with caplog.at_level(logging.DEBUG, logger="sparsejax"):
        jax.jit(lambda x: ops.pairwise_dots(x, implementation="pallas"))(jnp.ones((2, 3, 4)))
    assert any("pairwise_dots on cpu: requested pallas -> xla" in r.message for r in caplog.records)
