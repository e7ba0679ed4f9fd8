"""The table store seam: stacking as a pure function of the specs (names from the stack's
key, split below 2**31 rows), the `TableStore` protocol of `DeviceTableStore`, its mesh
and shardings (4 fake CPU devices), and table init (in place, refused by name when it
cannot fit)."""

import math
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from sparsejax import nn as snn
from sparsejax import ops
from sparsejax.data import PaddedIds
from sparsejax.embedding import (
    MAX_STACK_ROWS,
    DeviceTableStore,
    FeatureSpec,
    TableSpec,
    TableStore,
    default_mesh,
    plan_stacks,
    stack_name,
)
from sparsejax.sharding import make_store

B = 2


def _specs():
    tables = [
        TableSpec(name="user", vocab_size=40, dim=8),
        TableSpec(name="item", vocab_size=90, dim=8),
        TableSpec(name="tag", vocab_size=7, dim=4, optimizer=ops.SGD(learning_rate=0.1)),
    ]
    features = [
        FeatureSpec(name="user", table="user"),
        FeatureSpec(name="item", table="item", combiner="mean", max_ids=2),
        FeatureSpec(name="tag", table="tag", combiner="max", max_ids=2),
    ]
    return tables, features


def _batch(features, vocab):
    """Ids 0 and vocab-1 (the first and last row of each table), two bags."""
    out = {}
    for f in features:
        last = vocab[f.table] - 1
        if f.max_ids == 1:
            out[f.name] = PaddedIds(jnp.array([0, last], jnp.int32), jnp.array([0, 1], jnp.int32))
        else:
            out[f.name] = PaddedIds(
                jnp.array([0, last, last, -1], jnp.int32), jnp.array([0, 0, 1, 1], jnp.int32)
            )
    return out


def _layer_variable_names(tables, features):
    layer = snn.EmbeddingBagCollection(tuple(tables), tuple(features))
    feats = _batch(features, {t.name: t.vocab_size for t in tables})
    shapes = jax.eval_shape(lambda: layer.init(jax.random.key(0), feats, B))
    return shapes[snn.EMBEDDING]


# ---- stacking ---------------------------------------------------------------------------


def test_stack_names_come_from_the_stack_key_not_the_order():
    tables, _ = _specs()
    stacks = plan_stacks(tables)
    d8 = stack_name(8, "float32", tables[0].optimizer)
    assert d8.startswith("d8_float32_rowwiseadagrad_") and len(d8.rsplit("_", 1)[1]) == 6
    assert set(stacks) == {d8, stack_name(4, "float32", ops.SGD(learning_rate=0.1))}
    assert [t.name for t in stacks[d8].tables] == ["item", "user"]  # by name
    assert stacks[d8].offsets == (0, 90)
    assert plan_stacks(list(reversed(tables))) == stacks
    # the hash tells optimizers with different hyperparameters apart
    assert stack_name(8, "float32", ops.SGD(learning_rate=0.1)) != stack_name(
        8, "float32", ops.SGD(learning_rate=0.2)
    )
    assert stack_name(8, "float32", ops.SGD(learning_rate=0.1)) == stack_name(
        8, "float32", ops.SGD(learning_rate=0.1)
    )


def test_a_large_table_is_a_stack_of_its_own():
    tables, _ = _specs()
    d8 = stack_name(8, "float32", tables[0].optimizer)
    # item: 90 rows of 8 f32 weights and a row-wise Adagrad slot, 36 bytes each
    for alone_bytes, names in ((90 * 36, {f"{d8}_item", d8}), (90 * 36 + 1, {d8})):
        stacks = plan_stacks(tables, alone_bytes=alone_bytes)
        assert {n for n in stacks if n.startswith("d8_")} == names
        assert [t.name for t in stacks[d8].tables] == (
            ["user"] if len(names) == 2 else ["item", "user"]
        )


def test_inserting_a_table_renames_no_other_stacks_flax_variables():
    tables, features = _specs()
    before = _layer_variable_names(tables, features)
    new_tables = [
        TableSpec(name="aaa_new", vocab_size=5, dim=16),  # a new stack, declared first
        TableSpec(
            name="aab_new",
            vocab_size=3,
            dim=4,  # joins tag's stack
            optimizer=ops.SGD(learning_rate=0.1),
        ),
        *tables,
    ]
    new_features = [
        FeatureSpec(name="n1", table="aaa_new"),
        FeatureSpec(name="n2", table="aab_new"),
        *features,
    ]
    after = _layer_variable_names(new_tables, new_features)
    assert set(before) < set(after) and len(after) == len(before) + 1
    d8 = stack_name(8, "float32", tables[0].optimizer)
    assert after[d8]["weights"].shape == before[d8]["weights"].shape == (130, 8)
    d4 = stack_name(4, "float32", ops.SGD(learning_rate=0.1))
    assert after[d4]["weights"].shape == (10, 4)


