"""The Pallas-Triton kernels (`sparsejax.ops._pallas`): interpret-mode numerics against
float64 numpy references on fresh random inputs, and CUDA lowering of every kernel.

Interpret mode runs the kernels' grids sequentially on the CPU, so sizes stay small
(a few hundred lookups, grids of at most a few dozen programs). What neither check can
catch (races, real out-of-bounds reads, masked atomics, performance) is covered by
`experiments/gpu_check.py` on a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.ops import _pallas
from sparsejax.ops import optimizers as opt_lib

TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}

OPTIMIZERS = [
    opt_lib.SGD(learning_rate=0.1),
    opt_lib.Adagrad(learning_rate=0.1),
    opt_lib.RowWiseAdagrad(learning_rate=0.1),
    opt_lib.LazyAdam(learning_rate=0.01),
    opt_lib.FTRL(learning_rate=0.1, l1=0.01, l2=0.001, beta=0.5),
    opt_lib.AdagradDecay(learning_rate=0.1, accumulator_decay_step=3),
]
OPT_IDS = [type(o).__name__ for o in OPTIMIZERS]
STEP = 7  # with accumulator_decay_step=3: period 2, so stored powers 0..2 cover every case


# ------------------------------------------------------------------ input generators
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
        bad_seg = ([-1, num_segments, num_segments + 3][int(rng.integers(0, 3))] if kind == 3
                   else int(rng.integers(-2, num_segments + 2)))
        ids = np.insert(ids, pos, bad_id)
        seg = np.insert(seg, pos, bad_seg)
        coef = np.insert(coef, pos, np.float32(rng.uniform(-1.0, 1.0)))
    return ids.astype(np.int32), seg.astype(np.int32), coef.astype(np.float32)


def bag_lengths(rng, num_segments, *, long=40):
    """Empty bags, single-lookup bags, one long bag (L >> R) and random ones."""
    lengths = rng.integers(0, 6, num_segments)
    lengths[0] = 0
    lengths[1] = 1
    lengths[num_segments // 2] = long
    lengths[-1] = 0
    return lengths


def valid_mask(ids, seg, vocab, num_segments):
    return (ids >= 0) & (ids < vocab) & (seg >= 0) & (seg < num_segments)


# ------------------------------------------------------------------ float64 references
def ref_spmm(values, col, seg, dense, num_segments):
    dense = np.asarray(jnp.asarray(dense, jnp.float32), np.float64)
    out = np.zeros((num_segments, dense.shape[1]))
    for v, c, s in zip(values.astype(np.float64), col, seg, strict=True):
        if 0 <= c < dense.shape[0] and 0 <= s < num_segments:
            out[s] += v * dense[c]
    return out


def ref_bag_max(table, ids, seg, coef, num_segments):
    table = np.asarray(jnp.asarray(table, jnp.float32), np.float64)
    dim = table.shape[1]
    out = np.zeros((num_segments, dim))
    arg = np.full((num_segments, dim), -1, np.int64)
    best = np.full((num_segments, dim), -np.inf)
    for k in np.flatnonzero(valid_mask(ids, seg, table.shape[0], num_segments)):
        # f32 product, as the kernel computes it, so ties are exact ties.
        x = (np.float32(coef[k]) * table[ids[k]].astype(np.float32)).astype(np.float64)
        better = x > best[seg[k]]  # strict: the smallest k wins a tie
        best[seg[k]] = np.where(better, x, best[seg[k]])
        arg[seg[k]] = np.where(better, k, arg[seg[k]])
    found = arg >= 0
    out[found] = best[found]
    return out, arg


def row_grads(ids, seg, coef, grad, vocab):
    """{row: float64 summed gradient} over valid lookups (a coef of 0 still touches)."""
    grad = np.asarray(grad, np.float64)
    out = {}
    for k in np.flatnonzero(valid_mask(ids, seg, vocab, grad.shape[0])):
        out.setdefault(int(ids[k]), np.zeros(grad.shape[1]))
        out[int(ids[k])] += np.float64(coef[k]) * grad[seg[k]]
    return out


def random_slots(optimizer, vocab, dim, rng):
    slots = []
    for spec in optimizer.slots():
        shape = (vocab,) if spec.per_row else (vocab, dim)
        if spec.dtype == "int32":
            slots.append(jnp.asarray(rng.integers(0, 3, shape), jnp.int32))
        elif spec.name in ("accumulator", "nu"):
            slots.append(jnp.asarray(rng.uniform(0.1, 1.0, shape), jnp.float32))
        else:
            slots.append(jnp.asarray(rng.normal(0.0, 0.1, shape), jnp.float32))
    return tuple(slots)


def ref_apply(optimizer, table, slots, grads_by_row, step):
    """jnp reference: `update_rows` on the gathered touched rows, scattered back."""
    vocab, dim = table.shape
    rows = np.array(sorted(grads_by_row), np.int32)
    if rows.size == 0:
        return np.asarray(table), [np.asarray(s) for s in slots]
    g = jnp.asarray(np.stack([grads_by_row[r] for r in rows]), jnp.float32)
    specs = optimizer.slots()
    slot_rows = {s.name: v[rows] for s, v in zip(specs, slots, strict=True)}
    new_rows, new_slots = optimizer.update_rows(
        optimizer.hparams(), table[rows].astype(jnp.float32), slot_rows, g,
        jnp.int32(step), dim=dim)
    table = np.asarray(table.at[rows].set(new_rows.astype(table.dtype)))
    slots = [np.asarray(v.at[rows].set(new_slots[s.name].astype(v.dtype)))
             for s, v in zip(specs, slots, strict=True)]
    return table, slots


def check_apply(optimizer, table, slots, new_table, new_slots, grads_by_row, step, tol):
    """Touched rows match the reference; untouched rows and slots are bit-identical."""
    ref_table, ref_slots = ref_apply(optimizer, table, slots, grads_by_row, step)
    touched = np.zeros(table.shape[0], bool)
    touched[list(grads_by_row)] = True
    states = [(new_table, ref_table, table), *zip(new_slots, ref_slots, slots, strict=True)]
    for new, ref, old in states:
        new, old = np.asarray(new), np.asarray(old)
        assert new.dtype == old.dtype and new.shape == old.shape
        np.testing.assert_array_equal(new[~touched], old[~touched])  # bit-identical
        np.testing.assert_allclose(new[touched].astype(np.float64),
                                   ref[touched].astype(np.float64), **tol)


# ------------------------------------------------------------------ spmm (kernel 3)
@pytest.mark.parametrize("dim,dtype", [(8, jnp.float32), (64, jnp.float32), (96, jnp.float32),
                                       (128, jnp.float32), (96, jnp.bfloat16)])
def test_spmm_matches_reference(dim, dtype):
    rng = np.random.default_rng(dim)
    num_k, chunk = 30, 32
    lengths = bag_lengths(rng, 10, long=110)  # the hot row spans > 3 chunks of 32
    col, seg, val = make_lookups(rng, lengths, num_k, n_bad=12)
    assert col.shape[0] % chunk != 0
    dense = jnp.asarray(rng.normal(size=(num_k, dim)), dtype)
    f = jax.jit(functools.partial(_pallas.spmm, num_segments=10, chunk=chunk, interpret=True))
    out = f(jnp.asarray(val), jnp.asarray(col), jnp.asarray(seg), dense)
    assert out.shape == (10, dim) and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_spmm(val, col, seg, dense, 10),
                               **TOL[dtype])


@pytest.mark.parametrize("case", ["tiny_chunk", "one_chunk", "one_row", "all_invalid",
                                  "column_blocks"])
def test_spmm_edge_cases(case):
    rng = np.random.default_rng(1)
    num_k, dim, chunk, block_d = 20, 64, 8, None
    lengths = {
        "tiny_chunk": [0, 30, 1, 0, 27, 5],  # every row spans several chunks of 8
        "one_chunk": [2, 0, 1, 1],  # nnz < C
        "one_row": [0, 0, 37],
        "all_invalid": [0, 0, 0],
        "column_blocks": [3, 0, 12, 1, 9],  # D = 128 in two 64-column blocks
    }[case]
    num_segments = len(lengths)
    col, seg, val = make_lookups(rng, lengths, num_k, n_bad=5)
    if case == "one_chunk":
        chunk = 32
    if case == "column_blocks":
        dim, block_d = 128, 64
    dense = jnp.asarray(rng.normal(size=(num_k, dim)), jnp.float32)
    f = jax.jit(functools.partial(_pallas.spmm, num_segments=num_segments, chunk=chunk,
                                  block_d=block_d, interpret=True))
    out = f(jnp.asarray(val), jnp.asarray(col), jnp.asarray(seg), dense)
    np.testing.assert_allclose(np.asarray(out),
                               ref_spmm(val, col, seg, dense, num_segments),
                               **TOL[jnp.float32])


def test_spmm_empty():
    dense = jnp.ones((5, 8), jnp.float32)
    e = jnp.zeros((0,), jnp.int32)
    out = _pallas.spmm(jnp.zeros((0,), jnp.float32), e, e, dense, 3, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((3, 8)))
    assert _pallas.spmm(jnp.ones(2), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32),
                        dense, 0, interpret=True).shape == (0, 8)


# ------------------------------------------------------------------ forward (kernel 1)
@pytest.mark.parametrize("dim,dtype,rows_per_step,bags", [
    (8, jnp.float32, 16, 1),
    (64, jnp.float32, 4, 3),
    (96, jnp.float32, 16, 1),
    (128, jnp.float32, 8, 2),
    (96, jnp.bfloat16, 16, 2),
])
def test_forward_sum(dim, dtype, rows_per_step, bags):
    rng = np.random.default_rng(dim + bags)
    vocab, num_segments = 40, 9
    lengths = bag_lengths(rng, num_segments, long=45)
    ids, seg, coef = make_lookups(rng, lengths, vocab, n_bad=10)
    ids[seg == num_segments - 2] = -1  # an all-padding bag
    table = jnp.asarray(rng.normal(size=(vocab, dim)), dtype)
    f = jax.jit(functools.partial(_pallas.embedding_bag_forward, num_segments=num_segments,
                                  rows_per_step=rows_per_step, bags_per_program=bags,
                                  interpret=True))
    out = f(table, jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(coef))
    assert out.shape == (num_segments, dim) and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               ref_spmm(coef, ids, seg, table, num_segments), **TOL[dtype])


@pytest.mark.parametrize("dim,dtype,rows_per_step,bags", [
    (8, jnp.float32, 4, 1),
    (96, jnp.float32, 16, 2),
    (128, jnp.bfloat16, 8, 1),
])
def test_forward_max_with_ties(dim, dtype, rows_per_step, bags):
    rng = np.random.default_rng(7 * dim)
    vocab, num_segments = 12, 8
    lengths = bag_lengths(rng, num_segments, long=30)
    ids, seg, coef = make_lookups(rng, lengths, vocab, n_bad=8)
    ids[seg == 2] = -1  # an all-padding bag
    # Small integers and coefficients in {-1, 1, 2}: ties everywhere, and repeated ids.
    table = jnp.asarray(rng.integers(-3, 4, (vocab, dim)), dtype)
    coef = rng.choice(np.array([-1.0, 1.0, 2.0], np.float32), coef.shape[0])
    f = jax.jit(functools.partial(_pallas.embedding_bag_forward, num_segments=num_segments,
                                  combiner="max", rows_per_step=rows_per_step,
                                  bags_per_program=bags, interpret=True))
    out, arg = f(table, jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(coef))
    ref_out, ref_arg = ref_bag_max(table, ids, seg, coef, num_segments)
    assert out.dtype == dtype and arg.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out, np.float64), ref_out)
    np.testing.assert_array_equal(np.asarray(arg), ref_arg)
    assert (ref_arg[0] == -1).all() and (ref_arg[2] == -1).all()  # empty, all padding


def test_forward_max_real_values():
    rng = np.random.default_rng(3)
    vocab, num_segments, dim = 30, 6, 64
    ids, seg, coef = make_lookups(rng, bag_lengths(rng, num_segments, long=25), vocab,
                                  n_bad=6)
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32)
    f = jax.jit(functools.partial(_pallas.embedding_bag_forward, num_segments=num_segments,
                                  combiner="max", interpret=True))
    out, arg = f(table, jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(coef))
    ref_out, ref_arg = ref_bag_max(table, ids, seg, coef, num_segments)
    np.testing.assert_array_equal(np.asarray(arg), ref_arg)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-6, atol=1e-6)


def test_forward_degenerate_inputs():
    table = jnp.ones((5, 8), jnp.float32)
    e = jnp.zeros((0,), jnp.int32)
    out = _pallas.embedding_bag_forward(table, e, e, jnp.zeros((0,)), 3, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((3, 8)))
    out, arg = _pallas.embedding_bag_forward(table, e, e, jnp.zeros((0,)), 3, combiner="max",
                                             interpret=True)
    np.testing.assert_array_equal(np.asarray(arg), -np.ones((3, 8)))
    with pytest.raises(ValueError, match="power of two"):
        _pallas.embedding_bag_forward(table, e, e, jnp.zeros((0,)), 3, rows_per_step=12)
    with pytest.raises(ValueError, match="combiner"):
        _pallas.embedding_bag_forward(table, e, e, jnp.zeros((0,)), 3, combiner="mean")


# ------------------------------------------------------------------ optimizer kernel
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=OPT_IDS)
def test_apply_rows(optimizer):
    rng = np.random.default_rng(0)
    vocab, num_u, dim = 50, 29, 96
    uids = rng.permutation(vocab)[:num_u].astype(np.int32)
    uids[[3, 11, 12, 28]] = [-1, vocab, -7, vocab + 100]  # skipped, anywhere
    grads = rng.normal(size=(num_u, dim)).astype(np.float32)
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32)
    slots = random_slots(optimizer, vocab, dim, rng)
    f = jax.jit(functools.partial(_pallas.apply_rows, optimizer=optimizer, interpret=True))
    new_table, new_slots = f(table, slots, jnp.asarray(uids), jnp.asarray(grads),
                             optimizer.hparams(), jnp.int32(STEP))
    by_row = {int(u): grads[i].astype(np.float64) for i, u in enumerate(uids) if 0 <= u < vocab}
    check_apply(optimizer, table, slots, new_table, new_slots, by_row, STEP, TOL[jnp.float32])


def test_apply_rows_bf16_table():
    rng = np.random.default_rng(5)
    optimizer, vocab, dim = opt_lib.RowWiseAdagrad(learning_rate=0.1), 40, 64
    uids = np.array([3, -1, 17, 39, 0, 40], np.int32)
    grads = rng.normal(size=(6, dim)).astype(np.float32)
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.bfloat16)
    slots = random_slots(optimizer, vocab, dim, rng)
    f = jax.jit(functools.partial(_pallas.apply_rows, optimizer=optimizer, rows_per_step=4,
                                  interpret=True))
    new_table, new_slots = f(table, slots, jnp.asarray(uids), jnp.asarray(grads),
                             optimizer.hparams(), jnp.int32(1))
    by_row = {int(u): grads[i].astype(np.float64) for i, u in enumerate(uids) if 0 <= u < vocab}
    check_apply(optimizer, table, slots, new_table, new_slots, by_row, 1, TOL[jnp.bfloat16])


# ------------------------------------------------------------------ sparse_apply (kernel 2)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=OPT_IDS)
def test_sparse_apply(optimizer):
    rng = np.random.default_rng(11)
    vocab, num_segments, dim = 40, 10, 96
    lengths = bag_lengths(rng, num_segments, long=220)
    # id 5 is hot: about half of all lookups, so its run spans > 3 chunks of 32.
    ids, seg, coef = make_lookups(rng, lengths, vocab, n_bad=10, dup_id=5)
    assert np.sum((ids == 5) & valid_mask(ids, seg, vocab, num_segments)) > 3 * 32
    coef[np.flatnonzero(ids == 9)] = 0.0  # touched with a zero gradient
    grad = rng.normal(size=(num_segments, dim)).astype(np.float32)
    grad[0] = np.nan  # bag 0 is empty: its gradient must never leak anywhere
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32)
    slots = random_slots(optimizer, vocab, dim, rng)
    f = jax.jit(functools.partial(_pallas.sparse_apply, optimizer=optimizer, interpret=True))
    new_table, new_slots = f(table, slots, jnp.asarray(ids), jnp.asarray(seg),
                             jnp.asarray(coef), jnp.asarray(grad), optimizer.hparams(),
                             jnp.int32(STEP))
    by_row = row_grads(ids, seg, coef, grad, vocab)
    assert 5 in by_row and np.isfinite(np.asarray(new_table)).all()
    check_apply(optimizer, table, slots, new_table, new_slots, by_row, STEP, TOL[jnp.float32])


def test_sparse_apply_bf16_table_and_small_dim():
    rng = np.random.default_rng(12)
    optimizer, vocab, num_segments, dim = opt_lib.Adagrad(learning_rate=0.1), 25, 7, 8
    ids, seg, coef = make_lookups(rng, bag_lengths(rng, num_segments, long=30), vocab,
                                  n_bad=6)
    grad = rng.normal(size=(num_segments, dim)).astype(np.float32)
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.bfloat16)
    slots = random_slots(optimizer, vocab, dim, rng)
    f = jax.jit(functools.partial(_pallas.sparse_apply, optimizer=optimizer, chunk=8,
                                  interpret=True))
    new_table, new_slots = f(table, slots, jnp.asarray(ids), jnp.asarray(seg),
                             jnp.asarray(coef), jnp.asarray(grad), optimizer.hparams(),
                             jnp.int32(2))
    check_apply(optimizer, table, slots, new_table, new_slots,
                row_grads(ids, seg, coef, grad, vocab), 2, TOL[jnp.bfloat16])


def test_sparse_apply_nothing_valid():
    optimizer = opt_lib.LazyAdam(learning_rate=0.1)
    table = jnp.arange(40.0, dtype=jnp.float32).reshape(5, 8)
    slots = tuple(optimizer.init_slots(5, 8)[s.name] for s in optimizer.slots())
    ids = jnp.array([-1, 5, 9, 2], jnp.int32)
    seg = jnp.array([0, 1, 1, 4], jnp.int32)  # id 2 is valid but its segment is not
    f = jax.jit(functools.partial(_pallas.sparse_apply, optimizer=optimizer, interpret=True))
    new_table, new_slots = f(table, slots, ids, seg, jnp.ones(4), jnp.ones((3, 8)),
                             optimizer.hparams(), jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(new_table), np.asarray(table))
    for a, b in zip(new_slots, slots, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ CUDA lowering
def lower_for_cuda(f, *args, donate_argnums=()):
    """StableHLO text of `f` lowered for CUDA without a GPU (see GPU_NOTES, Testing)."""
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,),
        abstract_device=jax.sharding.AbstractDevice("NVIDIA H200", 1, "cuda"))
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(f, donate_argnums=donate_argnums).trace(*args)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


SDS = jax.ShapeDtypeStruct
N_LOWER, S_LOWER, V_LOWER = 4096, 256, 100_000


@pytest.mark.parametrize("dim,dtype", [(128, jnp.float32), (96, jnp.bfloat16), (256, jnp.float32)])
def test_spmm_lowers_for_cuda(dim, dtype):
    i = SDS((N_LOWER,), jnp.int32)
    txt = lower_for_cuda(functools.partial(_pallas.spmm, num_segments=S_LOWER),
                         SDS((N_LOWER,), jnp.float32), i, i, SDS((V_LOWER, dim), dtype))
    assert "__gpu$xla.gpu.triton" in txt


@pytest.mark.parametrize("combiner", ["sum", "max"])
@pytest.mark.parametrize("dim,dtype,bags", [(128, jnp.float32, 1), (96, jnp.bfloat16, 3)])
def test_forward_lowers_for_cuda(combiner, dim, dtype, bags):
    i = SDS((N_LOWER,), jnp.int32)
    f = functools.partial(_pallas.embedding_bag_forward, num_segments=S_LOWER,
                          combiner=combiner, bags_per_program=bags)
    txt = lower_for_cuda(f, SDS((V_LOWER, dim), dtype), i, i, SDS((N_LOWER,), jnp.float32))
    assert "__gpu$xla.gpu.triton" in txt


def _slot_structs(optimizer, dim):
    return tuple(SDS((V_LOWER,) if s.per_row else (V_LOWER, dim), jnp.dtype(s.dtype))
                 for s in optimizer.slots())


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=OPT_IDS)
def test_optimizer_kernels_lower_for_cuda_with_donation(optimizer):
    dim = 96
    table = SDS((V_LOWER, dim), jnp.float32)
    slots = _slot_structs(optimizer, dim)
    hp, step = SDS((8,), jnp.float32), SDS((), jnp.int32)
    i = SDS((N_LOWER,), jnp.int32)
    n_state = 1 + len(slots)
    txt = lower_for_cuda(functools.partial(_pallas.apply_rows, optimizer=optimizer),
                         table, slots, i, SDS((N_LOWER, dim), jnp.float32), hp, step,
                         donate_argnums=(0, 1))
    assert "__gpu$xla.gpu.triton" in txt
    # Donated table and slots alias the jit outputs and, inside, the kernel's outputs:
    # the update is in place.
    assert txt.count("tf.aliasing_output") == n_state
    assert txt.count("stablehlo.output_operand_alias<") == n_state
    txt = lower_for_cuda(functools.partial(_pallas.sparse_apply, optimizer=optimizer),
                         table, slots, i, i, SDS((N_LOWER,), jnp.float32),
                         SDS((S_LOWER, dim), jnp.float32), hp, step, donate_argnums=(0, 1))
    assert txt.count("__gpu$xla.gpu.triton") >= 2  # spmm + apply_rows
    assert txt.count("tf.aliasing_output") == n_state


def test_bf16_table_optimizer_lowers_for_cuda():
    optimizer = opt_lib.LazyAdam(learning_rate=0.1)
    i = SDS((N_LOWER,), jnp.int32)
    txt = lower_for_cuda(functools.partial(_pallas.sparse_apply, optimizer=optimizer),
                         SDS((V_LOWER, 128), jnp.bfloat16), _slot_structs(optimizer, 128),
                         i, i, SDS((N_LOWER,), jnp.float32), SDS((S_LOWER, 128), jnp.float32),
                         SDS((8,), jnp.float32), SDS((), jnp.int32), donate_argnums=(0, 1))
    assert "__gpu$xla.gpu.triton" in txt
