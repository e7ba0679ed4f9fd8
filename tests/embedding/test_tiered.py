"""Tiered tables (dynamic IDs, the device cache): exactly the training of the same table
fully on the device, checkpoints that continue bit-identically, bounded device memory,
and one-line errors for bad ids."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from sparsejax.checkpoint._layout import stack_tables, tables_by_name
from sparsejax.data import PaddedIds, SparseBatch
from sparsejax.embedding import (
    CountAdmission,
    DeviceTableStore,
    DynamicVocab,
    Eviction,
    FeatureSpec,
    HostCache,
    TableSpec,
)
from sparsejax.embedding._spec import normal_init, truncated_normal_init, uniform_init
from sparsejax.embedding.host import (
    CacheCapacityError,
    DynamicTableFullError,
    TieredInputError,
    keyed_rows,
)
from sparsejax.nn import DLRM
from sparsejax.ops.optimizers import SGD, RowWiseAdagrad
from sparsejax.train import Trainer

B = 16
DIM = 4


def _features():
    return [
        FeatureSpec(name="user", table="user"),
        FeatureSpec(name="items", table="item", combiner="mean", max_ids=3),
        FeatureSpec(name="plain", table="plain"),
    ]


def _tables(opt, *, user=None, item=None):
    """user/item: extra TableSpec keywords (a cache, or dynamic keys)."""
    user = {"vocab_size": 500} if user is None else user
    item = {"vocab_size": 400} if item is None else item
    return [
        TableSpec(name="user", dim=DIM, optimizer=opt, **user),
        TableSpec(name="item", dim=DIM, optimizer=opt, **item),
        TableSpec(name="plain", vocab_size=50, dim=DIM, optimizer=opt),
    ]


def _zipf(rng, n, size, s=1.2):
    p = 1.0 / np.arange(1, size + 1) ** s
    return rng.choice(size, n, p=p / p.sum())


def _batches(steps, *, seed=0, user_keys=None, item_keys=None):
    """Batches with duplicate ids, empty and short bags. `user_keys` / `item_keys`
    (int64 arrays) turn the drawn indices into raw keys (dynamic tables)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        user = _zipf(rng, B, 500)
        lens = rng.integers(0, 4, B)
        items = np.full(B * 3, -1, np.int64)
        segs = np.repeat(np.arange(B), 3).astype(np.int32)
        for b in range(B):
            items[b * 3 : b * 3 + lens[b]] = _zipf(rng, lens[b], 400)
        # padding sits at the end of each example's slots: pack them CSR (ids first)
        order = np.argsort(np.where(items >= 0, 0, 1) * 10 * B + segs, kind="stable")
        items, segs = items[order], segs[order]
        segs = np.where(items >= 0, segs, B - 1).astype(np.int32)
        segs = np.maximum.accumulate(segs)
        if user_keys is not None:
            user = user_keys[user]
        if item_keys is not None:
            items = np.where(items >= 0, item_keys[np.maximum(items, 0)], -1)
        out.append(
            SparseBatch(
                features={
                    "user": PaddedIds(user.astype(np.int64), np.arange(B, dtype=np.int32)),
                    "items": PaddedIds(items.astype(np.int64), segs),
                    "plain": PaddedIds(
                        rng.integers(0, 50, B).astype(np.int32), np.arange(B, dtype=np.int32)
                    ),
                },
                dense=rng.normal(size=(B, 2)).astype(np.float32),
                labels=rng.integers(0, 2, B).astype(np.float32),
                mask=np.ones(B, np.float32),
            )
        )
    return out


def _int32(batch):
    """A static table's ids as the device store takes them."""
    return dataclasses.replace(
        batch,
        features={
            k: dataclasses.replace(v, ids=np.asarray(v.ids).astype(np.int32))
            for k, v in batch.features.items()
        },
    )


def _train(tables, batches, *, state=None, trainer=None):
    if trainer is None:
        model = DLRM(tables=tuple(tables), features=tuple(_features()), bottom=(8, DIM), top=(8, 1))
        trainer = Trainer(model, optax.sgd(0.05))
        state = trainer.init(jax.random.key(0), batches[0])
    losses = []
    for b in batches:
        state, m = trainer.train_step(state, b)
        losses.append(float(m["loss"]))
    return trainer, state, np.array(losses)


