"""Process settings that make XLA:CPU steps cheaper; applied once, before the CPU backend starts.

XLA:CPU allocates each execution's temporary buffer (every intermediate of a train step:
~110 MB for a B=4096 DLRM step) with `malloc` on its worker threads and frees it at the
end. With glibc's defaults a block that large is a fresh `mmap` each time (threads
allocate from per-thread arenas, whose blocks above 64 MiB are always mapped, and
mapped blocks are unmapped on free), so every step takes a page fault per 4 KiB it
touches: ~27,000 faults and ~50 ms of kernel time per step on 2 cores, more than the
step's whole sparse part. `tune_allocator` makes glibc serve large blocks from the
main heap (one arena, no `mmap`) and keep up to `TRIM_THRESHOLD` bytes of freed heap,
so the next step reuses the same pages without faults. The trade-off: memory freed at
the top of the heap (up to that threshold) and inside it stays with the process
instead of going back to the system, as with any caching allocator.

`SPARSEJAX_MALLOC_TUNING=0` leaves the allocator alone. Other C libraries, and
processes whose first JAX computation ran before this call (their XLA threads already
hold arenas), are unaffected.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

ENV = "SPARSEJAX_MALLOC_TUNING"
"""Environment variable: "0" turns `tune_allocator` into a no-op."""
TRIM_THRESHOLD = 1 << 30
"""Bytes of free heap top kept mapped (glibc's `M_TRIM_THRESHOLD`)."""

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8

_applied: bool | None = None


def tune_allocator() -> bool:
    """Configure glibc malloc so XLA:CPU's per-step temporary buffer is reused (see the
    module docstring). Idempotent; call it before the first JAX computation. Returns
    whether the settings are in effect (False off Linux/glibc or with
    `SPARSEJAX_MALLOC_TUNING=0`)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl's mallopt is a stub
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_ARENA_MAX, 1),
            (_M_MMAP_MAX, 0),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        )
    )
    return _applied
