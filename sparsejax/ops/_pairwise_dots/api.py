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
from jax.interpreters import batching

from .. import _checks, _dispatch
from .._primitive import define_primitive
from . import base, cpu_ffi

__all__ = ["pairwise_dots", "pairwise_dots_p", "pairwise_dots_bwd_p"]

_FFI_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


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
        raise TypeError(
            f"sparsejax.ops.{op}: `x` must be float32 or bfloat16 for "
            f"implementation='cpu_ffi', got {x.dtype}"
        )
    return _pairwise_dots(implementation, x)


# ---------------------------------------------------------------- primitives
# Forward `x -> out` and backward `(g, x) -> dx`, each lowered per platform to the
# chosen implementation; the custom_vjp below ties them together.
def _choose(impl, avals_in):
    if impl == "cpu_ffi" and jnp.dtype(avals_in[-1].dtype) not in _FFI_DTYPES:
        return "xla"  # only reachable with implementation=None (explicit: trace-time error)
    return impl


def _fwd_abstract_eval(x, *, implementation):
    del implementation
    b, f, _ = x.shape
    return jax.core.ShapedArray((b, f * (f - 1) // 2), x.dtype)


def _bwd_abstract_eval(g, x, *, implementation):
    del g, implementation
    return jax.core.ShapedArray(x.shape, x.dtype)


def _fold(args, dims):
    """Move the vmapped axis to the front of every arg and fold it into B."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    out = []
    for a, d in zip(args, dims, strict=True):
        a = (
            batching.bdim_at_front(a, d, size)
            if d is not None
            else jnp.broadcast_to(a, (size, *a.shape))
        )
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


pairwise_dots_p = define_primitive(
    "pairwise_dots",
    abstract_eval=_fwd_abstract_eval,
    implementations={"xla": base.pairwise_dots, "cpu_ffi": cpu_ffi.pairwise_dots},
    batch_rule=_fwd_batch,
    choose=_choose,
)
pairwise_dots_bwd_p = define_primitive(
    "pairwise_dots_bwd",
    abstract_eval=_bwd_abstract_eval,
    implementations={"xla": base.pairwise_dots_bwd, "cpu_ffi": cpu_ffi.pairwise_dots_bwd},
    batch_rule=_bwd_batch,
    choose=_choose,
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pairwise_dots(implementation, x):
    return pairwise_dots_p.bind(x, implementation=implementation)


def _vjp_fwd(implementation, x):
    return pairwise_dots_p.bind(x, implementation=implementation), x


def _vjp_bwd(implementation, x, g):
    return (pairwise_dots_bwd_p.bind(g.astype(x.dtype), x, implementation=implementation),)


_pairwise_dots.defvjp(_vjp_fwd, _vjp_bwd)
