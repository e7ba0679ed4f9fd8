"""The sharded store on a 2x4 mesh of fake CPU devices: every placement gives the outputs
and updated tables of the single-device store, step after step (fp32, 1e-6), on fresh
random batches with duplicates, empty bags, padding and skewed ids; its state is an
ordinary sharded array; export/import restores across meshes exactly; bad placements and
batches are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sparsejax import ops
from sparsejax.data import PaddedIds, SparseBatch
from sparsejax.embedding import DeviceTableStore, FeatureSpec, TableSpec
from sparsejax.sharding import ShardedTableStore, make_mesh, make_store, shard_batch

B = 16
MESH_2X4 = None


def _mesh(data, model):
    return make_mesh(model=model, devices=jax.devices()[: data * model])


def _specs(placement, optimizer=None, vocab=(50, 37, 9)):
    opt = optimizer or ops.RowWiseAdagrad(learning_rate=0.1)
    tables = [
        TableSpec(name="user", vocab_size=vocab[0], dim=8, optimizer=opt, placement=placement),
        TableSpec(name="item", vocab_size=vocab[1], dim=8, optimizer=opt, placement=placement),
        TableSpec(name="tag", vocab_size=vocab[2], dim=4, optimizer=opt, placement=placement),
    ]
    features = [
        FeatureSpec(name="user", table="user"),
        FeatureSpec(name="clicks", table="item", combiner="mean", max_ids=5),
        FeatureSpec(name="bought", table="item", combiner="sqrtn", max_ids=3, weighted=True),
        FeatureSpec(name="tags", table="tag", combiner=None, max_ids=3),
    ]
    return tables, features


def _batch(rng, tables, features, b=B, skew=False):
    """Random ids (duplicates, empty bags, -1 padding inside the capacity); `skew`:
    most ids are 0 (one hot row)."""
    vocab = {t.name: t.vocab_size for t in tables}
    out = {}
    for f in features:
        lengths = rng.integers(0, f.max_ids + 1, b) if f.max_ids > 1 else np.ones(b, int)
        n = int(lengths.sum())
        ids = rng.integers(0, vocab[f.table], n)
        if skew:
            ids = np.where(rng.random(n) < 0.8, 0, ids)
        segs = np.repeat(np.arange(b), lengths)
        if f.is_sequence:  # one bag per position
            segs = segs * f.max_ids + np.concatenate([np.arange(k) for k in lengths])
        cap = f.capacity_for(b)
        pad = cap - n
        last = b * f.bags_per_example() - 1
        w = rng.uniform(0.5, 2.0, n).astype(np.float32) if f.weighted else None
        out[f.name] = PaddedIds(
            np.concatenate([ids, -np.ones(pad, int)]).astype(np.int32),
            np.concatenate([segs, np.full(pad, last)]).astype(np.int32),
            None if w is None else np.concatenate([w, np.zeros(pad, np.float32)]),
        )
    ones = np.ones(b, np.float32)
    return SparseBatch(out, np.zeros((b, 1), np.float32), ones, ones)


def _loss_grads(pooled):
    """A fixed nonlinear loss of the pooled rows, so gradients differ per bag."""

    def loss(p):
        return sum(jnp.sum(jnp.sin(v) * (i + 1.0)) for i, v in enumerate(p.values()))

    return loss


def _step_fn(store, batch_size):
    def step(state, feats, k):
        def f(outputs):
            split = store.split(outputs, batch_size)
            return _loss_grads(split)(split), split

        outputs, res = store.lookup(state, feats, batch_size)
        (_, split), g = jax.value_and_grad(f, has_aux=True)(outputs)
        return store.apply_gradients(state, res, g, step=k), split

    return jax.jit(step, static_argnums=())


def _run(store, batches, steps):
    state = store.init(jax.random.key(1))
    step = _step_fn(store, B)
    outs = []
    for k, batch in enumerate(batches[:steps]):
        feats = batch.features
        if isinstance(store, ShardedTableStore):
            feats = shard_batch(batch, store.features, store.num_devices).features
        state, split = step(state, feats, k + 1)
        outs.append(jax.tree.map(np.asarray, split))
    return outs, jax.tree.map(np.asarray, store.export_tables(state))


@pytest.mark.parametrize(
    "placement", ["replicated", "table_wise", "column_wise", "table_row_wise", "row_wise"]
)
def test_every_placement_matches_one_device_for_several_steps(placement):
    opt = ops.Adagrad(learning_rate=0.1) if placement == "column_wise" else None
    tables, features = _specs(placement, opt)
    if placement not in ("row_wise", "table_row_wise"):  # max pooling: one owner per bag
        features = [*features, FeatureSpec(name="top", table="user", combiner="max", max_ids=3)]
    rng = np.random.default_rng(7)
    batches = [_batch(rng, tables, features, skew=k == 1) for k in range(3)]
    sharded = ShardedTableStore(tables, features, mesh=_mesh(2, 4), implementation="xla")
    plain = [TableSpec(**{**t.__dict__, "placement": "device"}) for t in tables]
    ref = DeviceTableStore(plain, features, implementation="xla")
    got, got_tables = _run(sharded, batches, 3)
    want, want_tables = _run(ref, batches, 3)
    for g, w in zip(got, want, strict=True):
        for name in w:
            np.testing.assert_allclose(g[name], w[name], rtol=1e-6, atol=1e-6, err_msg=name)
    for name in want_tables:
        np.testing.assert_allclose(
            got_tables[name]["weights"], want_tables[name]["weights"], rtol=1e-6, atol=1e-6
        )
        for s in want_tables[name]["slots"]:
            np.testing.assert_allclose(
                got_tables[name]["slots"][s], want_tables[name]["slots"][s], rtol=1e-6, atol=1e-6
            )


def test_state_is_an_ordinary_sharded_array_and_row_wise_splits_rows_over_every_device():
    tables, features = _specs("row_wise")
    store = make_store(tables, features, mesh=_mesh(2, 4))
    assert isinstance(store, ShardedTableStore)
    state = store.init(jax.random.key(0))
    (stack,) = [s for s in store.stacks.values() if s.dim == 8]
    w = state[stack.name]["weights"]
    assert w.sharding.spec == P(("data", "model"), None)
    assert len({s.index[0].start for s in w.addressable_shards}) == 8
    assert w.shape[0] == 8 * stack.rows_per_shard
    # contiguous row blocks: shard s holds rows [s * B, (s + 1) * B), B = ceil(50 / 8)
    piece = next(p for p in stack.pieces if p.source == "user")
    assert (piece.stride, piece.local_rows) == (8, 7)
    owner, local = piece.route(np.arange(50, dtype=np.int64), 8)
    np.testing.assert_array_equal(owner, np.arange(50) // 7)
    np.testing.assert_array_equal(local, piece.offset + np.arange(50) % 7)
    assert [piece.shard_rows(s) for s in (0, 6, 7)] == [(0, 7), (42, 49), (49, 50)]


def test_export_import_restores_exactly_on_another_mesh():
    tables, features = _specs("table_row_wise")
    a = ShardedTableStore(tables, features, mesh=_mesh(2, 4))
    state = a.init(jax.random.key(3))
    saved = jax.tree.map(np.asarray, a.export_tables(state))
    for data, model in [(1, 2), (1, 1), (2, 4)]:
        b = a.with_mesh(_mesh(data, model))
        back = jax.tree.map(np.asarray, b.export_tables(b.import_tables(saved)))
        jax.tree.map(np.testing.assert_array_equal, back, saved)
    ref = DeviceTableStore(
        [TableSpec(**{**t.__dict__, "placement": "device"}) for t in tables], features
    )
    # the same initial values as the single-device store
    jax.tree.map(
        np.testing.assert_array_equal,
        saved,
        jax.tree.map(np.asarray, ref.export_tables(ref.init(jax.random.key(3)))),
    )


def test_bad_placements_and_batches_are_refused_by_name():
    tables, features = _specs("column_wise")  # row-wise Adagrad keeps one value per row
    with pytest.raises(ValueError, match="table 'user': column_wise .* RowWiseAdagrad"):
        ShardedTableStore(tables, features, mesh=_mesh(2, 4))
    tables, features = _specs("row_wise")
    features = [*features, FeatureSpec(name="top", table="tag", combiner="max", max_ids=2)]
    with pytest.raises(ValueError, match="feature 'top': max pooling .* row_wise"):
        ShardedTableStore(tables, features, mesh=_mesh(2, 4))
    tables, features = _specs("table_wise")
    odd = [*tables[:2], TableSpec(name="tag", vocab_size=9, dim=6, placement="column_wise")]
    with pytest.raises(ValueError, match="table 'tag': column_wise .* dim 6 .* 4 devices"):
        ShardedTableStore(odd, features, mesh=_mesh(2, 4))
    store = ShardedTableStore(tables, features, mesh=_mesh(2, 4))
    batch = _batch(np.random.default_rng(0), tables, features, b=12)
    with pytest.raises(ValueError, match="batch size 12 does not divide over the 8 devices"):
        store.lookup(store.init(jax.random.key(0)), batch.features, 12)
    wide = FeatureSpec(name="clicks", table="item", max_ids=5)
    batch = _batch(np.random.default_rng(0), tables, [wide])
    small = FeatureSpec(name="clicks", table="item", max_ids=5, capacity=8)  # 1 id a device
    with pytest.raises(ValueError, match="feature 'clicks': device \\d+ gets \\d+ ids"):
        shard_batch(batch, {"clicks": small}, 8)


# ---- the trainer on a mesh --------------------------------------------------------------


def _placed(model, placement):
    """`model` with every table of every layer placed `placement`."""
    import dataclasses

    return model.clone(
        tables=tuple(dataclasses.replace(t, placement=placement) for t in model.tables)
    )


def test_trainer_on_a_2x4_mesh_matches_one_device(tmp_path, placement="row_wise"):
    """A DLRM trained with placed tables on 8 devices: the loss, the dense parameters,
    the tables and slots and the eval metrics of the single-device run, step by step."""
    from sparsejax import runner, train

    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp_path}",
            "data.batch_size=64",
            "data.eval_batches=2",
            "data.synthetic_options={vocab_sizes: [300, 50, 7, 120], num_dense: 3}",
            "model.embedding_dim=8",
            "model.options={bottom: [16, 8], top: [16, 1]}",
        ],
    )
    data = runner.build_data(cfg)
    model = runner.build_model(cfg, data.tables, data.features)
    b = data.packer.batch_size
    batches = [
        data.packer.pack(s, labels=y, dense=d)
        for s, y, d in (data.train_source.batch(i, b) for i in range(3))
    ]
    tx = runner.dense_optimizer(cfg.optimizer)
    one = train.Trainer(model, tx)
    eight = train.Trainer(_placed(model, placement), tx, mesh=_mesh(2, 4))
    s1, s8 = one.init(jax.random.key(0), batches[0]), eight.init(jax.random.key(0), batches[0])
    assert eight.shards_batch
    for batch in batches:
        s1, m1 = one.train_step(s1, batch)
        s8, m8 = eight.train_step(s8, batch)
        np.testing.assert_allclose(float(m8["loss"]), float(m1["loss"]), rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
        (s8.params, eight.tables_by_name(s8)),
        (s1.params, one.tables_by_name(s1)),
    )
    e1, e8 = one.evaluate(s1, data.eval_batches), eight.evaluate(s8, data.eval_batches)
    assert e8["auc"] == pytest.approx(e1["auc"], abs=1e-6)
    assert e8["loss"] == pytest.approx(e1["loss"], abs=1e-6)


def test_dynamic_and_cached_tables_train_on_a_mesh_as_on_one_device():
    """Raw-id tables with a small device cache, the cache row-split (slot i on shard
    i % 8) or table-wise: the same losses and host rows as on one device."""
    import dataclasses

    import optax
    from embedding.test_tiered import DIM, ITEM_KEYS, _batches, _dynamic, _features, _tables

    from sparsejax.embedding import HostCache
    from sparsejax.nn import DLRM
    from sparsejax.train import Trainer

    opt = ops.RowWiseAdagrad(learning_rate=0.3)
    tables = _tables(opt, user={"vocab_size": 500, "cache": HostCache(rows=24)}, item=_dynamic(48))
    batches = _batches(12, user_keys=None, item_keys=ITEM_KEYS)
    placed = [
        dataclasses.replace(t, placement=p)
        for t, p in zip(tables, ["table_wise", "row_wise", "row_wise"], strict=True)
    ]
    results = []
    for specs, mesh in [(tables, None), (placed, _mesh(2, 4))]:
        model = DLRM(tables=tuple(specs), features=tuple(_features()), bottom=(8, DIM), top=(8, 1))
        trainer = Trainer(model, optax.sgd(0.05), mesh=mesh)
        state = trainer.init(jax.random.key(0), batches[0])
        losses = []
        for b in batches:
            state, m = trainer.train_step(state, b)
            losses.append(float(m["loss"]))
        results.append((np.array(losses), trainer.host.export(state.tables)))
    (l1, h1), (l8, h8) = results
    np.testing.assert_allclose(l8, l1, rtol=1e-6)
    for key in h1:
        np.testing.assert_array_equal(h8[key]["keys"], h1[key]["keys"])
        np.testing.assert_allclose(h8[key]["weights"], h1[key]["weights"], rtol=1e-5, atol=1e-6)


def _random_tables(store, seed):
    """Every table of `store` with random weights and slots (the per-table form)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: rng.uniform(0.1, 1.0, s.shape).astype(s.dtype), store.abstract_tables()
    )


