"""One tiered table's host side: its id map, admission, eviction, host rows (`HostRows`)
and the device cache's slots, and the initial values of a row as a function of its key
(`keyed_rows`), so every process and every mesh creates the same rows."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..._hashing import mix64
from .._device_store import _name_hash, fill_rows, init_block_rows
from .._spec import (
    FeatureSpec,
    TableSpec,
    constant_init,
    normal_init,
    truncated_normal_init,
    uniform_init,
)
from ._admission import make_filter, merge_filter_states, owner_share
from ._host_rows import HostRows
from ._id_map import IdMap, unique_keys
from ._owners import OWNER_HASH, key_owner
from ._snapshot import TableSnapshot


class TieredInputError(ValueError):
    """A batch's ids for a tiered table are not valid (dtype, sign, range)."""


class CacheCapacityError(ValueError):
    """A batch needs more distinct rows of a table than its device cache holds."""


class DynamicTableFullError(ValueError):
    """A dynamic table at `max_rows` got new IDs and may not evict."""


class SavedTableMismatchError(ValueError):
    """A tiered table's saved host state is of another key space or key routing."""


class RestoreWarning(UserWarning):
    """A restore changed a dynamic table's state to fit this run: rows evicted past its
    max_rows (counted in the text), or Bloom admission counts that do not carry over to
    another process count."""