def _device_tables(trainer, state):
    return jax.device_get(trainer.tables_by_name(state))["embedding"]


def _host(trainer, state):
    return trainer.host.export(state.tables)


@pytest.mark.parametrize("opt", [SGD(learning_rate=0.3), RowWiseAdagrad(learning_rate=0.3)])
def test_cached_static_tables_train_exactly_as_on_the_device(opt):
    batches = _batches(200)
    ref_trainer, ref_state, ref_losses = _train(_tables(opt), [_int32(b) for b in batches])
    cached = _tables(
        opt,
        user={"vocab_size": 500, "cache": HostCache(rows=24)},
        item={"vocab_size": 400, "cache": HostCache(rows=48, policy="lfu")},
    )
    trainer, state, losses = _train(cached, batches)
    np.testing.assert_array_equal(losses, ref_losses)
    ref = _device_tables(ref_trainer, ref_state)
    host = _host(trainer, state)
    for name in ("user", "item"):
        got = host[f"embedding/{name}"]
        np.testing.assert_array_equal(got["keys"], np.arange(ref[name]["weights"].shape[0]))
        np.testing.assert_array_equal(got["weights"], ref[name]["weights"])
        for k, v in ref[name]["slots"].items():
            np.testing.assert_array_equal(got["slots"][k], v)
    np.testing.assert_array_equal(
        _device_tables(trainer, state)["plain"]["weights"], ref["plain"]["weights"]
    )
    stats = trainer.host.stats()["embedding/user"]
    assert 0 < stats["cache_hit_rate"] < 1 and stats["rows_moved_per_step"] > 0
    assert stats["lookups_per_step"] == B


USER_KEYS = np.random.default_rng(7).integers(0, 2**62, 500)
ITEM_KEYS = np.random.default_rng(8).integers(0, 2**62, 400)


def _dynamic(cache_rows, *, min_count=2, **dyn):
    return {
        "dynamic": DynamicVocab(admission=CountAdmission(min_count=min_count), **dyn),
        "cache": HostCache(rows=cache_rows),
    }


@pytest.mark.parametrize("opt", [SGD(learning_rate=0.3), RowWiseAdagrad(learning_rate=0.3)])
def test_dynamic_tables_with_a_small_cache_train_exactly_as_with_all_rows_cached(opt):
    batches = _batches(200, user_keys=USER_KEYS, item_keys=ITEM_KEYS)
    big = _tables(opt, user=_dynamic(1024), item=_dynamic(1024))
    small = _tables(opt, user=_dynamic(24), item=_dynamic(48))
    t_big, s_big, l_big = _train(big, batches)
    t_small, s_small, l_small = _train(small, batches)
    np.testing.assert_array_equal(l_small, l_big)
    a, b = _host(t_big, s_big), _host(t_small, s_small)
    for key in a:
        np.testing.assert_array_equal(a[key]["keys"], b[key]["keys"])
        np.testing.assert_array_equal(a[key]["weights"], b[key]["weights"])
    st = t_small.host.stats()["embedding/user"]
    assert st["rejected"] > 0 and st["admitted"] == st["rows_live"] > 24
    assert t_big.host.stats()["embedding/user"]["rows_moved_per_step"] < st["rows_moved_per_step"]
    # admission: every key with a row was seen at least twice
    seen = np.concatenate([np.asarray(bt.features["user"].ids) for bt in batches])
    keys, counts = np.unique(seen, return_counts=True)
    assert set(a["embedding/user"]["keys"]) == set(keys[counts >= 2])


def _restart(trainer_old, state_old, tables, chain, batches_next):
    """A new trainer from a saved state (tables re-stacked from their by-name form, so
    tiered caches start empty) and a host chain."""
    model = DLRM(tables=tuple(tables), features=tuple(_features()), bottom=(8, DIM), top=(8, 1))
    trainer = Trainer(model, optax.sgd(0.05))
    fresh = trainer.init(jax.random.key(1), batches_next[0])
    by_name = tables_by_name(trainer_old.layouts, jax.device_get(state_old.tables))
    state = trainer.put_state(
        fresh.replace(
            step=state_old.step,
            params=state_old.params,
            opt_state=state_old.opt_state,
            rng=state_old.rng,
            tables=stack_tables(trainer.layouts, by_name),
        )
    )
    trainer.host.restore(chain)
    return _train(None, batches_next, trainer=trainer, state=state)