@pytest.mark.parametrize(
    "placement", ["replicated", "table_wise", "column_wise", "table_row_wise", "row_wise"]
)
def test_sharded_tables_round_trip_on_1_2_4_8_devices(placement):
    """The per-shard seam: each table in its logical layout (row-split: rows padded to
    B * S, shard s holding rows [s * B, (s + 1) * B)), placed as the store places it,
    and back; several tables per stack, vocabularies that do not divide."""
    opt = ops.Adagrad(learning_rate=0.1)
    tables, features = _specs(placement, opt)
    for data, model in [(1, 1), (1, 2), (2, 2), (2, 4)]:
        store = ShardedTableStore(tables, features, mesh=_mesh(data, model))
        want = _random_tables(store, data * model)
        state = store.import_tables(want)
        abstract = store.abstract_sharded_tables()
        sharded = store.sharded_tables(state)
        for name, t in sharded.items():
            spec = store.tables[name]
            split = placement in ("row_wise", "table_row_wise")
            shards = {"row_wise": data * model, "table_row_wise": model}.get(placement, 1)
            rows = -(-spec.vocab_size // shards) * shards if split else spec.vocab_size
            w = t["weights"]
            assert w.shape == abstract[name]["weights"].shape == (rows, spec.dim)
            assert w.sharding == abstract[name]["weights"].sharding
            np.testing.assert_array_equal(np.asarray(w)[: spec.vocab_size], want[name]["weights"])
            np.testing.assert_array_equal(
                np.asarray(t["slots"]["accumulator"])[: spec.vocab_size],
                want[name]["slots"]["accumulator"],
            )
            if split:  # each device's shard is its contiguous block of rows
                b = rows // shards
                for sh in w.addressable_shards:
                    assert sh.data.shape[0] == b and (sh.index[0].start or 0) % b == 0
        # padding rows are ignored on the way back
        padded = {
            name: jax.tree.map(lambda a, v=store.tables[name].vocab_size: a.at[v:].set(7.0), t)
            for name, t in sharded.items()
        }
        back = store.import_sharded_tables(padded)
        got = jax.tree.map(np.asarray, store.export_tables(back))
        jax.tree.map(np.testing.assert_array_equal, got, want)
        # the whole-table form (an older checkpoint) is resharded on the way in
        again = store.import_sharded_tables(want)
        jax.tree.map(
            np.testing.assert_array_equal,
            jax.tree.map(np.asarray, store.export_tables(again)),
            want,
        )
    with pytest.raises(ValueError, match=r"table 'user': sharded weights have shape \(3, 8\)"):
        store.import_sharded_tables({**want, "user": {**want["user"], "weights": np.zeros((3, 8))}})
    with pytest.raises(KeyError, match="no saved state for table 'item'"):
        store.import_sharded_tables({k: v for k, v in want.items() if k != "item"})
