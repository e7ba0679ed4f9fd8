"""Python side of the C++ CPU kernels (`csrc/sparsejax_cpu.cc`, module `sparsejax._cpu_ext`).

On import this module tries to load the extension and registers its XLA FFI
targets for the CPU platform (once per process). The wrappers below are
jnp-traceable and meant to be called inside `jit` (they lower to a custom call that
only the CPU backend can run).

Entry `k` is valid iff `0 <= col_ids[k] < K` (`0 <= ids[k] < V` for `sparse_apply`)
and `0 <= segment_ids[k] < S`; invalid entries (e.g. padding `-1`) contribute
nothing and are never dereferenced. Dense/table dtype is float32 or bfloat16
(accumulation in f32, bf16 results rounded to nearest even).

Thread count: `$SPARSEJAX_CPU_THREADS` (default: all hardware threads).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "is_available",
    "unavailable_reason",
    "spmm",
    "segment_max",
    "sparse_apply",
    "pairwise_dots",
    "pairwise_dots_bwd",
    "NUM_SLOTS",
]

SPMM_TARGET = "sparsejax_spmm"
SEGMENT_MAX_TARGET = "sparsejax_segment_max"
SPARSE_APPLY_TARGET = "sparsejax_sparse_apply"
PAIRWISE_DOTS_TARGET = "sparsejax_pairwise_dots"
PAIRWISE_DOTS_BWD_TARGET = "sparsejax_pairwise_dots_bwd"

NUM_SLOTS = {0: 0, 1: 1, 2: 1, 3: 2, 4: 2, 5: 2}
"""Slot count per optimizer code (SGD, Adagrad, RowWiseAdagrad, LazyAdam, FTRL, AdagradDecay)."""

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
            _reason = (f"the C++ extension sparsejax._cpu_ext is not built or failed to load "
                       f"({type(e).__name__}: {e})")
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


def _require() -> None:
    if not _registered:
        raise RuntimeError(f"sparsejax CPU FFI kernels unavailable: {_reason}")


def _float_dense(x, what: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} must be float32 or bfloat16, got {x.dtype}")
    return x


def _entries(values, col_ids, segment_ids):
    values = jnp.asarray(values, jnp.float32)
    col_ids = jnp.asarray(col_ids, jnp.int32)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    if not (values.ndim == col_ids.ndim == segment_ids.ndim == 1) or not (
        values.shape == col_ids.shape == segment_ids.shape
    ):
        raise ValueError("values, col_ids and segment_ids must be rank-1 with equal length, got "
                         f"{values.shape}, {col_ids.shape}, {segment_ids.shape}")
    return values, col_ids, segment_ids


def spmm(values, col_ids, segment_ids, dense, num_segments: int) -> jax.Array:
    """out[s] = sum over valid k with segment_ids[k] == s of values[k] * dense[col_ids[k]].

    Args:
      values: f32[N] weights, or None for all ones (the kernel then reads no values).
      col_ids: i32[N] rows of `dense`. segment_ids: i32[N].
      dense: f32 or bf16 [K, D].
      num_segments: S (static).
    Returns: dense.dtype [S, D]; empty segments are 0.
    """
    _require()
    if values is None:  # f32[0] tells the kernel that every value is 1
        _, col_ids, segment_ids = _entries(jnp.zeros(jnp.shape(col_ids)), col_ids, segment_ids)
        values = jnp.zeros((0,), jnp.float32)
    else:
        values, col_ids, segment_ids = _entries(values, col_ids, segment_ids)
    dense = _float_dense(dense, "dense")
    if dense.ndim != 2:
        raise ValueError(f"dense must be [K, D], got {dense.shape}")
    out = jax.ShapeDtypeStruct((int(num_segments), dense.shape[1]), dense.dtype)
    return jax.ffi.ffi_call(SPMM_TARGET, out, vmap_method="sequential")(
        values, col_ids, segment_ids, dense)


def segment_max(values, col_ids, segment_ids, dense, num_segments: int):
    """Max-pooling counterpart of `spmm`.

    Returns (out dense.dtype[S, D], argk i32[S, D]): out[s, d] is the max over valid k
    in segment s of values[k] * dense[col_ids[k], d] (computed in f32; NaN wins),
    argk[s, d] the smallest k attaining it. Empty segments: out 0, argk -1.
    """
    _require()
    values, col_ids, segment_ids = _entries(values, col_ids, segment_ids)
    dense = _float_dense(dense, "dense")
    if dense.ndim != 2:
        raise ValueError(f"dense must be [K, D], got {dense.shape}")
    shape = (int(num_segments), dense.shape[1])
    outs = (jax.ShapeDtypeStruct(shape, dense.dtype), jax.ShapeDtypeStruct(shape, jnp.int32))
    out, argk = jax.ffi.ffi_call(SEGMENT_MAX_TARGET, outs, vmap_method="sequential")(
        values, col_ids, segment_ids, dense)
    return out, argk


def sparse_apply(table, slots: Sequence[jax.Array], ids, segment_ids, coef, grad, hparams,
                 step, *, optimizer_code: int):
    """Lazy row-sparse optimizer step, in place when `table`/`slots` are donated.

    For every unique valid id r: g = sum over its entries k of coef[k] * grad[segment_ids[k]]
    (f32), then row r of (table, slots) is updated by the optimizer's `update_rows`
    (sparsejax/ops/optimizers.py). Untouched rows are bit-identical.

    Args:
      table: f32 or bf16 [V, D].
      slots: the optimizer's slots in `opt.slots()` order (f32 [V, D] / [V]; the
        AdagradDecay `decay_power` slot is int32 [V]).
      ids, segment_ids: i32[N]. coef: f32[N]. grad: f32[S, D].
      hparams: f32[8] from `opt.hparams()`. step: i32 scalar (1-based).
      optimizer_code: `type(opt).code`.
    Returns: (table, tuple(slots)), aliased to the inputs.
    """
    _require()
    code = int(optimizer_code)
    if code not in NUM_SLOTS:
        raise ValueError(f"unknown optimizer code {optimizer_code}")
    slots = tuple(slots)
    if len(slots) != NUM_SLOTS[code]:
        raise ValueError(f"optimizer code {code} takes {NUM_SLOTS[code]} slots, got {len(slots)}")
    table = _float_dense(table, "table")
    if table.ndim != 2:
        raise ValueError(f"table must be [V, D], got {table.shape}")
    ids, segment_ids = jnp.asarray(ids, jnp.int32), jnp.asarray(segment_ids, jnp.int32)
    coef = jnp.asarray(coef, jnp.float32)
    grad = jnp.asarray(grad, jnp.float32)
    hparams = jnp.asarray(hparams, jnp.float32)
    step = jnp.asarray(step, jnp.int32).reshape(())
    if hparams.shape != (8,):
        raise ValueError(f"hparams must be f32[8], got {hparams.shape}")
    if grad.ndim != 2 or grad.shape[1] != table.shape[1]:
        raise ValueError(f"grad must be [S, {table.shape[1]}], got {grad.shape}")
    state = (table, *slots)
    out_types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state)
    outs = jax.ffi.ffi_call(
        SPARSE_APPLY_TARGET,
        out_types,
        input_output_aliases={i: i for i in range(len(state))},
        vmap_method="sequential",
    )(*state, ids, segment_ids, coef, grad, hparams, step, optimizer=np.int32(code))
    return outs[0], tuple(outs[1:])


def pairwise_dots(x) -> jax.Array:
    """out[b, p] = <x[b, i], x[b, j]> for the p-th pair i < j in `np.triu_indices(F, 1)` order.

    Args:
      x: f32 or bf16 [B, F, D].
    Returns: x.dtype [B, F(F-1)/2] (accumulated in f32).
    """
    _require()
    x = _float_dense(x, "x")
    if x.ndim != 3:
        raise ValueError(f"x must be [B, F, D], got {x.shape}")
    b, f, _ = x.shape
    out = jax.ShapeDtypeStruct((b, f * (f - 1) // 2), x.dtype)
    return jax.ffi.ffi_call(PAIRWISE_DOTS_TARGET, out, vmap_method="broadcast_all")(x)


def pairwise_dots_bwd(g, x) -> jax.Array:
    """The vjp of `pairwise_dots`: dx[b, i] = sum_{j != i} g[b, pair(i, j)] * x[b, j].

    Args:
      g: [B, F(F-1)/2] cotangent (cast to x.dtype). x: f32 or bf16 [B, F, D].
    Returns: x.dtype [B, F, D].
    """
    _require()
    x = _float_dense(x, "x")
    if x.ndim != 3:
        raise ValueError(f"x must be [B, F, D], got {x.shape}")
    b, f, _ = x.shape
    g = jnp.asarray(g).astype(x.dtype)
    if g.shape != (b, f * (f - 1) // 2):
        raise ValueError(f"g must be [{b}, {f * (f - 1) // 2}], got {g.shape}")
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ffi.ffi_call(PAIRWISE_DOTS_BWD_TARGET, out, vmap_method="broadcast_all")(g, x)
