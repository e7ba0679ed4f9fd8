"""The one place for what the op tests share: float64 numpy references (independent of
sparsejax's jnp references, so a shared bug cannot hide), input generators, the
optimizer grid and the tolerance table."""

import jax.numpy as jnp
import numpy as np

from sparsejax import ops

BF16 = jnp.bfloat16
I32_MIN, I32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max

TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
"""Tolerance by dtype of the table for results accumulated in f32."""

OPTIMIZERS = [
    ops.SGD(learning_rate=0.1),
    ops.Adagrad(learning_rate=0.1),
    ops.RowWiseAdagrad(learning_rate=0.1),
    ops.LazyAdam(learning_rate=0.01),
    ops.FTRL(learning_rate=0.1, l1=0.01, l2=0.01, beta=0.5),
    ops.AdagradDecay(learning_rate=0.1, accumulator_decay_step=3, accumulator_decay_rate=0.5),
]
"""Every optimizer, once; AdagradDecay's period is 3 steps."""
OPT_IDS = [type(o).__name__ for o in OPTIMIZERS]


def optimizer(name):
    """The grid's instance of the optimizer class called `name`."""
    return OPTIMIZERS[OPT_IDS.index(name)]


# ------------------------------------------------------------------ references
def valid_mask(ids, seg, vocab, num_segments):
    return (ids >= 0) & (ids < vocab) & (seg >= 0) & (seg < num_segments)


def f64(x):
    """float64 numpy copy of an f32 / bf16 (jax or numpy) array."""
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def embedding_bag(table, ids, seg, num_segments, weights=None, combiner="sum"):
    table = f64(table)
    ids, seg = np.asarray(ids), np.asarray(seg)
    w = np.ones(len(ids)) if weights is None else np.asarray(weights, np.float64)
    # The contract: subnormal f32 weights count as 0 (XLA flushes them on CPU and GPU).
    w = np.where(np.abs(w) < np.finfo(np.float32).tiny, 0.0, w)
    out = np.zeros((num_segments, table.shape[1]))
    for s in range(num_segments):
        ks = [k for k in range(len(ids)) if seg[k] == s and 0 <= ids[k] < table.shape[0]]
        if not ks:
            continue
        rows = np.stack([w[k] * table[ids[k]] for k in ks])
        if combiner == "max":
            out[s] = rows.max(0)
            continue
        total = rows.sum(0)
        if combiner == "mean":
            norm = sum(w[k] for k in ks)
        elif combiner == "sqrtn":
            norm = np.sqrt(sum(w[k] ** 2 for k in ks))
        else:
            norm = 1.0
        out[s] = total / norm if norm != 0 else 0.0
    return out


def segment_spmm(values, col, seg, dense, num_segments, *, with_bound=False):
    """out[s] = sum of values[k] * dense[col[k]] over valid k in segment s (float64).

    with_bound: also return the per-element bound on an f32 accumulation's error
    (2 (n + 1) eps32 sum |terms|, plus a bf16 rounding of the result) and the entry
    count of each segment.
    """
    dense = f64(dense)
    values, col, seg = np.asarray(values, np.float64), np.asarray(col), np.asarray(seg)
    m = valid_mask(col, seg, dense.shape[0], num_segments)
    terms = values[m][:, None] * dense[col[m]]
    out = np.zeros((num_segments, dense.shape[1]))
    np.add.at(out, seg[m], terms)
    if not with_bound:
        return out
    absum = np.zeros_like(out)
    cnt = np.zeros(num_segments)
    np.add.at(absum, seg[m], np.abs(terms))
    np.add.at(cnt, seg[m], 1)
    return out, 2 * (cnt[:, None] + 1) * 2.0**-24 * absum, cnt


def segment_max(values, col, seg, dense, num_segments):
    """(max over valid k in each segment of f32(values[k] * dense[col[k]]), the smallest
    k attaining it); empty segments give 0 and -1. Exact: the products are rounded to
    f32 as the kernels compute them, so ties are exact ties."""
    dense = np.asarray(jnp.asarray(dense, jnp.float32))
    values, col, seg = np.asarray(values, np.float32), np.asarray(col), np.asarray(seg)
    k, d = dense.shape
    out = np.zeros((num_segments, d), np.float32)
    arg = np.full((num_segments, d), -1, np.int32)
    idx = np.nonzero(valid_mask(col, seg, k, num_segments))[0]
    prod = (values[idx].astype(np.float64)[:, None] * dense[col[idx]].astype(np.float64)).astype(
        np.float32
    )
    for s in range(num_segments):
        sel = seg[idx] == s
        if not sel.any():
            continue
        p = prod[sel]
        first = np.argmax(p == p.max(axis=0)[None, :], axis=0)
        arg[s] = idx[sel][first]
        out[s] = p[first, np.arange(d)]
    return out, arg