def test_full_and_incremental_snapshots_continue_bit_identically_at_any_cache_size():
    opt = RowWiseAdagrad(learning_rate=0.3)
    evict = Eviction(ttl_steps=30, every_steps=10)
    batches = _batches(150, user_keys=USER_KEYS, item_keys=ITEM_KEYS, seed=3)
    tables = _tables(opt, user=_dynamic(24, eviction=evict), item=_dynamic(48))
    t_ref, s_ref, l_ref = _train(tables, batches)

    t, s, _ = _train(tables, batches[:50])
    full = t.host.snapshot(s.tables, incremental=False)
    t.host.mark_saved()
    t, s, _ = _train(None, batches[50:100], trainer=t, state=s)
    delta = t.host.snapshot(s.tables, incremental=True)
    t.host.mark_saved()
    assert delta["embedding/user"].kind == "delta"
    assert delta["embedding/user"].arrays["tombstones"].shape[0] > 0  # the TTL evicted some
    assert (
        delta["embedding/user"].arrays["keys"].shape[0]
        < t.host.stats()["embedding/user"]["rows_live"]
        + delta["embedding/user"].arrays["tombstones"].shape[0]
    )
    state_100 = jax.device_get(s)
    for cache in ((24, 48), (100, 40)):
        resized = _tables(opt, user=_dynamic(cache[0], eviction=evict), item=_dynamic(cache[1]))
        t2, s2, l2 = _restart(t, state_100, resized, [full, delta], batches[100:])
        np.testing.assert_array_equal(l2, l_ref[100:])
        a, b = _host(t_ref, s_ref), _host(t2, s2)
        for key in a:
            np.testing.assert_array_equal(a[key]["keys"], b[key]["keys"])
            np.testing.assert_array_equal(a[key]["weights"], b[key]["weights"])
            for k in a[key]["slots"]:
                np.testing.assert_array_equal(a[key]["slots"][k], b[key]["slots"][k])


def test_a_cached_static_table_restores_and_continues_bit_identically():
    opt = RowWiseAdagrad(learning_rate=0.3)
    batches = _batches(60, seed=4)
    tables = _tables(opt, user={"vocab_size": 500, "cache": HostCache(rows=24)})
    t_ref, s_ref, l_ref = _train(tables, batches)
    t, s, _ = _train(tables, batches[:30])
    full = t.host.snapshot(s.tables, incremental=False)
    t2, s2, l2 = _restart(t, jax.device_get(s), tables, [full], batches[30:])
    np.testing.assert_array_equal(l2, l_ref[30:])
    a, b = _host(t_ref, s_ref)["embedding/user"], _host(t2, s2)["embedding/user"]
    np.testing.assert_array_equal(a["weights"], b["weights"])


def test_device_memory_stays_at_the_cache_while_the_vocabulary_grows_tenfold():
    opt = SGD(learning_rate=0.1)
    keys = np.arange(10_000, dtype=np.int64) * 7919 + 3
    tables = _tables(opt, user=_dynamic(64, min_count=1), item=_dynamic(64, min_count=1))
    batches = _batches(60, user_keys=keys, item_keys=keys)
    # fresh keys every step: the vocabulary grows far past the cache
    rng = np.random.default_rng(0)
    for b in batches:
        ids = rng.choice(keys, B, replace=False)
        b.features["user"] = PaddedIds(ids, np.arange(B, dtype=np.int32))
    trainer, state, losses = _train(tables, batches)
    before = [x.shape for x in jax.tree.leaves(state.tables)]
    st = trainer.host.stats()["embedding/user"]
    assert st["rows_live"] >= 10 * 64
    assert [x.shape for x in jax.tree.leaves(state.tables)] == before
    assert all(x.shape[0] <= 64 + 1 + 50 + 64 + 1 for x in jax.tree.leaves(state.tables))
    assert np.isfinite(losses).all()


