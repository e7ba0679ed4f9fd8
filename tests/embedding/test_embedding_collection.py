"""DeviceTableStore and the Flax EmbeddingBagCollection: lookups of many features over
stacked tables match a per-feature float64 reference, and one sparse SGD step equals a
dense-gradient SGD step on the same loss (so the whole sparse path is the true gradient)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import nn as snn
from sparsejax import ops
from sparsejax.data import BatchPacker, JaggedIds
from sparsejax.embedding import DeviceTableStore, FeatureSpec, TableSpec, stack_name

B = 6


def _specs(optimizer=None):
    kw = {} if optimizer is None else {"optimizer": optimizer}
    tables = [
        TableSpec(name="user", vocab_size=40, dim=8, **kw),
        TableSpec(name="item", vocab_size=90, dim=8, **kw),
        TableSpec(name="tag", vocab_size=7, dim=4, **kw),
        TableSpec(name="small", vocab_size=1, dim=8, **kw),
    ]
    features = [
        FeatureSpec(name="user", table="user"),
        FeatureSpec(name="item", table="item"),
        FeatureSpec(name="clicked", table="item", combiner="mean", max_ids=4),
        FeatureSpec(name="recent", table="item", combiner=None, max_ids=3),
        FeatureSpec(name="tags", table="tag", combiner="sqrtn", max_ids=3, weighted=True),
        FeatureSpec(name="tag_max", table="tag", combiner="max", max_ids=2),
        FeatureSpec(name="only", table="small", combiner="sum", max_ids=2),
    ]
    return tables, features


def _host_batch(rng, tables, features):
    vocab = {t.name: t.vocab_size for t in tables}
    sparse = {}
    for f in features:
        lengths = rng.integers(0, f.max_ids + (2 if f.is_sequence else 1), B)
        if f.max_ids == 1:
            lengths = np.ones(B, np.int64)
        values = rng.integers(0, vocab[f.table], lengths.sum())  # duplicates likely
        weights = rng.random(lengths.sum()).astype(np.float32) if f.weighted else None
        sparse[f.name] = JaggedIds(lengths, values, weights)
    return sparse


def _reference(tables_np, features, table_of, host):
    """float64 per-feature pooling straight from the host lists."""
    out = {}
    for f in features:
        col = host[f.name]
        t = tables_np[table_of[f.name]].astype(np.float64)
        starts = np.concatenate([[0], np.cumsum(col.lengths)])
        rows = []
        for b in range(B):
            ids = col.values[starts[b] : starts[b + 1]]
            w = (
                np.ones(len(ids))
                if col.weights is None
                else col.weights[starts[b] : starts[b + 1]].astype(np.float64)
            )
            if f.is_sequence:
                ids, w = ids[-f.max_ids :], w[-f.max_ids :]
                seq = np.zeros((f.max_ids, t.shape[1]))
                seq[: len(ids)] = t[ids] * w[:, None]
                rows.append(seq)
                continue
            if len(ids) == 0:
                rows.append(np.zeros(t.shape[1]))
            elif f.combiner == "max":
                rows.append((t[ids] * w[:, None]).max(0))
            else:
                norm = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[f.combiner]
                rows.append((t[ids] * w[:, None]).sum(0) / norm)
        out[f.name] = np.stack(rows)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_lookup_matches_per_feature_reference(seed):
    rng = np.random.default_rng(seed)
    tables, features = _specs()
    ec = DeviceTableStore(tables, features)
    assert len(ec.stacks) == 2  # dims 8 and 4: user+item+small stacked, tag alone
    state = ec.init(jax.random.key(seed))
    host = _host_batch(rng, tables, features)
    batch = BatchPacker(tables, features, batch_size=B).pack(host, labels=np.zeros(B))
    outputs, _ = jax.jit(lambda s, f: ec.lookup(s, f, B))(state, batch.features)
    got = ec.split(outputs, B)
    by_name = {k: np.asarray(v["weights"]) for k, v in ec.export_tables(state).items()}
    want = _reference(by_name, features, {f.name: f.table for f in features}, host)
    for f in features:
        np.testing.assert_allclose(got[f.name], want[f.name], rtol=1e-5, atol=1e-6, err_msg=f.name)


def test_sparse_sgd_step_equals_dense_gradient_step():
    rng = np.random.default_rng(3)
    lr = 0.5
    tables, features = _specs(ops.SGD(learning_rate=lr))
    ec = DeviceTableStore(tables, features)
    state = ec.init(jax.random.key(0))
    host = _host_batch(rng, tables, features)
    batch = BatchPacker(tables, features, batch_size=B).pack(host, labels=np.zeros(B))
    proj = {
        f.name: jnp.asarray(
            rng.normal(
                size=(
                    f.bags_per_example() * tables[0].dim
                    if f.table != "tag"
                    else f.bags_per_example() * 4,
                )
            ),
            jnp.float32,
        )
        for f in features
    }

    def loss_of_pooled(pooled):
        return sum(jnp.sum(jnp.tanh(pooled[k].reshape(B, -1) @ proj[k])) for k in pooled)

    outputs, lookups = ec.lookup(state, batch.features, B)
    g = jax.grad(lambda o: loss_of_pooled(ec.split(o, B)))(outputs)
    new = ec.export_tables(ec.apply_gradients(state, lookups, g, step=1))

    by_name = {k: v["weights"] for k, v in ec.export_tables(state).items()}

    def dense_loss(weights):  # plain autodiff through the jnp reference
        pooled = {}
        for f in features:
            jag = batch.features[f.name]
            bags = B * f.bags_per_example()
            p = ops.embedding_bag_ref(
                weights[f.table],
                jnp.asarray(jag.ids),
                jnp.asarray(jag.segments),
                bags,
                weights=None if jag.weights is None else jnp.asarray(jag.weights),
                combiner=f.combiner or "sum",
            )
            pooled[f.name] = p
        return loss_of_pooled(pooled)

    dense_g = jax.grad(dense_loss)(by_name)
    for name in by_name:
        want = np.asarray(by_name[name]) - lr * np.asarray(dense_g[name])
        np.testing.assert_allclose(new[name]["weights"], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_ids_outside_their_table_never_reach_a_neighbour():
    tables = [TableSpec(name="a", vocab_size=3, dim=2), TableSpec(name="b", vocab_size=5, dim=2)]
    features = [FeatureSpec(name="fa", table="a"), FeatureSpec(name="fb", table="b")]
    ec = DeviceTableStore(tables, features)
    state = ec.init(jax.random.key(0))
    from sparsejax.data import PaddedIds

    feats = {
        "fa": PaddedIds(jnp.array([3, 0]), jnp.array([0, 1])),  # 3 is row 0 of b if shifted
        "fb": PaddedIds(jnp.array([1, 2]), jnp.array([0, 1])),
    }
    lookup = jax.jit(lambda s, f: ec.lookup(s, f, 2)[0])
    out = ec.split(lookup(state, feats), 2)
    np.testing.assert_array_equal(out["fa"][0], 0.0)  # looked up nothing, not b's row 0
    with ops.checks(), pytest.raises(Exception, match=r"feature 'fa' \(table 'a'.*id 3"):
        jax.block_until_ready(jax.jit(lambda s, f: ec.lookup(s, f, 2)[0])(state, feats))
    with pytest.raises(IndexError, match="id 3"):  # eager: always checked
        ec.lookup(state, feats, 2)


def test_export_import_roundtrip_and_mismatch_errors():
    tables, features = _specs()
    ec = DeviceTableStore(tables, features)
    state = ec.init(jax.random.key(0))
    by_name = ec.export_tables(state)
    assert set(by_name) == {t.name for t in tables}
    back = ec.import_tables(by_name)
    jax.tree.map(np.testing.assert_array_equal, back, state)
    # a different stacking (new table order) restores the same tables
    ec2 = DeviceTableStore(list(reversed(tables)), features)
    again = ec2.export_tables(ec2.import_tables(by_name))
    jax.tree.map(np.testing.assert_array_equal, again, by_name)
    with pytest.raises(KeyError, match="'item'"):
        ec.import_tables({k: v for k, v in by_name.items() if k != "item"})
    bad = dict(by_name, item={**by_name["item"], "weights": np.zeros((91, 8), np.float32)})
    with pytest.raises(ValueError, match=r"table 'item'.*\(91, 8\).*\(90, 8\)"):
        ec.import_tables(bad)


def test_table_init_depends_on_its_name_not_its_stack():
    tables, features = _specs()
    a = DeviceTableStore(tables, features).export_tables(
        DeviceTableStore(tables, features).init(jax.random.key(7))
    )
    ec = DeviceTableStore(list(reversed(tables)), features)
    b = ec.export_tables(ec.init(jax.random.key(7)))
    for name in a:
        np.testing.assert_array_equal(a[name]["weights"], b[name]["weights"])


def test_spec_errors_name_the_problem():
    with pytest.raises(ValueError, match="did you mean 'item'"):
        DeviceTableStore(
            [TableSpec(name="item", vocab_size=3, dim=2)], [FeatureSpec(name="f", table="itme")]
        )
    with pytest.raises(ValueError, match="duplicate feature name 'f'"):
        DeviceTableStore(
            [TableSpec(name="t", vocab_size=3, dim=2)],
            [FeatureSpec(name="f", table="t"), FeatureSpec(name="f", table="t")],
        )
    with pytest.raises(ValueError, match=r"tables \['u'\] are declared but no feature"):
        DeviceTableStore(
            [TableSpec(name="t", vocab_size=3, dim=2), TableSpec(name="u", vocab_size=3, dim=2)],
            [FeatureSpec(name="f", table="t")],
        )
    with pytest.raises(ValueError, match="combiner"):
        FeatureSpec(name="f", table="t", combiner="avg")
    with pytest.raises(ValueError, match="vocab_size"):
        TableSpec(name="t", vocab_size=0, dim=2)
    with pytest.raises(ValueError, match="int32"):
        TableSpec(name="t", vocab_size=2**31, dim=2, placement="replicated")
    big = TableSpec(name="t", vocab_size=2**31, dim=2)  # the planner may still split it
    with pytest.raises(ValueError, match=r"int32 row ids\); place it row_wise"):
        DeviceTableStore([big], [FeatureSpec(name="f", table="t")])  # refused unallocated
    assert TableSpec(name="t", vocab_size=3, dim=2) == TableSpec(name="t", vocab_size=3, dim=2)


class _UserModel(nn.Module):
    """A user's own Flax model with a sparsejax layer inside."""

    tables: tuple
    features: tuple

    @nn.compact
    def __call__(self, batch):
        emb = snn.EmbeddingBagCollection(self.tables, self.features)(
            batch.features, batch.batch_size
        )
        x = jnp.concatenate(
            [emb[f.name].reshape(batch.batch_size, -1) for f in self.features], axis=1
        )
        return nn.Dense(1)(x)[:, 0]