def row_grads(ids, seg, coef, grad, vocab):
    """{row: float64 summed gradient} over valid lookups (a coef of 0 still touches)."""
    grad = np.asarray(grad, np.float64)
    out = {}
    for k in np.flatnonzero(valid_mask(ids, seg, vocab, grad.shape[0])):
        out.setdefault(int(ids[k]), np.zeros(grad.shape[1]))
        out[int(ids[k])] += np.float64(coef[k]) * grad[seg[k]]
    return out


def apply_row_grads(opt, table, slots, grads_by_row, step):
    """The optimizer's jnp `update_rows` on the touched rows, scattered back (numpy)."""
    table = np.asarray(table)
    slots = {k: np.asarray(v) for k, v in slots.items()}
    rows = np.array(sorted(grads_by_row), np.int64)
    if rows.size == 0:
        return table.copy(), {k: v.copy() for k, v in slots.items()}
    g = jnp.asarray(np.stack([grads_by_row[r] for r in rows]), jnp.float32)
    new_rows, new_slots = opt.update_rows(
        opt.hparams(),
        jnp.asarray(table[rows], jnp.float32),
        {k: jnp.asarray(v[rows]) for k, v in slots.items()},
        g,
        jnp.int32(step),
        dim=table.shape[1],
    )
    table = table.copy()
    table[rows] = np.asarray(new_rows.astype(table.dtype))
    out_slots = {}
    for k, v in slots.items():
        out_slots[k] = v.copy()
        out_slots[k][rows] = np.asarray(new_slots[k]).astype(v.dtype)
    return table, out_slots