def test_stacks_split_so_no_stacked_id_passes_int32():
    """Two 1.5e9-row tables of one key used to share a stack whose ids wrapped negative
    (silently padding); at the layer level, specs and shapes only, nothing allocated."""
    big = 1_500_000_000
    tables = [TableSpec(name=n, vocab_size=big, dim=8) for n in ("a", "b")]
    features = [FeatureSpec(name="fa", table="a"), FeatureSpec(name="fb", table="b")]
    layer = snn.EmbeddingBagCollection(tuple(tables), tuple(features))
    stacks = layer.store.stacks
    assert len(stacks) == 2
    assert all(s.rows <= MAX_STACK_ROWS for s in stacks.values())
    assert sorted(
        math.prod(v["weights"].shape) // 8 for v in _layer_variable_names(tables, features).values()
    ) == [big, big]
    # the stacked ids of each table's last row stay in int32 and inside their stack
    store = DeviceTableStore(tables, features, implementation="xla")
    tiny = {
        n: {
            "weights": jnp.zeros((1, 8), jnp.float32),
            "slots": {"accumulator": jnp.zeros((1,), jnp.float32)},
        }
        for n in stacks
    }
    feats = {
        f: PaddedIds(jnp.array([big - 1, 0], jnp.int32), jnp.array([0, 1], jnp.int32))
        for f in ("fa", "fb")
    }
    _, lookups = jax.jit(lambda s, f: store.lookup(s, f, B))(tiny, feats)
    for lk in lookups.values():
        np.testing.assert_array_equal(lk.ids, [big - 1, 0])


def test_split_stacks_look_up_and_update_the_right_rows():
    tables = [
        TableSpec(name="a", vocab_size=6, dim=2, optimizer=ops.SGD(learning_rate=1.0)),
        TableSpec(name="b", vocab_size=7, dim=2, optimizer=ops.SGD(learning_rate=1.0)),
    ]
    features = [FeatureSpec(name="fa", table="a"), FeatureSpec(name="fb", table="b")]
    split = DeviceTableStore(tables, features, max_stack_rows=10)
    whole = DeviceTableStore(tables, features)
    assert (len(split.stacks), len(whole.stacks)) == (2, 1)
    key = jax.random.key(1)
    s_split, s_whole = split.init(key), whole.init(key)
    for name, t in whole.export_tables(s_whole).items():  # same values whatever the stacking
        np.testing.assert_array_equal(split.export_tables(s_split)[name]["weights"], t["weights"])
    feats = _batch(features, {"a": 6, "b": 7})
    for store, state in ((split, s_split), (whole, s_whole)):
        out, lk = store.lookup(state, feats, B)
        pooled = store.split(out, B)
        by_name = store.export_tables(state)
        np.testing.assert_array_equal(pooled["fb"][1], by_name["b"]["weights"][6])
        new = store.export_tables(
            store.apply_gradients(state, lk, jax.tree.map(jnp.ones_like, out), step=1)
        )
        np.testing.assert_allclose(new["b"]["weights"][6], by_name["b"]["weights"][6] - 1.0)
        np.testing.assert_array_equal(new["b"]["weights"][1:6], by_name["b"]["weights"][1:6])


# ---- the protocol -----------------------------------------------------------------------


def test_device_store_implements_the_protocol():
    tables, features = _specs()
    store = make_store(tables, features)
    assert isinstance(store, DeviceTableStore) and isinstance(store, TableStore)
    state = store.init(jax.random.key(0))
    assert tuple(state) == store.state_names
    abstract = store.abstract_state()
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(state), strict=True):
        assert (a.shape, a.dtype, a.sharding) == (s.shape, s.dtype, s.sharding)
    tables_shapes = jax.tree.map(lambda a: (a.shape, a.dtype), store.abstract_tables())
    assert tables_shapes == jax.tree.map(lambda a: (a.shape, a.dtype), store.export_tables(state))
    assert tables_shapes["tag"] == {"weights": ((7, 4), jnp.float32), "slots": {}}
    back = store.import_tables(store.export_tables(state))
    jax.tree.map(np.testing.assert_array_equal, back, state)
    assert store == make_store(tables, features) and hash(store) == hash(
        make_store(tables, features)
    )


