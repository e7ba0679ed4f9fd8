"""Admission filters against a dict counter: exact counts (CountFilter) and a counting
Bloom filter that never admits late and rarely early; state round trips."""

import sys
import types
from collections import Counter

import numpy as np
import pytest

from sparsejax.embedding import BloomAdmission, CountAdmission
from sparsejax.embedding.host._admission import BloomFilter, CountFilter, make_filter


class _DictIdMap:
    """Stand-in for `_id_map.IdMap` (its interface) while the C++ map is not there."""

    def __init__(self, capacity=1024, *, backend=None):
        self.d = {}

    def __len__(self):
        return len(self.d)

    def lookup(self, keys):
        return np.array([self.d.get(int(k), -1) for k in keys], np.int32)

    def insert(self, keys, values):
        self.d.update(zip(keys.tolist(), values.tolist(), strict=True))

    def erase(self, keys):
        return np.array([self.d.pop(int(k), -1) for k in keys], np.int32)

    def items(self):
        kv = sorted(self.d.items(), key=lambda t: t[1])
        return np.array([k for k, _ in kv], np.int64), np.array([v for _, v in kv], np.int32)

    @property
    def nbytes(self):
        return 16 * len(self.d)


@pytest.fixture(autouse=True)
def id_map(monkeypatch):
    try:
        import sparsejax.embedding.host._id_map  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("sparsejax.embedding.host._id_map")
        stand_in.IdMap = _DictIdMap
        monkeypatch.setitem(sys.modules, "sparsejax.embedding.host._id_map", stand_in)


def batches(rng, steps=30, space=400, size=120):
    """Each step: unique keys (int64, some negative: uint64 keys viewed as int64) and
    their counts in the batch; the same keys recur across steps."""
    pool = rng.choice(np.iinfo(np.int64).max, space, replace=False)
    pool[::7] = -pool[::7] - 2  # negatives, never -1 (the map's empty key)
    for _ in range(steps):
        raw = pool[np.minimum(rng.zipf(1.3, size), space) - 1]
        keys, counts = np.unique(raw, return_counts=True)
        perm = rng.permutation(keys.size)
        yield keys[perm], counts[perm]


class DictFilter:
    """The reference: exact counts in a dict; admitted keys leave it."""

    def __init__(self, min_count):
        self.min_count, self.c = min_count, Counter()

    def observe(self, keys, counts):
        out = []
        for k, n in zip(keys.tolist(), counts.tolist(), strict=True):
            self.c[k] += n
            out.append(self.c[k] >= self.min_count)
            if out[-1]:
                del self.c[k]
        return np.array(out, bool)

    def forget(self, keys):
        for k in keys.tolist():
            self.c.pop(k, None)


@pytest.mark.parametrize("min_count", [1, 2, 5])
def test_count_filter_matches_dict(min_count):
    rng = np.random.default_rng(min_count)
    f, ref = make_filter(CountAdmission(min_count=min_count)), DictFilter(min_count)
    assert isinstance(f, CountFilter)
    for step, (keys, counts) in enumerate(batches(rng)):
        np.testing.assert_array_equal(f.observe(keys, counts), ref.observe(keys, counts))
        assert f.pending == (len(ref.c) if min_count > 1 else 0)
        if step % 5 == 4:  # evicted keys count again from zero
            gone = rng.choice(keys, 10)
            f.forget(np.unique(gone))
            ref.forget(np.unique(gone))
        if step % 7 == 6:  # a checkpoint restore continues exactly
            state = f.state()
            f = CountFilter(CountAdmission(min_count=min_count))
            f.load_state({k: v.copy() for k, v in state.items()})
    state = f.state()
    assert dict(zip(state["keys"].tolist(), state["counts"].tolist(), strict=True)) == dict(
        ref.c if min_count > 1 else {}
    )


def test_count_filter_reuses_slots():
    """A stream of new keys, each seen twice: memory stays at the keys pending."""
    f, most = CountFilter(CountAdmission(min_count=2)), 0
    for r in range(20):
        keys = np.arange(r * 500, (r + 2) * 500, dtype=np.int64)  # 500 new, 500 again
        admitted = f.observe(keys, np.ones(keys.size, np.int64))
        assert admitted[:500].tolist() == [r > 0] * 500 and not admitted[500:].any()
        most = max(most, f.pending)
    assert most == 1000 and f._top == 1000  # slots of admitted keys reused (not 10500)


