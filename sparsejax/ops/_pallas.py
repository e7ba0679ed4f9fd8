"""Pallas-Triton kernels for the GPU (and, with `interpret=True`, for tests on the CPU).

Three kernels plus their XLA-side preparation (design: shared/GPU_NOTES.md section 2):

- `spmm` (kernel 3): segment-sorted sparse x dense in fixed chunks of C nonzeros. Each
  program reduces its chunk sequentially; rows that start and end inside the chunk are
  stored once, the chunk's first and last rows (which may continue in the neighbouring
  chunks) are `atomic_add`ed into a zero-initialised, aliased f32 output. A hot row
  spread over many chunks is therefore split evenly, without a counter protocol.
- `embedding_bag_forward` (kernel 1): one bag per program (or `bags_per_program`), CSR
  offsets from the sorted segment ids, R lookups per step: a masked `[R]` id load and a
  masked `[R, Dp]` row gather, with the next step's ids prefetched through the loop
  carry. "sum" and "max" (with the winning lookup position per element).
- `apply_rows`: the row-wise optimizer. R unique rows per program: gather rows and
  slots, trace `optimizer.update_rows` (the same jnp code every implementation runs),
  masked scatter-store in place (`input_output_aliases`; zero copies under donation).
- `sparse_apply` (kernel 2): sort-based duplicate reduction in XLA (a 2-operand
  `lax.sort` so XLA:GPU uses CUB), `spmm` for the per-row gradient sums, `apply_rows`.

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

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

__all__ = ["spmm", "embedding_bag_forward", "apply_rows", "sparse_apply"]

_INT_MAX = 2**31 - 1


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _check_pow2(name: str, n: int) -> int:
    n = int(n)
    if n < 1 or n & (n - 1):
        raise ValueError(f"sparsejax Pallas kernels: {name} must be a power of two, got {n}")
    return n


def _params(num_warps: int) -> pltr.CompilerParams:
    # num_stages=1: Triton does not software-pipeline gathers (GPU_NOTES 1.4); the
    # forward prefetches ids by hand instead.
    return pltr.CompilerParams(num_warps=num_warps, num_stages=1)


def _iota(n: int) -> jax.Array:
    return lax.iota(jnp.int32, n)


# ============================================================== kernel 3: chunked SpMM
def _spmm_kernel(rows_ref, cols_ref, vals_ref, dense_ref, _zeros_ref, out_ref, *,
                 chunk: int, block_d: int, dim: int, group: int):
    """One chunk of `chunk` nonzeros x one `block_d` column block of the output."""
    base = pl.program_id(0) * chunk
    dcols = pl.program_id(1) * block_d + _iota(block_d)
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


def _spmm_f32(values, col_ids, segment_ids, dense, num_segments, *, chunk, block_d,
              num_warps, interpret):
    """f32[num_segments, Dp] (Dp = padded dim), the kernel's raw output."""
    nnz = values.shape[0]
    k, dim = dense.shape
    dp = _next_pow2(dim)
    block_d = min(dp, block_d or 128)
    _check_pow2("block_d", block_d)
    num_warps = num_warps or max(1, block_d // 128)
    if nnz == 0 or num_segments == 0 or k == 0:
        return jnp.zeros((num_segments, dp), jnp.float32)
    valid = (col_ids >= 0) & (col_ids < k) & (segment_ids >= 0) & (segment_ids < num_segments)
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
    kernel = functools.partial(_spmm_kernel, chunk=chunk, block_d=block_d, dim=dim,
                               group=group)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_segments, dp), jnp.float32),
        grid=(n_chunks, dp // block_d),
        input_output_aliases={4: 0},
        compiler_params=_params(num_warps),
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
    out = _spmm_f32(values, col_ids, segment_ids, dense, num_segments, chunk=int(chunk),
                    block_d=block_d, num_warps=num_warps, interpret=interpret)
    dim = dense.shape[1]
    if out.shape[1] != dim:
        out = out[:, :dim]
    return out.astype(dense.dtype)


# ======================================================= kernel 1: embedding-bag forward
def _bag_forward_kernel(off_ref, ids_ref, coef_ref, table_ref, *out_refs, combiner: str,
                        rows_per_step: int, bags: int, dim: int, num_segments: int):
    r_n, dp = rows_per_step, _next_pow2(dim)
    cols = _iota(dp)
    col_ok = None if dim == dp else cols < dim
    lane = _iota(r_n)
    is_max = combiner == "max"
    for i in range(bags):
        b = pl.program_id(0) * bags + i
        start, end = off_ref[b], off_ref[b + 1]

        def load_ids(k0, end=end):
            k = k0 + lane
            m = k < end
            return (pltr.load(ids_ref.at[k], mask=m, other=-1),
                    pltr.load(coef_ref.at[k], mask=m, other=0.0))

        def body(j, carry, start=start, load_ids=load_ids):
            *acc, ids, coef = carry
            k0 = start + j * r_n
            nxt = load_ids(k0 + r_n)  # prefetch: the next step's ids are in flight now
            valid = ids >= 0  # invalid lookups were set to -1 in the preparation
            m2 = jnp.broadcast_to(valid[:, None], (r_n, dp))
            if col_ok is not None:
                m2 = m2 & col_ok[None, :]
            rows = pltr.load(table_ref.at[jnp.maximum(ids, 0)[:, None], cols[None, :]],
                             mask=m2, other=0)
            x = coef[:, None] * rows.astype(jnp.float32)
            if not is_max:
                return (acc[0] + jnp.sum(x, axis=0), *nxt)
            best, arg = acc
            x = jnp.where(m2, x, -jnp.inf)
            blk_max = jnp.max(x, axis=0)
            pos = jnp.where(m2 & (x == blk_max[None, :]), (k0 + lane)[:, None], _INT_MAX)
            blk_arg = jnp.min(pos, axis=0)  # smallest position attaining the block max
            # Earlier blocks hold smaller positions, so a tie keeps the current winner.
            take = (blk_max > best) | ((arg < 0) & (blk_arg < _INT_MAX))
            return (jnp.where(take, blk_max, best), jnp.where(take, blk_arg, arg), *nxt)

        init = [jnp.zeros((dp,), jnp.float32)]
        if is_max:
            init = [jnp.full((dp,), -jnp.inf, jnp.float32), jnp.full((dp,), -1, jnp.int32)]
        n_steps = lax.div(end - start + (r_n - 1), jnp.int32(r_n))
        acc = lax.fori_loop(0, n_steps, body, (*init, *load_ids(start)))[:len(init)]

        row_ok = None if num_segments % bags == 0 else jnp.broadcast_to(b < num_segments, (dp,))
        mask = col_ok if row_ok is None else (row_ok if col_ok is None else row_ok & col_ok)
        if is_max:
            best, arg = acc
            found = arg >= 0  # an empty or all-padding bag gives 0 and -1
            pltr.store(out_refs[0].at[b, cols],
                       jnp.where(found, best, 0.0).astype(out_refs[0].dtype), mask=mask)
            pltr.store(out_refs[1].at[b, cols], arg, mask=mask)
        else:
            pltr.store(out_refs[0].at[b, cols], acc[0].astype(out_refs[0].dtype), mask=mask)


def embedding_bag_forward(
    table: jax.Array,  # T[V, D]
    ids: jax.Array,  # i32[N]
    segment_ids: jax.Array,  # i32[N], non-decreasing over valid entries
    coef: jax.Array,  # f32[N]
    num_segments: int,
    *,
    combiner: str = "sum",
    rows_per_step: int = 16,
    bags_per_program: int = 1,
    num_warps: int | None = None,
    interpret: bool = False,
):
    """Pooled lookups, one bag per program.

    "sum": out[s] = sum over valid k in bag s of coef[k] * table[ids[k]], T[S, D].
    "max": (out T[S, D], argk i32[S, D]) with out[s, d] the max over valid k in bag s of
    coef[k] * table[ids[k], d] and argk the smallest k attaining it; an empty or
    all-padding bag gives 0 and -1.

    Lookup k is valid when 0 <= ids[k] < V and 0 <= segment_ids[k] < num_segments.

    Args:
      rows_per_step: R, lookups gathered per loop step (power of two).
      bags_per_program: bags handled by one program, one after the other.
      num_warps: Triton warps per program (default 2).
      interpret: run the kernel with the Pallas interpreter (CPU tests).
    """
    if combiner not in ("sum", "max"):
        raise ValueError(f"embedding_bag_forward: combiner must be 'sum' or 'max', "
                         f"got {combiner!r}")
    r_n = _check_pow2("rows_per_step", rows_per_step)
    bags = int(bags_per_program)
    if bags < 1:
        raise ValueError(f"embedding_bag_forward: bags_per_program must be >= 1, got {bags}")
    num_segments = int(num_segments)
    vocab, dim = table.shape
    n = ids.shape[0]
    if num_segments == 0 or n == 0 or vocab == 0:
        out = jnp.zeros((num_segments, dim), table.dtype)
        return (out, jnp.full((num_segments, dim), -1, jnp.int32)) if combiner == "max" else out
    valid = (ids >= 0) & (ids < vocab) & (segment_ids >= 0) & (segment_ids < num_segments)
    ids_p = jnp.where(valid, ids, -1).astype(jnp.int32)
    coef_p = jnp.where(valid, coef.astype(jnp.float32), 0.0)
    # CSR offsets; invalid lookups inherit the running max so the array stays sorted.
    seg_sorted = lax.cummax(jnp.where(valid, segment_ids, 0).astype(jnp.int32), axis=0)
    n_prog = -(-num_segments // bags)
    bounds = jnp.arange(n_prog * bags + 1, dtype=jnp.int32)
    offsets = jnp.searchsorted(seg_sorted, bounds, side="left",
                               method="scan_unrolled").astype(jnp.int32)
    out_shape = [jax.ShapeDtypeStruct((num_segments, dim), table.dtype)]
    if combiner == "max":
        out_shape.append(jax.ShapeDtypeStruct((num_segments, dim), jnp.int32))
    kernel = functools.partial(_bag_forward_kernel, combiner=combiner, rows_per_step=r_n,
                               bags=bags, dim=dim, num_segments=num_segments)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_prog,),
        compiler_params=_params(num_warps or 2),
        interpret=interpret,
        name=f"sparsejax_embedding_bag_{combiner}",
    )(offsets, ids_p, coef_p, table)
    return tuple(outs) if combiner == "max" else outs[0]


