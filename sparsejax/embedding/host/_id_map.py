"""The ID map of dynamic tables: raw int64 IDs -> int32 row indices, and `unique_keys`.

A dynamic table's host side (`_tiered.py`) keeps the map from the raw IDs a batch
carries to the rows of its host store apart from the rows themselves, as NVIDIA's
dynamicemb does: the map is a hash table of 16-byte entries, the rows live in arrays.

Two backends give identical results:

- "cpp": `sparsejax._cpu_ext.IdMapCore` (csrc/id_map.cc), open addressing with linear
  probing, key and value in one 16-byte slot (one cache line per probe), load factor
  <= 0.5, growth by doubling, backward-shift deletion, and batched loops that prefetch
  the bucket of the key 16 positions ahead. Each call runs on the calling thread with
  the GIL released; calls on one map are serialized by its own mutex.
- "numpy": the same table done with vectorized numpy (rounds of probing over the whole
  batch; no per-key Python loop). Erase leaves a tombstone (value -1) that the next
  growth drops. About 10x slower; used where the extension is not built.

Example:
    >>> m = IdMap(backend="numpy")
    >>> m.insert(np.array([7, 1 << 62], np.int64), np.array([0, 1], np.int32))
    >>> m.lookup(np.array([1 << 62, 5], np.int64)).tolist()
    [1, -1]
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["EMPTY_KEY", "IdMap", "unique_keys", "cpp_available"]

EMPTY_KEY = -1
"""Reserved (uint64 max viewed as int64): never a key. Looking it up gives -1, erasing it
does nothing, inserting it is an error, `unique_keys` skips it (inverse -1)."""

_MIN_SLOTS = 16


def _load_cpp():
    try:
        from ... import _cpu_ext
    except ImportError as e:
        return None, f"sparsejax._cpu_ext is not built ({e})"
    if not hasattr(_cpu_ext, "IdMapCore"):
        return None, "sparsejax._cpu_ext was built without the ID map (csrc/id_map.cc)"
    return _cpu_ext, None


_CPP, _CPP_MISSING = _load_cpp()


def cpp_available() -> bool:
    """True when the C++ backend ("cpp") can be used."""
    return _CPP is not None


# ------------------------------------------------------------------ input checks


def _as_keys(keys, where: str) -> np.ndarray:
    a = np.asarray(keys)
    if a.dtype != np.int64:
        hint = " (view uint64 IDs as int64: keys.view(np.int64))" if a.dtype == np.uint64 else ""
        raise ValueError(f"{where}: keys must be int64, got {a.dtype}{hint}")
    return np.ascontiguousarray(a).reshape(-1)


def _as_values(values, n: int, where: str) -> np.ndarray:
    v = np.asarray(values)
    if v.dtype != np.int32:
        raise ValueError(f"{where}: values must be int32, got {v.dtype}")
    if v.size != n:
        raise ValueError(f"{where}: {n} keys but {v.size} values")
    v = np.ascontiguousarray(v).reshape(-1)
    if n and v.min() < 0:
        i = int(np.argmax(v < 0))
        raise ValueError(
            f"{where}: values must be >= 0 (-1 means absent), got {int(v[i])} at index {i}"
        )
    return v


def _check_no_empty_key(keys: np.ndarray, where: str) -> None:
    bad = keys == EMPTY_KEY
    if bad.any():
        raise ValueError(
            f"{where}: key {EMPTY_KEY} (EMPTY_KEY) is reserved and cannot be inserted "
            f"(index {int(np.argmax(bad))})"
        )


# ------------------------------------------------------------------ numpy backend

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def _mix(keys: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer of int64 keys (as in csrc/id_map.cc), uint64."""
    x = keys.view(np.uint64).copy()
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


def _slots_for(keys: int) -> int:
    s = _MIN_SLOTS
    while s // 2 < keys:
        s *= 2
    return s


