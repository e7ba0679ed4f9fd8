"""The package's integer mixers: splitmix64's finalizer (numpy, 64-bit) and murmur3's
(32-bit, numpy or jnp: multi-hash tables' row hashes, stochastic rounding's noise)."""

from __future__ import annotations

import numpy as np


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping arithmetic): a fixed pseudo-random
    bijection of uint64, vectorized; returns a new array."""
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def mix32(x):
    """murmur3's 32-bit finalizer on uint32 (wrapping arithmetic), numpy or jnp (also
    inside a Pallas kernel); csrc/sparse_apply.cc has the same as Mix32."""
    if isinstance(x, np.ndarray):
        c1, c2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
    else:
        import jax.numpy as jnp

        c1, c2 = jnp.uint32(0x85EBCA6B), jnp.uint32(0xC2B2AE35)
    x = x ^ (x >> 16)
    x = x * c1
    x = x ^ (x >> 13)
    x = x * c2
    return x ^ (x >> 16)
