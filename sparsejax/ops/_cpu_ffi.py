"""Loading and registration of the C++ CPU kernels (`csrc/`, module `sparsejax._cpu_ext`).

On import this module tries to load the extension and registers its XLA FFI
targets for the CPU platform (once per process). Each op's `cpu_ffi.py` holds its
jnp-traceable wrapper (meant for `jit`: it lowers to a custom call that only the CPU
backend can run); the operand checks they share are here.

Entry `k` is valid iff `0 <= col_ids[k] < K` (`0 <= ids[k] < V` for `sparse_apply`)
and `0 <= segment_ids[k] < S`; invalid entries (e.g. padding `-1`) contribute
nothing and are never dereferenced. Dense/table dtype is float32 or bfloat16
(accumulation in f32, bf16 results rounded to nearest even).

Thread count: `$SPARSEJAX_CPU_THREADS` (default: the CPUs in the process's affinity mask).
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp

from .optimizers import num_slots_by_code

__all__ = ["is_available", "unavailable_reason", "require", "float_dense", "entries", "NUM_SLOTS"]

SPMM_TARGET = "sparsejax_spmm"
SEGMENT_MAX_TARGET = "sparsejax_segment_max"
SPARSE_APPLY_TARGET = "sparsejax_sparse_apply"
PAIRWISE_DOTS_TARGET = "sparsejax_pairwise_dots"
PAIRWISE_DOTS_BWD_TARGET = "sparsejax_pairwise_dots_bwd"
QUANTIZED_BAG_TARGET = "sparsejax_quantized_bag"

NUM_SLOTS = num_slots_by_code()
"""Slot count per optimizer code, derived from `optimizers.py` (the one Python source)."""


def optimizer_mismatch(built: dict[int, tuple[str, int]]) -> str | None:
    """Why the extension's optimizers disagree with `optimizers.py`, or None if they agree.

    `built` is `_cpu_ext.optimizers()`, {code: (class name, slot count)} from
    csrc/optimizers.h. A code or slot count on one side only would make sparse_apply
    read the wrong slots, so the extension is then not registered.
    """
    theirs = {int(code): int(slots) for code, (_, slots) in built.items()}
    if theirs == NUM_SLOTS:
        return None
    diffs = []
    for c in sorted(set(theirs) | set(NUM_SLOTS)):
        if theirs.get(c) != NUM_SLOTS.get(c):
            name = f" ({built[c][0]})" if c in theirs else ""
            diffs.append(
                f"code {c}{name}: optimizers.py {NUM_SLOTS.get(c, 'no')} slots, "
                f"C++ {theirs.get(c, 'no')}"
            )
    return (
        "the C++ extension's optimizer codes/slot counts (csrc/optimizers.h) differ from "
        f"sparsejax/ops/optimizers.py ({'; '.join(diffs)}); make them agree and rebuild "
        "with `python setup.py build_ext --inplace`"
    )


_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

_lock = threading.Lock()
_registered = False
_reason: str | None = None


def _register() -> None:
    global _registered, _reason
    with _lock:
        if _registered or _reason is not None:
            return
        try:
            from sparsejax import _cpu_ext
        except Exception as e:  # ImportError, or a broken/ABI-mismatched build
            _reason = (
                f"the C++ extension sparsejax._cpu_ext is not built or failed to load "
                f"({type(e).__name__}: {e})"
            )
            return
        try:
            _reason = optimizer_mismatch(_cpu_ext.optimizers())
        except AttributeError:  # a build older than csrc/optimizers.h
            _reason = (
                "the C++ extension sparsejax._cpu_ext is out of date (no optimizers()); "
                "rebuild it with `python setup.py build_ext --inplace`"
            )
        if _reason is not None:
            return
        try:
            for name, capsule in _cpu_ext.registrations().items():
                jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        except Exception as e:
            _reason = f"registering the CPU FFI targets failed ({type(e).__name__}: {e})"
            return
        _registered = True


_register()


def is_available() -> bool:
    """True if the C++ CPU kernels are built and registered with XLA."""
    return _registered


def unavailable_reason() -> str | None:
    """Why `is_available()` is False, or None if it is True."""
    return None if _registered else _reason


def custom_call_targets() -> list[str]:
    """The XLA custom-call targets of the C++ kernels: what an exported model that runs them
    must allow (`jax.export.DisabledSafetyCheck.custom_call`)."""
    return [v for k, v in globals().items() if k.endswith("_TARGET") and isinstance(v, str)]


def require() -> None:
    if not _registered:
        raise RuntimeError(f"sparsejax CPU FFI kernels unavailable: {_reason}")


def float_dense(x, what: str, shape: str) -> jax.Array:
    """`x` as an f32 or bf16 array of the rank `shape` names (e.g. "[K, D]")."""
    x = jnp.asarray(x)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} must be float32 or bfloat16, got {x.dtype}")
    if x.ndim != shape.count(",") + 1:
        raise ValueError(f"{what} must be {shape}, got {x.shape}")
    return x


def entries(values, col_ids, segment_ids):
    values = jnp.asarray(values, jnp.float32)
    col_ids = jnp.asarray(col_ids, jnp.int32)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    if not (values.ndim == col_ids.ndim == segment_ids.ndim == 1) or not (
        values.shape == col_ids.shape == segment_ids.shape
    ):
        raise ValueError(
            "values, col_ids and segment_ids must be rank-1 with equal length, got "
            f"{values.shape}, {col_ids.shape}, {segment_ids.shape}"
        )
    return values, col_ids, segment_ids
