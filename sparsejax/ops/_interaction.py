"""`pairwise_dots`: DLRM's dot interaction, all pairwise dot products of F vectors.

    out[b, p] = <x[b, i], x[b, j]>   for the p-th pair (i, j), i < j, in row-major order
                                     (the order of `np.triu_indices(F, k=1)`)

XLA computes it as a batched `[F, D] x [D, F]` matmul and a gather of the upper
triangle; on CPU that batched dot of tiny matrices runs far below the machine's peak
and computes every product twice. The "cpu_ffi" kernel computes only the upper
triangle per example, in L1, and its backward is one fused kernel:

    dx[b, i] = sum_{j > i} g[b, (i, j)] * x[b, j] + sum_{j < i} g[b, (j, i)] * x[b, j]

Differentiation is a `jax.custom_vjp` (reverse mode: `jax.grad`, `jax.vjp`; forward
mode `jax.jvp` is not supported). Implementations: "xla" (every backend), "cpu_ffi"
(C++, f32/bf16); "pallas" has no kernel of its own for this op and runs the XLA one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from . import _checks, _dispatch

__all__ = ["pairwise_dots", "pairwise_dots_ref", "pairwise_dots_p", "pairwise_dots_bwd_p"]

_FFI_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def pairwise_dots_ref(x, *, implementation=None):
    """Pure-jnp reference with the same signature (`implementation` is ignored)."""
    del implementation
    x = jnp.asarray(x)
    i, j = np.triu_indices(x.shape[1], k=1)
    gram = jnp.einsum("bfd,bgd->bfg", x, x, preferred_element_type=jnp.float32)
    return gram[:, i, j].astype(x.dtype)


def pairwise_dots(x: jax.Array, *, implementation: str | None = None) -> jax.Array:
    """Dot products of every pair of the F vectors of each example, accumulated in f32.

    Args:
      x: `[B, F, D]` float array (f32 or bf16 for the "cpu_ffi" kernel; other float
        dtypes run the XLA implementation when `implementation` is None).
      implementation: "xla", "cpu_ffi", "pallas" (runs the XLA implementation) or
        None (best for the platform).

    Returns:
      `[B, F*(F-1)/2]` array of `x.dtype`: pairs (i, j), i < j, in row-major order.

    Example:
      >>> pairwise_dots(jnp.array([[[1., 0.], [1., 2.], [3., 4.]]]))
      Array([[ 1.,  3., 11.]], dtype=float32)
    """
    op = "pairwise_dots"
    _dispatch.check_implementation(implementation)
    _checks.check_array(op, "x", x, ndim=3, kind="float")
    if implementation == "cpu_ffi" and jnp.dtype(x.dtype) not in _FFI_DTYPES:
        raise TypeError(f"sparsejax.ops.{op}: `x` must be float32 or bfloat16 for "
                        f"implementation='cpu_ffi', got {x.dtype}")
    return _pairwise_dots(implementation, x)


# ---------------------------------------------------------------- implementations
def xla_pairwise_dots(x):
    """Batched einsum (f32 accumulation) + static gather of the strict upper triangle."""
    b, f, _ = x.shape
    gram = jnp.einsum("bfd,bgd->bfg", x, x, preferred_element_type=jnp.float32)
    flat = np.flatnonzero(np.triu(np.ones((f, f), bool), k=1))  # row-major i < j
    return jnp.take(gram.reshape(b, f * f), flat, axis=1).astype(x.dtype)


def xla_pairwise_dots_bwd(g, x):
    """dx = S @ x with S the symmetric, zero-diagonal [F, F] matrix of g (a static gather:
    one batched matmul instead of the two of autodiff through the einsum)."""
    b, f, _ = x.shape
    p = f * (f - 1) // 2
    where = np.full((f, f), p)  # (i, j) -> its pair's column of g; the diagonal -> a zero
    i, j = np.triu_indices(f, k=1)
    where[i, j] = where[j, i] = np.arange(p)
    g = jnp.concatenate([g.astype(x.dtype), jnp.zeros((b, 1), x.dtype)], axis=1)
    s = jnp.take(g, where.reshape(-1), axis=1).reshape(b, f, f)
    dx = jnp.einsum("bfg,bgd->bfd", s, x, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype)


def _ffi_fwd(x):
    from . import _cpu_ffi

    b, f, _ = x.shape
    if b == 0 or f < 2:
        return jnp.zeros((b, f * (f - 1) // 2), x.dtype)
    return _cpu_ffi.pairwise_dots(x)


def _ffi_bwd(g, x):
    from . import _cpu_ffi

    if x.size == 0 or x.shape[1] < 2:
        return jnp.zeros(x.shape, x.dtype)
    return _cpu_ffi.pairwise_dots_bwd(g, x)


def _choose(implementation, platform, dtype) -> str:
    impl = _dispatch.resolve_implementation(implementation, platform)
    if impl == "cpu_ffi" and jnp.dtype(dtype) not in _FFI_DTYPES:
        impl = "xla"  # only reachable with implementation=None (explicit: trace-time error)
    if impl == "pallas":
        impl = "xla"  # no Pallas kernel for this op
    _dispatch.log_choice("pairwise_dots", platform, implementation, impl)
    return impl


# ---------------------------------------------------------------- primitives
# Forward `x -> out` and backward `(g, x) -> dx`, each lowered per platform to the
# chosen implementation; the custom_vjp below ties them together.
pairwise_dots_p = Primitive("sparsejax_pairwise_dots")
pairwise_dots_bwd_p = Primitive("sparsejax_pairwise_dots_bwd")


def _fwd_abstract_eval(x, *, implementation):
    del implementation
    b, f, _ = x.shape
    return jax.core.ShapedArray((b, f * (f - 1) // 2), x.dtype)


def _bwd_abstract_eval(g, x, *, implementation):
    del g, implementation
    return jax.core.ShapedArray(x.shape, x.dtype)


def _fwd_lowering(platform):
    def rule(ctx, x, *, implementation):
        impl = _choose(implementation, platform, ctx.avals_in[0].dtype)
        fn = _ffi_fwd if impl == "cpu_ffi" else xla_pairwise_dots
        return mlir.lower_fun(fn, multiple_results=False)(ctx, x)

    return rule


def _bwd_lowering(platform):
    def rule(ctx, g, x, *, implementation):
        impl = _choose(implementation, platform, ctx.avals_in[1].dtype)
        fn = _ffi_bwd if impl == "cpu_ffi" else xla_pairwise_dots_bwd
        return mlir.lower_fun(fn, multiple_results=False)(ctx, g, x)

    return rule


@functools.cache
def _jitted(prim, implementation):
    return jax.jit(lambda *args: prim.bind(*args, implementation=implementation))


def _fold(args, dims):
    """Move the vmapped axis to the front of every arg and fold it into B."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    out = []
    for a, d in zip(args, dims, strict=True):
        a = batching.bdim_at_front(a, d, size) if d is not None else jnp.broadcast_to(
            a, (size, *a.shape))
        out.append(a.reshape(size * a.shape[1], *a.shape[2:]))
    return out, size