def test_eval_changes_nothing_and_reads_rows_outside_the_cache():
    opt = SGD(learning_rate=0.3)
    batches = _batches(30, user_keys=USER_KEYS, item_keys=ITEM_KEYS, seed=5)
    tables = _tables(opt, user=_dynamic(24, min_count=1), item=_dynamic(48, min_count=1))
    big = _tables(opt, user=_dynamic(1024, min_count=1), item=_dynamic(1024, min_count=1))
    t, s, _ = _train(tables, batches[:20])
    tb, sb, _ = _train(big, batches[:20])
    for b in batches[20:]:
        np.testing.assert_array_equal(
            np.asarray(t.eval_step(s, b)), np.asarray(tb.eval_step(sb, b))
        )
    # training on continues exactly as if the evals never happened
    _, _, l1 = _train(None, batches[20:], trainer=t, state=s)
    _, _, l2 = _train(None, batches[20:], trainer=tb, state=sb)
    np.testing.assert_array_equal(l1, l2)


def test_bad_ids_and_capacities_get_one_line_errors():
    opt = SGD(learning_rate=0.1)
    batches = _batches(3, user_keys=USER_KEYS, item_keys=ITEM_KEYS)
    tables = _tables(opt, user=_dynamic(24, min_count=1), item=_dynamic(48, min_count=1))
    trainer, state, _ = _train(tables, batches[:1])

    def with_user(ids):
        b = batches[1]
        f = dict(b.features)
        f["user"] = PaddedIds(ids, np.arange(B, dtype=np.int32))
        return dataclasses.replace(b, features=f)

    with pytest.raises(TieredInputError, match="feature 'user'.*dtype int32.*int64 or uint64"):
        trainer.train_step(state, with_user(np.arange(B, dtype=np.int32)))
    with pytest.raises(TieredInputError, match="feature 'user'.*negative ID -5"):
        trainer.train_step(state, with_user(np.full(B, -5, np.int64)))
    # uint64 keys are accepted as they are (all 64 bits)
    ok = with_user(np.arange(B, dtype=np.uint64) + np.uint64(2**63))
    state, _ = trainer.train_step(state, ok)

    small = _tables(opt, user=_dynamic(8, min_count=1), item=_dynamic(48, min_count=1))
    model = DLRM(tables=tuple(small), features=tuple(_features()), bottom=(8, DIM), top=(8, 1))
    t2 = Trainer(model, optax.sgd(0.05))
    s2 = t2.init(jax.random.key(0), batches[0])
    with pytest.raises(CacheCapacityError, match=r"table 'user'.*16 distinct rows.*holds 8"):
        t2.train_step(s2, with_user(np.arange(B, dtype=np.int64) + 100))


def test_a_full_dynamic_table_errors_or_reads_the_default_row_never_another_ids_row():
    opt = SGD(learning_rate=0.1)
    full = {"max_rows": 20}
    batches = _batches(2, user_keys=USER_KEYS, item_keys=ITEM_KEYS)

    def trainer_for(when_full):
        tables = _tables(
            opt,
            user={
                "dynamic": DynamicVocab(admission=CountAdmission(), when_full=when_full, **full),
            },
            item=_dynamic(48, min_count=1),
        )
        model = DLRM(tables=tuple(tables), features=tuple(_features()), bottom=(8, DIM), top=(8, 1))
        t = Trainer(model, optax.sgd(0.05))
        return t, t.init(jax.random.key(0), batches[0])

    def user_batch(ids):
        f = dict(batches[0].features)
        f["user"] = PaddedIds(ids.astype(np.int64), np.arange(B, dtype=np.int32))
        return dataclasses.replace(batches[0], features=f)

    t, s = trainer_for("error")
    s, _ = t.train_step(s, user_batch(np.arange(B) + 1000))
    with pytest.raises(DynamicTableFullError, match=r"'user' is full \(20 rows"):
        t.train_step(s, user_batch(np.arange(B) + 2000))

    t, s = trainer_for("default_row")
    s, _ = t.train_step(s, user_batch(np.arange(B) + 1000))
    first = _host(t, s)["embedding/user"]
    s, _ = t.train_step(s, user_batch(np.arange(B) + 2000))
    after = _host(t, s)["embedding/user"]
    assert after["keys"].shape[0] == 20
    kept = np.isin(after["keys"], first["keys"])
    assert kept.sum() == B  # the first batch's rows are still theirs
    assert t.host.stats()["embedding/user"]["rejected"] == B - 4

    t, s = trainer_for("evict")
    for k in range(4):
        s, _ = t.train_step(s, user_batch(np.arange(B) + 1000 * (k + 1)))
    keys = _host(t, s)["embedding/user"]["keys"]
    assert keys.shape[0] <= 20 and set(np.arange(B) + 4000) <= set(keys)


