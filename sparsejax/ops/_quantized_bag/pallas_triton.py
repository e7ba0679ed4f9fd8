"""The quantized bag as a Pallas-Triton kernel (GPU; `interpret=True` on the CPU).

The embedding-bag forward's structure (`_embedding_bag/pallas_triton.py`): one bag per
program, CSR offsets from the sorted segment ids, R lookups per step with the next
step's ids prefetched through the loop carry. Each step gathers `[R, Dp]` code bytes
(for int4 each byte twice, column d reading byte d // 2 and shifting by 4 (d % 2)), the
R scales and zero points, and dequantizes in registers before pooling ("sum" or "max")
in f32. A lookup reads D or ceil(D/2) bytes of codes plus 3, not 4 D. Kernel rules:
`sparsejax.ops._pallas_common`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from .._pallas_common import check_pow2, compiler_params, iota, next_pow2
from .._segment_spmm.base import valid_entries


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling of the quantized bag kernel."""

    rows_per_step: int = 16
    """R, lookups gathered per loop step (a power of two)."""
    num_warps: int = 2
    """Triton warps per program."""


def get_heuristic_config(dim: int, bits: int = 8) -> Config:
    """R = 16 and one warp per 128 code bytes (1 to 4). On an H200 (experiments/RESULTS.md,
    "GPU kernels") one warp was the best or within noise of it for int8 D=64 and D=128
    and for int4 D=128, where 4 warps ran 1.9x slower; the lookup is latency-bound."""
    width = dim if bits == 8 else (dim + 1) // 2
    return Config(num_warps=min(4, max(1, next_pow2(width) // 128)))


def _quantized_bag_kernel(
    off_ref,
    ids_ref,
    coef_ref,
    data_ref,
    scale_ref,
    zero_point_ref,
    out_ref,
    *,
    combiner: str,
    bits: int,
    rows_per_step: int,
    dim: int,
):
    r_n, dp = rows_per_step, next_pow2(dim)
    cols = iota(dp)
    col_ok = None if dim == dp else cols < dim
    byte_cols = cols if bits == 8 else cols // 2
    lane = iota(r_n)
    is_max = combiner == "max"
    b = pl.program_id(0)
    start, end = off_ref[b], off_ref[b + 1]

    def load_ids(k0):
        k = k0 + lane
        m = k < end
        return (
            pltr.load(ids_ref.at[k], mask=m, other=-1),
            pltr.load(coef_ref.at[k], mask=m, other=0.0),
        )

    def body(j, carry):
        acc, count, ids, coef = carry
        nxt = load_ids(start + (j + 1) * r_n)  # prefetch: the next step's ids are in flight
        valid = ids >= 0  # invalid lookups were set to -1 in the preparation
        safe = jnp.maximum(ids, 0)
        m2 = jnp.broadcast_to(valid[:, None], (r_n, dp))
        if col_ok is not None:
            m2 = m2 & col_ok[None, :]
        q = pltr.load(data_ref.at[safe[:, None], byte_cols[None, :]], mask=m2, other=0)
        q = q.astype(jnp.int32)
        if bits == 4:
            q = (q >> ((cols % 2) * 4)[None, :]) & 0xF
        scale = pltr.load(scale_ref.at[safe], mask=valid, other=0).astype(jnp.float32)
        zero_point = pltr.load(zero_point_ref.at[safe], mask=valid, other=0).astype(jnp.int32)
        # coef * (scale * (q - z)): the XLA path's rounding, so max ties are exact ties.
        x = coef[:, None] * (scale[:, None] * (q - zero_point[:, None]).astype(jnp.float32))
        if is_max:
            acc = jnp.maximum(acc, jnp.max(jnp.where(m2, x, -jnp.inf), axis=0))
            count = count + jnp.sum(valid.astype(jnp.int32))
        else:
            acc = acc + jnp.sum(x, axis=0)  # invalid lanes: coef 0, scale 0
        return (acc, count, *nxt)

    init = jnp.full((dp,), -jnp.inf if is_max else 0.0, jnp.float32)
    n_steps = lax.div(end - start + (r_n - 1), jnp.int32(r_n))
    acc, count, _, _ = lax.fori_loop(0, n_steps, body, (init, jnp.int32(0), *load_ids(start)))
    if is_max:
        acc = jnp.where(count > 0, acc, 0.0)  # an empty or all-padding bag gives 0
    pltr.store(out_ref.at[b, cols], acc, mask=col_ok)


def quantized_bag_forward(
    coef: jax.Array,  # f32[N]
    ids: jax.Array,  # i32[N]
    segment_ids: jax.Array,  # i32[N], non-decreasing over valid entries
    data: jax.Array,  # u8[V, W]
    scale: jax.Array,  # f16[V]
    zero_point: jax.Array,  # u8[V]
    num_segments: int,
    *,
    bits: int,
    dim: int,
    combiner: str = "sum",
    rows_per_step: int = 16,
    num_warps: int = 2,
    interpret: bool = False,
) -> jax.Array:  # f32[num_segments, dim]
    """Pooled lookups in a quantized table, one bag per program.

    "sum": out[s] = sum over valid k in bag s of coef[k] * row(ids[k]); "max": the
    elementwise max of the same products (0 for an empty or all-padding bag), where
    row(r) = float32(scale[r]) * (q[r] - zero_point[r]). Lookup k is valid when
    0 <= ids[k] < V and 0 <= segment_ids[k] < num_segments.

    Args:
      bits, dim: the table's code width (8 or 4) and row width D.
      rows_per_step: R, lookups gathered per loop step (power of two).
      num_warps: Triton warps per program.
      interpret: run the kernel with the Pallas interpreter (CPU tests).
    """
    if combiner not in ("sum", "max"):
        raise ValueError(
            f"quantized_bag_forward: combiner must be 'sum' or 'max', got {combiner!r}"
        )
    r_n = check_pow2("rows_per_step", rows_per_step)
    num_segments = int(num_segments)
    vocab, n = data.shape[0], ids.shape[0]
    if num_segments == 0 or n == 0 or vocab == 0 or dim == 0:
        return jnp.zeros((num_segments, dim), jnp.float32)
    valid = valid_entries(ids, segment_ids, vocab, num_segments)
    ids_p = jnp.where(valid, ids, -1).astype(jnp.int32)
    coef_p = jnp.where(valid, coef.astype(jnp.float32), 0.0)
    # CSR offsets; invalid lookups inherit the running max so the array stays sorted.
    seg_sorted = lax.cummax(jnp.where(valid, segment_ids, 0).astype(jnp.int32), axis=0)
    bounds = jnp.arange(num_segments + 1, dtype=jnp.int32)
    offsets = jnp.searchsorted(seg_sorted, bounds, side="left", method="scan_unrolled")
    kernel = functools.partial(
        _quantized_bag_kernel, combiner=combiner, bits=bits, rows_per_step=r_n, dim=dim
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_segments, dim), jnp.float32),
        grid=(num_segments,),
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name=f"sparsejax_quantized_bag_{combiner}",
    )(offsets.astype(jnp.int32), ids_p, coef_p, data, scale, zero_point)


def quantized_bag(
    coef,
    ids,
    segment_ids,
    data,
    scale,
    zero_point,
    *,
    num_segments,
    bits,
    dim,
    combiner,
    unit_values=False,
    config: Config | None = None,
    interpret: bool = False,
):
    """The primitive's "pallas" implementation."""
    del unit_values
    config = config or get_heuristic_config(dim, bits)
    return quantized_bag_forward(
        coef,
        ids,
        segment_ids,
        data,
        scale,
        zero_point,
        num_segments,
        bits=bits,
        dim=dim,
        combiner=combiner,
        **dataclasses.asdict(config),
        interpret=interpret,
    )
