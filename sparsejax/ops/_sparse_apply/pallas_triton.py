"""`sparse_apply` as Pallas-Triton kernels (GPU; `interpret=True` on the CPU).

- `apply_rows`: the row-wise optimizer. R unique rows per program: gather rows and
  slots, trace `optimizer.update_rows` (the same jnp code every implementation runs),
  masked scatter-store in place (`input_output_aliases`; zero copies under donation).
- `sparse_apply`: sort-based duplicate reduction in XLA (a 2-operand `lax.sort` so
  XLA:GPU uses CUB), `segment_spmm`'s kernel for the per-row gradient sums, then
  `apply_rows`. Kernel rules: `sparsejax.ops._pallas_common`.
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
from .._segment_spmm.pallas_triton import spmm_f32
from ..optimizers import store_rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling of the sparse_apply kernels."""

    chunk: int = 32
    """Lookups per program of the gradient-reduction spmm."""
    rows_per_step: int = 8
    """Unique rows per program of `apply_rows` (a power of two)."""


def get_heuristic_config(dim: int) -> Config:
    """Chunks of 32 sorted lookups (FBGEMM's warp-sized chunk); 8 rows per optimizer
    program, 4 when a padded row passes 512 columns (keeps a program's rows + slots in
    registers)."""
    return Config(rows_per_step=4 if next_pow2(dim) > 512 else 8)


def _apply_rows_kernel(
    uids_ref,
    grads_ref,
    hp_ref,
    step_ref,
    *refs,
    optimizer,
    rows_per_step,
    dim,
    num_rows,
    vocab,
    n_slots,
):
    # Inputs table + slots are aliased with the outputs; read and write the outputs.
    out_refs = refs[n_slots + 1 :]
    table_ref, slot_refs = out_refs[0], out_refs[1:]
    specs = optimizer.slots()
    r_n, dp = rows_per_step, next_pow2(dim)
    k = pl.program_id(0) * r_n + iota(r_n)
    in_range = k < num_rows
    uids = pltr.load(uids_ref.at[k], mask=in_range, other=-1)
    valid = in_range & (uids >= 0) & (uids < vocab)

    @pl.when(jnp.max(valid.astype(jnp.int32)) > 0)  # over-launched grid: skip empty blocks
    def _():
        cols = iota(dp)
        m2 = jnp.broadcast_to(valid[:, None], (r_n, dp))
        if dim != dp:
            m2 = m2 & (cols < dim)[None, :]
        rd1 = jnp.where(valid, uids, 0)  # clamped: loads
        wr1 = jnp.where(valid, uids, vocab)  # past the end: stores (never written)
        rd, wr = (rd1[:, None], cols[None, :]), (wr1[:, None], cols[None, :])
        rows = pltr.load(table_ref.at[rd], mask=m2, other=0).astype(jnp.float32)
        grads = pltr.load(
            grads_ref.at[jnp.where(in_range, k, 0)[:, None], cols[None, :]], mask=m2, other=0.0
        ).astype(jnp.float32)
        slots = {}
        for spec, ref in zip(specs, slot_refs, strict=True):
            fill = jnp.asarray(spec.init, ref.dtype)
            if spec.per_row:
                slots[spec.name] = pltr.load(ref.at[rd1], mask=valid, other=fill)
            else:
                slots[spec.name] = pltr.load(ref.at[rd], mask=m2, other=fill)
        hp = tuple(hp_ref[i] for i in range(hp_ref.shape[0]))  # scalars; hp[i] as in f32[8]
        new_rows, new_slots = optimizer.update_rows(hp, rows, slots, grads, step_ref[0], dim=dim)
        new_rows = store_rows(optimizer, new_rows, rd1, step_ref[0], table_ref.dtype)
        pltr.store(table_ref.at[wr], new_rows, mask=m2)
        for spec, ref in zip(specs, slot_refs, strict=True):
            v = new_slots[spec.name].astype(ref.dtype)
            if spec.per_row:
                pltr.store(ref.at[wr1], v, mask=valid)
            else:
                pltr.store(ref.at[wr], v, mask=m2)