def test_keyed_initial_rows_depend_on_the_key_only():
    keys = np.array([5, 2**62, 17, 5], np.int64)
    for init in (uniform_init(0.1), normal_init(0.2), truncated_normal_init(0.3)):
        a = keyed_rows(init, keys, 8, seed=11, scale_rows=100)
        b = keyed_rows(init, keys[::-1].copy(), 8, seed=11, scale_rows=100)
        np.testing.assert_array_equal(a, b[::-1])
        np.testing.assert_array_equal(a[0], a[3])
        assert not np.array_equal(a[0], a[2])
        assert not np.array_equal(a, keyed_rows(init, keys, 8, seed=12, scale_rows=100))
    big = keyed_rows(uniform_init(0.1), np.arange(20000, dtype=np.int64), 8, 1, 100)
    assert (
        np.abs(big).max() <= 0.1
        and abs(big.mean()) < 0.002
        and big.std() == pytest.approx(0.1 / 3**0.5, rel=0.02)
    )
    z = keyed_rows(normal_init(1.0), np.arange(20000, dtype=np.int64), 8, 1, 100)
    assert abs(z.mean()) < 0.01 and z.std() == pytest.approx(1.0, rel=0.02)
    tz = keyed_rows(truncated_normal_init(1.0), np.arange(20000, dtype=np.int64), 8, 1, 100)
    assert np.abs(tz).max() <= 2.0


def test_disk_tier_bloom_admission_norm_eviction_and_a_trainable_default_row(tmp_path, monkeypatch):
    """The same training with every row on disk (a RAM budget of nothing, its pages
    released from memory every few steps) as in RAM; Bloom admission never admits
    before a key's min_count-th sighting; norm eviction removes keys; a trainable
    default row is saved and restored with the table."""
    from sparsejax.embedding import BloomAdmission
    from sparsejax.embedding.host import HostTables

    monkeypatch.setattr(HostTables, "release_every", 3)

    opt = RowWiseAdagrad(learning_rate=0.3)
    batches = _batches(40, user_keys=USER_KEYS, item_keys=ITEM_KEYS, seed=9)

    def user(**cache):
        return {
            "dynamic": DynamicVocab(
                admission=BloomAdmission(min_count=3, counters=1 << 14),
                eviction=Eviction(min_norm=0.25, every_steps=10),
                default_row="trainable",
            ),
            "cache": HostCache(rows=24, **cache),
        }

    ram = _tables(opt, user=user(), item=_dynamic(48))
    disk = _tables(opt, user=user(ram_bytes=1, disk_dir=str(tmp_path)), item=_dynamic(48))
    t_ram, s_ram, l_ram = _train(ram, batches)
    t_disk, s_disk, l_disk = _train(disk, batches)
    np.testing.assert_array_equal(l_disk, l_ram)
    a, b = _host(t_ram, s_ram)["embedding/user"], _host(t_disk, s_disk)["embedding/user"]
    np.testing.assert_array_equal(a["keys"], b["keys"])
    np.testing.assert_array_equal(a["weights"], b["weights"])
    ht = t_disk.host.tables["embedding/user"]
    assert ht.rows.disk_bytes_used > 0 and ht.rows.ram_bytes_used == 0
    st = ht.report()
    assert st["evicted"] > 0 and st["rejected"] > 0
    # never early: every key holding a row was seen at least 3 times
    seen = np.concatenate([np.asarray(bt.features["user"].ids) for bt in batches])
    keys, counts = np.unique(seen, return_counts=True)
    assert set(b["keys"]) <= set(keys[counts >= 3])
    # the trainable default row learned and travels with a snapshot
    snap = t_disk.host.snapshot(s_disk.tables, incremental=False)["embedding/user"]
    default = snap.arrays["default/weights"]
    assert np.abs(default).sum() > 0
    t2, s2, _ = _train(disk, batches[:1])
    t2.host.restore(
        [
            {
                "embedding/user": snap,
                **{
                    k: v
                    for k, v in t_disk.host.snapshot(s_disk.tables, incremental=False).items()
                    if k != "embedding/user"
                },
            }
        ]
    )
    np.testing.assert_array_equal(t2.host.tables["embedding/user"].default_row()[0], default)