# ============================================================ optimizer kernel
def _apply_rows_kernel(uids_ref, grads_ref, hp_ref, step_ref, *refs, optimizer, rows_per_step,
                       dim, num_rows, vocab, n_slots):
    # Inputs table + slots are aliased with the outputs; read and write the outputs.
    out_refs = refs[n_slots + 1:]
    table_ref, slot_refs = out_refs[0], out_refs[1:]
    specs = optimizer.slots()
    r_n, dp = rows_per_step, _next_pow2(dim)
    k = pl.program_id(0) * r_n + _iota(r_n)
    in_range = k < num_rows
    uids = pltr.load(uids_ref.at[k], mask=in_range, other=-1)
    valid = in_range & (uids >= 0) & (uids < vocab)

    @pl.when(jnp.max(valid.astype(jnp.int32)) > 0)  # over-launched grid: skip empty blocks
    def _():
        cols = _iota(dp)
        m2 = jnp.broadcast_to(valid[:, None], (r_n, dp))
        if dim != dp:
            m2 = m2 & (cols < dim)[None, :]
        rd1 = jnp.where(valid, uids, 0)  # clamped: loads
        wr1 = jnp.where(valid, uids, vocab)  # past the end: stores (never written)
        rd, wr = (rd1[:, None], cols[None, :]), (wr1[:, None], cols[None, :])
        rows = pltr.load(table_ref.at[rd], mask=m2, other=0).astype(jnp.float32)
        grads = pltr.load(grads_ref.at[jnp.where(in_range, k, 0)[:, None], cols[None, :]],
                          mask=m2, other=0.0).astype(jnp.float32)
        slots = {}
        for spec, ref in zip(specs, slot_refs, strict=True):
            fill = jnp.asarray(spec.init, ref.dtype)
            if spec.per_row:
                slots[spec.name] = pltr.load(ref.at[rd1], mask=valid, other=fill)
            else:
                slots[spec.name] = pltr.load(ref.at[rd], mask=m2, other=fill)
        hp = tuple(hp_ref[i] for i in range(hp_ref.shape[0]))  # scalars; hp[i] as in f32[8]
        new_rows, new_slots = optimizer.update_rows(hp, rows, slots, grads, step_ref[0],
                                                    dim=dim)
        pltr.store(table_ref.at[wr], new_rows.astype(table_ref.dtype), mask=m2)
        for spec, ref in zip(specs, slot_refs, strict=True):
            v = new_slots[spec.name].astype(ref.dtype)
            if spec.per_row:
                pltr.store(ref.at[wr1], v, mask=valid)
            else:
                pltr.store(ref.at[wr], v, mask=m2)