def bits(x):
    """The raw bits of an array, for bit-identity checks."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def check_apply(opt, table, slots, new_table, new_slots, grads_by_row, step, tol):
    """Touched rows match `apply_row_grads`; untouched rows and slots are bit-identical."""
    ref_table, ref_slots = apply_row_grads(opt, table, slots, grads_by_row, step)
    touched = np.zeros(np.shape(table)[0], bool)
    touched[list(grads_by_row)] = True
    states = [(new_table, ref_table, table)]
    states += [(new_slots[k], ref_slots[k], slots[k]) for k in slots]
    for new, want, old in states:
        new, old = np.asarray(new), np.asarray(old)
        assert new.dtype == old.dtype and new.shape == old.shape
        np.testing.assert_array_equal(bits(new[~touched]), bits(old[~touched]))
        if new.dtype == np.int32:
            np.testing.assert_array_equal(new[touched], want[touched])
        else:
            np.testing.assert_allclose(f64(new[touched]), f64(want[touched]), **tol)
    return touched


# ------------------------------------------------------------------ input generators
def random_bags(rng, *, vocab, num_segments, nnz, pad_frac=0.1, dup_frac=0.3, empty_frac=0.2):
    """Sorted segment ids with some empty bags, repeated ids and padding (-1) entries."""
    live = np.nonzero(rng.random(num_segments) >= empty_frac)[0]
    if live.size == 0 or nnz == 0:
        return np.full(nnz, -1, np.int32), np.zeros(nnz, np.int32)
    seg = np.sort(rng.choice(live, nnz)).astype(np.int32)
    ids = rng.integers(0, vocab, nnz).astype(np.int32)
    dup = rng.random(nnz) < dup_frac
    ids[dup] = ids[rng.integers(0, nnz, dup.sum())]
    ids[rng.random(nnz) < pad_frac] = -1
    return ids, seg


def junk_entries(rng, n, k, s, *, sorted_segments, pad_frac=0.2):
    """(values f32, col i32, seg i32) with duplicates, weights and invalid entries of
    every kind (-1, K, I32_MAX, I32_MIN, ...).

    When sorted_segments, segment ids are non-decreasing over *valid* entries only:
    invalid entries (bad col) carry arbitrary, out-of-order segment ids.
    """
    values = rng.standard_normal(n).astype(np.float32)
    values[rng.random(n) < 0.1] = 1.0
    col = rng.integers(0, max(k, 1), n)
    if n > 4:  # force duplicates of a hot row
        col[rng.random(n) < 0.2] = col[0]
    seg = rng.integers(0, s, n)
    if s > 4:  # leave empty segments: one in the middle, two at the end
        seg = seg % (s - 2)
        seg[seg == (s - 2) // 2] += 1
    if sorted_segments:
        seg = np.sort(seg)
    bad = rng.random(n) < pad_frac
    nb = int(bad.sum())
    if nb:
        junk = np.array([-1, k, k + 7, I32_MAX, I32_MIN], np.int64)
        col[bad] = rng.choice(junk, nb)
        # Bad-col entries may carry any segment id, including valid out-of-order ones.
        seg[bad] = rng.choice(np.array([-1, s, I32_MAX, I32_MIN, 0, s - 1]), nb)
    bad_seg = (rng.random(n) < pad_frac / 4) & ~bad
    if bad_seg.any() and not sorted_segments:
        seg[bad_seg] = rng.choice(np.array([-1, s, I32_MAX, I32_MIN]), int(bad_seg.sum()))
    elif bad_seg.any():
        # Invalid segment ids keep validity-sorted order (they are not valid entries).
        seg[bad_seg] = -1
    return values, col.astype(np.int32), seg.astype(np.int32)


def bag_lengths(rng, num_segments, *, long=40):
    """Empty bags, single-lookup bags, one long bag (L >> R) and random ones."""
    lengths = rng.integers(0, 6, num_segments)
    lengths[0] = 0
    lengths[1] = 1
    lengths[num_segments // 2] = long
    lengths[-1] = 0
    return lengths


def make_lookups(rng, lengths, vocab, *, n_bad=0, dup_id=None):
    """CSR-ordered lookups for bags of the given lengths, plus `n_bad` invalid lookups
    (id < 0, id >= vocab, or segment out of range) inserted at random positions.
    Returns (ids, seg, coef) as numpy arrays; valid segment ids are non-decreasing."""
    num_segments = len(lengths)
    seg = np.repeat(np.arange(num_segments), lengths).astype(np.int32)
    ids = rng.integers(0, vocab, seg.shape[0]).astype(np.int32)
    if dup_id is not None:
        ids[:] = np.where(rng.random(ids.shape[0]) < 0.5, dup_id, ids)
    coef = rng.uniform(-1.0, 1.0, seg.shape[0]).astype(np.float32)
    for _ in range(n_bad):
        pos = int(rng.integers(0, ids.shape[0] + 1))
        kind = int(rng.integers(0, 4))
        bad_id = [-1, vocab, vocab + 7, int(rng.integers(0, vocab))][kind]
        # An invalid segment id may be anything, even "out of order".
        bad_seg = (
            [-1, num_segments, num_segments + 3][int(rng.integers(0, 3))]
            if kind == 3
            else int(rng.integers(-2, num_segments + 2))
        )
        ids = np.insert(ids, pos, bad_id)
        seg = np.insert(seg, pos, bad_seg)
        coef = np.insert(coef, pos, np.float32(rng.uniform(-1.0, 1.0)))
    return ids.astype(np.int32), seg.astype(np.int32), coef.astype(np.float32)


def random_slots(opt, vocab, dim, rng, *, max_power=2):
    """Slot arrays with state in them: positive accumulators, small momenta, decay
    powers in [0, max_power] (some rows behind the current period)."""
    slots = {}
    for spec in opt.slots():
        shape = (vocab,) if spec.per_row else (vocab, dim)
        if spec.dtype == "int32":
            slots[spec.name] = rng.integers(0, max_power + 1, shape).astype(np.int32)
        elif spec.name in ("mu", "linear"):
            slots[spec.name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        else:
            slots[spec.name] = rng.uniform(0.05, 1.0, shape).astype(np.float32)
    return slots


# ------------------------------------------------------------------ CUDA lowering
def lower_for_cuda(f, *args, donate_argnums=()):
    """StableHLO text of `f` lowered for CUDA without a GPU."""
    import jax

    mesh = jax.sharding.AbstractMesh(
        (1,),
        ("x",),
        (jax.sharding.AxisType.Explicit,),
        abstract_device=jax.sharding.AbstractDevice("NVIDIA H200", 1, "cuda"),
    )
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(f, donate_argnums=donate_argnums).trace(*args)
        return traced.lower(lowering_platforms=("cuda",)).as_text()
