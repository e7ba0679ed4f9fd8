"""Key owners of tiered tables in several processes: the routing hash, where each owner's
cache slots lie, and host state that moves between process counts (every key to its one
new owner, nothing lost, nothing evicted brought back, stats and admission counts kept),
with one-line refusals of another hash or key space and of a restore past max_rows."""

import dataclasses

import jax
import numpy as np
import pytest

from sparsejax.embedding import DynamicVocab, Eviction, FeatureSpec, HostCache, TableSpec
from sparsejax.embedding._spec import BloomAdmission, CountAdmission
from sparsejax.embedding.host import (
    BUCKETS,
    DynamicTableFullError,
    HostTable,
    key_bucket,
    key_owner,
    owner_layout,
)
from sparsejax.embedding.host._host_table import RestoreWarning, SavedTableMismatchError
from sparsejax.ops.optimizers import RowWiseAdagrad

DIM = 4


def test_owner_of_a_key_is_a_fixed_balanced_function_of_the_key():
    keys = np.random.default_rng(0).integers(-1, 2**63 - 1, 200_000, dtype=np.int64)
    b = key_bucket(keys)
    assert b.min() >= 0 and b.max() < BUCKETS
    np.testing.assert_array_equal(key_bucket(keys.copy()), b)  # a pure function
    for owners in (1, 2, 3, 4, 7):
        own = key_owner(keys, owners)
        np.testing.assert_array_equal(own, b % owners)
        share = np.bincount(own, minlength=owners) / keys.shape[0]
        assert np.all(np.abs(share - 1 / owners) < 0.01), (owners, share)
    # small consecutive ids (a static table's rows) spread as well
    share = np.bincount(key_owner(np.arange(10_000, dtype=np.int64), 4)) / 10_000
    assert np.all(np.abs(share - 0.25) < 0.03)


@pytest.mark.parametrize(
    "rows, owners, devices", [(10, 2, 1), (1, 4, 1), (1000, 3, 2), (4096, 2, 4), (7, 8, 3)]
)
def test_each_owners_slots_lie_on_its_devices_and_the_default_row_on_no_ones(rows, owners, devices):
    lay = owner_layout(rows, owners, devices)
    assert lay.slots * owners >= rows
    assert lay.view_rows == owners * devices * lay.per_device
    seen = set()
    for p in range(owners):
        view = lay.rows(p, np.arange(lay.slots))
        device = view // lay.per_device
        assert np.all((device >= p * devices) & (device < (p + 1) * devices))
        assert seen.isdisjoint(view.tolist())
        seen.update(view.tolist())
    assert lay.default_row not in seen
    assert lay.default_row // lay.per_device == owners * devices - 1  # the last device


def _table(owner=0, owners=1, *, max_rows=None, when_full="evict", admission=None):
    spec = TableSpec(
        name="user",
        dim=DIM,
        optimizer=RowWiseAdagrad(learning_rate=0.1),
        dynamic=DynamicVocab(
            max_rows=max_rows,
            when_full=when_full,
            admission=admission or CountAdmission(min_count=2),
            eviction=Eviction(ttl_steps=1000),
        ),
        cache=HostCache(rows=64),
    )
    ht = HostTable(
        spec,
        (FeatureSpec(name="user", table="user"),),
        key="embedding/user",
        owner=owner,
        owners=owners,
        capacity=64,
    )
    ht.init(jax.random.key(0))
    return ht


def _train(ht, steps, seed, owners=1):
    """Batches of keys (each admitted at its second sight); a batch's keys the owner
    does not own are not its to see (what the exchange sends it)."""
    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1):
        keys = rng.integers(0, 300, 40).astype(np.int64) * 1_000_003
        keys = keys[key_owner(keys, owners) == ht.owner]
        uniq, counts = np.unique(keys, return_counts=True)
        ht.map_keys(uniq, counts.astype(np.int32), step, train=True)
        _, load_rows, _ = ht.map_keys(uniq, counts.astype(np.int32), step, train=False)[1:]
        assert load_rows.shape[0] == 0  # train placed every row it has


def _state(ht):
    """{key: (weights, slot, count, last_seen)} of every live key, and pending counts."""
    rows, keys = ht.live_rows()
    w, s = ht.rows.gather(rows)
    out = {
        int(k): (
            w[i].tolist(),
            s["accumulator"][i].item(),
            int(ht.count.data[r]),
            int(ht.last_seen.data[r]),
        )
        for i, (k, r) in enumerate(zip(keys, rows, strict=True))
    }
    adm = ht.admission.state()
    pending = dict(zip(adm["keys"].tolist(), adm["counts"].tolist(), strict=True))
    return out, pending