def _apply_rows(table, slots, uids, grads, hparams, step, *, optimizer, rows_per_step,
                num_warps, interpret):
    """`apply_rows` where `grads` may have more columns than D (the padded spmm output)."""
    vocab, dim = table.shape
    r_n = _check_pow2("rows_per_step", rows_per_step)
    specs = optimizer.slots()
    slots = tuple(slots)
    if len(slots) != len(specs):
        raise ValueError(f"apply_rows: {type(optimizer).__name__} has slots "
                         f"{[s.name for s in specs]}, got {len(slots)} arrays")
    num_rows = uids.shape[0]
    if num_rows == 0 or vocab == 0:
        return table, slots
    n_slots = len(slots)
    kernel = functools.partial(_apply_rows_kernel, optimizer=optimizer, rows_per_step=r_n,
                               dim=dim, num_rows=num_rows, vocab=vocab, n_slots=n_slots)
    state = (table, *slots)
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in state],
        grid=(-(-num_rows // r_n),),
        input_output_aliases={4 + i: i for i in range(len(state))},
        compiler_params=_params(num_warps or 2),
        interpret=interpret,
        name=f"sparsejax_apply_rows_{type(optimizer).__name__}",
    )(uids.astype(jnp.int32), grads, hparams.astype(jnp.float32).reshape(-1),
      jnp.asarray(step, jnp.int32).reshape(1), *state)
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
        raise ValueError(f"apply_rows: grads must be [U, D] = {[uids.shape[0], table.shape[1]]}"
                         f", got {list(grads.shape)}")
    return _apply_rows(table, slots, uids, grads, hparams, step, optimizer=optimizer,
                       rows_per_step=rows_per_step, num_warps=num_warps, interpret=interpret)


# ========================================== kernel 2: dedup + reduce + optimizer
def _dedup_plan(ids, segment_ids, coef, vocab, num_segments):
    """Sort lookups by id. Returns (uniq i32[N] (-1 past the last unique id),
    run i32[N] (the unique row of each sorted lookup, -1 if none), seg i32[N] (its
    segment, -1 if invalid) and coef f32[N], all in sorted order)."""
    n = ids.shape[0]
    valid = (ids >= 0) & (ids < vocab) & (segment_ids >= 0) & (segment_ids < num_segments)
    key = jnp.where(valid, ids.astype(jnp.uint32), jnp.uint32(0xFFFFFFFF))
    # Two operands, unsigned keys: XLA:GPU lowers this to a CUB radix sort.
    skey, perm = lax.sort((key, _iota(n)), num_keys=1, is_stable=True)
    svalid = skey != jnp.uint32(0xFFFFFFFF)
    new_run = svalid & jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]])
    run = jnp.cumsum(new_run.astype(jnp.int32)) - 1  # invalid tail keeps the last run
    uniq = jnp.full((n,), -1, jnp.int32).at[jnp.where(new_run, run, n)].set(
        skey.astype(jnp.int32), mode="drop")
    seg = jnp.where(svalid, segment_ids[perm], -1)
    return uniq, run, seg, coef[perm]


