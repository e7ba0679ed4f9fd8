"""Embedding-bag forward as a Pallas-Triton kernel (GPU; `interpret=True` on the CPU).

One bag per program (or `bags_per_program`), CSR offsets from the sorted segment ids, R
lookups per step: a masked `[R]` id load and a masked `[R, Dp]` row gather, with the
next step's ids prefetched through the loop carry. "sum" and "max" (with the winning
lookup position per element); the primitive uses it for max pooling, sum pooling runs
`segment_spmm`'s kernel. Kernel rules: `sparsejax.ops._pallas_common`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from .._pallas_common import (
    INT_MAX,
    check_pow2,
    compiler_params,
    iota,
    next_pow2,
)
from .._segment_spmm.base import valid_entries


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling of the embedding-bag forward kernel."""

    rows_per_step: int = 16
    """R, lookups gathered per loop step (a power of two)."""
    bags_per_program: int = 1
    """Bags one program handles, one after the other."""
    num_warps: int = 2
    """Triton warps per program."""


def get_heuristic_config(dim: int) -> Config:
    """R = 16, one bag per program, and Dp // 64 warps (1 to 4), so each thread keeps at
    least two elements of a `[Dp]` row (2 warps at D = 128, the measured start point)."""
    return Config(num_warps=min(4, max(1, next_pow2(dim) // 64)))


def _bag_forward_kernel(
    off_ref,
    ids_ref,
    coef_ref,
    table_ref,
    *out_refs,
    combiner: str,
    rows_per_step: int,
    bags: int,
    dim: int,
    num_segments: int,
):
    r_n, dp = rows_per_step, next_pow2(dim)
    cols = iota(dp)
    col_ok = None if dim == dp else cols < dim
    lane = iota(r_n)
    is_max = combiner == "max"
    for i in range(bags):
        b = pl.program_id(0) * bags + i
        start, end = off_ref[b], off_ref[b + 1]

        def load_ids(k0, end=end):
            k = k0 + lane
            m = k < end
            return (
                pltr.load(ids_ref.at[k], mask=m, other=-1),
                pltr.load(coef_ref.at[k], mask=m, other=0.0),
            )

        def body(j, carry, start=start, load_ids=load_ids):
            *acc, ids, coef = carry
            k0 = start + j * r_n
            nxt = load_ids(k0 + r_n)  # prefetch: the next step's ids are in flight now
            valid = ids >= 0  # invalid lookups were set to -1 in the preparation
            m2 = jnp.broadcast_to(valid[:, None], (r_n, dp))
            if col_ok is not None:
                m2 = m2 & col_ok[None, :]
            rows = pltr.load(
                table_ref.at[jnp.maximum(ids, 0)[:, None], cols[None, :]], mask=m2, other=0
            )
            x = coef[:, None] * rows.astype(jnp.float32)
            if not is_max:
                return (acc[0] + jnp.sum(x, axis=0), *nxt)
            best, arg = acc
            x = jnp.where(m2, x, -jnp.inf)
            blk_max = jnp.max(x, axis=0)
            pos = jnp.where(m2 & (x == blk_max[None, :]), (k0 + lane)[:, None], INT_MAX)
            blk_arg = jnp.min(pos, axis=0)  # smallest position attaining the block max
            # Earlier blocks hold smaller positions, so a tie keeps the current winner.
            take = (blk_max > best) | ((arg < 0) & (blk_arg < INT_MAX))
            return (jnp.where(take, blk_max, best), jnp.where(take, blk_arg, arg), *nxt)

        init = [jnp.zeros((dp,), jnp.float32)]
        if is_max:
            init = [jnp.full((dp,), -jnp.inf, jnp.float32), jnp.full((dp,), -1, jnp.int32)]
        n_steps = lax.div(end - start + (r_n - 1), jnp.int32(r_n))
        acc = lax.fori_loop(0, n_steps, body, (*init, *load_ids(start)))[: len(init)]

        row_ok = None if num_segments % bags == 0 else jnp.broadcast_to(b < num_segments, (dp,))
        mask = col_ok if row_ok is None else (row_ok if col_ok is None else row_ok & col_ok)
        if is_max:
            best, arg = acc
            found = arg >= 0  # an empty or all-padding bag gives 0 and -1
            pltr.store(
                out_refs[0].at[b, cols],
                jnp.where(found, best, 0.0).astype(out_refs[0].dtype),
                mask=mask,
            )
            pltr.store(out_refs[1].at[b, cols], arg, mask=mask)
        else:
            pltr.store(out_refs[0].at[b, cols], acc[0].astype(out_refs[0].dtype), mask=mask)


def bag_forward(
    coef: jax.Array,  # f32[N]
    ids: jax.Array,  # i32[N]
    segment_ids: jax.Array,  # i32[N], non-decreasing over valid entries
    table: jax.Array,  # T[V, D]
    num_segments: int,
    *,
    combiner: str = "sum",
    rows_per_step: int = 16,
    bags_per_program: int = 1,
    num_warps: int = 2,
    interpret: bool = False,
):
    """Pooled lookups, one bag per program (operands in `segment_spmm`'s order).

    "sum": out[s] = sum over valid k in bag s of coef[k] * table[ids[k]], T[S, D].
    "max": (out T[S, D], argk i32[S, D]) with out[s, d] the max over valid k in bag s of
    coef[k] * table[ids[k], d] and argk the smallest k attaining it; an empty or
    all-padding bag gives 0 and -1.

    Lookup k is valid when 0 <= ids[k] < V and 0 <= segment_ids[k] < num_segments.

    Args:
      rows_per_step: R, lookups gathered per loop step (power of two).
      bags_per_program: bags handled by one program, one after the other.
      num_warps: Triton warps per program.
      interpret: run the kernel with the Pallas interpreter (CPU tests).
    """
    if combiner not in ("sum", "max"):
        raise ValueError(f"bag_forward: combiner must be 'sum' or 'max', got {combiner!r}")
    r_n = check_pow2("rows_per_step", rows_per_step)
    bags = int(bags_per_program)
    if bags < 1:
        raise ValueError(f"bag_forward: bags_per_program must be >= 1, got {bags}")
    num_segments = int(num_segments)
    vocab, dim = table.shape
    n = ids.shape[0]
    if num_segments == 0 or n == 0 or vocab == 0:
        out = jnp.zeros((num_segments, dim), table.dtype)
        return (out, jnp.full((num_segments, dim), -1, jnp.int32)) if combiner == "max" else out
    valid = valid_entries(ids, segment_ids, vocab, num_segments)
    ids_p = jnp.where(valid, ids, -1).astype(jnp.int32)
    coef_p = jnp.where(valid, coef.astype(jnp.float32), 0.0)
    # CSR offsets; invalid lookups inherit the running max so the array stays sorted.
    seg_sorted = lax.cummax(jnp.where(valid, segment_ids, 0).astype(jnp.int32), axis=0)
    n_prog = -(-num_segments // bags)
    bounds = jnp.arange(n_prog * bags + 1, dtype=jnp.int32)
    offsets = jnp.searchsorted(seg_sorted, bounds, side="left", method="scan_unrolled").astype(
        jnp.int32
    )
    out_shape = [jax.ShapeDtypeStruct((num_segments, dim), table.dtype)]
    if combiner == "max":
        out_shape.append(jax.ShapeDtypeStruct((num_segments, dim), jnp.int32))
    kernel = functools.partial(
        _bag_forward_kernel,
        combiner=combiner,
        rows_per_step=r_n,
        bags=bags,
        dim=dim,
        num_segments=num_segments,
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_prog,),
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name=f"sparsejax_embedding_bag_{combiner}",
    )(offsets, ids_p, coef_p, table)
    return tuple(outs) if combiner == "max" else outs[0]


def segment_max(
    values,
    col_ids,
    segment_ids,
    dense,
    *,
    num_segments,
    config: Config | None = None,
    interpret: bool = False,
):
    """The max-pooling primitive's "pallas" implementation: (out, argk)."""
    config = config or get_heuristic_config(dense.shape[1])
    return bag_forward(
        values,
        col_ids,
        segment_ids,
        dense,
        num_segments,
        combiner="max",
        **dataclasses.asdict(config),
        interpret=interpret,
    )
