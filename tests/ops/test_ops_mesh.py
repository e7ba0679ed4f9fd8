"""The ops on a mesh of the 4 fake CPU devices (conftest): every implementation under
`jax.shard_map` with a replicated table and data-sharded ids equals the unsharded call;
a table sharded across devices is refused, not silently gathered. Also: importing
`sparsejax.ops` pulls in no Flax, Orbax or matplotlib."""

import functools
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
from sparsejax.ops import _cpu_ffi

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


needs_cpu_ffi = pytest.mark.skipif(not ops.cpu_ffi_available(), reason="C++ extension not built")


def _cases(values, pallas_values):
    """(implementation, value) over every CPU implementation; Pallas (interpret mode,
    seconds to compile per kernel) only on `pallas_values`: shard_map does not change
    a kernel, only how the op is lowered around it, which one case per kernel shows."""
    impls = ["xla", pytest.param("cpu_ffi", marks=needs_cpu_ffi), "pallas", None]
    cases = []
    for impl in impls:
        name = impl.values[0] if hasattr(impl, "values") else impl
        marks = impl.marks if hasattr(impl, "marks") else ()
        for v in pallas_values if name == "pallas" else values:
            cases.append(pytest.param(name, v, id=f"{name}-{v}", marks=marks))
    return cases


# sum and max: the segment-sum and segment-max kernels (mean and sqrtn are sum's kernel
# with other coefficients).
@pytest.mark.parametrize("implementation,combiner", _cases(ops.COMBINERS, ["sum", "max"]))
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
    "implementation,opt_name", _cases(["RowWiseAdagrad", "LazyAdam"], ["RowWiseAdagrad"])
)
def test_sparse_apply_under_shard_map(mesh, implementation, opt_name):
    opt = ref.optimizer(opt_name)
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


def _table_ops():
    """Each op that takes a table, as a function of the table alone."""
    ids, seg = jnp.array([1, 5], jnp.int32), jnp.array([0, 0], jnp.int32)
    return {
        "embedding_bag": lambda t, **kw: ops.embedding_bag(t, ids, seg, 1, name="user", **kw),
        "embedding_bag_max": lambda t, **kw: ops.embedding_bag(
            t, ids, seg, 1, combiner="max", name="user", **kw
        ),
        "embedding_lookup": lambda t, **kw: ops.embedding_lookup(t, ids, name="user", **kw),
        "sparse_apply": lambda t, **kw: ops.sparse_apply(
            t,
            {},
            ids,
            seg,
            jnp.ones((1, D)),
            optimizer=ops.SGD(learning_rate=1.0),
            step=1,
            name="user",
            **kw,
        )[0],
    }


REFUSAL = r"table 'user' is sharded across devices.*use a sharded table store / shard_map"


@pytest.mark.parametrize("call", ["embedding_bag", "embedding_lookup", "sparse_apply"])
def test_a_row_sharded_table_is_refused(call):
    """Eagerly, and under plain `jit` on an Explicit mesh (`jax.make_mesh`'s default):
    a one-line error pointing to the sharded store, never a silent all-gather."""
    mesh = jax.make_mesh((DEVICES,), ("model",), axis_types=(AxisType.Explicit,))
    table = jax.device_put(jnp.ones((8, D)), NamedSharding(mesh, P("model", None)))
    f = _table_ops()[call]
    with pytest.raises(ValueError, match=REFUSAL):
        f(table)
    with pytest.raises(ValueError, match=REFUSAL):
        jax.jit(f)(table)
    replicated = jax.device_put(jnp.ones((8, D)), NamedSharding(mesh, P()))
    assert f(replicated).shape[-1] == D


@pytest.mark.parametrize("axes", ["auto", "plain_mesh"])
def test_jit_on_auto_axes_refuses_a_sharded_table(axes):
    """Auto mesh axes: the sharding is not in the traced type, so the refusal comes when
    the multi-device `jit` is compiled (a `JaxRuntimeError` carrying the same message),
    for rows or columns sharded; a replicated table compiles to the unchecked program."""
    devices = jax.devices()[:DEVICES]
    if axes == "auto":
        mesh = jax.make_mesh((DEVICES,), ("model",), axis_types=(AxisType.Auto,))
    else:
        mesh = jax.sharding.Mesh(np.array(devices), ("model",))
    want = {name: f(jnp.ones((8, D))) for name, f in _table_ops().items()}
    for name, f in _table_ops().items():
        for spec, split in ((P("model", None), "rows"), (P(None, "model"), "columns")):
            table = jax.device_put(jnp.ones((8, D)), NamedSharding(mesh, spec))
            with pytest.raises(jax.errors.JaxRuntimeError, match=REFUSAL) as e:
                jax.jit(f)(table)
            assert f"({split} split {DEVICES} ways)" in str(e.value), name
        replicated = jax.device_put(jnp.ones((8, D)), NamedSharding(mesh, P()))
        compiled = jax.jit(f).lower(replicated).compile()
        np.testing.assert_array_equal(compiled(replicated), want[name])
        text = compiled.as_text()
        assert "CustomSPMDPartitioning" not in text and "all-gather" not in text, name


