"""Table and feature specs: what a user declares; everything else is derived from them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import COMBINERS
from ..ops.optimizers import RowWiseAdagrad, SparseOptimizer
from ._compose import Composition

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]
DTYPES = ("float32", "bfloat16")
PLACEMENTS = (
    "device",
    "host",
    "replicated",
    "table_wise",
    "column_wise",
    "table_row_wise",
    "row_wise",
)
"""Where a table lives: "device" (whole on every device of the mesh, the single-device
store), "host" (in host memory, looked up and updated by the host's CPU beside a dense
network on the devices; `HybridTableStore`) or a placement of `sparsejax.sharding`
(see `sparsejax.sharding._placement`)."""
FILL_CHUNK_ELEMENTS = 1 << 18
"""Elements drawn at a time by `uniform_init.fill` (1 MiB of float32)."""


class _HostInit:
    """`host` from `fill`: an initializer that draws with numpy (see `uniform_init`)."""

    def host(self, rng: np.random.Generator, shape, dtype) -> np.ndarray:
        """The same distribution drawn by numpy into a new array (see `fill`)."""
        out = np.empty(shape, dtype)
        self.fill(rng, out)
        return out


@dataclasses.dataclass(frozen=True)
class uniform_init(_HostInit):  # noqa: N801 - used like a function: uniform_init(0.01)
    """U(-scale, scale); scale=None gives TorchRec's default sqrt(1 / vocab_size).

    A frozen dataclass rather than a closure, so equal specs compare (and hash) equal.
    """

    scale: float | None = None

    def _bound(self, shape) -> float:
        return math.sqrt(1.0 / shape[0]) if self.scale is None else self.scale

    def __call__(self, key, shape, dtype):
        s = self._bound(shape)
        return jax.random.uniform(key, shape, jnp.float32, -s, s).astype(dtype)

    def fill(self, rng: np.random.Generator, out: np.ndarray) -> None:
        """Draw the same distribution with numpy into `out` (`[V, D]`, the storage
        dtype), in place and in chunks: no XLA compile per table shape (~0.3 s each on
        CPU) and no float64 or full-size temporary, so a table's init peaks at its own
        size. The values depend on `rng`'s state only, not on the chunking."""
        s = np.float32(self._bound(out.shape))

        def draw(buf):
            rng.random(dtype=np.float32, out=buf)
            buf *= 2 * s
            buf -= s

        _fill_chunks(out, draw)