class _NumpyCore:
    """The numpy backend, with the method names of `_cpu_ext.IdMapCore`.

    `_keys[i]` is EMPTY_KEY for an empty slot; `_vals[i]` is -1 for an empty slot or a
    tombstone (an erased key keeps its slot until the next rehash, so probe chains stay
    intact without moving entries)."""

    def __init__(self, capacity: int) -> None:
        self._alloc(_slots_for(capacity))
        self._live = 0
        self._used = 0  # live + tombstones

    def _alloc(self, slots: int) -> None:
        self._keys = np.full(slots, EMPTY_KEY, np.int64)
        self._vals = np.full(slots, -1, np.int32)
        self._mask = np.uint64(slots - 1)

    def size(self) -> int:
        return self._live

    def num_slots(self) -> int:
        return self._keys.size

    def nbytes(self) -> int:
        return self._keys.nbytes + self._vals.nbytes

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return (_mix(keys) & self._mask).astype(np.intp)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key (tombstones included), -1 where absent; keys != EMPTY_KEY."""
        found = np.full(keys.size, -1, np.intp)
        idx = np.arange(keys.size)
        k = keys
        pos = self._home(keys)
        mask = self._keys.size - 1
        while idx.size:
            sk = self._keys[pos]
            hit = sk == k
            found[idx[hit]] = pos[hit]
            go = np.flatnonzero(~hit & (sk != EMPTY_KEY))
            idx, k, pos = idx[go], k[go], (pos[go] + 1) & mask
        return found

    def _place(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Puts distinct keys that are not in the table into empty slots."""
        k, v = keys, vals
        pos = self._home(keys)
        mask = self._keys.size - 1
        while k.size:
            free = np.flatnonzero(self._keys[pos] == EMPTY_KEY)
            keep = np.ones(k.size, bool)
            if free.size:
                p = pos[free]
                self._keys[p] = k[free]  # keys racing for one slot: one of them lands
                won = free[self._keys[p] == k[free]]
                self._vals[pos[won]] = v[won]
                keep[won] = False
            # Everyone else is at a slot that is now taken: move on.
            k, v, pos = k[keep], v[keep], (pos[keep] + 1) & mask

    def _rehash(self, need: int) -> None:
        live = self._vals >= 0
        k, v = self._keys[live], self._vals[live]
        slots = cur = self._keys.size
        if need > cur // 2:
            slots = _slots_for(need)
        elif need > cur // 4:  # dropping tombstones alone would free too little: grow
            slots = 2 * cur
        self._alloc(slots)
        self._place(k, v)
        self._used = k.size

    def lookup(self, keys: np.ndarray, out: np.ndarray) -> None:
        out[:] = -1
        ok = np.flatnonzero(keys != EMPTY_KEY)
        pos = self._find(keys[ok])
        hit = pos >= 0
        out[ok[hit]] = self._vals[pos[hit]]

    def insert(self, keys: np.ndarray, values: np.ndarray) -> None:
        if keys.size == 0:
            return
        # The last occurrence of a key wins, as in a sequence of dict assignments.
        uk, first = np.unique(keys[::-1], return_index=True)
        uv = values[::-1][first]
        pos = self._find(uk)
        hit = pos >= 0
        p = pos[hit]
        self._live += int(np.count_nonzero(self._vals[p] < 0))  # tombstones revived
        self._vals[p] = uv[hit]
        nk, nv = uk[~hit], uv[~hit]
        if nk.size:
            if self._used + nk.size > self._keys.size // 2:
                self._rehash(self._live + nk.size)
            self._place(nk, nv)
            self._live += nk.size
            self._used += nk.size

    def erase(self, keys: np.ndarray, out: np.ndarray) -> None:
        out[:] = -1
        ok = np.flatnonzero(keys != EMPTY_KEY)
        pos = self._find(keys[ok])
        hit = pos >= 0
        ok, pos = ok[hit], pos[hit]
        old = self._vals[pos]
        live = old >= 0
        ok, pos, old = ok[live], pos[live], old[live]
        # A key erased twice in one call: its first occurrence gets the value.
        _, first = np.unique(pos, return_index=True)
        out[ok[first]] = old[first]
        self._vals[pos] = -1
        self._live -= first.size

    def items(self, keys_out: np.ndarray, values_out: np.ndarray) -> int:
        live = self._vals >= 0
        n = min(keys_out.size, int(np.count_nonzero(live)))
        keys_out[:n] = self._keys[live][:n]
        values_out[:n] = self._vals[live][:n]
        return n


