"""`pairwise_dots` and its backward on the C++ CPU kernels (`csrc/sparsejax_interaction.cc`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _cpu_ffi


def pairwise_dots(x) -> jax.Array:
    """out[b, p] = <x[b, i], x[b, j]> for the p-th pair i < j in `np.triu_indices(F, 1)` order.

    Args:
      x: f32 or bf16 [B, F, D].
    Returns: x.dtype [B, F(F-1)/2] (accumulated in f32).
    """
    _cpu_ffi.require()
    x = _cpu_ffi.float_dense(x, "x", "[B, F, D]")
    b, f, _ = x.shape
    if b == 0 or f < 2:
        return jnp.zeros((b, f * (f - 1) // 2), x.dtype)
    out = jax.ShapeDtypeStruct((b, f * (f - 1) // 2), x.dtype)
    return jax.ffi.ffi_call(_cpu_ffi.PAIRWISE_DOTS_TARGET, out, vmap_method="broadcast_all")(x)


def pairwise_dots_bwd(g, x) -> jax.Array:
    """The vjp of `pairwise_dots`: dx[b, i] = sum_{j != i} g[b, pair(i, j)] * x[b, j].

    Args:
      g: [B, F(F-1)/2] cotangent (cast to x.dtype). x: f32 or bf16 [B, F, D].
    Returns: x.dtype [B, F, D].
    """
    _cpu_ffi.require()
    x = _cpu_ffi.float_dense(x, "x", "[B, F, D]")
    b, f, _ = x.shape
    g = jnp.asarray(g).astype(x.dtype)
    if g.shape != (b, f * (f - 1) // 2):
        raise ValueError(f"g must be [{b}, {f * (f - 1) // 2}], got {g.shape}")
    if x.size == 0 or f < 2:
        return jnp.zeros(x.shape, x.dtype)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ffi.ffi_call(_cpu_ffi.PAIRWISE_DOTS_BWD_TARGET, out, vmap_method="broadcast_all")(
        g, x
    )