def test_flax_layer_trains_sparsely_inside_any_model():
    rng = np.random.default_rng(5)
    tables, features = _specs(ops.SGD(learning_rate=0.3))
    host = _host_batch(rng, tables, features)
    batch = BatchPacker(tables, features, batch_size=B).pack(host, labels=np.ones(B))
    model = _UserModel(tuple(tables), tuple(features))
    v = model.init(jax.random.key(0), batch)
    assert "params" in v and snn.EMBEDDING in v
    assert not any("weights" in str(k) for k in jax.tree_util.tree_leaves_with_path(v["params"]))

    def loss(params, probe):
        out, aux = model.apply(
            {**v, "params": params, snn.EMBEDDING_GRADS: probe},
            batch,
            mutable=[snn.EMBEDDING_LOOKUPS],
        )
        return jnp.mean((out - 1.0) ** 2), aux[snn.EMBEDDING_LOOKUPS]

    (_, lookups), (_, g_rows) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
        v["params"], v[snn.EMBEDDING_GRADS]
    )
    new = snn.apply_embedding_gradients(v[snn.EMBEDDING], lookups, g_rows, step=1)

    def dense_loss(tables_var):  # the dense gradient w.r.t. the tables themselves
        out = model.apply({**v, snn.EMBEDDING: tables_var}, batch)
        return jnp.mean((out - 1.0) ** 2)

    dense_g = jax.grad(dense_loss)(v[snn.EMBEDDING])
    want = jax.tree.map(lambda w, g: w - 0.3 * g, v[snn.EMBEDDING], dense_g)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), new, want)
    changed = sum(
        int((np.asarray(a) != np.asarray(b)).any(axis=-1).sum())
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(v[snn.EMBEDDING]), strict=True)
    )
    assert 0 < changed < sum(t.vocab_size for t in tables)


def test_specs_are_hashable_module_fields():
    tables, features = _specs()
    assert hash(dataclasses.replace(tables[0])) == hash(tables[0])
    m = snn.EmbeddingBagCollection(tuple(tables), tuple(features))
    assert m.store == snn.EmbeddingBagCollection(tuple(tables), tuple(features)).store
    d8 = stack_name(8, "float32", tables[0].optimizer)
    d4 = stack_name(4, "float32", tables[2].optimizer)
    groups = {name: [f.name for f in g.features] for name, g in m.store.groups.items()}
    assert groups == {
        f"{d4}_max": ["tag_max"],
        f"{d4}_sum": ["tags"],
        f"{d8}_sum": ["user", "item", "clicked", "recent", "only"],
    }
