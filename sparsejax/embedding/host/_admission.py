"""Admission filters of dynamic tables: which new IDs get a trainable row.

An ID not yet in a table is counted each time a batch holds it; it is admitted (gets a
row) once its count reaches `min_count`. Until then it reads the default row and gets
no update. Two filters, made by `make_filter(spec)`:

- `CountFilter` (`CountAdmission`): exact counts of the keys not yet admitted, in an
  `IdMap` from key to a slot of a counts array; an admitted key leaves it, and
  `forget` (eviction) makes a key start again from zero. Memory grows with the keys
  seen fewer than `min_count` times.
- `BloomFilter` (`BloomAdmission`): a counting Bloom filter of `counters` uint8
  saturating counters and `hashes` hash functions: bounded memory whatever the ID
  space. Each key's count is estimated by the minimum of its counters, and counters are
  raised by conservative update (each of a key's counters to at most its new
  estimate), so an estimate is never below the key's true count: a key is never
  admitted late; a collision can admit one early.

Both take a batch's unique keys with their counts and return an admitted mask, fully
vectorized, and their `state()` / `load_state()` continue exactly after a checkpoint
restore. `min_count=1` admits every key at first sight, without counting.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..._hashing import mix64
from .._spec import BloomAdmission, CountAdmission

__all__ = ["BloomFilter", "CountFilter", "make_filter", "merge_filter_states", "owner_share"]


def _keys_counts(owner: str, keys, counts) -> tuple[np.ndarray, np.ndarray]:
    keys = np.asarray(keys)
    if keys.dtype == np.uint64:
        keys = keys.view(np.int64)
    if keys.dtype != np.int64 or keys.ndim != 1:
        raise TypeError(f"{owner}: keys must be int64[n], got {keys.dtype}{list(keys.shape)}")
    counts = np.asarray(counts)
    if counts.shape != keys.shape or counts.dtype.kind not in "iu":
        raise TypeError(
            f"{owner}: counts must be integers of the keys' shape {list(keys.shape)}, "
            f"got {counts.dtype}{list(counts.shape)}"
        )
    counts = counts.astype(np.int64, copy=False)
    if counts.size and counts.min() < 0:
        raise ValueError(f"{owner}: counts must be >= 0, got {counts.min()}")
    return keys, counts


class CountFilter:
    """Exact admission (`CountAdmission`): counts of the keys seen fewer than
    `min_count` times, in an `IdMap` (key -> slot of `int32` counts; the slots of
    admitted or forgotten keys are reused).

    Example:
      >>> f = CountFilter(CountAdmission(min_count=2))
      >>> f.observe(np.array([7, 8], np.int64), np.array([1, 2])).tolist()
      [False, True]
      >>> f.observe(np.array([7], np.int64), np.array([1])).tolist(), f.pending
      ([True], 0)
    """

    def __init__(self, spec: CountAdmission):
        self.min_count = int(spec.min_count)
        self._counts = np.zeros(0, np.int32)  # by slot
        self._top = 0  # slots ever used
        self._free = np.zeros(0, np.int32)  # freed slots (a stack)
        self._map = None
        if self.min_count > 1:
            self._map = _new_map()

    @property
    def pending(self) -> int:
        """Keys counted and not yet admitted."""
        return 0 if self._map is None else len(self._map)

    @property
    def nbytes(self) -> int:
        if self._map is None:
            return 0
        return self._map.nbytes + self._counts.nbytes + self._free.nbytes

    def observe(self, keys, counts) -> np.ndarray:
        """Count `keys` (int64[n], unique) seen `counts` (int[n]) times in this batch;
        bool[n]: whether each has now been seen `min_count` times in all (those leave
        the counter; the caller gives them rows)."""
        keys, counts = _keys_counts("CountFilter.observe", keys, counts)
        if self._map is None:
            return np.ones(keys.shape, bool)
        slots = self._map.lookup(keys)
        have = slots >= 0
        total = counts.copy()
        total[have] += self._counts[slots[have]]
        admitted = total >= self.min_count
        done = have & admitted
        if done.any():
            self._map.erase(keys[done])
            self._release(slots[done])
        stay = have & ~admitted
        self._counts[slots[stay]] = total[stay]
        new = ~have & ~admitted & (counts > 0)
        if new.any():
            fresh = self._allocate(int(new.sum()))
            self._map.insert(keys[new], fresh)
            self._counts[fresh] = total[new]
        return admitted

    def forget(self, keys) -> None:
        """Drop the counts of `keys` (int64[n]): evicted keys count again from zero."""
        if self._map is None:
            return
        keys, _ = _keys_counts("CountFilter.forget", keys, np.zeros(np.shape(keys), np.int64))
        old = self._map.erase(keys)
        self._release(old[old >= 0])

    def _allocate(self, n: int) -> np.ndarray:
        reuse = min(n, self._free.size)
        out = np.empty(n, np.int32)
        out[:reuse] = self._free[self._free.size - reuse :]
        self._free = self._free[: self._free.size - reuse]
        more = n - reuse
        if self._top + more > self._counts.size:
            grown = np.zeros(max(2 * self._counts.size, self._top + more, 1024), np.int32)
            grown[: self._top] = self._counts[: self._top]
            self._counts = grown
        out[reuse:] = np.arange(self._top, self._top + more, dtype=np.int32)
        self._top += more
        return out

    def _release(self, slots: np.ndarray) -> None:
        if slots.size:
            self._counts[slots] = 0
            self._free = np.concatenate([self._free, slots.astype(np.int32)])

    def state(self) -> dict[str, np.ndarray]:
        """`{"keys": int64[k], "counts": int32[k]}`: the keys still counted."""
        if self._map is None:
            return {"keys": np.zeros(0, np.int64), "counts": np.zeros(0, np.int32)}
        keys, slots = self._map.items()
        return {"keys": np.asarray(keys, np.int64), "counts": self._counts[slots].copy()}

    def load_state(self, arrays) -> None:
        """Continue from `state()` (replaces every count)."""
        _expect("CountFilter", arrays, ("keys", "counts"))
        keys = np.asarray(arrays["keys"], np.int64)
        counts = np.asarray(arrays["counts"], np.int32)
        if keys.shape != counts.shape or keys.ndim != 1:
            raise ValueError(
                f"CountFilter.load_state: keys {list(keys.shape)} and counts "
                f"{list(counts.shape)} must be 1-d of one length"
            )
        self._counts = np.zeros(0, np.int32)
        self._top = 0
        self._free = np.zeros(0, np.int32)
        if self._map is None:
            return  # min_count 1 now: nothing is pending
        self._map = _new_map(max(1024, 2 * keys.size))
        # keys that reached a lowered min_count are admitted on their next sight
        keep = counts > 0
        slots = self._allocate(int(keep.sum()))
        self._map.insert(keys[keep], slots)
        self._counts[slots] = counts[keep]


def _new_map(capacity: int = 1024):
    from ._id_map import IdMap  # imported late: the C++ map is optional at import

    return IdMap(capacity)


def _expect(owner: str, arrays, names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in arrays]
    if missing:
        raise ValueError(
            f"{owner}.load_state: the state has arrays {sorted(arrays)}, missing {missing} "
            f"(was it saved by another kind of admission filter?)"
        )


# splitmix64 (Steele et al.): the finalizer mixes, the golden-ratio step seeds each hash
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class BloomFilter:
    """Bounded-memory admission (`BloomAdmission`): a counting Bloom filter.

    `counters` uint8 counters saturating at 255; hash `i` of a key is splitmix64 of the
    key plus a per-hash seed, modulo `counters`. A key's estimated count is the minimum
    of its `hashes` counters; a batch raises each of its counters to at least the key's
    new estimate (conservative update). So an estimate is never below the key's true
    count (no late admission), and collisions only make admission early.
    `forget` does nothing: counters cannot forget one key, so an evicted key is
    admitted again at its next sight.
    """

    pending = -1
    """Not known for a Bloom filter (the API of `CountFilter.pending`)."""

    def __init__(self, spec: BloomAdmission):
        self.min_count = int(spec.min_count)
        self.num_counters = int(spec.counters)
        self.hashes = int(spec.hashes)
        seed = 0
        seeds = []
        for _ in range(self.hashes):
            seed = _splitmix(seed)
            seeds.append(seed)
        self._seeds = [np.uint64(s) for s in seeds]
        self._counters = (
            np.zeros(self.num_counters, np.uint8)  # calloc: pages on first touch
            if self.min_count > 1
            else np.zeros(0, np.uint8)
        )

    @property
    def nbytes(self) -> int:
        return self._counters.nbytes

    def positions(self, keys: np.ndarray) -> np.ndarray:
        """int64[hashes, n]: the counters of each key."""
        u = keys.view(np.uint64)
        out = np.empty((self.hashes, u.size), np.int64)
        m = np.uint64(self.num_counters)
        for i, s in enumerate(self._seeds):
            out[i] = mix64(u + s) % m
        return out

    def observe(self, keys, counts) -> np.ndarray:
        """As `CountFilter.observe`: bool[n], whether each key's estimated count
        (including this batch's) reached `min_count`."""
        keys, counts = _keys_counts("BloomFilter.observe", keys, counts)
        if self.min_count <= 1:
            return np.ones(keys.shape, bool)
        pos = self.positions(keys)
        est = self._counters[pos].min(axis=0).astype(np.int64)
        new = np.minimum(est + counts, 255)
        admitted = new >= self.min_count
        # conservative update: each counter rises to the largest new estimate among the
        # keys hashed to it (a key's counters never fall below its true count)
        np.maximum.at(
            self._counters,
            pos.ravel(),
            np.broadcast_to(new.astype(np.uint8), pos.shape).ravel(),
        )
        return admitted

    def forget(self, keys) -> None:
        """Nothing: a counting Bloom filter cannot forget one key's count."""

    def state(self) -> dict[str, np.ndarray]:
        """`{"counters": uint8[counters], "params": int64[3]}` (counters, hashes,
        min_count; checked by `load_state`)."""
        params = np.array([self.num_counters, self.hashes, self.min_count], np.int64)
        return {"counters": self._counters.copy(), "params": params}

    def load_state(self, arrays) -> None:
        """Continue from `state()`. The filter's size and hash count must match."""
        _expect("BloomFilter", arrays, ("counters", "params"))
        counters = np.asarray(arrays["counters"], np.uint8)
        n, hashes, saved_min_count = (int(x) for x in np.asarray(arrays["params"]))
        if self.min_count <= 1:
            return  # admits everything now: the counts are not needed
        if saved_min_count <= 1:  # saved while admitting everything: nothing was counted
            self._counters = np.zeros(self.num_counters, np.uint8)
            return
        if n != self.num_counters or hashes != self.hashes or counters.shape != (n,):
            raise ValueError(
                f"BloomFilter.load_state: the saved filter has {n} counters and {hashes} "
                f"hashes, this one {self.num_counters} and {self.hashes}; the counts cannot "
                f"carry over (keep admission.bloom counters/hashes as saved)"
            )
        self._counters = counters.copy()


def owner_share(spec, owners: int):
    """An admission spec for one of `owners` processes that each count their own keys:
    a Bloom filter's counters split among them (the same false-positive rate), exact
    counts as they are."""
    if isinstance(spec, BloomAdmission) and owners > 1:
        return dataclasses.replace(spec, counters=max(1, -(-spec.counters // owners)))
    return spec


def merge_filter_states(states: list[dict]) -> dict:
    """One filter's `state()` from those of filters that counted disjoint sets of keys
    (the owners of a table in several processes): the counted keys of all
    (`CountFilter`), or each counter's maximum (`BloomFilter`: an estimate stays at or
    above a key's true count). Empty states (no filter saved) are skipped."""
    states = [s for s in states if s]
    if not states:
        return {}
    if "counters" not in states[0]:
        return {k: np.concatenate([s[k] for s in states]) for k in ("keys", "counts")}
    params = [tuple(np.asarray(s["params"]).tolist()) for s in states]
    if len(set(params)) > 1:
        raise ValueError(
            f"merge_filter_states: Bloom filters of different sizes {sorted(set(params))}"
        )
    return {
        "counters": np.maximum.reduce([np.asarray(s["counters"]) for s in states]),
        "params": states[0]["params"],
    }


def make_filter(spec: CountAdmission | BloomAdmission) -> CountFilter | BloomFilter:
    """The admission filter of a `DynamicVocab.admission` spec."""
    if isinstance(spec, CountAdmission):
        return CountFilter(spec)
    if isinstance(spec, BloomAdmission):
        return BloomFilter(spec)
    raise TypeError(
        f"make_filter: expected a CountAdmission or BloomAdmission, got {type(spec).__name__}"
    )