def test_count_filter_uint64_keys_and_bad_input():
    f = CountFilter(CountAdmission(min_count=2))
    big = np.array([2**64 - 2, 5], np.uint64)
    assert f.observe(big, np.array([1, 1])).tolist() == [False, False]
    assert f.observe(big.view(np.int64), np.array([1, 3])).tolist() == [True, True]
    assert f.pending == 0
    with pytest.raises(TypeError, match="int64"):
        f.observe(np.array([1, 2], np.int32), np.array([1, 1]))
    with pytest.raises(TypeError, match="counts"):
        f.observe(np.array([1, 2], np.int64), np.array([1]))
    with pytest.raises(ValueError, match="missing"):
        f.load_state({"counters": np.zeros(3, np.uint8)})


@pytest.mark.parametrize("min_count", [2, 3])
def test_bloom_never_late_rarely_early(min_count):
    rng = np.random.default_rng(10 + min_count)
    spec = BloomAdmission(min_count=min_count, counters=4096, hashes=3)  # ~10x the keys
    f, ref = make_filter(spec), DictFilter(min_count)
    assert isinstance(f, BloomFilter) and f.pending == -1
    admitted_ref, early, checked = set(), 0, 0
    for step, (keys, counts) in enumerate(batches(rng)):
        fresh = np.array([k not in admitted_ref for k in keys.tolist()], bool)
        keys, counts = keys[fresh], counts[fresh]  # admitted keys have rows: not observed
        got, want = f.observe(keys, counts), ref.observe(keys, counts)
        assert not (want & ~got).any()  # never late: admitted set contains the exact one
        early += int((got & ~want).sum())
        checked += keys.size
        admitted_ref.update(keys[got].tolist())
        if step == 15:
            state = f.state()
            f = BloomFilter(spec)
            f.load_state(state)
    assert early <= 0.02 * checked


def test_bloom_small_filter_still_never_late():
    """A filter far too small: many early admissions, still none late."""
    rng = np.random.default_rng(3)
    f, ref = BloomFilter(BloomAdmission(min_count=4, counters=64, hashes=2)), DictFilter(4)
    for keys, counts in batches(rng, steps=10):
        got, want = f.observe(keys, counts), ref.observe(keys, counts)
        assert not (want & ~got).any()


def test_bloom_counters_saturate_and_hashes_differ():
    f = BloomFilter(BloomAdmission(min_count=255, counters=1 << 16, hashes=4))
    key = np.array([123456789], np.int64)
    assert not f.observe(key, np.array([200]))[0]
    assert f.observe(key, np.array([100]))[0]  # 300 saturates at 255 >= 255
    pos = f.positions(key)[:, 0]
    assert len(set(pos.tolist())) == 4
    np.testing.assert_array_equal(f.state()["counters"][pos], 255)
    # every hash spreads keys evenly over the counters
    many = f.positions(np.arange(1 << 14, dtype=np.int64))
    for row in many:
        hist = np.bincount(row % 16, minlength=16)
        assert hist.min() > 0.8 * hist.mean()
    saved = BloomFilter(BloomAdmission(min_count=2, counters=4096, hashes=3)).state()
    with pytest.raises(ValueError, match="saved filter has 4096 counters and 3 hashes, this one 8"):
        BloomFilter(BloomAdmission(min_count=2, counters=8192, hashes=3)).load_state(saved)


def test_min_count_one_admits_everything_without_memory():
    keys = np.array([3, -7, 2**40], np.int64)
    for spec in (CountAdmission(min_count=1), BloomAdmission(min_count=1, counters=1 << 20)):
        f = make_filter(spec)
        assert f.observe(keys, np.ones(3, np.int64)).all()
        assert f.nbytes == 0
        f.forget(keys)
        f.load_state(f.state())
    with pytest.raises(TypeError, match="CountAdmission or BloomAdmission"):
        make_filter("count")
