"""splitmix64's finalizer: the one 64-bit mixer of the package's numpy hashing."""

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