def _fwd_batch(args, dims, *, implementation):
    (x,), size = _fold(args, dims)
    out = pairwise_dots_p.bind(x, implementation=implementation)
    return out.reshape(size, -1, out.shape[-1]), 0


def _bwd_batch(args, dims, *, implementation):
    (g, x), size = _fold(args, dims)
    out = pairwise_dots_bwd_p.bind(g, x, implementation=implementation)
    return out.reshape(size, -1, *out.shape[1:]), 0


for _p, _abs, _low, _batch in [
    (pairwise_dots_p, _fwd_abstract_eval, _fwd_lowering, _fwd_batch),
    (pairwise_dots_bwd_p, _bwd_abstract_eval, _bwd_lowering, _bwd_batch),
]:
    _p.def_abstract_eval(_abs)
    _p.def_impl(functools.partial(lambda p, *args, implementation: _jitted(p, implementation)(
        *args), _p))
    mlir.register_lowering(_p, _low("xla_only"))
    mlir.register_lowering(_p, _low("cpu"), platform="cpu")
    mlir.register_lowering(_p, _low("cuda"), platform="cuda")
    batching.primitive_batchers[_p] = _batch


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pairwise_dots(implementation, x):
    return pairwise_dots_p.bind(x, implementation=implementation)


def _vjp_fwd(implementation, x):
    return pairwise_dots_p.bind(x, implementation=implementation), x


def _vjp_bwd(implementation, x, g):
    return (pairwise_dots_bwd_p.bind(g.astype(x.dtype), x, implementation=implementation),)


_pairwise_dots.defvjp(_vjp_fwd, _vjp_bwd)