def _prefixed(arrays: Mapping, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _uniform01(keys: np.ndarray, dim: int, seed: int, stream: int) -> np.ndarray:
    """f32[n, dim] in [0, 1): a pure function of (seed, stream, key, column)."""
    base = mix64(keys.astype(np.uint64) ^ np.uint64(seed & (2**64 - 1)))
    cols = (np.arange(dim, dtype=np.uint64) + np.uint64(1 + stream * dim)) * _GOLDEN
    bits = mix64(base[:, None] + cols[None, :])
    return ((bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)).astype(np.float32)


def keyed_rows(init, keys: np.ndarray, dim: int, seed: int, scale_rows: int) -> np.ndarray:
    """Initial rows (f32[n, dim]) of new keys of a dynamic table: each a pure function of
    the table's seed and the key, so a key's row is the same whenever, and in whichever
    order, it is admitted. `scale_rows` stands for the vocabulary size of initializers
    whose default scale depends on it (TorchRec's U(+-sqrt(1/V)))."""
    n = keys.shape[0]
    shape = (scale_rows, dim)
    if isinstance(init, uniform_init):
        s = np.float32(init._bound(shape))
        return (_uniform01(keys, dim, seed, 0) * 2 - 1) * s
    if isinstance(init, (normal_init, truncated_normal_init)):
        std = np.float32(init._std(shape))
        z = _normal(keys, dim, seed, 0)
        if isinstance(init, truncated_normal_init):
            bad, stream = np.abs(z) > 2, 1
            while bad.any():
                rows = np.nonzero(bad.any(axis=1))[0]
                redraw = _normal(keys[rows], dim, seed, stream)
                z[rows] = np.where(bad[rows], redraw, z[rows])
                bad, stream = np.abs(z) > 2, stream + 1
        return z * std
    if isinstance(init, constant_init):
        return np.full((n, dim), init.value, np.float32)
    # any other initializer: a jax.random key folded from each key (one call per row)
    base = jax.random.key(seed & 0x7FFFFFFF)
    out = np.empty((n, dim), np.float32)
    for i, k in enumerate(keys.astype(np.uint64)):
        kk = jax.random.fold_in(
            jax.random.fold_in(base, int(k >> np.uint64(32))), int(k) & 0xFFFFFFFF
        )
        out[i] = np.asarray(init(kk, (1, dim), jnp.float32), np.float32)[0]
    return out


def _normal(keys, dim, seed, stream) -> np.ndarray:
    """Standard normals by Box-Muller over two keyed uniform streams."""
    u1 = _uniform01(keys, dim, seed, 2 * stream + 1)
    u2 = _uniform01(keys, dim, seed, 2 * stream + 2)
    r = np.sqrt(-2.0 * np.log1p(-u1))  # u1 in [0, 1): 1 - u1 in (0, 1]
    return (r * np.cos(2 * np.pi * u2)).astype(np.float32)


class _RowMeta:
    """Per-row metadata of a table as one record per row (count, last seen, key, cache
    slot, dirty): the few thousand rows a step touches are scattered over the table, so
    one cache line per row instead of one per array and row. Grows by doubling; each
    field is a `_Field` whose `.data` is a view of the records."""

    FIELDS = (
        ("count", np.int64, 0),  # times seen
        ("last_seen", np.int64, -1),  # step last seen
        ("key", np.int64, -1),  # a dynamic table's key (-1: free row)
        ("slot", np.int32, -1),  # cache slot, -1: not cached
        ("dirty", np.bool_, False),  # changed since the last save
    )

    def __init__(self):
        self.dtype = np.dtype([(n, t) for n, t, _ in self.FIELDS], align=True)
        self.records = self._new(1024)

    def _new(self, n: int) -> np.ndarray:
        rec = np.empty(n, self.dtype)
        for name, _, fill in self.FIELDS:
            rec[name] = fill
        return rec

    def ensure(self, n: int) -> None:
        if n > self.records.shape[0]:
            new = self._new(max(n, 2 * self.records.shape[0]))
            new[: self.records.shape[0]] = self.records
            self.records = new

    def field(self, name: str) -> _Field:
        return _Field(self, name)


class _Field:
    """One field of `_RowMeta`: `.data` is its current view (valid until it grows)."""

    def __init__(self, meta: _RowMeta, name: str):
        self.meta, self.name = meta, name

    @property
    def data(self) -> np.ndarray:
        return self.meta.records[self.name]


@dataclasses.dataclass
class TableStats:
    """Counters of one tiered table since the run (or the restore) started."""

    steps: int = 0
    lookups: int = 0  # ids looked up (padding excluded)
    unique_rows: int = 0  # distinct rows looked up, summed over steps
    hits: int = 0  # of those, already in the device cache
    rows_moved: int = 0  # rows loaded into the cache
    admitted: int = 0
    rejected: int = 0  # lookups of keys without a row (not yet admitted, or refused when full)
    evicted: int = 0


def bucket_size(n: int) -> int:
    """Padded size of an exchange: a few sizes only, so it compiles a few times."""
    return max(64, 1 << max(0, n - 1).bit_length())


def table_report(t: Mapping[str, int]) -> dict:
    """A tiered table's stats for logs and summary.json from its `HostTable.totals`."""
    steps = max(t["steps"], 1)
    out = {
        "rows_live": t["rows_live"],
        "cache_rows": t["cache_rows"],
        "admitted": t["admitted"],
        "rejected": t["rejected"],
        "evicted": t["evicted"],
        "lookups_per_step": t["lookups"] / steps,
        "rows_moved_per_step": t["rows_moved"] / steps,
        "cache_hit_rate": t["hits"] / t["unique_rows"] if t["unique_rows"] else None,
        "host_ram_bytes": t["host_ram_bytes"],
        "host_disk_bytes": t["host_disk_bytes"],
    }
    if "pending_admission" in t:
        out["pending_admission"] = t["pending_admission"]
    return out


def split_by_feature(values, inverse, names, sizes) -> dict[str, np.ndarray]:
    """`{feature: values[inverse] of its ids}`, padding (inverse -1) as -1: the per-key
    `values` of `HostTable.batch_keys`' distinct keys spread back over the features."""
    flat = np.append(values, np.asarray(-1, values.dtype))[inverse]
    out, start = {}, 0
    for f, n in zip(names, sizes, strict=True):
        out[f] = flat[start : start + n]
        start += n
    return out


class HostTable:
    """The host side of one tiered table (see the module docstring): all its keys, or
    (`owners` > 1) those of owner `owner` (`key_owner`), with `capacity` cache slots
    (default `spec.device_rows`) and its share of `max_rows`."""

    def __init__(
        self,
        spec: TableSpec,
        features: tuple[FeatureSpec, ...],
        *,
        key: str,
        owner: int = 0,
        owners: int = 1,
        capacity: int | None = None,
    ):
        self.spec, self.key, self.features = spec, key, features
        self.owner, self.owners = owner, owners
        self.dynamic = spec.dynamic is not None
        self.keyed = self.dynamic or owners > 1
        """Whether rows are found through a key map: a dynamic table's, or a static
        table's whose ids several owners share (each keeps its ids' rows only)."""
        # cache slots; slot `capacity` is the default row
        self.capacity = spec.device_rows if capacity is None else capacity
        max_rows = None if not self.dynamic else spec.dynamic.max_rows
        self.max_rows = None if max_rows is None else -(-max_rows // owners)
        """The rows this owner may hold: its share of `dynamic.max_rows` (None: any)."""
        self.slot_specs = tuple(spec.optimizer.slots())
        cache = spec.cache
        # blocks of 12-24 MiB: a call costs a little per block it touches, and each disk
        # block is one mapping (a process gets ~65k: vm.max_map_count), so a 1e8-row
        # table takes a few hundred; a static table smaller than that, one block its size
        row_bytes = spec.dim * jnp.dtype(spec.dtype).itemsize + sum(
            4 if s.per_row else 4 * spec.dim for s in self.slot_specs
        )
        big = 1 << max(12, ((24 << 20) // row_bytes).bit_length() - 1)
        disk = cache is not None and cache.disk_dir is not None
        if self.keyed:
            block_rows = big if disk else 1 << 16
        else:
            block_rows = min(big, 1 << max(10, (spec.vocab_size - 1).bit_length()))
        self.rows = HostRows(
            spec.name,
            spec.dim,
            jnp.dtype(spec.dtype),
            [(s.name, s.per_row, s.init) for s in self.slot_specs],
            # each owner's share of the table's RAM budget
            ram_bytes=None
            if cache is None or cache.ram_bytes is None
            else -(-cache.ram_bytes // owners),
            disk_dir=None if cache is None else cache.disk_dir,
            block_rows=block_rows,
        )
        self.policy = "lru" if cache is None else cache.policy
        self.meta = _RowMeta()
        self.count = self.meta.field("count")
        self.last_seen = self.meta.field("last_seen")
        self.dirty = self.meta.field("dirty")
        self.row_slot = self.meta.field("slot")
        self.slot_row = np.full(self.capacity, -1, np.int32)
        self.slot_used = np.zeros(self.capacity, np.int64)  # LRU: step last used
        self.free_slots = np.arange(self.capacity - 1, -1, -1, dtype=np.int32)  # a stack
        self._protect = np.zeros(self.capacity, np.bool_)  # slots a victim search skips
        self._cand = np.zeros(0, np.int64)  # victim candidates, lowest score first
        self._cand_score = np.zeros(0, np.int64)
        self._cand_pos = 0
        self.n_free_slots = self.capacity
        self.stats = TableStats()
        self.seed = 0
        if self.keyed:
            self.map = IdMap()
            self.row_keys = self.meta.field("key")
            self.free_rows = np.zeros(0, np.int64)
            self.high = 0  # rows ever allocated (the next fresh row)
        if self.dynamic:
            self.admission = make_filter(owner_share(spec.dynamic.admission, owners))
            self.tombstones: list[np.ndarray] = []
        elif not self.keyed:
            self.high = spec.vocab_size
            self.meta.ensure(self.high)
        self.default_reset = True  # the default row is (re)written at the next exchange
        self.default_values: tuple[np.ndarray, dict] | None = None  # trainable default row
        self._initial_default: tuple[np.ndarray, dict] | None = None

    # ---- initial values ----------------------------------------------------------------
    def init(self, layer_key: jax.Array) -> None:
        """Initial rows: a static table's all at once (those of its ids this owner owns),
        drawn exactly as the device store draws the same table; a dynamic table's per
        key at admission (from a seed)."""
        key_data = np.asarray(jax.random.key_data(layer_key)).ravel().tolist()
        mixed = 0
        for word in key_data:  # the layer key's words, then the table's name
            mixed = int(mix64(np.array([(mixed << 32 ^ word) & (2**64 - 1)], np.uint64))[0])
        self.seed = int(mix64(np.array([mixed ^ _name_hash(self.spec.name)], np.uint64))[0])
        if self.dynamic:
            return
        spec, v = self.spec, self.spec.vocab_size
        if not self.keyed:
            self.rows.ensure(v)
        dtype = jnp.dtype(spec.dtype)
        # drawn block by block as every store draws it (`fill_rows`: a pure function
        # of the key, the table's name and the row)
        chunk = init_block_rows(spec.dim) * 4
        for start in range(0, v, chunk):
            ids = np.arange(start, min(v, start + chunk))
            w = np.empty((ids.shape[0], spec.dim), dtype)
            fill_rows(layer_key, spec, start, w)
            if self.keyed:  # this owner's ids, in rows of their own
                mine = key_owner(ids, self.owners) == self.owner
                ids, w = ids[mine], w[mine]
            self._write_initial(self._rows_for(ids) if self.keyed else ids, w)

    def default_row(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(weights [D], {slot: value}) the default row is (re)written with: zeros and
        the slots' initial values, or the saved trainable row."""
        if self.default_values is not None and self.spec.dynamic is not None:
            if self.spec.dynamic.default_row == "trainable":
                return self.default_values
        if self._initial_default is None:
            slots = {k: v[0] for k, v in self._init_slots(1).items()}
            self._initial_default = (np.zeros(self.spec.dim, np.float32), slots)
        return self._initial_default

    def _write_initial(self, rows: np.ndarray, weights: np.ndarray) -> None:
        self.rows.scatter(rows, weights, self._init_slots(rows.shape[0]))

    def _init_slots(self, n: int) -> dict[str, np.ndarray]:
        d = self.spec.dim
        return {
            s.name: np.full((n,) if s.per_row else (n, d), s.init, np.float32)
            for s in self.slot_specs
        }

    # ---- ids -> rows -------------------------------------------------------------------
    def check_ids(self, feature: str, ids) -> np.ndarray:
        """The feature's ids as int64 (padding -1), or a one-line error naming it."""
        ids = np.asarray(ids)
        t = self.spec.name
        if self.dynamic:
            if ids.dtype == np.uint64:
                return ids.view(np.int64)
            if ids.dtype != np.int64:
                raise TieredInputError(
                    f"feature {feature!r} (dynamic table {t!r}): ids have dtype {ids.dtype}; "
                    f"raw IDs must be int64 or uint64"
                )
            if ids.shape[0] and ids.min() < -1:
                bad = ids < -1
                raise TieredInputError(
                    f"feature {feature!r} (dynamic table {t!r}): negative ID "
                    f"{int(ids[bad][0])}; raw IDs are >= 0 (-1 pads; missing values: "
                    f"MISSING_KEY)"
                )
            return ids
        if not np.issubdtype(ids.dtype, np.integer):
            raise TieredInputError(
                f"feature {feature!r} (table {t!r}): ids have dtype {ids.dtype}, not integers"
            )
        ids = ids.astype(np.int64, copy=False)
        if ids.shape[0] and (ids.min() < -1 or ids.max() >= self.spec.vocab_size):
            bad = (ids < -1) | (ids >= self.spec.vocab_size)
            raise TieredInputError(
                f"feature {feature!r} (table {t!r}): id {int(ids[bad][0])} is out of range "
                f"[0, {self.spec.vocab_size})"
            )
        return ids

    def _rows_of(self, uniq: np.ndarray, counts: np.ndarray, step: int, admit: bool) -> np.ndarray:
        """Rows of unique keys (-1: no row); with `admit`, new keys may get rows."""
        if not self.keyed:
            return uniq.copy()
        rows = self.map.lookup(uniq).astype(np.int64)
        if not self.dynamic:  # a static table's ids: this owner holds a row for each
            return rows
        if not admit:
            return rows
        new = np.nonzero(rows < 0)[0]
        if new.shape[0]:
            ok = self.admission.observe(uniq[new], counts[new])
            take = new[ok]
            if take.shape[0]:
                got = self._allocate(uniq[take], keep=rows[rows >= 0], step=step)
                rows[take[: got.shape[0]]] = got
        return rows

    def _allocate(self, keys: np.ndarray, *, keep: np.ndarray, step: int) -> np.ndarray:
        """Rows for newly admitted keys (fewer than asked only with when_full='default_row');
        rows of keys in `keep` (this batch's) are never evicted to make room."""
        dyn = self.spec.dynamic
        n = keys.shape[0]
        room = self.free_rows.shape[0] + (
            n if self.max_rows is None else max(0, self.max_rows - self.high)
        )
        if room < n:
            if dyn.when_full == "error":
                raise DynamicTableFullError(
                    f"dynamic table {self.spec.name!r} is full ({self.max_rows} rows, "
                    f"max_rows{self._per_owner()}) and {n} new IDs need rows; set "
                    f"dynamic.when_full to 'evict' or 'default_row', add an eviction "
                    f"policy, or raise max_rows"
                )
            if dyn.when_full == "evict":
                self._evict_to_make_room(n - room, keep)
                room = self.free_rows.shape[0] + max(0, self.max_rows - self.high)
            keys = keys[:room]
            n = keys.shape[0]
        rows = self._take_rows(n)
        # the default scale of U(+-sqrt(1/V)) with no V: max_rows, else the dim (as
        # DeepRec's 1/sqrt(dim)); never the cache size, which may change between runs
        scale_rows = dyn.max_rows or self.spec.dim
        w = keyed_rows(self.spec.initializer, keys, self.spec.dim, self.seed, scale_rows)
        self.rows.scatter(rows, w.astype(jnp.dtype(self.spec.dtype)), self._init_slots(n))
        self.map.insert(keys, rows.astype(np.int32))
        self.row_keys.data[rows] = keys
        self.count.data[rows] = 0
        self.last_seen.data[rows] = step
        self.dirty.data[rows] = True
        self.stats.admitted += n
        return rows

    def _take_rows(self, n: int) -> np.ndarray:
        """n rows for new keys: freed rows first (the last freed first), then fresh ones;
        the metadata and the host store grow to cover them."""
        reuse = min(n, self.free_rows.shape[0])
        rows = np.concatenate(
            [
                self.free_rows[self.free_rows.shape[0] - reuse :][::-1],
                np.arange(self.high, self.high + n - reuse, dtype=np.int64),
            ]
        )
        self.free_rows = self.free_rows[: self.free_rows.shape[0] - reuse]
        self.high += n - reuse
        self.meta.ensure(self.high)
        self.rows.ensure(self.high)
        return rows

    def _evict_to_make_room(self, need: int, keep: np.ndarray) -> None:
        """Evict the least frequently seen rows (ties: least recently) outside `keep`;
        a little more than needed, so a full table does not sort every step."""
        extra = max(need, (self.max_rows or 0) // 100)
        k = min(len(self.map) - keep.shape[0], extra)  # `keep`: live rows
        if k < need:
            raise DynamicTableFullError(
                f"dynamic table {self.spec.name!r}: one batch needs {need} more rows than "
                f"max_rows={self.max_rows}{self._per_owner()} leaves after its own rows"
            )
        self.evict_rows(self._least_used(k, keep))

    def _least_used(self, k: int, keep: np.ndarray) -> np.ndarray:
        """The `k` live rows outside `keep` seen least often (ties: least recently);
        one int64 score, an O(n) select."""
        live = np.nonzero(self.row_keys.data[: self.high] >= 0)[0]
        live = live[~np.isin(live, keep)]
        score = (np.minimum(self.count.data[live], 2**31 - 1) << 32) + (
            self.last_seen.data[live] + 1
        )
        pick = np.argpartition(score, k - 1)[:k] if k < live.shape[0] else np.arange(k)
        return live[pick]

    def _per_owner(self) -> str:
        if self.owners == 1:
            return ""
        return f" (process {self.owner} of {self.owners}'s share of {self.spec.dynamic.max_rows})"

    def evict_rows(self, rows: np.ndarray) -> None:
        """Remove rows' keys (tombstoned for the next save); rows and slots are reused."""
        if rows.shape[0] == 0:
            return
        keys = self.row_keys.data[rows]
        self.map.erase(keys)
        self.admission.forget(keys)
        self.tombstones.append(keys.copy())
        slots = self.row_slot.data[rows]
        cached = slots >= 0
        self._free_slots(slots[cached])
        self.row_slot.data[rows] = -1
        self.row_keys.data[rows] = -1
        self.dirty.data[rows] = False
        self.count.data[rows] = 0
        self.last_seen.data[rows] = -1
        self.free_rows = np.concatenate([self.free_rows, rows.astype(np.int64)])
        self.stats.evicted += rows.shape[0]

    def _free_slots(self, slots: np.ndarray) -> None:
        self.slot_row[slots] = -1
        n = slots.shape[0]
        self.free_slots[self.n_free_slots : self.n_free_slots + n] = slots
        self.n_free_slots += n

    # ---- rows -> cache slots -----------------------------------------------------------
    def _check_capacity(self, distinct: int) -> None:
        if distinct > self.capacity and self.owners > 1:
            raise CacheCapacityError(
                f"table {self.spec.name!r}: one batch looks up {distinct} distinct rows "
                f"that process {self.owner} owns, but its part of the device cache "
                f"holds {self.capacity} (of cache.rows={self.spec.device_rows} over "
                f"{self.owners} processes); raise cache.rows or use smaller batches"
            )
        if distinct > self.capacity:
            raise CacheCapacityError(
                f"table {self.spec.name!r}: one batch looks up {distinct} distinct rows "
                f"but its device cache holds {self.capacity} (cache.rows); raise cache.rows "
                f"to at least {distinct} or use smaller batches"
            )

    def place(self, rows: np.ndarray, step: int):
        """Cache slots of distinct `rows` (all >= 0), loading misses: returns
        `(slots, load_slots, load_rows, old_rows)`: `load_rows` go into `load_slots`,
        whose previous rows `old_rows` (-1: the slot was free) leave the cache."""
        self._check_capacity(rows.shape[0])
        slots = self.row_slot.data[rows]
        hit = slots >= 0
        if self.policy == "lru":
            self.slot_used[slots[hit]] = step
        miss = np.nonzero(~hit)[0]
        n = miss.shape[0]
        take = min(n, self.n_free_slots)
        load_slots = np.empty(n, np.int32)
        load_slots[:take] = self.free_slots[self.n_free_slots - take : self.n_free_slots]
        self.n_free_slots -= take
        if n > take:
            # neither a slot the batch hits nor one it just took may be a victim
            keep = np.concatenate([slots[hit], load_slots[:take]])
            load_slots[take:] = self._victims(n - take, keep, step)
        old = self.slot_row[load_slots].astype(np.int64)
        self.row_slot.data[old[old >= 0]] = -1
        load_rows = rows[miss]
        self.slot_row[load_slots] = load_rows
        self.row_slot.data[load_rows] = load_slots
        if self.policy == "lru":
            self.slot_used[load_slots] = step
        slots[miss] = load_slots
        return slots, load_slots, load_rows, old

    def _scores(self, slots: np.ndarray) -> np.ndarray:
        """Eviction order of slots (lowest first): step last used (LRU) or the times
        its row was seen (LFU)."""
        if self.policy == "lru":
            return self.slot_used[slots]
        return self.count.data[np.maximum(self.slot_row[slots], 0)]

    def _victims(self, k: int, keep: np.ndarray, step: int) -> np.ndarray:
        """k occupied slots outside `keep` (the batch's), lowest score first.

        A sorted list of the lowest-scored slots (a sixteenth of the cache, or more) is
        computed once and consumed across steps: a candidate whose score changed since
        (used again, or reloaded) or that the batch keeps is skipped. Scores only grow,
        so what remains are still the lowest of the cache (exactly LRU; LFU up to rows
        loaded since the list was made), at O(k) per step instead of O(cache)."""
        protect = self._protect
        protect[keep] = True
        out = []
        while k > 0:
            if self._cand_pos >= self._cand.shape[0]:
                self._refresh_candidates(k)
            c = self._cand[self._cand_pos : self._cand_pos + 2 * k]
            ok = (
                (self._scores(c) == self._cand_score[self._cand_pos : self._cand_pos + c.shape[0]])
                & ~protect[c]
                & (self.slot_row[c] >= 0)
            )
            good = np.nonzero(ok)[0][:k]
            out.append(c[good])
            protect[c[good]] = True  # a refresh below must not offer them again
            k -= good.shape[0]
            self._cand_pos += int(good[-1]) + 1 if k == 0 else c.shape[0]
        victims = np.concatenate(out).astype(np.int32)
        protect[keep] = False
        protect[victims] = False
        return victims

    def _refresh_candidates(self, k: int) -> None:
        occupied = np.nonzero((self.slot_row >= 0) & ~self._protect)[0]
        if occupied.shape[0] < k:  # place() checked the batch fits: this is a bug
            raise AssertionError(f"table {self.spec.name!r}: {k} victims needed, none left")
        score = self._scores(occupied)
        n = min(occupied.shape[0], max(2 * k, self.capacity // 16))
        part = np.argpartition(score, n - 1)[:n] if n < occupied.shape[0] else np.arange(n)
        order = part[np.argsort(score[part], kind="stable")]
        self._cand, self._cand_score, self._cand_pos = occupied[order], score[order], 0

    # ---- one batch ----------------------------------------------------------------------
    def batch_keys(self, ids_by_feature: Mapping[str, np.ndarray]):
        """`(names, sizes, uniq, inverse, counts)` of a batch's ids of this table: the
        features, their id counts, and `unique_keys` of all their ids (checked)."""
        names = list(ids_by_feature)
        checked = [self.check_ids(f, ids_by_feature[f]) for f in names]
        keys = np.concatenate(checked) if checked else np.zeros(0, np.int64)
        return (names, [c.shape[0] for c in checked], *unique_keys(keys))

    def map_batch(self, ids_by_feature: Mapping[str, np.ndarray], step: int, *, train: bool):
        """Slot ids per feature, and `(load_slots, load_rows, old_rows)` of the cache
        exchange (`map_keys`)."""
        names, sizes, uniq, inverse, counts = self.batch_keys(ids_by_feature)
        slots, *moves = self.map_keys(uniq, counts, step, train=train)
        return split_by_feature(slots, inverse, names, sizes), *moves

    def map_keys(self, uniq: np.ndarray, counts: np.ndarray, step: int, *, train: bool):
        """`(slots, load_slots, load_rows, old_rows)`: the cache slot of each of the
        distinct keys `uniq` (seen `counts` times; slot `capacity`, the default row, for a
        key without a row), and the cache exchange: `load_rows` go into `load_slots`,
        whose rows `old_rows` (-1: none) are written back.

        Train: new keys may be admitted, counts and last-seen updated, the cache
        changed. Eval: nothing changes; rows outside the cache are placed (for this
        batch only) in slots the batch does not use, returned as the loads."""
        rows = self._rows_of(uniq, counts, step, admit=train)
        has = rows >= 0
        r = rows[has]
        if train:
            self.count.data[r] += counts[has]
            self.last_seen.data[r] = step
            self.dirty.data[r] = True
            st = self.stats
            st.steps += 1
            st.lookups += int(counts.sum())
            st.rejected += int(counts[~has].sum())
            st.unique_rows += r.shape[0]
            slots, load_slots, load_rows, old_rows = self.place(r, step)
            st.hits += r.shape[0] - load_rows.shape[0]
            st.rows_moved += load_rows.shape[0]
        else:
            slots, load_slots, load_rows = self._place_for_eval(r)
            old_rows = np.full(load_slots.shape[0], -1, np.int64)
        out = np.full(uniq.shape[0], self.capacity, np.int32)  # no row: the default row
        out[has] = slots
        return out, load_slots, load_rows, old_rows

    def _place_for_eval(self, rows: np.ndarray):
        self._check_capacity(rows.shape[0])
        slots = self.row_slot.data[rows].copy()
        miss = np.nonzero(slots < 0)[0]
        if miss.shape[0] == 0:
            return slots, np.zeros(0, np.int32), np.zeros(0, np.int64)
        used = np.zeros(self.capacity, np.bool_)
        used[slots[slots >= 0]] = True
        spare = np.nonzero(~used)[0][: miss.shape[0]].astype(np.int32)
        slots[miss] = spare
        return slots, spare, rows[miss]

    # ---- eviction policy -----------------------------------------------------------------
    def expired_rows(self, step: int, norms=None) -> np.ndarray:
        """Live rows the eviction policy removes now (TTL; norm when `norms` given)."""
        ev = self.spec.dynamic.eviction
        live = np.nonzero(self.row_keys.data[: self.high] >= 0)[0]
        out = np.zeros(live.shape[0], np.bool_)
        if ev.ttl_steps is not None:
            out |= self.last_seen.data[live] < step - ev.ttl_steps
        if ev.min_norm is not None and norms is not None:
            out |= norms(live) < ev.min_norm
        return live[out]

    # ---- checkpoints ---------------------------------------------------------------------
    def live_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, keys) of every row holding a key (a static table: all, keyed by id)."""
        if not self.keyed:
            rows = np.arange(self.high, dtype=np.int64)
            return rows, rows
        rows = np.nonzero(self.row_keys.data[: self.high] >= 0)[0]
        return rows, self.row_keys.data[rows]

    def snapshot(self, step: int, incremental: bool) -> TableSnapshot:
        """The host state (current: flush the cache first); `incremental`: the rows changed
        since the last `mark_saved`, and the keys evicted since."""
        rows, keys = self.live_rows()
        if incremental:
            keep = self.dirty.data[rows]
            rows, keys = rows[keep], keys[keep]
        w, slots = self.rows.gather(rows)
        arrays = {
            "keys": keys.astype(np.int64),
            "weights": w,
            "count": self.count.data[rows].copy(),
            "last_seen": self.last_seen.data[rows].copy(),
            **{f"slot/{k}": v for k, v in slots.items()},
        }
        if self.dynamic:
            tomb = np.concatenate(self.tombstones) if self.tombstones else np.zeros(0, np.int64)
            arrays["tombstones"] = tomb if incremental else np.zeros(0, np.int64)
            arrays |= {f"admission/{k}": v for k, v in self.admission.state().items()}
        if self.default_values is not None:
            dw, ds = self.default_values
            arrays["default/weights"] = dw
            arrays |= {f"default/slot/{k}": v for k, v in ds.items()}
        meta = {
            "table": self.spec.name,
            "dim": self.spec.dim,
            "dtype": self.spec.dtype,
            "dynamic": self.dynamic,
            "owner": self.owner,
            "owners": self.owners,
            "owner_hash": OWNER_HASH,
            "seed": str(self.seed),
            "stats": dataclasses.asdict(self.stats),
        }
        return TableSnapshot("delta" if incremental else "full", step, arrays, meta)

    def mark_saved(self) -> None:
        self.dirty.data[:] = False
        if self.dynamic:
            self.tombstones = []

    def restore(self, chain: list[TableSnapshot]) -> None:
        """Rebuild from the snapshots of each process that saved the table (one: its
        full snapshot and its deltas, in order; several: one such chain after another),
        keeping the keys this owner owns (`key_owner`); the cache starts empty. Stats
        add up over the savers and are shared among the owners (their sum is kept).

        Raises:
          SavedTableMismatchError: a snapshot of another key space (dynamic or not, dim)
            or whose keys were routed by another hash.
          DynamicTableFullError: this owner gets more rows than its share of max_rows
            and `when_full` is "error" (otherwise the least used are evicted, with a
            warning that counts them).
        """
        self.__init__(
            self.spec,
            self.features,
            key=self.key,
            owner=self.owner,
            owners=self.owners,
            capacity=self.capacity,
        )
        if not self.keyed:  # every row of a static table is in the full save
            self.rows.ensure(self.spec.vocab_size)
        if chain[0].kind != "full":
            raise ValueError(f"table {self.spec.name!r}: a restore chain starts with a full save")
        admission, stats, savers = {}, [], 1
        for snap in chain:
            if snap.kind == "full":  # a saver's chain starts
                self._check_saved(snap.meta)
                savers = int(snap.meta.get("owners", 1))
                saver = int(snap.meta.get("owner", 0))
                self.seed = int(snap.meta["seed"])
                stats.append({})
            a = self._owned(snap.arrays)
            slots = {k[len("slot/") :]: v for k, v in a.items() if k.startswith("slot/")}
            if self.dynamic:
                if a["tombstones"].shape[0]:
                    rows = self.map.lookup(a["tombstones"])
                    self.evict_rows(rows[rows >= 0].astype(np.int64))
                rows = self._rows_for(a["keys"])
                admission[saver] = _prefixed(a, "admission/")
            else:
                rows = self._rows_for(a["keys"]) if self.keyed else a["keys"]
            self.rows.scatter(rows, a["weights"], slots)
            self.count.data[rows] = a["count"]
            self.last_seen.data[rows] = a["last_seen"]
            if "default/weights" in a:
                self.default_values = (a["default/weights"], _prefixed(a, "default/slot/"))
            stats[-1] = snap.meta.get("stats", {})
        if self.dynamic:
            self._load_admission(admission, savers)
            self.tombstones = []  # the evictions replayed above are in the chain already
        self.stats = self._share(stats)
        self._fit_max_rows()

    def _load_admission(self, states: dict[int, dict], savers: int) -> None:
        """The admission counts of this owner's keys from `states` (each saver's last):
        on as many processes as saved them, its own saver's; on another count, exact
        counts gathered from every saver; a Bloom filter's (each owner's filter is its
        share of the counters) do not carry over."""
        if savers == self.owners:
            if self.owner in states:
                self.admission.load_state(states[self.owner])
            return
        state = merge_filter_states(list(states.values()))
        if "counters" in state and self.admission.min_count > 1:
            warnings.warn(
                f"dynamic table {self.spec.name!r}: its Bloom admission counts were kept "
                f"by {savers} process(es) and do not carry over to {self.owners}; keys "
                f"not yet admitted count again from zero",
                RestoreWarning,
                stacklevel=3,
            )
            return
        if state:
            self.admission.load_state(state)

    def _check_saved(self, meta: Mapping) -> None:
        name = self.spec.name
        saved_hash = meta.get("owner_hash", OWNER_HASH)
        if saved_hash != OWNER_HASH:
            raise SavedTableMismatchError(
                f"table {name!r}: the checkpoint's keys were routed to processes by "
                f"{saved_hash!r}, this version routes them by {OWNER_HASH!r}; restore it "
                f"with the sparsejax version that saved it"
            )
        if bool(meta.get("dynamic", self.dynamic)) != self.dynamic:
            was, now = ("raw 64-bit keys", "row ids")[:: 1 if self.dynamic is False else -1]
            raise SavedTableMismatchError(
                f"table {name!r}: the checkpoint keys it by {was}, this run by {now} "
                f"(dynamic is {self.dynamic} now); its keys cannot carry over"
            )
        if int(meta.get("dim", self.spec.dim)) != self.spec.dim:
            raise SavedTableMismatchError(
                f"table {name!r}: the checkpoint's rows have dim {meta['dim']}, this run's "
                f"{self.spec.dim}"
            )

    def _owned(self, arrays: Mapping) -> Mapping:
        """`arrays` of a snapshot without the keys another owner owns."""
        if self.owners == 1:
            return arrays
        mine = key_owner(arrays["keys"], self.owners) == self.owner
        out = {}
        for k, v in arrays.items():
            if k == "tombstones":
                v = v[key_owner(v, self.owners) == self.owner]
            elif k in ("admission/keys", "admission/counts"):
                v = v[key_owner(arrays["admission/keys"], self.owners) == self.owner]
            elif not k.startswith(("admission/", "default/")):  # one entry per key
                v = v[mine]
            out[k] = v
        return out

    def _rows_for(self, keys: np.ndarray) -> np.ndarray:
        """Host rows of `keys`, new ones taken for keys without one."""
        rows = self.map.lookup(keys).astype(np.int64)
        new = rows < 0
        if new.any():
            got = self._take_rows(int(new.sum()))
            self.map.insert(keys[new], got.astype(np.int32))
            self.row_keys.data[got] = keys[new]
            rows[new] = got
        return rows

    def _share(self, stats: list[Mapping]) -> TableStats:
        """This owner's part of the savers' summed stats (the owners' parts add up)."""
        out = TableStats(steps=max(int(s.get("steps", 0)) for s in stats))
        for f in dataclasses.fields(TableStats):
            if f.name != "steps":  # every owner counts every step
                total = sum(int(s.get(f.name, 0)) for s in stats)
                setattr(out, f.name, total // self.owners + (self.owner < total % self.owners))
        return out

    def _fit_max_rows(self) -> None:
        """After a restore: evict the least used rows past this owner's share of
        max_rows (a restore on fewer processes, or an uneven split), with a warning
        that counts them, or refuse when `when_full` is "error"."""
        live = len(self.map) if self.dynamic else 0
        if self.max_rows is None or live <= self.max_rows:
            return
        over = live - self.max_rows
        if self.spec.dynamic.when_full == "error":
            raise DynamicTableFullError(
                f"dynamic table {self.spec.name!r}: the checkpoint gives it {live} rows, "
                f"{over} over max_rows={self.max_rows}{self._per_owner()}; raise "
                f"max_rows, or set "
                f"dynamic.when_full to 'evict' to drop the least used"
            )
        self.evict_rows(self._least_used(over, np.zeros(0, np.int64)))
        warnings.warn(
            f"dynamic table {self.spec.name!r}: evicted the {over} least used of its {live} "
            f"restored rows to fit max_rows={self.max_rows}{self._per_owner()}",
            RestoreWarning,
            stacklevel=2,
        )

    def totals(self) -> dict[str, int]:
        """Counters of the table since the run (or the restore) started, and its rows
        and bytes now: numbers that add up over a table's owners (`steps` excepted:
        every owner counts every step)."""
        out = {
            **dataclasses.asdict(self.stats),
            "rows_live": len(self.map) if self.keyed else self.spec.vocab_size,
            "cache_rows": self.capacity,
            "host_ram_bytes": int(self.rows.ram_bytes_used),
            "host_disk_bytes": int(self.rows.disk_bytes_used),
        }
        if self.dynamic:
            out["pending_admission"] = int(self.admission.pending)
        return out

    def report(self) -> dict:
        """Stats for logs and summary.json (`table_report` of `totals`)."""
        return table_report(self.totals())