def _unique_numpy(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    inverse = np.full(keys.size, -1, np.int32)
    ok = np.flatnonzero(keys != EMPTY_KEY)
    u, first, inv, counts = np.unique(
        keys[ok], return_index=True, return_inverse=True, return_counts=True
    )
    order = np.argsort(first, kind="stable")  # sorted order -> first-appearance order
    rank = np.empty(order.size, np.int32)
    rank[order] = np.arange(order.size, dtype=np.int32)
    inverse[ok] = rank[inv.reshape(-1)]
    return u[order], inverse, counts[order].astype(np.int32)


# ------------------------------------------------------------------ public API


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        return "cpp" if _CPP is not None else "numpy"
    if backend not in ("cpp", "numpy"):
        raise ValueError(f"IdMap: backend must be 'cpp', 'numpy' or None, got {backend!r}")
    if backend == "cpp" and _CPP is None:
        raise ValueError(
            f"IdMap: backend='cpp' needs the C++ extension: {_CPP_MISSING}; rebuild with "
            "`pip install -e .` or use backend='numpy'"
        )
    return backend


class IdMap:
    """int64 key -> int32 value hash table (open addressing) that grows itself.

    Values must be >= 0: -1 is what `lookup` and `erase` return for an absent key. The
    key EMPTY_KEY (-1) is reserved. Any array shape is accepted (flattened); `lookup` and
    `erase` return the keys' shape.

    Args:
      capacity: keys the map holds before it first grows (slots = next power of two
        >= 2 * capacity, at least 16).
      backend: "cpp", "numpy", or None for "cpp" when the extension is built.

    Memory: 16 bytes per slot ("cpp"; 12 for "numpy"), 32-64 bytes per live key at
    load 0.25-0.5; a growth briefly holds the old and the new slot arrays.
    """

    def __init__(self, capacity: int = 1024, *, backend: str | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer):
            raise ValueError(f"IdMap: capacity must be an int, got {type(capacity).__name__}")
        if not 0 <= capacity <= 1 << 40:
            raise ValueError(f"IdMap: capacity must be in [0, 2**40], got {capacity}")
        self.backend: str = _pick_backend(backend)
        if self.backend == "cpp":
            self._core = _CPP.IdMapCore(int(capacity))
            self._lock = None  # the C++ table has its own mutex
        else:
            self._core = _NumpyCore(int(capacity))
            self._lock = threading.Lock()

    def _call(self, name: str, *args):
        if self._lock is None:
            return getattr(self._core, name)(*args)
        with self._lock:
            return getattr(self._core, name)(*args)

    def __len__(self) -> int:
        return self._core.size()

    def __repr__(self) -> str:
        return f"IdMap(len={len(self)}, slots={self.num_slots}, backend={self.backend!r})"

    @property
    def num_slots(self) -> int:
        """Slots allocated (a power of two; the map grows past half of them)."""
        return self._core.num_slots()

    @property
    def nbytes(self) -> int:
        """Bytes of the slot arrays."""
        return self._core.nbytes()

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """int32 value of each key, -1 where absent. keys: int64, any shape."""
        k = _as_keys(keys, "IdMap.lookup")
        out = np.empty(k.size, np.int32)
        self._call("lookup", k, out)
        return out.reshape(np.shape(keys))

    def insert(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Sets key -> value, overwriting a present key; of duplicates the last wins.

        Raises:
          ValueError: keys not int64, values not int32 or negative, sizes differ, or a
            key is EMPTY_KEY (nothing is inserted then).
        """
        k = _as_keys(keys, "IdMap.insert")
        v = _as_values(values, k.size, "IdMap.insert")
        _check_no_empty_key(k, "IdMap.insert")
        self._call("insert", k, v)

    def erase(self, keys: np.ndarray) -> np.ndarray:
        """Removes keys; returns the value each had (-1 where absent or already erased
        earlier in the same call)."""
        k = _as_keys(keys, "IdMap.erase")
        out = np.empty(k.size, np.int32)
        self._call("erase", k, out)
        return out.reshape(np.shape(keys))

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys int64[n], values int32[n]) of every live key, sorted by value, then key."""
        if self._lock is None:
            return self._items()
        with self._lock:
            return self._items()

    def _items(self) -> tuple[np.ndarray, np.ndarray]:
        n = self._core.size()
        keys = np.empty(n, np.int64)
        values = np.empty(n, np.int32)
        got = self._core.items(keys, values)
        if got != n:  # only if another thread changed the map between the two calls
            raise RuntimeError("IdMap.items: the map changed while it was read")
        order = np.argsort(values, kind="stable")
        keys, values = keys[order], values[order]
        if n > 1 and not np.all(values[1:] != values[:-1]):  # equal values: order by key
            order = np.lexsort((keys, values))
            keys, values = keys[order], values[order]
        return keys, values


def unique_keys(keys: np.ndarray, *, backend: str | None = None):
    """Distinct keys in order of first appearance, with inverse and counts; O(n).

    Args:
      keys: int64, any shape. EMPTY_KEY entries are skipped.
      backend: as for `IdMap`.

    Returns:
      (unique int64[u], inverse int32 (keys' shape; -1 at EMPTY_KEY), counts int32[u])
      with `unique[inverse[i]] == keys[i]` wherever `inverse[i] >= 0`.
    """
    k = _as_keys(keys, "unique_keys")
    if k.size >= 1 << 31:
        raise ValueError(f"unique_keys: at most 2**31 - 1 keys (int32 inverse), got {k.size}")
    if _pick_backend(backend) == "numpy":
        uniq, inverse, counts = _unique_numpy(k)
    else:
        uniq = np.empty(k.size, np.int64)
        inverse = np.empty(k.size, np.int32)
        counts = np.empty(k.size, np.int32)
        u = _CPP.unique_keys(k, uniq, inverse, counts)
        uniq, counts = uniq[:u].copy(), counts[:u].copy()
    return uniq, inverse.reshape(np.shape(keys)), counts
