"""The ID map of dynamic tables (`IdMap`, `unique_keys`): both backends against a Python
dict on fresh random inputs, and the C++ backend against the numpy one."""

import threading

import numpy as np
import pytest

from sparsejax.embedding.host import _id_map
from sparsejax.embedding.host._id_map import EMPTY_KEY, IdMap, unique_keys

I64_MAX = np.iinfo(np.int64).max
I64_MIN = np.iinfo(np.int64).min

BACKENDS = [
    "numpy",
    pytest.param(
        "cpp",
        marks=pytest.mark.skipif(not _id_map.cpp_available(), reason="C++ ID map not built"),
    ),
]
needs_cpp = pytest.mark.skipif(not _id_map.cpp_available(), reason="C++ ID map not built")


def key_pool(rng, n):
    """Distinct keys of every kind: small, negative (uint64 viewed as int64), near the
    int64 limits, random 64-bit; never EMPTY_KEY."""
    parts = [
        np.arange(-n // 8, n // 8),
        I64_MAX - np.arange(n // 8),
        I64_MIN + np.arange(n // 8),
        np.array([I64_MAX, I64_MIN, -2, 0, 1]),
        rng.integers(I64_MIN, I64_MAX, size=n, dtype=np.int64, endpoint=True),
    ]
    keys = np.unique(np.concatenate(parts).astype(np.int64))
    return rng.permutation(keys[keys != EMPTY_KEY])


def draw(rng, pool, n, empty_frac=0.05):
    """n keys from the pool (with duplicates), some EMPTY_KEY."""
    k = pool[rng.integers(0, pool.size, size=n)]
    k[rng.random(n) < empty_frac] = EMPTY_KEY
    return k


class DictMap:
    """The reference: a dict applied one key at a time."""

    def __init__(self):
        self.d = {}

    def lookup(self, keys):
        return np.array([self.d.get(int(k), -1) for k in keys], np.int32)

    def insert(self, keys, values):
        for k, v in zip(keys.tolist(), values.tolist(), strict=True):
            self.d[k] = v

    def erase(self, keys):
        return np.array([self.d.pop(int(k), -1) for k in keys], np.int32)

    def items(self):
        pairs = sorted(self.d.items(), key=lambda kv: (kv[1], kv[0]))
        return (
            np.array([k for k, _ in pairs], np.int64),
            np.array([v for _, v in pairs], np.int32),
        )


def run_ops(maps, rng, pool, steps, *, batch=300, value_range=1 << 20):
    """The same random inserts / lookups / erases on every map; asserts they agree."""
    for _ in range(steps):
        op = rng.integers(3)
        if op == 0:
            keys = draw(rng, pool, batch, empty_frac=0)
            vals = rng.integers(0, value_range, size=batch, dtype=np.int32)
            for m in maps:
                m.insert(keys, vals)
        elif op == 1:
            keys = draw(rng, pool, batch)
            outs = [m.lookup(keys) for m in maps]
            for o in outs[1:]:
                np.testing.assert_array_equal(o, outs[0])
        else:
            keys = draw(rng, pool, batch // 2)
            outs = [m.erase(keys) for m in maps]
            for o in outs[1:]:
                np.testing.assert_array_equal(o, outs[0])
    ref = maps[0]
    for m in maps[1:]:
        assert len(m) == len(ref.d)
        k, v = m.items()
        rk, rv = ref.items()
        np.testing.assert_array_equal(k, rk)
        np.testing.assert_array_equal(v, rv)
        assert k.dtype == np.int64 and v.dtype == np.int32
        np.testing.assert_array_equal(m.lookup(pool), ref.lookup(pool))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_dict_on_random_ops(backend, seed):
    rng = np.random.default_rng(seed)
    pool = key_pool(rng, 2000)
    m = IdMap(0, backend=backend)  # 16 slots: grows several times
    assert m.backend == backend
    run_ops([DictMap(), m], rng, pool, steps=60)
    assert m.num_slots >= 2 * len(m)


@needs_cpp
def test_cpp_equals_numpy():
    rng = np.random.default_rng(7)
    pool = key_pool(rng, 3000)
    maps = [IdMap(1, backend="cpp"), IdMap(1, backend="numpy")]
    ref = DictMap()
    run_ops([ref, *maps], rng, pool, steps=80)
    for a, b in zip(maps[0].items(), maps[1].items(), strict=True):
        np.testing.assert_array_equal(a, b)


def colliding_keys(home_slots, n, rng, slots=16):
    """n distinct keys whose home slot (in a table of `slots` slots) is in home_slots."""
    out = []
    while sum(map(len, out)) < n:
        k = rng.integers(I64_MIN, I64_MAX, size=1 << 14, dtype=np.int64)
        home = (_id_map._mix(k) & np.uint64(slots - 1)).astype(np.int64)
        out.append(k[np.isin(home, home_slots) & (k != EMPTY_KEY)])
    return np.unique(np.concatenate(out))[:n]


@pytest.mark.parametrize("backend", BACKENDS)
def test_erase_in_long_clusters_that_wrap(backend):
    # 8 keys homed at the last two slots of a 16-slot table: one cluster that wraps
    # around the end; erasing in any order must keep the others reachable.
    rng = np.random.default_rng(3)
    keys = colliding_keys([14, 15], 8, rng)
    for _ in range(20):
        m = IdMap(8, backend=backend)
        assert m.num_slots == 16
        m.insert(keys, np.arange(8, dtype=np.int32))
        order = rng.permutation(8)
        alive = set(range(8))
        for i in order:
            assert m.erase(keys[i : i + 1])[0] == i
            alive.discard(int(i))
            want = np.array([j if j in alive else -1 for j in range(8)], np.int32)
            np.testing.assert_array_equal(m.lookup(keys), want)
        assert len(m) == 0
        # reinsert into the emptied table
        m.insert(keys[::-1], np.arange(8, dtype=np.int32)[::-1])
        np.testing.assert_array_equal(m.lookup(keys), np.arange(8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_erase_then_reinsert_and_churn(backend):
    rng = np.random.default_rng(11)
    pool = key_pool(rng, 4000)
    m, ref = IdMap(64, backend=backend), DictMap()
    for step in range(30):
        keys = pool[rng.integers(0, pool.size, size=200)]
        vals = np.full(200, step, np.int32)
        m.insert(keys, vals)
        ref.insert(keys, vals)
        gone = pool[rng.integers(0, pool.size, size=150)]
        np.testing.assert_array_equal(m.erase(gone), ref.erase(gone))
    assert len(m) == len(ref.d)
    np.testing.assert_array_equal(m.lookup(pool), ref.lookup(pool))
    for a, b in zip(m.items(), ref.items(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_growth_from_tiny_capacity(backend):
    rng = np.random.default_rng(5)
    keys = np.unique(rng.integers(I64_MIN, I64_MAX, size=100_000, dtype=np.int64))
    keys = rng.permutation(keys[keys != EMPTY_KEY])
    vals = np.arange(keys.size, dtype=np.int32)
    m = IdMap(0, backend=backend)
    for c in range(0, keys.size, 7919):
        m.insert(keys[c : c + 7919], vals[c : c + 7919])
    assert len(m) == keys.size
    assert keys.size <= m.num_slots // 2
    np.testing.assert_array_equal(m.lookup(keys), vals)
    absent = keys[:1000] ^ np.int64(0x5BD1E995)
    absent = absent[~np.isin(absent, keys) & (absent != EMPTY_KEY)]
    assert (m.lookup(absent) == -1).all()
    k, v = m.items()
    np.testing.assert_array_equal(v, vals)
    np.testing.assert_array_equal(k, keys)


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicates_last_wins_and_empty_key(backend):
    m = IdMap(backend=backend)
    m.insert(np.array([4, 4, 9, 4], np.int64), np.array([1, 2, 3, 7], np.int32))
    assert len(m) == 2
    np.testing.assert_array_equal(m.lookup(np.array([4, 9, EMPTY_KEY, 5])), [7, 3, -1, -1])
    np.testing.assert_array_equal(m.erase(np.array([4, EMPTY_KEY, 4, 5])), [7, -1, -1, -1])
    assert len(m) == 1
    m.insert(np.array([4], np.int64), np.array([0], np.int32))
    np.testing.assert_array_equal(m.lookup(np.array([[4, 9]], np.int64)), [[0, 3]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_items_sorted_by_value_then_key(backend):
    m = IdMap(backend=backend)
    m.insert(np.array([30, -5, 10, I64_MAX, 20], np.int64), np.array([2, 1, 2, 0, 1], np.int32))
    k, v = m.items()
    np.testing.assert_array_equal(v, [0, 1, 1, 2, 2])
    np.testing.assert_array_equal(k, [I64_MAX, -5, 20, 10, 30])
    empty = IdMap(backend=backend).items()
    assert empty[0].shape == (0,) and empty[0].dtype == np.int64 and empty[1].dtype == np.int32


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    m = IdMap(backend=backend)
    e = np.zeros(0, np.int64)
    m.insert(e, np.zeros(0, np.int32))
    assert m.lookup(e).shape == (0,) and m.erase(e).shape == (0,) and len(m) == 0
    u, inv, c = unique_keys(e, backend=backend)
    assert u.shape == inv.shape == c.shape == (0,)


def unique_reference(keys):
    first, counts = {}, {}
    for k in keys.tolist():
        if k == EMPTY_KEY:
            continue
        first.setdefault(k, len(first))
        counts[k] = counts.get(k, 0) + 1
    uniq = np.array(list(first), np.int64)
    inverse = np.array([first.get(k, -1) if k != EMPTY_KEY else -1 for k in keys.tolist()])
    return uniq, inverse.astype(np.int32), np.array([counts[k] for k in first], np.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 50, 5000])
def test_unique_keys_matches_reference(backend, n):
    rng = np.random.default_rng(n)
    pool = key_pool(rng, max(8, n // 3))
    keys = draw(rng, pool, n, empty_frac=0.1)
    got = unique_keys(keys, backend=backend)
    for g, w in zip(got, unique_reference(keys), strict=True):
        np.testing.assert_array_equal(g, w)
        assert g.dtype == w.dtype
    u, inv, _ = got
    ok = inv >= 0
    np.testing.assert_array_equal(u[inv[ok]], keys[ok])


@needs_cpp
def test_unique_keys_cpp_equals_numpy_and_keeps_shape():
    rng = np.random.default_rng(9)
    keys = draw(rng, key_pool(rng, 1000), 6000, empty_frac=0.2).reshape(60, 100)
    a = unique_keys(keys, backend="cpp")
    b = unique_keys(keys, backend="numpy")
    assert a[1].shape == (60, 100)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    # the C++ scratch table is reused between calls: a second, different call is clean
    a2 = unique_keys(keys[::-1].copy(), backend="cpp")
    b2 = unique_keys(keys[::-1].copy(), backend="numpy")
    for x, y in zip(a2, b2, strict=True):
        np.testing.assert_array_equal(x, y)


@needs_cpp
def test_default_backend_is_cpp_when_built():
    assert IdMap().backend == "cpp"


@needs_cpp
def test_cpp_threads_share_a_map():
    m = IdMap(backend="cpp")
    keys = np.arange(4 * 50_000, dtype=np.int64).reshape(4, -1)

    def work(i):
        m.insert(keys[i], np.full(keys.shape[1], i, np.int32))
        m.lookup(keys[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(m) == keys.size
    np.testing.assert_array_equal(
        m.lookup(keys), np.repeat(np.arange(4), keys.shape[1]).reshape(4, -1)
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.lookup(np.array([1, 2], np.int32)), "keys must be int64, got int32"),
        (lambda m: m.lookup(np.array([1], np.uint64)), r"got uint64 \(view uint64"),
        (lambda m: m.lookup([1.5]), "keys must be int64, got float64"),
        (
            lambda m: m.insert(np.array([1], np.int64), np.array([1], np.int64)),
            "values must be int32, got int64",
        ),
        (
            lambda m: m.insert(np.array([1, 2], np.int64), np.array([1], np.int32)),
            "2 keys but 1 values",
        ),
        (
            lambda m: m.insert(np.array([1, 2], np.int64), np.array([0, -3], np.int32)),
            "values must be >= 0 .* got -3 at index 1",
        ),
        (
            lambda m: m.insert(np.array([5, EMPTY_KEY], np.int64), np.zeros(2, np.int32)),
            r"key -1 \(EMPTY_KEY\) is reserved .*index 1",
        ),
        (lambda m: m.erase(np.array([1], np.int8)), "IdMap.erase: keys must be int64, got int8"),
    ],
)
def test_bad_input_is_one_line(backend, call, match):
    m = IdMap(backend=backend)
    with pytest.raises(ValueError, match=match) as e:
        call(m)
    assert "\n" not in str(e.value)
    assert len(m) == 0  # nothing inserted


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="backend must be 'cpp', 'numpy' or None, got 'gpu'"):
        IdMap(backend="gpu")
    with pytest.raises(ValueError, match=r"capacity must be in \[0, 2\*\*40\], got -1"):
        IdMap(-1)
    with pytest.raises(ValueError, match="capacity must be an int, got float"):
        IdMap(1.5)
    with pytest.raises(ValueError, match="unique_keys: keys must be int64, got int32"):
        unique_keys(np.array([1], np.int32))


def test_cpp_backend_missing_is_one_line(monkeypatch):
    monkeypatch.setattr(_id_map, "_CPP", None)
    monkeypatch.setattr(_id_map, "_CPP_MISSING", "sparsejax._cpu_ext is not built (test)")
    assert IdMap().backend == "numpy"
    with pytest.raises(ValueError, match="backend='cpp' needs the C\\+\\+ extension"):
        IdMap(backend="cpp")


@needs_cpp
def test_cpp_large_allocations():
    # slot arrays of 64 MiB or more are mmap'd (2 MiB-aligned): the map, its growth, and
    # unique_keys' own scratch table above the kept one
    rng = np.random.default_rng(13)
    m = IdMap((1 << 22) - 1, backend="cpp")
    assert m.num_slots == 1 << 23 and m.nbytes == 16 << 23
    keys = key_pool(rng, 4000)
    m.insert(keys, np.arange(keys.size, dtype=np.int32))
    np.testing.assert_array_equal(m.erase(keys[::2]), np.arange(0, keys.size, 2))
    np.testing.assert_array_equal(m.items()[0], keys[1::2])
    big = rng.integers(0, 1 << 20, size=(1 << 21) + 5).astype(np.int64)
    uniq, inverse, counts = unique_keys(big)
    np.testing.assert_array_equal(uniq[inverse], big)
    np.testing.assert_array_equal(counts, np.bincount(inverse))
    assert (np.diff(np.sort(uniq)) != 0).all()
    # first-appearance order: each new index is one more than the largest seen before
    seen = np.maximum.accumulate(np.concatenate([[-1], inverse[:-1]]))
    assert (inverse <= seen + 1).all() and (uniq.size == inverse.max() + 1)