def _apply_rows(
    table, slots, uids, grads, hparams, step, *, optimizer, rows_per_step, num_warps, interpret
):
    """`apply_rows` where `grads` may have more columns than D (the padded spmm output)."""
    vocab, dim = table.shape
    r_n = check_pow2("rows_per_step", rows_per_step)
    specs = optimizer.slots()
    slots = tuple(slots)
    if len(slots) != len(specs):
        raise ValueError(
            f"apply_rows: {type(optimizer).__name__} has slots "
            f"{[s.name for s in specs]}, got {len(slots)} arrays"
        )
    num_rows = uids.shape[0]
    if num_rows == 0 or vocab == 0:
        return table, slots
    n_slots = len(slots)
    kernel = functools.partial(
        _apply_rows_kernel,
        optimizer=optimizer,
        rows_per_step=r_n,
        dim=dim,
        num_rows=num_rows,
        vocab=vocab,
        n_slots=n_slots,
    )
    state = (table, *slots)
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in state],
        grid=(-(-num_rows // r_n),),
        input_output_aliases={4 + i: i for i in range(len(state))},
        compiler_params=compiler_params(num_warps or 2),
        interpret=interpret,
        name=f"sparsejax_apply_rows_{type(optimizer).__name__}",
    )(
        uids.astype(jnp.int32),
        grads,
        hparams.astype(jnp.float32).reshape(-1),
        jnp.asarray(step, jnp.int32).reshape(1),
        *state,
    )
    return outs[0], tuple(outs[1:])


def apply_rows(
    table: jax.Array,  # T[V, D]
    slots: tuple,  # per optimizer.slots(): [V] (per-row) or [V, D]
    uids: jax.Array,  # i32[U], unique
    grads: jax.Array,  # f32[U, D]
    hparams: jax.Array,  # f32[8]
    step: jax.Array,  # i32[]
    *,
    optimizer,
    rows_per_step: int = 8,
    num_warps: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, tuple]:
    """In-place optimizer update of the rows `uids` with their summed gradients `grads`.

    uids must be unique among valid entries; entries with uid < 0 or >= V are skipped.
    Table and slots are aliased to the outputs: donate them at the `jit` boundary and
    nothing is copied. Rows not in `uids` come back bit-identical.
    """
    if grads.shape != (uids.shape[0], table.shape[1]):
        raise ValueError(
            f"apply_rows: grads must be [U, D] = {[uids.shape[0], table.shape[1]]}"
            f", got {list(grads.shape)}"
        )
    return _apply_rows(
        table,
        slots,
        uids,
        grads,
        hparams,
        step,
        optimizer=optimizer,
        rows_per_step=rows_per_step,
        num_warps=num_warps,
        interpret=interpret,
    )


# ========================================== kernel 2: dedup + reduce + optimizer
def _dedup_plan(ids, segment_ids, coef, vocab, num_segments):
    """Sort lookups by id. Returns (uniq i32[N] (-1 past the last unique id),
    run i32[N] (the unique row of each sorted lookup, -1 if none), seg i32[N] (its
    segment, -1 if invalid) and coef f32[N], all in sorted order)."""
    n = ids.shape[0]
    valid = valid_entries(ids, segment_ids, vocab, num_segments)
    key = jnp.where(valid, ids.astype(jnp.uint32), jnp.uint32(0xFFFFFFFF))
    # Two operands, unsigned keys: XLA:GPU lowers this to a CUB radix sort.
    skey, perm = lax.sort((key, iota(n)), num_keys=1, is_stable=True)
    svalid = skey != jnp.uint32(0xFFFFFFFF)
    new_run = svalid & jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]])
    run = jnp.cumsum(new_run.astype(jnp.int32)) - 1  # invalid tail keeps the last run
    uniq = (
        jnp.full((n,), -1, jnp.int32)
        .at[jnp.where(new_run, run, n)]
        .set(skey.astype(jnp.int32), mode="drop")
    )
    seg = jnp.where(svalid, segment_ids[perm], -1)
    return uniq, run, seg, coef[perm]


def sparse_apply(
    table, *operands, optimizer, config: Config | None = None, interpret: bool = False
):
    """Operands (*slots, ids, segment_ids, coef, grad, hparams, step) as every backend's;
    returns [table, *slots].

    Row k's gradient is sum over lookups with ids[k] == row of coef[k] * grad[seg[k]];
    every row with a valid lookup (0 <= id < V, 0 <= seg < S, whatever its coef) gets
    one optimizer update; all other rows come back bit-identical.

    Steps: XLA sort-based dedup plan, the spmm kernel (rows = runs of equal ids,
    columns = segment ids) for the per-row gradient sums G[N, Dp], then `apply_rows`.
    """
    config = config or get_heuristic_config(table.shape[1])
    n_slots = optimizer.num_slots()
    slots, (ids, segment_ids, coef, grad, hparams, step) = (
        tuple(operands[:n_slots]),
        operands[n_slots:],
    )
    vocab, dim = table.shape
    n, num_segments = ids.shape[0], grad.shape[0]
    if n == 0 or num_segments == 0 or vocab == 0:
        return [table, *slots]
    if grad.shape[1] != dim:
        raise ValueError(f"sparse_apply: grad has dim {grad.shape[1]}, table has {dim}")
    uniq, run, seg, coef_s = _dedup_plan(
        ids.astype(jnp.int32),
        segment_ids.astype(jnp.int32),
        coef.astype(jnp.float32),
        vocab,
        num_segments,
    )
    # One output row per unique id (at most N); the padded [N, Dp] f32 goes straight in.
    g = spmm_f32(
        coef_s,
        seg,
        run,
        grad,
        n,
        chunk=config.chunk,
        block_d=None,
        num_warps=None,
        interpret=interpret,
    )
    table, slots = _apply_rows(
        table,
        slots,
        uniq,
        g,
        hparams,
        step,
        optimizer=optimizer,
        rows_per_step=config.rows_per_step,
        num_warps=None,
        interpret=interpret,
    )
    return [table, *slots]