def sparse_apply(
    table: jax.Array,  # T[V, D]
    slots: tuple,
    ids: jax.Array,  # i32[N]
    segment_ids: jax.Array,  # i32[N]
    coef: jax.Array,  # f32[N]
    grad: jax.Array,  # f32[S, D]
    hparams: jax.Array,  # f32[8]
    step: jax.Array,  # i32[]
    *,
    optimizer,
    chunk: int = 32,
    rows_per_step: int = 8,
    interpret: bool = False,
) -> tuple[jax.Array, tuple]:
    """Row k's gradient is sum over lookups with ids[k] == row of coef[k] * grad[seg[k]];
    every row with a valid lookup (0 <= id < V, 0 <= seg < S, whatever its coef) gets
    one optimizer update; all other rows come back bit-identical.

    Steps: XLA sort-based dedup plan, `spmm` (rows = runs of equal ids, columns =
    segment ids) for the per-row gradient sums G[N, Dp], then `apply_rows`.
    """
    vocab, dim = table.shape
    n, num_segments = ids.shape[0], grad.shape[0]
    if n == 0 or num_segments == 0 or vocab == 0:
        return table, tuple(slots)
    if grad.shape[1] != dim:
        raise ValueError(f"sparse_apply: grad has dim {grad.shape[1]}, table has {dim}")
    uniq, run, seg, coef_s = _dedup_plan(ids.astype(jnp.int32), segment_ids.astype(jnp.int32),
                                         coef.astype(jnp.float32), vocab, num_segments)
    # One output row per unique id (at most N); the padded [N, Dp] f32 goes straight in.
    g = _spmm_f32(coef_s, seg, run, grad, n, chunk=chunk, block_d=None, num_warps=None,
                  interpret=interpret)
    return _apply_rows(table, slots, uniq, g, hparams, step, optimizer=optimizer,
                       rows_per_step=rows_per_step, num_warps=None, interpret=interpret)
