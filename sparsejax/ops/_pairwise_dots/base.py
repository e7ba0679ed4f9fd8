"""`pairwise_dots` in plain jnp: the "xla" implementation, which is also the reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def pairwise_dots(x):
    """Batched einsum (f32 accumulation) + static gather of the strict upper triangle."""
    b, f, _ = x.shape
    gram = jnp.einsum("bfd,bgd->bfg", x, x, preferred_element_type=jnp.float32)
    flat = np.flatnonzero(np.triu(np.ones((f, f), bool), k=1))  # row-major i < j
    return jnp.take(gram.reshape(b, f * f), flat, axis=1).astype(x.dtype)


def pairwise_dots_ref(x, *, implementation=None):
    """Pure-jnp reference with the same signature (`implementation` is ignored)."""
    del implementation
    return pairwise_dots(jnp.asarray(x))


def pairwise_dots_bwd(g, x):
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