def test_jit_on_auto_axes_data_parallel_with_a_replicated_table(mesh):
    """The trainer's layout (ids split over "data", table replicated) compiles and runs,
    forward and gradient (the check is on the table's value only, not its cotangent)."""
    table, ids, seg, w, _ = _shards(4)
    seg = seg + jnp.arange(DEVICES, dtype=jnp.int32)[:, None] * S  # global bag ids
    flat = [x.reshape(-1) for x in (ids, seg, w)]

    def loss(t, i, s, w):
        return jnp.sum(ops.embedding_bag(t, i, s, DEVICES * S, weights=w) ** 2)

    f = jax.jit(jax.value_and_grad(loss))
    want = f(table, *flat)
    data = NamedSharding(mesh, P("data"))
    got = f(
        jax.device_put(table, NamedSharding(mesh, P())), *(jax.device_put(x, data) for x in flat)
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)


@pytest.mark.parametrize("impl", ["xla", "pallas", "cpu_ffi"])
def test_export_of_each_op(mesh, impl):
    """`jax.export` is untouched by the check: no custom partitioning in the module, for
    one device (where the exported call gives the op's answer) and for a replicated
    table on the 4-device mesh. (The C++ kernels' custom calls carry no compatibility
    guarantee, so exporting them needs `disabled_checks`, as any FFI call does.) Pallas
    in interpret mode is slow to compile: one op, exported for one device, stands for it."""
    if impl == "cpu_ffi" and not ops.cpu_ffi_available():
        pytest.skip("C++ extension not built")
    targets = [v for k, v in vars(_cpu_ffi).items() if k.endswith("_TARGET")]
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
    spec = jax.ShapeDtypeStruct((8, D), jnp.float32)
    table = jnp.asarray(np.random.default_rng(5).normal(size=(8, D)), jnp.float32)
    seg = jnp.array([0, 0, 1], jnp.int32)
    every_op = dict(
        _table_ops(),
        segment_spmm=lambda t, **kw: ops.segment_spmm(jnp.ones(3), seg, seg, t, 2, **kw),
        pairwise_dots=lambda t, **kw: ops.pairwise_dots(t.reshape(2, 4, D), **kw),
    )
    if impl == "pallas":
        every_op = {"embedding_bag": every_op["embedding_bag"]}
    for name, f in every_op.items():
        g = functools.partial(f, implementation=impl)
        # on the mesh: one op stands for all (the check is the same for every op)
        on_mesh = name == "embedding_bag" and impl != "pallas"
        for shardings in (None, NamedSharding(mesh, P())) if on_mesh else (None,):
            exported = jax.export.export(
                jax.jit(g, in_shardings=shardings),
                disabled_checks=checks if impl == "cpu_ffi" else (),
            )(spec)
            assert "CustomSPMDPartitioning" not in exported.mlir_module(), name
            if shardings is None and impl != "pallas":  # (its interpreter: seconds to compile)
                np.testing.assert_array_equal(exported.call(table), g(table), err_msg=name)


def test_lowering_without_devices_is_untouched():
    """Lowering on an AbstractMesh (export for devices this process lacks, or for CUDA on
    a CPU-only machine) never needs the devices: the check is left out there."""
    f = _table_ops()["embedding_bag"]
    spec = jax.ShapeDtypeStruct((8, D), jnp.float32)
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        abstract = jax.sharding.AbstractMesh((DEVICES,), ("model",), (axis_type,))
        exported = jax.export.export(
            jax.jit(
                functools.partial(f, implementation="xla"),
                in_shardings=NamedSharding(abstract, P()),
            )
        )(spec)
        assert exported.nr_devices == DEVICES
    cuda = ref.lower_for_cuda(functools.partial(f, implementation="pallas"), spec)
    assert "__gpu$xla.gpu.triton" in cuda


def test_unsharded_path_is_unchanged_hlo():
    """On one device the check is nothing: the lowered forward has no collective and no
    extra op over the primitive's own lowering."""
    table, ids = jnp.ones((V, D)), jnp.zeros(N, jnp.int32)
    seg = jnp.zeros(N, jnp.int32)
    text = jax.jit(lambda t, i: ops.embedding_bag(t, i, seg, S)).lower(table, ids).as_text()
    for collective in ("all-gather", "all_gather", "all-reduce", "all_reduce", "@Sharding"):
        assert collective not in text
    assert "CustomSPMDPartitioning" not in text


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