def test_public_api_imports():
    import sparsejax.embedding as emb

    assert set(emb.__all__) == {n for n in dir(emb) if not n.startswith("_")}
    for name in emb.__all__:
        assert getattr(emb, name) is not None, name
    for name in (
        "EmbeddingBagCollection",
        "StoreLookups",
        "apply_embedding_gradients",
        "EMBEDDING",
        "EMBEDDING_GRADS",
        "EMBEDDING_LOOKUPS",
    ):
        assert getattr(snn, name) is not None, name


def test_old_names_still_work_and_warn():
    import sparsejax.embedding as emb

    with pytest.warns(DeprecationWarning, match="DeviceTableStore"):
        old = emb.EmbeddingCollection
    assert old is DeviceTableStore
    tables, features = _specs()
    layer = snn.EmbeddingBagCollection(tuple(tables), tuple(features))
    assert layer.collection == layer.store
    store = layer.store
    state = store.init_stack(jax.random.key(0), store.state_names[0])
    np.testing.assert_array_equal(
        state["weights"], store.init_part(jax.random.key(0), store.state_names[0])["weights"]
    )
    full = store.init(jax.random.key(0))
    by_name = store.tables_by_name(full)
    assert set(by_name) == {"user", "item", "tag"}
    jax.tree.map(np.testing.assert_array_equal, by_name, store.export_tables(full))
    jax.tree.map(np.testing.assert_array_equal, store.state_from_tables(by_name), full)


# ---- mesh and shardings -------------------------------------------------------------------


def test_default_mesh_is_one_device_and_state_carries_named_shardings():
    tables, features = _specs()
    store = DeviceTableStore(tables, features)
    assert store.mesh.devices.size == 1 and store.mesh.axis_names == ("data",)
    assert store.mesh == default_mesh()
    state = store.init(jax.random.key(0))
    shardings = store.state_shardings()
    assert jax.tree.structure(shardings) == jax.tree.structure(state)
    for leaf, sh in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
        assert isinstance(sh, NamedSharding) and sh.mesh == store.mesh
        assert leaf.sharding == sh


def test_four_device_mesh_replicates_tables_and_matches_one_device(implementation):
    assert len(jax.devices()) >= 4
    tables, features = _specs()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(4, 1), ("data", "model"))
    store = DeviceTableStore(tables, features, mesh=mesh, implementation=implementation)
    assert store.with_mesh(default_mesh()) == DeviceTableStore(
        tables, features, implementation=implementation
    )
    one = DeviceTableStore(tables, features, implementation="xla")  # the reference
    state, ref_state = store.init(jax.random.key(3)), one.init(jax.random.key(3))
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 4
    feats = _batch(features, {t.name: t.vocab_size for t in tables})
    step = jax.jit(
        lambda s, f: store.split(store.lookup(s, f, B)[0], B),
        in_shardings=(store.state_shardings(), None),
    )
    got, want = step(state, feats), one.split(one.lookup(ref_state, feats, B)[0], B)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)


def test_mesh_axes_the_store_cannot_use_are_named():
    tables, features = _specs()
    devices = np.array(jax.devices()[:4])
    with pytest.raises(ValueError, match="mesh axis 'batch'"):
        DeviceTableStore(tables, features, mesh=Mesh(devices, ("batch",)))
    with pytest.raises(ValueError, match="mesh axis 'model' has size 2"):
        DeviceTableStore(tables, features, mesh=Mesh(devices.reshape(2, 2), ("data", "model")))
    layer = snn.EmbeddingBagCollection(
        tuple(tables), tuple(features), mesh=Mesh(devices, ("rows",))
    )
    with pytest.raises(ValueError, match="mesh axis 'rows'"):
        layer.init(jax.random.key(0), _batch(features, {t.name: t.vocab_size for t in tables}), B)


def test_flax_layer_places_its_tables_on_its_mesh():
    tables, features = _specs()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    layer = snn.EmbeddingBagCollection(tuple(tables), tuple(features), mesh=mesh)
    v = layer.init(jax.random.key(0), _batch(features, {t.name: t.vocab_size for t in tables}), B)
    leaves = jax.tree.leaves(v[snn.EMBEDDING])
    assert leaves and all(
        leaf.sharding == NamedSharding(mesh, jax.sharding.PartitionSpec()) for leaf in leaves
    )


