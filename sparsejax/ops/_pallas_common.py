"""Pieces every Pallas-Triton kernel of the package shares.

Rules every kernel follows (Triton lowering and interpret mode both):
- every in-kernel array has a power-of-two size: D is padded to `Dp` with a column mask;
- ids are clamped before they index a load (a negative id would be a huge offset on the
  GPU) and the load is masked; a masked-off *store* lane points past the end of the
  array (row V), where interpret mode's scatter drops it and the GPU never writes;
- atomics use a scalar row index and a slice (interpret mode loses duplicate indices
  in an array-indexed atomic, and cannot run a masked one);
- accumulation is in f32; `compiler_params` selects Triton (not Mosaic GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltr

INT_MAX = 2**31 - 1


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_pow2(name: str, n: int) -> int:
    n = int(n)
    if n < 1 or n & (n - 1):
        raise ValueError(f"sparsejax Pallas kernels: {name} must be a power of two, got {n}")
    return n


def compiler_params(num_warps: int) -> pltr.CompilerParams:
    """Triton parameters. num_stages=1: Triton does not software-pipeline gathers; the
    kernels prefetch ids by hand instead."""
    return pltr.CompilerParams(num_warps=num_warps, num_stages=1)


def iota(n: int) -> jax.Array:
    return lax.iota(jnp.int32, n)