def _fill_chunks(out: np.ndarray, draw) -> None:
    """Fill `out` (`[V, D]`, any float dtype) in row chunks of about
    `FILL_CHUNK_ELEMENTS`: `draw(buf)` writes float32 values into `buf` in place."""
    rows = max(1, FILL_CHUNK_ELEMENTS // max(1, out.shape[1]))
    direct = out.dtype == np.float32
    tmp = None if direct else np.empty((min(rows, out.shape[0]), out.shape[1]), np.float32)
    for start in range(0, out.shape[0], rows):
        chunk = out[start : start + rows]
        buf = chunk if direct else tmp[: len(chunk)]
        draw(buf)
        if not direct:
            chunk[...] = buf


def _default_stddev(shape) -> float:
    return 1.0 / math.sqrt(shape[1])


@dataclasses.dataclass(frozen=True)
class normal_init(_HostInit):  # noqa: N801 - used like a function: normal_init(0.01)
    """N(0, stddev^2); stddev=None gives 1/sqrt(dim) (TensorFlow's embedding default)."""

    stddev: float | None = None

    def _std(self, shape) -> float:
        return _default_stddev(shape) if self.stddev is None else self.stddev

    def __call__(self, key, shape, dtype):
        return (self._std(shape) * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    def fill(self, rng: np.random.Generator, out: np.ndarray) -> None:
        """Draw with numpy into `out`, in chunks (as `uniform_init.fill`)."""
        s = np.float32(self._std(out.shape))

        def draw(buf):
            rng.standard_normal(dtype=np.float32, out=buf)
            buf *= s

        _fill_chunks(out, draw)


@dataclasses.dataclass(frozen=True)
class truncated_normal_init(_HostInit):  # noqa: N801
    """N(0, stddev^2) truncated to +-2 stddev (redrawn beyond), as TensorFlow's
    `truncated_normal` and `jax.random.truncated_normal(-2, 2) * stddev`; stddev=None gives
    1/sqrt(dim) (TensorFlow's embedding_column default)."""

    stddev: float | None = None

    def _std(self, shape) -> float:
        return _default_stddev(shape) if self.stddev is None else self.stddev

    def __call__(self, key, shape, dtype):
        x = jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
        return (self._std(shape) * x).astype(dtype)

    def fill(self, rng: np.random.Generator, out: np.ndarray) -> None:
        """Draw with numpy into `out`, in chunks, redrawing values beyond 2 (standard)."""
        s = np.float32(self._std(out.shape))

        def draw(buf):
            rng.standard_normal(dtype=np.float32, out=buf)
            bad = np.abs(buf) > 2
            while bad.any():
                buf[bad] = rng.standard_normal(int(bad.sum()), dtype=np.float32)
                bad = np.abs(buf) > 2
            buf *= s

        _fill_chunks(out, draw)


@dataclasses.dataclass(frozen=True)
class constant_init(_HostInit):  # noqa: N801 - used like a function: constant_init(0.0)
    """Every weight `value` (zeros by default: e.g. first-order / linear tables)."""

    value: float = 0.0

    def __call__(self, key, shape, dtype):
        del key
        return jnp.full(shape, self.value, dtype)

    def fill(self, rng: np.random.Generator, out: np.ndarray) -> None:
        del rng
        out[...] = self.value


def _positive_int(owner: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")


MISSING_KEY = (1 << 63) - 1
"""The raw key of a missing value (an empty field) in a dynamic table: a key of its own,
so "missing" gets one row like any other value."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountAdmission:
    """A new ID gets a trainable row once seen `min_count` times (exact counts of the IDs
    not yet admitted, kept on the host); until then it reads the default row and
    receives no update. `min_count=1` admits every ID at first sight."""

    min_count: int = 1

    def __post_init__(self):
        _positive_int("CountAdmission", "min_count", self.min_count)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BloomAdmission:
    """A new ID gets a row once a counting Bloom filter has seen it `min_count` times:
    memory bounded by `counters` (one byte each) whatever the ID space. A false
    positive admits an ID early (at most as often as `hashes` colliding counters
    allow), never late."""

    min_count: int = 2
    counters: int = 1 << 24
    """Counters of the filter (bytes of memory); ~10x the distinct IDs seen keeps false
    positives rare."""
    hashes: int = 3

    def __post_init__(self):
        for name in ("min_count", "counters", "hashes"):
            _positive_int("BloomAdmission", name, getattr(self, name))
        if self.min_count > 255:
            raise ValueError(f"BloomAdmission: `min_count` must be <= 255, got {self.min_count}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eviction:
    """Which IDs lose their rows (and optimizer slots, reused by new IDs). Runs every
    `every_steps` steps and before every checkpoint."""

    ttl_steps: int | None = None
    """Evict IDs not seen for this many steps (None: never by age)."""
    min_norm: float | None = None
    """Evict IDs whose row's L2 norm is below this (None: never by norm)."""
    every_steps: int = 1000
    """Steps between runs of the policy."""

    def __post_init__(self):
        if self.ttl_steps is not None:
            _positive_int("Eviction", "ttl_steps", self.ttl_steps)
        _positive_int("Eviction", "every_steps", self.every_steps)
        if self.min_norm is not None and not self.min_norm >= 0:
            raise ValueError(f"Eviction: `min_norm` must be >= 0, got {self.min_norm!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicVocab:
    """A table keyed by raw int64/uint64 IDs: rows are created while training runs
    (admission), and reused after eviction; no vocabulary size, no hash collisions."""

    max_rows: int | None = None
    """Rows at most (None: unbounded, limited by host memory and disk)."""
    admission: CountAdmission | BloomAdmission = dataclasses.field(default_factory=CountAdmission)
    eviction: Eviction | None = None
    default_row: Literal["zeros", "trainable"] = "zeros"
    """What IDs without a row read: zeros (never updated), or one shared trainable row."""
    when_full: Literal["error", "evict", "default_row"] = "error"
    """A new ID at `max_rows`: "error" (naming the table), "evict" the least frequently
    seen IDs not in the batch (ties: least recently seen), or read the default row."""

    def __post_init__(self):
        if self.max_rows is not None:
            _positive_int("DynamicVocab", "max_rows", self.max_rows)
        if not isinstance(self.admission, (CountAdmission, BloomAdmission)):
            raise TypeError(
                "DynamicVocab: `admission` must be a CountAdmission or BloomAdmission, "
                f"got {type(self.admission).__name__}"
            )
        if self.default_row not in ("zeros", "trainable"):
            raise ValueError(
                "DynamicVocab: `default_row` must be 'zeros' or 'trainable', "
                f"got {self.default_row!r}"
            )
        if self.when_full not in ("error", "evict", "default_row"):
            raise ValueError(
                "DynamicVocab: `when_full` must be 'error', 'evict' or 'default_row', "
                f"got {self.when_full!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostCache:
    """Tiered storage: every row and optimizer slot in a host store (RAM, then a
    memory-mapped file once `ram_bytes` is used), the hot rows in a device cache of
    `rows` rows, exchanged between steps, overlapped with the device step."""

    rows: int
    """Rows of the device cache (the device memory the table takes, whatever its size)."""
    policy: Literal["lru", "lfu"] = "lru"
    """Which cached rows make room for a batch's misses (never a row the batch uses)."""
    ram_bytes: int | None = None
    """Host RAM for the table's rows and slots (None: unbounded); beyond it rows go to
    `disk_dir`."""
    disk_dir: str | None = None
    """Directory of the disk tier (needed when `ram_bytes` is set)."""

    def __post_init__(self):
        _positive_int("HostCache", "rows", self.rows)
        if self.policy not in ("lru", "lfu"):
            raise ValueError(f"HostCache: `policy` must be 'lru' or 'lfu', got {self.policy!r}")
        if self.ram_bytes is not None:
            _positive_int("HostCache", "ram_bytes", self.ram_bytes)
            if self.disk_dir is None:
                raise ValueError("HostCache: `ram_bytes` needs a `disk_dir` for the rows beyond it")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One embedding table. Several features may share it (`FeatureSpec.table`)."""

    name: str
    """Unique name; checkpoints store the table under it."""
    vocab_size: int | None = None
    """Rows. Ids of its features must lie in `[0, vocab_size)`. None for a dynamic table."""
    dim: int
    """Row width."""
    dtype: str = "float32"
    """Storage dtype of the weights, "float32" or "bfloat16" (slots are always f32)."""
    initializer: Initializer = dataclasses.field(default_factory=uniform_init)
    """`init(key, shape, dtype)`; default U(+-sqrt(1/vocab_size)) as in TorchRec (a
    dynamic table: `dynamic.max_rows` for vocab_size, else U(+-sqrt(1/dim))). A dynamic
    table draws each new key's row from the table's seed and the key alone."""
    optimizer: SparseOptimizer = dataclasses.field(
        default_factory=lambda: RowWiseAdagrad(learning_rate=0.01)
    )
    """Sparse optimizer for this table's touched rows."""
    placement: str = "device"
    """Where the table lives (`PLACEMENTS`): "device", the whole table on every device;
    "host", in host memory, looked up and updated by the host's CPU;
    or a placement on a ("data", "model") mesh ("replicated", "table_wise",
    "column_wise", "table_row_wise", "row_wise"), served by `sparsejax.sharding`."""
    dynamic: DynamicVocab | None = None
    """Keyed by raw 64-bit IDs, rows created while training (None: ids in [0, vocab_size))."""
    cache: HostCache | None = None
    """Rows in a host store with a device cache (None: the whole table on the device;
    a dynamic table without a cache keeps `dynamic.max_rows` rows on the device)."""
    compose: Composition | None = None
    """Stored as smaller tables whose rows combine per id (quotient-remainder or
    multi-hash; `sparsejax.embedding.Composition`); None: one `[vocab_size, dim]` table."""

    def __post_init__(self):
        owner = f"TableSpec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableSpec: `name` must be a non-empty str, got {self.name!r}")
        if self.dynamic is None:
            _positive_int(owner, "vocab_size", self.vocab_size)
        elif self.vocab_size is not None:
            raise ValueError(
                f"{owner}: a dynamic table has no `vocab_size` (got {self.vocab_size}); "
                f"bound it with dynamic.max_rows"
            )
        elif self.cache is None and self.dynamic.max_rows is None:
            raise ValueError(
                f"{owner}: a dynamic table needs a device size: set cache=HostCache(rows=...) "
                f"or dynamic.max_rows"
            )
        _positive_int(owner, "dim", self.dim)
        limit = 2**31 - 1 if self.is_tiered else 2**31  # a tiered table adds its default row
        # a static row-split table may have any number of rows: each shard's stay int32
        # (the sharded store refuses a shard of 2**31 rows or more, naming the devices
        # it needs); "device", the default, may still be placed so (by the planner), and
        # the device store refuses it otherwise
        split = self.placement in ("device", "row_wise", "table_row_wise") and not self.is_tiered
        if self.device_rows >= limit and not split:
            raise ValueError(
                f"{owner}: {self.device_rows} device rows exceed the int32 row "
                f"ids of the batches and kernels (< {limit}); key it by raw 64-bit ids "
                f"(dynamic=DynamicVocab(...)) with a device cache"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"{owner}: `dtype` must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.optimizer, SparseOptimizer):
            raise TypeError(
                f"{owner}: `optimizer` must be a sparsejax SparseOptimizer, "
                f"got {type(self.optimizer).__name__}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"{owner}: `placement` must be one of {PLACEMENTS}, got {self.placement!r}"
            )
        if self.dynamic is not None and not isinstance(self.dynamic, DynamicVocab):
            raise TypeError(f"{owner}: `dynamic` must be a DynamicVocab or None")
        if self.cache is not None and not isinstance(self.cache, HostCache):
            raise TypeError(f"{owner}: `cache` must be a HostCache or None")
        if self.compose is not None:
            if not isinstance(self.compose, Composition):
                raise TypeError(f"{owner}: `compose` must be a Composition or None")
            if self.is_tiered:
                raise ValueError(
                    f"{owner}: compose does not apply to a dynamic or host-cached table "
                    f"(its ids are raw keys); store it whole or make it static"
                )
            self.compose.part_rows(self.vocab_size, self.dim, self.name)  # refuses oversize

    @property
    def is_tiered(self) -> bool:
        """Whether a host side manages the table (dynamic keys or a device cache)."""
        return self.dynamic is not None or self.cache is not None

    @property
    def device_rows(self) -> int:
        """Rows the device holds: the cache, else `dynamic.max_rows`, else the vocabulary."""
        if self.cache is not None:
            return self.cache.rows
        if self.dynamic is not None:
            return self.dynamic.max_rows
        return self.vocab_size

    def device_view(self, rows: int | None = None) -> TableSpec:
        """The table the device store holds for a tiered table: `device_rows` slots plus
        one last row, the default row (zeros; or the shared trainable row), all filled by
        the host side; `rows` (when several processes own its keys: their
        `OwnerLayout.view_rows`) instead of `device_rows + 1`. A plain table is its own
        view."""
        if not self.is_tiered:
            return self
        return TableSpec(
            name=self.name,
            vocab_size=self.device_rows + 1 if rows is None else rows,
            dim=self.dim,
            dtype=self.dtype,
            initializer=constant_init(0.0),
            optimizer=self.optimizer,
            placement=self.placement,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSpec:
    """One sparse input feature: which table it reads and how its ids are pooled."""

    name: str
    """Key of the feature in `SparseBatch.features` and in the layer's output."""
    table: str
    """Name of the `TableSpec` it looks up."""
    combiner: str | None = "sum"
    """"sum", "mean", "sqrtn" or "max" pool an example's ids into one `[D]` row; None
    keeps them as a sequence `[max_ids, D]` (zero rows past the example's length)."""
    max_ids: int = 1
    """Ids per example at most: 1 for one-hot, the longest bag for multi-hot, the window
    length for sequences (longer sequences keep their last `max_ids` ids)."""
    capacity: int | None = None
    """Ids per batch the compiled step holds (padding fills the rest). None means
    `batch_size * max_ids`, which never overflows; a smaller value saves memory for
    multi-hot features whose bags are mostly short, and a batch that needs more is an
    error naming the feature and the capacity it needs."""
    weighted: bool = False
    """Whether each id carries a weight (e.g. a multi-hot strength)."""

    def __post_init__(self):
        owner = f"FeatureSpec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"FeatureSpec: `name` must be a non-empty str, got {self.name!r}")
        if self.combiner is not None and self.combiner not in COMBINERS:
            raise ValueError(
                f"{owner}: `combiner` must be one of {COMBINERS} or None "
                f"(sequence), got {self.combiner!r}"
            )
        _positive_int(owner, "max_ids", self.max_ids)
        if self.capacity is not None:
            _positive_int(owner, "capacity", self.capacity)

    @property
    def is_sequence(self) -> bool:
        return self.combiner is None

    def capacity_for(self, batch_size: int) -> int:
        """Ids per batch of this feature at `batch_size`."""
        return self.capacity if self.capacity is not None else batch_size * self.max_ids

    def bags_per_example(self) -> int:
        """Output rows per example: `max_ids` positions for a sequence, else one bag."""
        return self.max_ids if self.is_sequence else 1


def check_specs(tables: Sequence[TableSpec], features: Sequence[FeatureSpec]) -> None:
    """Names unique, every feature's table declared, every table used."""
    for kind, specs in (("table", tables), ("feature", features)):
        seen = set()
        for s in specs:
            if s.name in seen:
                raise ValueError(f"duplicate {kind} name {s.name!r}")
            seen.add(s.name)
    names = {t.name for t in tables}
    for f in features:
        if f.table not in names:
            import difflib

            close = difflib.get_close_matches(f.table, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"feature {f.name!r} reads table {f.table!r}, which is not "
                f"declared (tables: {sorted(names)}){hint}"
            )
    unused = names - {f.table for f in features}
    if unused:
        raise ValueError(f"tables {sorted(unused)} are declared but no feature reads them")