# ---- init -------------------------------------------------------------------------------


def test_a_table_that_cannot_fit_is_refused_by_name_before_allocating():
    huge = TableSpec(name="huge", vocab_size=2**31 - 1, dim=4096)  # 32 TiB + slots
    features = [FeatureSpec(name="f", table="huge")]
    store = DeviceTableStore([huge], features)
    pattern = (
        r"table 'huge' needs [\d.]+ TiB \(weights [\d.]+ TiB \+ optimizer slots "
        r"[\d.]+ GiB \+ init block [\d.]+ MiB\) but [\d.]+ \w+ is available"
    )
    with pytest.raises(MemoryError, match=pattern):
        store.init(jax.random.key(0))
    layer = snn.EmbeddingBagCollection((huge,), tuple(features))
    feats = {"f": PaddedIds(jnp.zeros(2, jnp.int32), jnp.arange(2, dtype=jnp.int32))}
    with pytest.raises(MemoryError, match="table 'huge'"):
        layer.init(jax.random.key(0), feats, B)
    assert jax.eval_shape(lambda: layer.init(jax.random.key(0), feats, B))  # shapes only


def test_a_stack_that_cannot_fit_is_refused_by_name(monkeypatch):
    from sparsejax.embedding import _device_store

    tables, features = _specs()
    monkeypatch.setattr(_device_store, "available_memory", lambda devices: (1000, "test"))
    with pytest.raises(
        MemoryError,
        match=r"stack 'd8_float32_rowwiseadagrad_\w+' \(tables "
        r"\['item', 'user'\]\) needs 7.38 KiB \(weights 4.06 KiB \+ optimizer slots 520 B "
        r"\+ init block 2.81 KiB\) but 1000 B",
    ):
        DeviceTableStore(tables, features).init(jax.random.key(0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_init_fills_in_place_in_the_storage_dtype(dtype):
    """Host allocations during init stay within 1.1x the table's bytes: no float64 draw,
    no per-table copy before a concatenate (the old path peaked at ~3.2x)."""
    rows = 400_000
    table = TableSpec(
        name="t", vocab_size=rows, dim=32, dtype=dtype, optimizer=ops.SGD(learning_rate=0.1)
    )
    store = DeviceTableStore([table], [FeatureSpec(name="f", table="t")])
    store.init(jax.random.key(0))  # warm the caches of everything but the fill
    nbytes = rows * 32 * np.dtype(jnp.dtype(dtype)).itemsize
    tracemalloc.start()
    try:
        state = store.init(jax.random.key(1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert nbytes <= peak <= 1.1 * nbytes, (peak, nbytes)
    w = np.asarray(state[store.state_names[0]]["weights"]).astype(np.float32)
    assert w.dtype == np.float32 and state[store.state_names[0]]["weights"].dtype == dtype


def test_default_init_keeps_its_distribution_and_depends_on_key_and_name_only(monkeypatch):
    from sparsejax.embedding import _spec

    rows, dim = 100_000, 16
    tables = [
        TableSpec(name="t", vocab_size=rows, dim=dim),
        TableSpec(name="u", vocab_size=rows, dim=dim),
    ]
    features = [FeatureSpec(name="f", table="t"), FeatureSpec(name="g", table="u")]
    store = DeviceTableStore(tables, features)
    by_name = store.export_tables(store.init(jax.random.key(0)))
    w = np.asarray(by_name["t"]["weights"], np.float64)
    s = math.sqrt(1.0 / rows)  # TorchRec's default bound
    assert -s <= w.min() < -0.999 * s and 0.999 * s < w.max() < s
    assert abs(w.mean()) < 0.01 * s and abs(w.std() / (s / math.sqrt(3)) - 1) < 0.01
    assert not np.array_equal(by_name["t"]["weights"], by_name["u"]["weights"])
    # alone in its store, or drawn in other chunk sizes: the same values
    monkeypatch.setattr(_spec, "FILL_CHUNK_ELEMENTS", 777)
    alone = DeviceTableStore(tables[:1], features[:1])
    np.testing.assert_array_equal(
        alone.export_tables(alone.init(jax.random.key(0)))["t"]["weights"], by_name["t"]["weights"]
    )
    other_key = alone.export_tables(alone.init(jax.random.key(1)))["t"]["weights"]
    assert not np.array_equal(other_key, by_name["t"]["weights"])