def test_a_large_cached_table_starts_as_the_same_table_on_the_device():
    """Initial rows drawn in chunks on the host equal the device store's, for a table
    larger than one chunk (the default U(+-sqrt(1/V)) scale comes from the whole V)."""
    opt = SGD(learning_rate=0.1)
    v = 70_000  # > 16 chunks of FILL_CHUNK_ELEMENTS // 64 rows
    batch = _int32(_batches(1)[0])
    feats = (FeatureSpec(name="user", table="user"),)

    def start(**cache):
        t = (TableSpec(name="user", vocab_size=v, dim=64, optimizer=opt, **cache),)
        model = DLRM(tables=t, features=feats, bottom=(8, 64), top=(8, 1))
        trainer = Trainer(model, optax.sgd(0.05))
        return trainer, trainer.init(jax.random.key(3), batch)

    ref = _device_tables(*start())["user"]["weights"]
    trainer, state = start(cache=HostCache(rows=32))
    got = _host(trainer, state)["embedding/user"]["weights"]
    np.testing.assert_array_equal(got, ref)


def test_bfloat16_tables_train_exactly_through_the_cache():
    opt = RowWiseAdagrad(learning_rate=0.3)
    batches = _batches(30, seed=11)

    def tables(**cache):
        return [
            TableSpec(
                name="user", vocab_size=500, dim=DIM, dtype="bfloat16", optimizer=opt, **cache
            ),
            TableSpec(name="item", vocab_size=400, dim=DIM, optimizer=opt),
            TableSpec(name="plain", vocab_size=50, dim=DIM, optimizer=opt),
        ]

    ref_t, ref_s, ref_l = _train(tables(), [_int32(b) for b in batches])
    t, s, losses = _train(tables(cache=HostCache(rows=24)), batches)
    np.testing.assert_array_equal(losses, ref_l)
    got = _host(t, s)["embedding/user"]["weights"]
    assert got.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(got, _device_tables(ref_t, ref_s)["user"]["weights"])


def test_a_feature_read_by_tiered_tables_in_two_layers_gets_each_tables_slots():
    """DeepFM reads every feature twice (embedding and first-order tables, in two
    layers): each tiered table maps the ids to its own cache slots, exactly as with
    all rows cached; a feature read by a tiered and a plain table is refused."""
    from sparsejax.nn import DeepFM

    opt = SGD(learning_rate=0.3)
    batches = _batches(15, user_keys=USER_KEYS, item_keys=ITEM_KEYS, seed=2)

    def run(user_cache, item_cache):
        t = _tables(opt, user=_dynamic(user_cache), item=_dynamic(item_cache))
        model = DeepFM(tables=tuple(t), features=tuple(_features()), hidden=(8,))
        trainer = Trainer(model, optax.sgd(0.05))
        return _train(
            None, batches, trainer=trainer, state=trainer.init(jax.random.key(0), batches[0])
        )

    small, big = run(24, 48), run(1024, 1024)
    np.testing.assert_array_equal(small[2], big[2])
    assert sorted(small[0].host.tables) == [
        "embedding/item",
        "embedding/user",
        "linear/item_linear",
        "linear/user_linear",
    ]

    from sparsejax.embedding.host import HostTables

    plain = DeviceTableStore(
        [TableSpec(name="u2", vocab_size=10, dim=DIM)], [FeatureSpec(name="user", table="u2")]
    )
    tiered = DeviceTableStore(
        [TableSpec(name="user", dim=DIM, **_dynamic(8))], [FeatureSpec(name="user", table="user")]
    )
    with pytest.raises(ValueError, match="feature 'user' is read by tiered and plain tables"):
        HostTables({("a",): plain, ("b",): tiered})
