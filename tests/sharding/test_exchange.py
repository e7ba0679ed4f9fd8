"""The sharded lookup's right-sized exchange and 64-bit rows: send buffers sized from the
host's per-owner counts give the single-device store's outputs and tables on 2 and 4
devices (skewed ids, duplicates, empty bags, padding); a capacity a batch does not fit
is never silent (NaN on the device; the trainer grows it first and gets the same
result); the host routes int64 ids of a row-split table (checked against numpy), and a
small table trains the same routed on the host; an int64 id a device cannot take is an
error naming the feature, table and position."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import ops
from sparsejax.data import PaddedIds, SparseBatch
from sparsejax.embedding import DeviceTableStore, FeatureSpec, TableSpec
from sparsejax.sharding import ShardedTableStore, make_mesh, shard_batch

B = 16


def _mesh(n):
    return make_mesh(model=n, devices=jax.devices()[:n])


def _specs(placement, vocab=(50, 37)):
    opt = ops.RowWiseAdagrad(learning_rate=0.1)
    tables = [
        TableSpec(name="user", vocab_size=vocab[0], dim=8, optimizer=opt, placement=placement),
        TableSpec(name="item", vocab_size=vocab[1], dim=4, optimizer=opt, placement=placement),
    ]
    features = [
        FeatureSpec(name="user", table="user"),
        FeatureSpec(name="clicks", table="item", combiner="mean", max_ids=5),
        FeatureSpec(name="bought", table="item", combiner="sqrtn", max_ids=3, weighted=True),
    ]
    return tables, features


def _batch(rng, tables, features, skew):
    vocab = {t.name: t.vocab_size for t in tables}
    out = {}
    for f in features:
        lengths = rng.integers(0, f.max_ids + 1, B) if f.max_ids > 1 else np.ones(B, int)
        n = int(lengths.sum())
        ids = rng.integers(0, vocab[f.table], n)
        if skew:  # most ids on one row, so one owner gets most of them
            ids = np.where(rng.random(n) < 0.8, 1, ids)
        segs = np.repeat(np.arange(B), lengths)
        pad = f.capacity_for(B) - n
        w = rng.uniform(0.5, 2.0, n).astype(np.float32) if f.weighted else None
        out[f.name] = PaddedIds(
            np.concatenate([ids, -np.ones(pad, int)]).astype(np.int32),
            np.concatenate([segs, np.full(pad, B - 1)]).astype(np.int32),
            None if w is None else np.concatenate([w, np.zeros(pad, np.float32)]),
        )
    ones = np.ones(B, np.float32)
    return SparseBatch(out, np.zeros((B, 1), np.float32), ones, ones)


def _step(store):
    def step(state, feats, k):
        def f(outputs):
            split = store.split(outputs, B)
            return sum(jnp.sum(jnp.sin(v) * (i + 1.0)) for i, v in enumerate(split.values())), split

        outputs, res = store.lookup(state, feats, B)
        (_, split), g = jax.value_and_grad(f, has_aux=True)(outputs)
        return store.apply_gradients(state, res, g, step=k), split

    return jax.jit(step)


def _sized(store, batch, slack=0, route_on_host=False):
    """The batch split per device, with capacities = the largest count + `slack`."""
    counts = {}
    sb = shard_batch(
        batch,
        store.batch_features(),
        store.num_devices,
        stores=[store],
        route_on_host=route_on_host,
        counts=counts,
    )
    caps = tuple((g, int(c.max()) + slack) for g, c in sorted(counts.items()))
    feats = {k: dataclasses.replace(v, exchange=caps) for k, v in sb.features.items()}
    return feats, counts


def _run(store, batches, **kw):
    state = store.init(jax.random.key(1))
    step = _step(store)
    outs = []
    for k, batch in enumerate(batches):
        feats = batch.features
        if isinstance(store, ShardedTableStore):
            feats, _ = _sized(store, batch, **kw)
        state, split = step(state, feats, k + 1)
        outs.append(jax.tree.map(np.asarray, split))
    return outs, jax.tree.map(np.asarray, store.export_tables(state))


def _reference(tables, features, batches):
    plain = [TableSpec(**{**t.__dict__, "placement": "device"}) for t in tables]
    return _run(DeviceTableStore(plain, features, implementation="xla"), batches)


def _assert_close(got, want):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6), got, want)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("placement", ["row_wise", "table_wise"])
def test_right_sized_exchange_matches_one_device(devices, placement):
    tables, features = _specs(placement)
    rng = np.random.default_rng(devices)
    batches = [_batch(rng, tables, features, skew=k == 1) for k in range(3)]
    store = ShardedTableStore(tables, features, mesh=_mesh(devices), implementation="xla")
    feats, counts = _sized(store, batches[0])
    n = sum(np.asarray(feats[f.name].ids).shape[0] // devices for f in features)
    for g, c in counts.items():
        assert c.shape == (devices, store.stacks[store.groups[g].stack].shards)
        assert c.max() < n  # a smaller buffer than the n slots of before
    got, got_tables = _run(store, batches)
    want, want_tables = _reference(tables, features, batches)
    _assert_close(got, want)
    _assert_close(got_tables, want_tables)


def test_owner_counts_match_numpy():
    tables, features = _specs("row_wise")
    rng = np.random.default_rng(3)
    batch = _batch(rng, tables, features, skew=True)
    store = ShardedTableStore(tables, features, mesh=_mesh(4), implementation="xla")
    feats, counts = _sized(store, batch)
    group = next(g for g in store.groups.values() if store.stacks[g.stack].dim == 8)
    want = np.zeros((4, 4), int)
    for e in group.entries:  # one id at a time, with the layout's own mapping
        ids = np.asarray(feats[e.feature.name].ids).reshape(4, -1)
        for d in range(4):
            for i in ids[d][ids[d] >= 0]:
                want[d, int(e.piece.route(np.array([i], np.int64), 4)[0][0])] += 1
    np.testing.assert_array_equal(counts[group.name], want)


def test_a_capacity_too_small_is_never_silent():
    tables, features = _specs("row_wise")
    rng = np.random.default_rng(5)
    batch = _batch(rng, tables, features, skew=True)
    store = ShardedTableStore(tables, features, mesh=_mesh(2), implementation="xla")
    state = store.init(jax.random.key(1))
    feats, _ = _sized(store, batch, slack=-1)  # one id short on the fullest device
    outputs, _ = jax.jit(lambda s, f: store.lookup(s, f, B))(state, feats)
    assert any(np.isnan(np.asarray(v)).any() for v in outputs.values())
    feats, _ = _sized(store, batch, slack=0)
    outputs, _ = jax.jit(lambda s, f: store.lookup(s, f, B))(state, feats)
    assert all(np.isfinite(np.asarray(v)).all() for v in outputs.values())


def test_host_routing_of_int64_ids_matches_numpy():
    big = 2**31 + 7
    opt = ops.SGD(learning_rate=0.1)
    features = [
        FeatureSpec(name="w", table="wide", max_ids=3),
        FeatureSpec(name="s", table="small"),
    ]

    def specs(vocab):
        return [
            TableSpec(name="wide", vocab_size=vocab, dim=1, optimizer=opt, placement="row_wise"),
            TableSpec(name="small", vocab_size=10, dim=1, optimizer=opt, placement="row_wise"),
        ]

    try:  # specs only: no table is made
        store = ShardedTableStore(specs(big), features, mesh=_mesh(4))
    except ValueError:  # a TableSpec of 2**31 rows or more is not accepted yet: stand in
        store = ShardedTableStore(specs(2**31 - 1), features, mesh=_mesh(4))
        for st in store.stacks.values():
            for p in st.pieces:
                if p.source == "wide":
                    object.__setattr__(p.table, "vocab_size", big)
    rng = np.random.default_rng(0)
    ids = rng.integers(2**31 - 100, big, 3 * B).astype(np.int64)
    ids[::5] = -1
    segs = np.repeat(np.arange(B), 3).astype(np.int32)
    small = PaddedIds(rng.integers(0, 10, B).astype(np.int32), np.arange(B, dtype=np.int32))
    ones = np.ones(B, np.float32)
    batch = SparseBatch({"w": PaddedIds(ids, segs), "s": small}, np.zeros((B, 1)), ones, ones)
    counts = {}
    out = shard_batch(batch, store.batch_features(), 4, stores=[store], counts=counts)
    w = out.features["w"]
    assert w.ids.dtype == np.int32 and w.owners.dtype == np.int32
    assert out.features["s"].owners is None  # a table below 2**31 rows: routed on the device
    (piece,) = [p for st in store.stacks.values() for p in st.pieces if p.source == "wide"]
    real = np.asarray(w.ids) >= 0
    # the ids as they were, in the split order: (owner, row) of each is Piece.route's,
    # numpy int64 one id at a time, and rows stay below the shard's int32 rows
    order = np.argsort(segs[ids >= 0], kind="stable")
    sent = ids[ids >= 0][order]
    want = np.array([[int(x[0]) for x in piece.route(np.array([i]), 4)] for i in sent])
    got = np.stack([np.asarray(w.owners)[real], np.asarray(w.ids)[real] + piece.offset], 1)
    np.testing.assert_array_equal(got, want)
    assert (got[:, 0] < 4).all() and np.asarray(w.ids)[real].max() < piece.local_rows < 2**31
    assert len({tuple(r) for r in got}) == len(set(sent.tolist()))  # one slot per id
    # an id outside the table, and one >= 2**31 for a table that is not routed
    bad = dataclasses.replace(batch.features["w"], ids=np.where(ids >= 0, big, -1))
    with pytest.raises(ValueError, match=r"feature 'w': id 2147483655 at position 1 is outside"):
        shard_batch(
            dataclasses.replace(batch, features={**batch.features, "w": bad}),
            store.batch_features(),
            4,
            stores=[store],
        )
    wide_s = dataclasses.replace(small, ids=np.full(B, 2**31, np.int64))
    with pytest.raises(ValueError, match=r"feature 's': id 2147483648 at position 0 of table"):
        shard_batch(
            dataclasses.replace(batch, features={**batch.features, "s": wide_s}),
            store.batch_features(),
            4,
            stores=[store],
        )


def test_small_tables_routed_on_the_host_train_the_same():
    tables, features = _specs("row_wise")
    rng = np.random.default_rng(9)
    batches = [_batch(rng, tables, features, skew=k == 0) for k in range(2)]
    store = ShardedTableStore(tables, features, mesh=_mesh(4), implementation="xla")
    feats, _ = _sized(store, batches[0], route_on_host=True)
    assert all(feats[f.name].owners is not None for f in features)
    got, got_tables = _run(store, batches, route_on_host=True)
    want, want_tables = _reference(tables, features, batches)
    _assert_close(got, want)
    _assert_close(got_tables, want_tables)


def test_trainer_sizes_grows_and_counts_the_exchange():
    """A DLRM on 4 devices: right-sized buffers, a capacity forced too small (grown
    before the step runs, counted) and host routing give the losses and tables of the
    buffers of before (room for every id)."""
    from sparsejax import runner, train

    cfg = runner.config_from_dict(
        {
            "data": {
                "batch_size": 32,
                "synthetic_options": {"vocab_sizes": [300, 50, 120], "num_dense": 2},
            },
            "model": {"embedding_dim": 8, "options": {"bottom": [8], "top": [8, 1]}},
        }
    )
    data = runner.build_data(cfg)
    model = runner.build_model(cfg, data.tables, data.features)
    placed = model.clone(
        tables=tuple(dataclasses.replace(t, placement="row_wise") for t in model.tables)
    )
    b = data.packer.batch_size
    batches = [
        data.packer.pack(s, labels=y, dense=d)
        for s, y, d in (data.train_source.batch(i, b) for i in range(4))
    ]
    tx = runner.dense_optimizer(cfg.optimizer)

    def run(**kw):
        trainer = train.Trainer(placed, tx, mesh=_mesh(4), **kw)
        state = trainer.init(jax.random.key(0), batches[0])
        losses = []
        for k, batch in enumerate(batches):
            if k == 2 and trainer.exchange_capacity:  # force an overflow: too small
                trainer.exchange_capacity = dict.fromkeys(trainer.exchange_capacity, 1)
            state, m = trainer.train_step(state, batch)
            losses.append(float(m["loss"]))
        return losses, jax.tree.map(np.asarray, trainer.tables_by_name(state)), trainer

    want, want_tables, old = run(exchange_headroom=None)
    assert old.exchange_stats()["steps"] == 0 and not old.exchange_capacity
    for kw in ({}, {"route_on_host": True}):
        got, got_tables, trainer = run(**kw)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        _assert_close(got_tables, want_tables)
        stats = trainer.exchange_stats()
        assert stats["grows"] >= 1 and stats["steps"] == 4
        assert all(c > 1 for c in stats["capacity"].values())
        assert 0 < stats["needed_bytes"] <= stats["sent_bytes"] <= 1.5 * stats["needed_bytes"]
