"""`segment_spmm` as a Pallas-Triton kernel (GPU; `interpret=True` runs it on the CPU).

Segment-sorted sparse x dense in fixed chunks of C nonzeros. Each program reduces its
chunk sequentially; rows that start and end inside the chunk are stored once, the
chunk's first and last rows (which may continue in the neighbouring chunks) are
`atomic_add`ed into a zero-initialised, aliased f32 output. A hot row spread over many
chunks is therefore split evenly, without a counter protocol. The kernel rules shared
by every kernel are in `sparsejax.ops._pallas_common`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from .._pallas_common import check_pow2, compiler_params, iota, next_pow2
from . import base


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling of the spmm kernel."""

    chunk: int = 32
    """Nonzeros per program (C), any positive int; read in groups of gcd(C, 8) row loads
    issued back to back (8 loads in flight for C = 32)."""
    block_d: int = 128
    """Output columns per program (a power of two)."""
    num_warps: int = 1
    """Triton warps per program."""


def get_heuristic_config(dim: int) -> Config:
    """One program spans up to 128 columns of the padded dim, one warp per 128 columns."""
    block_d = min(next_pow2(dim), 128)
    return Config(block_d=block_d, num_warps=max(1, block_d // 128))


def _spmm_kernel(
    rows_ref,
    cols_ref,
    vals_ref,
    dense_ref,
    _zeros_ref,
    out_ref,
    *,
    chunk: int,
    block_d: int,
    dim: int,
    group: int,
):
    """One chunk of `chunk` nonzeros x one `block_d` column block of the output."""
    base = pl.program_id(0) * chunk
    dcols = pl.program_id(1) * block_d + iota(block_d)
    col_ok = None if dim % block_d == 0 else dcols < dim
    first, last = rows_ref[base], rows_ref[base + chunk - 1]  # rows are sorted

    def body(g, carry):
        acc, first_acc, last_acc = carry
        k0 = base + g * group
        # Issue the group's row loads before consuming them (loads in flight).
        xs = []
        for t in range(group):
            col = cols_ref[k0 + t]
            mask = jnp.broadcast_to(col >= 0, (block_d,))  # col < 0: padding/invalid
            if col_ok is not None:
                mask = mask & col_ok
            x = pltr.load(dense_ref.at[jnp.maximum(col, 0), dcols], mask=mask, other=0)
            xs.append((vals_ref[k0 + t], x))
        rows = [rows_ref[k0 + t] for t in range(group)]
        rows.append(rows_ref[jnp.minimum(k0 + group, base + chunk - 1)])
        for t, (val, x) in enumerate(xs):
            acc = acc + val * x.astype(jnp.float32)
            r = rows[t]
            chunk_end = k0 + t == base + chunk - 1
            seg_end = (r != rows[t + 1]) | chunk_end
            is_first = r == first
            first_acc = jnp.where(seg_end & is_first, acc, first_acc)
            last_acc = jnp.where(chunk_end & jnp.logical_not(is_first), acc, last_acc)
            # A row that starts and ends inside this chunk has all its entries here:
            # store it once. (Array column index: in interpret mode a scalar-and-slice
            # store copies the whole output; masked-off lanes rewrite row r's value.)
            interior = seg_end & jnp.logical_not(is_first) & (r != last)
            pltr.store(out_ref.at[r, dcols], acc, mask=jnp.broadcast_to(interior, (block_d,)))
            acc = jnp.where(seg_end, 0.0, acc)
        return acc, first_acc, last_acc

    zero = jnp.zeros((block_d,), jnp.float32)
    _, first_acc, last_acc = lax.fori_loop(0, chunk // group, body, (zero, zero, zero))
    # Boundary rows may continue in neighbouring chunks: add, don't store. When the
    # chunk holds one row only, last_acc is zero. Scalar row index + slice: exact in
    # interpret mode too.
    out_cols = pl.ds(pl.program_id(1) * block_d, block_d)
    pltr.atomic_add(out_ref, (first, out_cols), first_acc)
    pltr.atomic_add(out_ref, (last, out_cols), last_acc)


def spmm_f32(
    values, col_ids, segment_ids, dense, num_segments, *, chunk, block_d, num_warps, interpret
):
    """f32[num_segments, Dp] (Dp = padded dim), the kernel's raw output."""
    nnz = values.shape[0]
    k, dim = dense.shape
    dp = next_pow2(dim)
    block_d = min(dp, block_d or get_heuristic_config(dim).block_d)
    check_pow2("block_d", block_d)
    num_warps = num_warps or max(1, block_d // 128)
    if nnz == 0 or num_segments == 0 or k == 0:
        return jnp.zeros((num_segments, dp), jnp.float32)
    valid = base.valid_entries(col_ids, segment_ids, k, num_segments)
    # Invalid entries keep the array sorted (running max of the valid ids) and read nothing.
    rows = lax.cummax(jnp.where(valid, segment_ids, 0).astype(jnp.int32), axis=0)
    cols = jnp.where(valid, col_ids, -1).astype(jnp.int32)
    vals = jnp.where(valid, values.astype(jnp.float32), 0.0)
    n_chunks = -(-nnz // chunk)
    pad = n_chunks * chunk - nnz
    if pad:
        rows = jnp.concatenate([rows, jnp.broadcast_to(rows[-1:], (pad,))])
        cols = jnp.pad(cols, (0, pad), constant_values=-1)
        vals = jnp.pad(vals, (0, pad))
    group = math.gcd(chunk, 8)
    kernel = functools.partial(_spmm_kernel, chunk=chunk, block_d=block_d, dim=dim, group=group)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_segments, dp), jnp.float32),
        grid=(n_chunks, dp // block_d),
        input_output_aliases={4: 0},
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name="sparsejax_spmm",
    )(rows, cols, vals, dense, jnp.zeros((num_segments, dp), jnp.float32))


def spmm(
    values: jax.Array,  # f32[N]
    col_ids: jax.Array,  # i32[N]
    segment_ids: jax.Array,  # i32[N], non-decreasing over valid entries
    dense: jax.Array,  # T[K, D], T in {f32, bf16}
    num_segments: int,
    *,
    chunk: int = 32,
    block_d: int | None = None,
    num_warps: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # T[num_segments, D]
    """out[s] = sum over valid k with segment_ids[k] == s of values[k] * dense[col_ids[k]].

    Entry k is valid when 0 <= col_ids[k] < K and 0 <= segment_ids[k] < num_segments;
    invalid entries may sit anywhere and contribute nothing. Accumulates in f32.

    Args:
      chunk: nonzeros per program (C), any positive int. They are read in groups of
        gcd(C, 8) row loads issued back to back (8 loads in flight for C = 32).
      block_d: output columns per program (power of two; default min(Dp, 128)).
      num_warps: Triton warps per program (default block_d // 128, at least 1).
      interpret: run the kernel with the Pallas interpreter (CPU tests).
    """
    num_segments = int(num_segments)
    if chunk < 1:
        raise ValueError(f"spmm: chunk must be >= 1, got {chunk}")
    out = spmm_f32(
        values,
        col_ids,
        segment_ids,
        dense,
        num_segments,
        chunk=int(chunk),
        block_d=block_d,
        num_warps=num_warps,
        interpret=interpret,
    )
    dim = dense.shape[1]
    if out.shape[1] != dim:
        out = out[:, :dim]
    return out.astype(dense.dtype)


def segment_spmm(
    values,
    col_ids,
    segment_ids,
    dense,
    *,
    num_segments,
    sorted_segments=True,
    unit_values=False,
    config: Config | None = None,
    interpret: bool = False,
):
    """The primitive's "pallas" implementation: the kernel needs CSR order, so unsorted
    segment ids (the transposes) run the XLA implementation."""
    del unit_values
    if not sorted_segments:
        return base.segment_spmm(values, col_ids, segment_ids, dense, num_segments=num_segments)
    config = config or get_heuristic_config(dense.shape[1])
    return spmm(
        values,
        col_ids,
        segment_ids,
        dense,
        num_segments,
        **dataclasses.asdict(config),
        interpret=interpret,
    )
