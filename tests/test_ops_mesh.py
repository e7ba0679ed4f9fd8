"""The ops on a mesh of the 4 fake CPU devices (conftest): every implementation under
`jax.shard_map` with a replicated table and data-sharded ids equals the unsharded call;
a table sharded across devices is refused, not silently gathered. Also: importing
`sparsejax.ops` pulls in no Flax, Orbax or matplotlib."""

import subprocess
import sys

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsejax import ops

DEVICES, V, D, S, N = 4, 30, 8, 3, 12


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) >= DEVICES
    return jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))


def _shards(seed):
    """Per-device lookups: ids, local segment ids, weights and pooled gradients."""
    rng = np.random.default_rng(seed)
    per = [ref.random_bags(rng, vocab=V, num_segments=S, nnz=N) for _ in range(DEVICES)]
    ids = jnp.asarray(np.stack([p[0] for p in per]))
    seg = jnp.asarray(np.stack([p[1] for p in per]))
    w = jnp.asarray(rng.uniform(0.5, 1.5, (DEVICES, N)), jnp.float32)
    grad = jnp.asarray(rng.normal(size=(DEVICES, S, D)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
    return table, ids, seg, w, grad


def _per_device(mesh, f, table, *sharded):
    """f(table, *one device's rows) on every device (table replicated), stacked."""

    def body(t, *xs):
        return jax.tree.map(lambda y: y[None], f(t, *(x[0] for x in xs)))

    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(), *[P("data")] * len(sharded)), out_specs=P("data")
        )
    )(table, *sharded)


@pytest.mark.parametrize("combiner", ops.COMBINERS)
def test_embedding_bag_under_shard_map(mesh, implementation, combiner):
    table, ids, seg, w, _ = _shards(0)

    def bag(t, i, s, w):
        return ops.embedding_bag(
            t, i, s, S, weights=w, combiner=combiner, implementation=implementation
        )

    got = _per_device(mesh, bag, table, ids, seg, w)
    for b in range(DEVICES):
        np.testing.assert_allclose(got[b], bag(table, ids[b], seg[b], w[b]), rtol=1e-6, atol=1e-6)


def test_lookup_spmm_and_dots_under_shard_map(mesh, implementation):
    table, ids, seg, w, _ = _shards(1)
    impl = dict(implementation=implementation)
    got = _per_device(mesh, lambda t, i: ops.embedding_lookup(t, i, **impl), table, ids)
    got_spmm = _per_device(
        mesh, lambda t, v, i, s: ops.segment_spmm(v, i, s, t, S, **impl), table, w, ids, seg
    )
    x = jnp.asarray(np.random.default_rng(2).normal(size=(DEVICES, 5, 4, D)), jnp.float32)
    got_dots = _per_device(mesh, lambda t, x: ops.pairwise_dots(x, **impl), table, x)
    for b in range(DEVICES):
        np.testing.assert_array_equal(got[b], ops.embedding_lookup(table, ids[b], **impl))
        np.testing.assert_allclose(
            got_spmm[b], ops.segment_spmm(w[b], ids[b], seg[b], table, S), rtol=1e-6, atol=1e-6
        )
        np.testing.assert_allclose(got_dots[b], ops.pairwise_dots_ref(x[b]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "opt",
    [ref.optimizer("RowWiseAdagrad"), ref.optimizer("LazyAdam")],
    ids=["RowWiseAdagrad", "LazyAdam"],
)
def test_sparse_apply_under_shard_map(mesh, implementation, opt):
    table, ids, seg, w, grad = _shards(3)
    slots = opt.init_slots(V, D)

    def apply(t, i, s, w, g):
        return ops.sparse_apply(
            t, slots, i, s, g, optimizer=opt, step=1, weights=w, implementation=implementation
        )

    got_t, got_s = _per_device(mesh, apply, table, ids, seg, w, grad)
    for b in range(DEVICES):
        want_t, want_s = apply(table, ids[b], seg[b], w[b], grad[b])
        np.testing.assert_allclose(got_t[b], want_t, rtol=1e-6, atol=1e-6)
        for k in slots:
            np.testing.assert_allclose(got_s[k][b], want_s[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("call", ["embedding_bag", "embedding_lookup", "sparse_apply"])
def test_a_row_sharded_table_is_refused(call):
    """Eagerly, and under plain `jit` on an Explicit mesh (`jax.make_mesh`'s default):
    a one-line error pointing to the sharded store, never a silent all-gather."""
    mesh = jax.make_mesh((DEVICES,), ("model",), axis_types=(AxisType.Explicit,))
    table = jax.device_put(jnp.ones((8, D)), NamedSharding(mesh, P("model", None)))
    ids, seg = jnp.array([1, 5], jnp.int32), jnp.array([0, 0], jnp.int32)
    f = {
        "embedding_bag": lambda t: ops.embedding_bag(t, ids, seg, 1, name="user"),
        "embedding_lookup": lambda t: ops.embedding_lookup(t, ids, name="user"),
        "sparse_apply": lambda t: ops.sparse_apply(
            t,
            {},
            ids,
            seg,
            jnp.ones((1, D)),
            optimizer=ops.SGD(learning_rate=1.0),
            step=1,
            name="user",
        )[0],
    }[call]
    message = r"table 'user' is sharded across devices.*use a sharded table store / shard_map"
    with pytest.raises(ValueError, match=message):
        f(table)
    with pytest.raises(ValueError, match=message):
        jax.jit(f)(table)
    replicated = jax.device_put(jnp.ones((8, D)), NamedSharding(mesh, P()))
    assert f(replicated).shape[-1] == D


def test_unsharded_path_is_unchanged_hlo():
    """The check is trace-time only: the compiled forward has no collective and no extra
    op over the primitive's own lowering."""
    table, ids = jnp.ones((V, D)), jnp.zeros(N, jnp.int32)
    seg = jnp.zeros(N, jnp.int32)
    text = jax.jit(lambda t, i: ops.embedding_bag(t, i, seg, S)).lower(table, ids).as_text()
    for collective in ("all-gather", "all_gather", "all-reduce", "all_reduce", "@Sharding"):
        assert collective not in text


def test_import_pulls_in_no_flax_orbax_or_matplotlib():
    code = (
        "import sys, sparsejax.ops; "
        "print(sorted(m for m in ('flax', 'orbax', 'matplotlib') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out