def test_host_state_moves_from_one_owner_to_three_and_back_key_for_key():
    one = _table()
    _train(one, 6, seed=0)
    full = one.snapshot(6, incremental=False)
    one.mark_saved()
    _train(one, 4, seed=1)
    rows, keys = one.live_rows()
    gone = keys[:5]
    one.evict_rows(rows[:5])  # evicted after the full save: tombstones of the delta
    delta = one.snapshot(10, incremental=True)
    assert set(delta.arrays["tombstones"].tolist()) == set(gone.tolist())
    want, pending = _state(one)
    assert pending and not set(gone.tolist()) & set(want)

    parts = []
    for p in range(3):
        ht = _table(p, 3)
        ht.restore([full, delta])
        got, got_pending = _state(ht)
        assert all(key_owner(np.array(list(got), np.int64), 3) == p)
        assert all(key_owner(np.array(list(got_pending), np.int64), 3) == p)
        parts.append((ht, got, got_pending))
    union = {k: v for _, got, _ in parts for k, v in got.items()}
    assert sum(len(got) for _, got, _ in parts) == len(union)  # each key once
    assert union == want  # rows, slots, counts: nothing lost, nothing evicted back
    assert {k: v for *_, pend in parts for k, v in pend.items()} == pending
    for f in dataclasses.fields(one.stats):  # the owners' stats add up to the saver's
        each = [getattr(ht.stats, f.name) for ht, *_ in parts]
        total = max(each) if f.name == "steps" else sum(each)  # every owner counts steps
        assert total == getattr(one.stats, f.name), f.name
    assert 0.2 < min(len(got) for _, got, _ in parts) / len(want) < 0.47

    # each owner trains on, saves, and one process restores every part
    snaps = []
    for ht, *_ in parts:
        _train(ht, 3, seed=2, owners=3)
        snaps.append(ht.snapshot(13, incremental=False))
    _train(one, 3, seed=2)
    back = _table()
    back.restore(snaps)
    assert _state(back) == _state(one)


def test_bloom_admission_splits_its_counters_and_keeps_them_on_as_many_processes():
    bloom = BloomAdmission(counters=1 << 12, hashes=2, min_count=3)
    parts = []
    for p in range(2):
        ht = _table(p, 2, admission=bloom)
        assert ht.admission.num_counters == 1 << 11  # each owner counts its own keys
        _train(ht, 3, seed=0, owners=2)
        parts.append(ht.snapshot(3, incremental=False))
    for p in range(2):  # the same count: each owner its own counters
        back = _table(p, 2, admission=bloom)
        back.restore(parts)
        np.testing.assert_array_equal(
            back.admission.state()["counters"], parts[p].arrays["admission/counters"]
        )
    one = _table(admission=bloom)
    with pytest.warns(RestoreWarning, match=r"'user': its Bloom admission counts .* 2 "):
        one.restore(parts)
    assert not one.admission.state()["counters"].any() and len(one.map) > 0


def test_a_restore_past_max_rows_evicts_the_least_used_with_a_warning_or_refuses():
    one = _table()
    _train(one, 8, seed=0)
    saved = one.snapshot(8, incremental=False)
    live = len(one.map)
    small = _table(max_rows=live - 10)
    with pytest.warns(
        RestoreWarning,
        match=r"'user': evicted the 10 least used of its \d+ restored rows to fit max_rows=\d+$",
    ):
        small.restore([saved])
    assert len(small.map) == live - 10 and small.stats.evicted == one.stats.evicted + 10
    kept = set(small.live_rows()[1].tolist())
    counts = {int(k): int(one.count.data[r]) for r, k in zip(*one.live_rows(), strict=True)}
    dropped = set(counts) - kept
    assert max(counts[k] for k in dropped) <= min(counts[k] for k in kept)  # least used
    strict = _table(max_rows=live - 10, when_full="error")
    with pytest.raises(DynamicTableFullError, match=r"'user'.*, 10 over max_rows=\d+; raise"):
        strict.restore([saved])


def test_a_snapshot_of_another_hash_or_key_space_is_refused_naming_the_table():
    one = _table()
    _train(one, 2, seed=0)
    saved = one.snapshot(2, incremental=False)
    other = dataclasses.replace(saved, meta={**saved.meta, "owner_hash": "crc32/64"})
    with pytest.raises(SavedTableMismatchError, match=r"table 'user'.*routed .*'crc32/64'"):
        _table(0, 2).restore([other])
    static = dataclasses.replace(saved, meta={**saved.meta, "dynamic": False})
    with pytest.raises(SavedTableMismatchError, match=r"table 'user'.*keys it by row ids"):
        _table().restore([static])


def test_a_host_cached_static_table_splits_its_ids_over_the_owners():
    """Each owner draws the rows of the ids it owns exactly as one process draws them,
    and a save of either restores on the other count."""
    spec = TableSpec(
        name="item",
        vocab_size=3000,
        dim=DIM,
        optimizer=RowWiseAdagrad(learning_rate=0.1),
        cache=HostCache(rows=64),
    )
    feats = (FeatureSpec(name="item", table="item"),)

    def table(owner, owners):
        ht = HostTable(spec, feats, key="embedding/item", owner=owner, owners=owners, capacity=64)
        ht.init(jax.random.key(3))
        return ht

    def rows_by_id(ht):
        rows, ids = ht.live_rows()
        return dict(zip(ids.tolist(), ht.rows.gather(rows)[0].tolist(), strict=True))

    one = rows_by_id(table(0, 1))
    parts = [table(p, 2) for p in range(2)]
    got = [rows_by_id(ht) for ht in parts]
    assert not set(got[0]) & set(got[1]) and {**got[0], **got[1]} == one
    assert all(
        key_owner(np.array(list(g), np.int64), 2).tolist() == [p] * len(g)
        for p, g in enumerate(got)
    )
    uniq = np.array([5, 17, 2999], np.int64)
    mine = uniq[key_owner(uniq, 2) == 0]
    slots, _, load_rows, _ = parts[0].map_keys(
        mine, np.ones(mine.shape[0], np.int32), 1, train=True
    )
    assert (slots < 64).all() and load_rows.shape[0] == mine.shape[0]
    back = table(0, 1)
    back.restore([ht.snapshot(1, incremental=False) for ht in parts])
    assert rows_by_id(back) == one
