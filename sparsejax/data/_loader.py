"""In-memory columnar examples and the prefetching, resumable `Loader` of `SparseBatch`es.

The `Loader` trains from three kinds of source: `Examples` in memory (shuffled globally
per epoch), a batch generator (`SyntheticCriteo`), or a stream of chunks (`FileSource`:
files larger than memory, read with a bounded shuffle buffer and resumable mid-file).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ._batch import BatchPacker, JaggedIds, PaddedIds, SparseBatch

HostBatch = tuple[dict[str, JaggedIds], np.ndarray, np.ndarray]
"""`(sparse by feature name, labels f32[n, ...], dense f32[n, num_dense])`: host arrays of
one batch before packing; what `Examples.take` and a generator's `batch` return."""


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Examples:
    """A columnar in-memory store of examples: labels, dense features, ragged sparse ids.

    Each sparse feature is one `JaggedIds` over all `n` examples (`lengths[n]`, flat
    `values`, optional flat `weights`), so taking a batch is a handful of vectorized gathers. A
    reader fills it with raw ids (e.g. Criteo hex values, missing = -1); `map_ids` turns
    them into table rows. Slicing (`ex[a:b]`), `split` and `concat` build train/eval splits
    and join chunks.
    """

    labels: np.ndarray  # f32[n] (or [n, ...])
    dense: np.ndarray  # f32[n, num_dense]
    sparse: Mapping[str, JaggedIds]  # name -> JaggedIds over all n examples
    _offsets: dict[str, np.ndarray | None] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self):
        labels = np.asarray(self.labels, np.float32)
        n = labels.shape[0]
        dense = np.asarray(self.dense, np.float32)
        if dense.ndim == 1 and dense.size == 0:
            dense = dense.reshape(n, 0)
        if dense.ndim != 2 or dense.shape[0] != n:
            raise ValueError(f"Examples: dense must have shape ({n}, num_dense), got {dense.shape}")
        sparse, offsets = {}, {}
        for name, col in self.sparse.items():
            lengths = np.asarray(col.lengths)
            values = np.asarray(col.values)
            if lengths.shape != (n,):
                raise ValueError(
                    f"Examples: feature {name!r} has lengths of shape "
                    f"{lengths.shape}, expected ({n},)"
                )
            off = _offsets(lengths)
            if values.shape != (off[-1],):
                raise ValueError(
                    f"Examples: feature {name!r} has {values.shape[0]} values "
                    f"but its lengths sum to {off[-1]}"
                )
            weights = col.weights
            if weights is not None:
                weights = np.asarray(weights, np.float32)
                if weights.shape != values.shape:
                    raise ValueError(
                        f"Examples: feature {name!r} has {weights.shape[0]} "
                        f"weights for {values.shape[0]} values"
                    )
            sparse[name] = JaggedIds(lengths=lengths, values=values, weights=weights)
            # One id per example (the common case): a batch is a plain gather.
            offsets[name] = None if off[-1] == n and np.all(lengths == 1) else off
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "dense", dense)
        object.__setattr__(self, "sparse", sparse)
        object.__setattr__(self, "_offsets", offsets)

    @classmethod
    def unchecked(
        cls,
        labels: np.ndarray,
        dense: np.ndarray,
        sparse: Mapping[str, JaggedIds],
        one_id: Collection[str] = (),
    ) -> Examples:
        """Examples of arrays whose maker built them consistent (labels f32[n], dense
        f32[n, d], each feature's lengths summing to its values; `one_id`: the features
        with one id per example), taken as they are: a served request's parse spent half
        its time checking again what it had just built."""
        offsets = {
            name: None if name in one_id else _offsets(col.lengths) for name, col in sparse.items()
        }
        out = object.__new__(cls)
        for field, value in [
            ("labels", labels),
            ("dense", dense),
            ("sparse", sparse),
            ("_offsets", offsets),
        ]:
            object.__setattr__(out, field, value)
        return out

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def most_ids(self, name: str) -> int:
        """The most ids one example has of feature `name` (0 without examples)."""
        if not len(self):
            return 0
        if self._offsets[name] is None:  # one id per example
            return 1
        return int(self.sparse[name].lengths.max())

    @property
    def num_dense(self) -> int:
        return int(self.dense.shape[1])

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(self.sparse)

    def take(self, indices: np.ndarray | Sequence[int]) -> HostBatch:
        """Examples at `indices` (any order, repeats allowed), as host arrays of a batch."""
        idx = np.asarray(indices, np.int64)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"Examples.take: index out of range for {n} examples")
        idx = np.where(idx < 0, idx + n, idx)
        return self._take_sparse(idx), self.labels[idx], self.dense[idx]

    def _take_sparse(self, idx: np.ndarray) -> dict[str, JaggedIds]:
        out = {}
        for name, col in self.sparse.items():
            off = self._offsets[name]
            if off is None:
                w = None if col.weights is None else col.weights[idx]
                out[name] = JaggedIds(lengths=col.lengths[idx], values=col.values[idx], weights=w)
                continue
            lengths = col.lengths[idx]
            src = ragged_source(off[idx], lengths)
            w = None if col.weights is None else col.weights[src]
            out[name] = JaggedIds(lengths=lengths, values=col.values[src], weights=w)
        return out

    def __getitem__(self, key: slice) -> Examples:
        """A contiguous slice (step 1) as a new store sharing memory with this one."""
        if not isinstance(key, slice):
            raise TypeError("Examples supports slices (ex[a:b]); use take() for indices")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("Examples slices must have step 1; use take() otherwise")
        stop = max(start, stop)
        sparse = {}
        for name, col in self.sparse.items():
            off = self._offsets[name]
            lo, hi = (start, stop) if off is None else (int(off[start]), int(off[stop]))
            sparse[name] = JaggedIds(
                lengths=col.lengths[start:stop],
                values=col.values[lo:hi],
                weights=None if col.weights is None else col.weights[lo:hi],
            )
        return Examples(labels=self.labels[start:stop], dense=self.dense[start:stop], sparse=sparse)

    def split(self, n_first: int) -> tuple[Examples, Examples]:
        """`(self[:n_first], self[n_first:])`: e.g. the first days for train, the rest eval."""
        if not 0 <= n_first <= len(self):
            raise ValueError(f"split({n_first}) outside [0, {len(self)}]")
        return self[:n_first], self[n_first:]

    @classmethod
    def concat(cls, chunks: Sequence[Examples]) -> Examples:
        """Join chunks (e.g. from `iter_criteo_chunks`) with the same features, in order."""
        chunks = list(chunks)
        if not chunks:
            raise ValueError("Examples.concat needs at least one chunk")
        names = chunks[0].feature_names
        for c in chunks[1:]:
            if c.feature_names != names or c.num_dense != chunks[0].num_dense:
                raise ValueError(
                    f"Examples.concat: chunks differ in features ({names} vs "
                    f"{c.feature_names}) or dense width"
                )
        sparse = {}
        for name in names:
            cols = [c.sparse[name] for c in chunks]
            has_w = {col.weights is not None for col in cols}
            if len(has_w) > 1:
                raise ValueError(
                    f"Examples.concat: feature {name!r} is weighted in some chunks only"
                )
            sparse[name] = JaggedIds(
                lengths=np.concatenate([col.lengths for col in cols]),
                values=np.concatenate([col.values for col in cols]),
                weights=np.concatenate([col.weights for col in cols]) if has_w == {True} else None,
            )
        return cls(
            labels=np.concatenate([c.labels for c in chunks]),
            dense=np.concatenate([c.dense for c in chunks]),
            sparse=sparse,
        )

    def map_ids(self, mappings: Mapping[str, Callable[[np.ndarray], np.ndarray]]) -> Examples:
        """Apply an id mapping per feature (e.g. `HashMapping`, a fitted `VocabMapping`);
        features without a mapping keep their values. Fit on train, apply to both splits."""
        unknown = set(mappings) - set(self.sparse)
        if unknown:
            raise ValueError(
                f"map_ids: unknown features {sorted(unknown)}; the examples have "
                f"{list(self.sparse)}"
            )
        sparse = dict(self.sparse)
        for name, mapping in mappings.items():
            col = sparse[name]
            values = np.asarray(mapping(col.values))
            if values.shape != col.values.shape:
                raise ValueError(
                    f"map_ids: the mapping of {name!r} gave ids of shape {values.shape} for "
                    f"{col.values.shape}"
                )
            sparse[name] = JaggedIds(lengths=col.lengths, values=values, weights=col.weights)
        # the lengths are unchanged: the checks and offsets of `self` hold
        one_id = [name for name, off in self._offsets.items() if off is None]
        return Examples.unchecked(self.labels, self.dense, sparse, one_id)


# ---------------------------------------------------------------------------------------
# Loader


class BatchSource(Protocol):
    """A generator of batches by number (e.g. `SyntheticCriteo`): batch `i` must depend
    only on `i` and the generator's config, so a run can resume at any batch."""

    def batch(self, index: int, batch_size: int) -> HostBatch: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderPosition:
    """Where a `Loader` stands: the next batch it yields is batch `batch` of epoch `epoch`.

    Store it in a checkpoint (`to_dict`) and pass it back as `Loader(position=...)` to
    continue with exactly the batches an uninterrupted run would have seen next.
    """

    epoch: int = 0
    """Epoch of the next batch (always 0 for an endless generator)."""
    batch: int = 0
    """Batches of that epoch already yielded (for a generator: batches yielded so far)."""
    stream: Mapping[str, Any] | None = None
    """Streaming sources only: where the next batch's first example is, as
    {"window": the source position where its shuffle window starts (None: the epoch's
    start), "index": the window's number in the epoch, "skip": examples of the window
    (in its shuffled order) already yielded}. None: the start of `epoch`.
    A position re-split for another process count (`resplit_stream_positions`) is
    {"processes": the old count, "shares": [{"rank": an old process, "window", "index",
    "skip"}, ...]}: the rest of this epoch is those old processes' remaining shares."""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"epoch": self.epoch, "batch": self.batch}
        if self.stream is not None:
            d["stream"] = dict(self.stream)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoaderPosition:
        stream = d.get("stream")
        return cls(
            epoch=int(d["epoch"]),
            batch=int(d["batch"]),
            stream=None if stream is None else dict(stream),
        )


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


def _shutdown(stop: threading.Event, q: queue.Queue, thread: threading.Thread) -> None:
    stop.set()
    while thread.is_alive():
        try:  # drain so a producer blocked on put() wakes up and sees `stop`
            while True:
                q.get_nowait()
        except queue.Empty:
            pass
        thread.join(timeout=0.05)


def _epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The order of the examples in `epoch`: a permutation seeded by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)


def _schedule(
    start: LoaderPosition, epochs: int | None, per_epoch: int | None
) -> Iterator[tuple[int, int]]:
    """(epoch, batch) of every batch from `start` on."""
    epoch, b = start.epoch, start.batch
    while epochs is None or epoch < epochs:
        yield epoch, b
        b += 1
        if per_epoch is not None and b == per_epoch:
            epoch, b = epoch + 1, 0


def _produce(items: Iterator[tuple[LoaderPosition, Any]], q: queue.Queue, stop: threading.Event):
    """Put `(position after, batch)` items on `q` until they end or `stop` is set."""

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in items:
            if stop.is_set() or not put(item):
                return
        put(_END)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the consumer
        put(_Failure(exc))
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()  # a generator's `finally` (its worker threads) runs now, in this thread


def _ordered_map(fn: Callable, args: Iterable[tuple], workers: int, ahead: int) -> Iterator:
    """`fn(*a)` for every `a` of `args`, in order, computed by `workers` threads at most
    `ahead` calls ahead of the consumer. A call's exception is raised in its turn."""
    with ThreadPoolExecutor(workers, thread_name_prefix="sparsejax-loader") as pool:
        pending: collections.deque = collections.deque()
        try:
            for a in args:
                pending.append(pool.submit(fn, *a))
                if len(pending) >= ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


class Loader:
    """Iterates `SparseBatch`es, parsing and packing ahead in a background thread.

    The thread keeps up to `prefetch` finished batches (optionally already on device) in
    a bounded queue, so host work overlaps the device step. An exception in the thread is
    re-raised in the consumer (same exception, its traceback reaching into the thread).
    `close()` (or leaving a `with` block, or dropping the loader) stops and joins the
    thread.

    Sources:
      * `Examples`: epochs over the store, shuffled per epoch with a permutation seeded
        by `(seed, epoch)`; the last partial batch is dropped (`drop_remainder=True`) or
        padded with mask-0 rows. Packer errors name the example by its position in the
        epoch's order (its index in the store when `shuffle=False`).
      * a generator with `batch(index, batch_size)` (e.g. `SyntheticCriteo`): endless.
      * a streaming source with `chunks(position)` (`FileSource`): files larger than
        memory. Rows are shuffled within consecutive windows of about `shuffle_buffer`
        rows (whole chunks; a window's order is a permutation seeded by `(seed, epoch,
        window number)`), so memory stays bounded by the window, a few chunks and the
        `prefetch` batches. Chunks are parsed (and the source's `transform` applied) in
        the background thread. Batches do not span epochs; the last one is padded or
        dropped as for `Examples`.

    `workers` > 1 makes the batches of an `Examples`, prepared or generated source on that
    many threads (in order, each batch the same as with one: a batch depends only on its
    index), for the hosts where one thread cannot keep up with the device; numpy, the
    C++ parser and the device transfers release the GIL. A stream is read by one thread.

    Resuming: `position` is the next batch to be yielded (`LoaderPosition`); a loader
    constructed with that position yields bit-identical batches to the ones the
    uninterrupted loader would have yielded next. For a stream the position records the
    source position of the current shuffle window and how far into it the loader is, so
    resuming re-reads one window, not the files before it.

    Example::

        with Loader(train, packer, seed=0, epochs=None) as loader:
            for batch in loader:
                state = step(state, batch)
                if want_checkpoint: save(state, loader.position.to_dict())
    """

    def __init__(
        self,
        source: Examples | BatchSource,
        packer: BatchPacker,
        *,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int | None = 1,
        drop_remainder: bool = False,
        prefetch: int = 2,
        device_put: bool | jax.Device | jax.sharding.Sharding = False,
        position: LoaderPosition | Mapping[str, Any] | None = None,
        shuffle_buffer: int = 1 << 16,
        workers: int = 1,
    ):
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be >= 0 or None, got {epochs}")
        if isinstance(position, Mapping):
            position = LoaderPosition.from_dict(position)
        self.source = source
        self.packer = packer
        self.shuffle = shuffle
        self.seed = seed
        self.epochs = epochs
        self.drop_remainder = drop_remainder
        self.prefetch = prefetch
        self.device_put = device_put
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1, got {shuffle_buffer}")
        self.shuffle_buffer = shuffle_buffer
        self.workers = workers
        self.streaming = False
        b = packer.batch_size
        self.prepared = callable(getattr(source, "batch_rows", None))
        if self.prepared:  # `PreparedData`: its columns must be the packer's
            source.check(packer)
        if isinstance(source, Examples) or self.prepared:
            n = len(source)
            self.batches_per_epoch = n // b if drop_remainder else math.ceil(n / b)
            if self.batches_per_epoch == 0 and epochs != 0:
                raise ValueError(
                    f"{n} examples make no batch of {b}"
                    + (" with drop_remainder" if drop_remainder else "")
                )
        elif callable(getattr(source, "batch", None)):
            self.batches_per_epoch = None
        elif callable(getattr(source, "chunks", None)):
            self.batches_per_epoch = None
            self.streaming = True
        else:
            raise TypeError(
                "Loader source must be Examples, have batch(index, batch_size) or "
                f"chunks(position), got {type(source).__name__}"
            )
        self._position = position or LoaderPosition()
        self._normalize()
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._finalizer = None
        self._done = False
        self._peeked = None  # an item `peek` took from the queue, for `next`

    # -- position and schedule ------------------------------------------------------
    @property
    def position(self) -> LoaderPosition:
        """The next batch to be yielded; store it in checkpoints."""
        return self._position

    def _normalize(self) -> None:
        p = self._position
        if self.batches_per_epoch and p.batch >= self.batches_per_epoch:
            extra, b = divmod(p.batch, self.batches_per_epoch)
            self._position = LoaderPosition(epoch=p.epoch + extra, batch=b)

    def _items(self) -> Iterator[tuple[LoaderPosition, Any]]:
        """`(position after, batch)` of every batch from the current position on."""
        # Refers to no `self`, so the thread does not keep the loader alive.
        if self.streaming:
            return _stream_batches(
                self.source,
                self.packer,
                self._position,
                epochs=self.epochs,
                shuffle=self.shuffle,
                seed=self.seed,
                buffer_rows=self.shuffle_buffer,
                drop_remainder=self.drop_remainder,
                target=self.device_put,
            )
        make, per_epoch = self._make(), self.batches_per_epoch

        def after(epoch: int, b: int) -> LoaderPosition:
            if per_epoch is not None and b + 1 >= per_epoch:
                return LoaderPosition(epoch=epoch + 1, batch=0)
            return LoaderPosition(epoch=epoch, batch=b + 1)

        schedule = _schedule(self._position, self.epochs, per_epoch)
        if self.workers == 1:
            return ((after(epoch, b), make(epoch, b)) for epoch, b in schedule)
        return _ordered_map(
            lambda epoch, b: (after(epoch, b), make(epoch, b)),
            schedule,
            self.workers,
            ahead=self.workers + self.prefetch,
        )

    def _make(self) -> Callable[[int, int], Any]:
        source, packer, target = self.source, self.packer, self.device_put
        shuffle, seed, bs = self.shuffle, self.seed, packer.batch_size
        endless = self.batches_per_epoch is None
        orders = BoundedCache(2)  # of the last epochs the workers are in

        def epoch_order(epoch: int) -> np.ndarray:
            return orders.get(epoch, lambda: _epoch_order(len(source), shuffle, seed, epoch))

        if self.prepared:
            share = getattr(packer, "share_of", None)  # one process's share of the batch
            compact = target is True and share is None and source.compact_for(packer)
            window = self.shuffle_buffer

            def make_prepared(epoch: int, index: int):
                rows = source.batch_rows(
                    epoch, index, bs, shuffle=shuffle, seed=seed, window_rows=window
                )
                if compact:
                    return _put_compact(packer, *source.take_compact(rows))
                first, pack = index * bs, packer.pack
                if share is not None:  # read only this process's rows
                    lo, hi = share(rows.shape[0])
                    rows, first, pack = rows[lo:hi], first + lo, packer.local.pack
                sparse, labels, dense = source.take(rows)
                batch = pack(sparse, labels=labels, dense=dense, first_example=first)
                return _to_device(batch, target)

            return make_prepared

        def make(epoch: int, index: int):
            if endless:
                sparse, labels, dense = source.batch(index, bs)
            else:
                order = epoch_order(epoch)
                sparse, labels, dense = source.take(order[index * bs : (index + 1) * bs])
            return _ship(packer, sparse, labels, dense, index * bs, target)

        return make

    # -- iteration ------------------------------------------------------------------
    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        # The thread gets no reference to `self`, so dropping the loader shuts it down.
        self._thread = threading.Thread(
            target=_produce,
            args=(self._items(), self._queue, stop),
            name="sparsejax-loader",
            daemon=True,
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, stop, self._queue, self._thread)

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> SparseBatch:
        if self._done:
            raise StopIteration
        item = self._take()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        self._position, batch = item
        return batch

    def _take(self):
        """The next item of the queue (the peeked one first)."""
        item, self._peeked = self._peeked, None
        if item is None:
            if self._thread is None:
                self._start()
            item = self._queue.get()
        return item

    def peek(self) -> SparseBatch | None:
        """The batch `next` will yield, without taking it (the position stays); None at
        the end or before an error (which `next` then raises)."""
        if self._done:
            return None
        if self._peeked is None:
            self._peeked = self._take()
        item = self._peeked
        return None if item is _END or isinstance(item, _Failure) else item[1]

    def close(self) -> None:
        """Stop and join the background thread; the loader yields nothing more."""
        self._done = True
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ragged_source(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat source index of every value of the examples whose values start at `starts`
    and number `lengths`: each example's start plus the value's position in it."""
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    return np.arange(total) + np.repeat(starts - (ends - lengths), lengths)


class BoundedCache:
    """The last `limit` values built, by key; thread-safe (the loader's worker threads
    share them). A value may be built twice by two threads at once, never wrong: every
    `build` of a key gives the same value."""

    def __init__(self, limit: int):
        self.limit = limit
        self._values: dict = {}
        self._lock = threading.Lock()

    def get(self, key, build: Callable[[], Any]):
        """`build()`'s value for `key`, built on a miss; the oldest entries make room."""
        with self._lock:
            value = self._values.get(key)
        if value is None:
            value = build()
            with self._lock:
                while len(self._values) >= self.limit:
                    self._values.pop(next(iter(self._values)))
                self._values[key] = value
        return value


def _to_device(batch, target):
    if target is True:
        return _put_default(batch)
    if target is not False and target is not None:
        return jax.device_put(batch, target)
    return batch


_UNFLATTEN = BoundedCache(64)


def _put_default(batch):
    """`jax.device_put(batch)` in two transfers: the leaves are concatenated per dtype
    on the host, put, and split by one cached jitted function (a batch of 26 features has
    55 leaves; putting each costs more than parsing its rows)."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    if len(leaves) < 8 or not all(isinstance(x, np.ndarray) for x in leaves):
        return jax.device_put(batch)
    dtypes = [x.dtype for x in leaves]
    sig = (treedef, tuple(x.shape for x in leaves), tuple(dtypes))
    groups: dict = {}
    for i, dt in enumerate(dtypes):
        groups.setdefault(dt, []).append(i)

    def build():
        layout = [
            (idx, [leaves[i].shape for i in idx], [leaves[i].size for i in idx])
            for idx in groups.values()
        ]

        def unflatten(*flats):
            out = [None] * len(leaves)
            for flat, (idx, shapes, sizes) in zip(flats, layout, strict=True):
                o = 0
                for i, shape, size in zip(idx, shapes, sizes, strict=True):
                    out[i] = flat[o : o + size].reshape(shape)
                    o += size
            return jax.tree_util.tree_unflatten(treedef, out)

        return jax.jit(unflatten)

    fn = _UNFLATTEN.get(sig, build)
    flats = [np.concatenate([leaves[i].ravel() for i in idx]) for idx in groups.values()]
    return fn(*jax.device_put(flats))


def _put_compact(packer: BatchPacker, ids: np.ndarray, labels: np.ndarray, dense: np.ndarray):
    """The batch `packer.pack` would build from one-id features `ids[n, F]` (columns in
    `packer.features` order), put on the default device as three arrays and unpacked
    there: one jitted split of the id columns; the segments and the mask, the same for
    every batch of n examples, made once and shared (a step does not donate its batch)."""
    n, b = ids.shape[0], packer.batch_size
    caps = tuple(f.capacity_for(b) for f in packer.features)
    key = (caps, b, n, labels.shape[1:], dense.shape[1])

    def build():
        def split(ids, labels, dense):
            cols = [
                jnp.full(cap, -1, jnp.int32).at[:n].set(ids[:, j]) for j, cap in enumerate(caps)
            ]
            pad = [(0, b - n)]
            return (
                cols,
                jnp.pad(labels, pad + [(0, 0)] * (labels.ndim - 1)),
                jnp.pad(dense, pad + [(0, 0)]),
            )

        segments = {
            cap: jax.device_put(
                np.concatenate([np.arange(n), np.full(cap - n, b - 1)]).astype(np.int32)
            )
            for cap in set(caps)
        }
        mask = jax.device_put((np.arange(b) < n).astype(np.float32))
        return jax.jit(split), segments, mask

    split, segments, mask = _UNPACK.get(key, build)
    cols, labels, dense = split(
        *jax.device_put((ids, labels.astype(np.float32, copy=False), dense))
    )
    features = {
        f.name: PaddedIds(ids=col, segments=segments[cap])
        for f, col, cap in zip(packer.features, cols, caps, strict=True)
    }
    return SparseBatch(features=features, dense=dense, labels=labels, mask=mask)


_UNPACK = BoundedCache(64)


def _concat_host(parts: list[HostBatch]) -> HostBatch:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0][0], np.ndarray):
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))
    sparse = {}
    for name in parts[0][0]:
        cols = [p[0][name] for p in parts]
        w = None if cols[0].weights is None else np.concatenate([c.weights for c in cols])
        sparse[name] = JaggedIds(
            lengths=np.concatenate([c.lengths for c in cols]),
            values=np.concatenate([c.values for c in cols]),
            weights=w,
        )
    return (
        sparse,
        np.concatenate([p[1] for p in parts]),
        np.concatenate([p[2] for p in parts]),
    )


def _windows(chunks, start: Mapping | None, rows: int):
    """(start position, end position, Examples) of consecutive windows of whole chunks
    holding at least `rows` rows each (the last may hold fewer)."""
    parts, n, w_start = [], 0, start
    for chunk in chunks:
        parts.append(chunk.examples)
        n += len(chunk.examples)
        if n >= rows:
            end = chunk.position.to_dict()
            yield w_start, end, parts[0] if len(parts) == 1 else Examples.concat(parts)
            parts, n, w_start = [], 0, end
    if n:
        yield w_start, None, parts[0] if len(parts) == 1 else Examples.concat(parts)


def resplit_stream_positions(positions: Sequence[Mapping], num_processes: int) -> list[dict]:
    """The `LoaderPosition` dicts of `num_processes` processes resuming a stream that
    `len(positions)` processes saved (`positions[r]`: process r's, each reading its own
    share of the files). Old process r's remaining share of the epoch (the rest of its
    shuffle window, then its files after it) goes whole to new process `r %
    num_processes`, which reads those shares in rank order, each as the old process
    would have (same windows, same shuffles); from the next epoch on every process
    reads its own share of `num_processes`. So no example is skipped or repeated. A
    position of another kind (not a stream's, or of different epochs) is refused with
    one line."""
    old = [LoaderPosition.from_dict(p) for p in positions]
    epochs = {p.epoch for p in old}
    if len(epochs) != 1:
        raise ValueError(
            f"data positions of {len(old)} processes are at different epochs "
            f"({sorted(epochs)}); resume on {len(old)} processes"
        )
    (epoch,) = epochs
    shares = []
    for r, p in enumerate(old):
        st = p.stream
        if st is not None and "shares" in st:
            raise ValueError(
                f"process {r}'s data position is itself re-split from another process count;"
                f" resume it on {len(old)} processes until the epoch ends"
            )
        if st is None and p.batch:
            raise ValueError(
                f"process {r}'s data position {p.to_dict()} is not a streamed source's; "
                f"resume on {len(old)} processes"
            )
        st = st or {"window": None, "index": 0, "skip": 0}
        shares.append({"rank": r, **{k: st[k] for k in ("window", "index", "skip")}})
    out = []
    for j in range(num_processes):
        mine = [s for s in shares if s["rank"] % num_processes == j]
        batch = old[j].batch if j < len(old) else 0
        out.append(
            LoaderPosition(
                epoch=epoch, batch=batch, stream={"processes": len(old), "shares": mine}
            ).to_dict()
        )
    return out


def _stream_batches(
    source,
    packer: BatchPacker,
    start: LoaderPosition,
    *,
    epochs: int | None,
    shuffle: bool,
    seed: int,
    buffer_rows: int,
    drop_remainder: bool,
    target,
) -> Iterator[tuple[LoaderPosition, Any]]:
    """The batches of a streaming source from `start`, with the position after each.
    Chunks are parsed in the same thread (a reader thread of their own ran slower: the
    two threads took turns holding the GIL and the loader still used one core)."""
    bs = packer.batch_size
    epoch, st, batch_i = start.epoch, start.stream, start.batch
    if st is not None and "shares" in st and (epochs is None or epoch < epochs):
        yield from _resplit_epoch(
            source, packer, epoch, st, batch_i, shuffle=shuffle, seed=seed,
            buffer_rows=buffer_rows, drop_remainder=drop_remainder, target=target,
        )  # fmt: skip
        epoch, st, batch_i = epoch + 1, None, 0
    while epochs is None or epoch < epochs:
        st = st or {"window": None, "index": 0, "skip": 0}
        w0, skip = int(st["index"]), int(st["skip"])
        pending: list[HostBatch] = []
        pending_n = seen = 0
        chunks = source.chunks(st["window"])
        try:
            for k, (w_start, w_end, ex) in enumerate(_windows(chunks, st["window"], buffer_rows)):
                w = w0 + k
                n = len(ex)
                ex = _window_rows(packer, ex, target)
                seen += n
                order = (
                    np.random.default_rng([seed, epoch, w]).permutation(n)
                    if shuffle
                    else np.arange(n)
                )
                off = skip if k == 0 else 0
                while off < n:
                    take = min(bs - pending_n, n - off)
                    pending.append(ex.take(order[off : off + take]))
                    pending_n += take
                    off += take
                    if pending_n < bs:
                        continue
                    if off < n:
                        nxt = {"window": w_start, "index": w, "skip": off}
                    elif w_end is not None:
                        nxt = {"window": w_end, "index": w + 1, "skip": 0}
                    else:  # the epoch's last example: the next batch starts the next epoch
                        nxt = None
                    after = (
                        LoaderPosition(epoch=epoch + 1, batch=0)
                        if nxt is None
                        else LoaderPosition(epoch=epoch, batch=batch_i + 1, stream=nxt)
                    )
                    yield after, _pack(packer, pending, batch_i * bs, target)
                    batch_i += 1
                    pending, pending_n = [], 0
        finally:
            chunks.close()
        if seen == 0 and st["window"] is None:
            report = getattr(source, "report", None)
            raise ValueError(
                f"{source!r} has no usable rows"
                + (f" in this process's share: {report}" if report is not None else "")
            )
        if pending_n and not drop_remainder:
            yield (
                LoaderPosition(epoch=epoch + 1, batch=0),
                _pack(packer, pending, batch_i * bs, target),
            )
        epoch, st, batch_i = epoch + 1, None, 0


def _resplit_epoch(
    source, packer, epoch, st, batch_i, *, shuffle, seed, buffer_rows, drop_remainder, target
) -> Iterator[tuple[LoaderPosition, Any]]:
    """The rest of an epoch re-split from another process count: each old share in
    turn (`source.share(rank, processes)`), from its window and skip, with the same
    windows and shuffles as the old process; the position after each batch lists the
    shares still to read."""
    bs, n_old = packer.batch_size, int(st["processes"])
    shares = [dict(s) for s in st["shares"]]
    pending: list[HostBatch] = []
    pending_n = 0
    for i, sh in enumerate(shares):
        src = source.share(int(sh["rank"]), n_old)
        w0, skip = int(sh["index"]), int(sh["skip"])
        chunks = src.chunks(sh["window"])
        try:
            for k, (w_start, w_end, ex) in enumerate(_windows(chunks, sh["window"], buffer_rows)):
                w, n = w0 + k, len(ex)
                ex = _window_rows(packer, ex, target)
                order = (
                    np.random.default_rng([seed, epoch, w]).permutation(n)
                    if shuffle
                    else np.arange(n)
                )
                off = skip if k == 0 else 0
                while off < n:
                    take = min(bs - pending_n, n - off)
                    pending.append(ex.take(order[off : off + take]))
                    pending_n += take
                    off += take
                    if pending_n < bs:
                        continue
                    if off < n:
                        here = [{**sh, "window": w_start, "index": w, "skip": off}]
                    elif w_end is not None:
                        here = [{**sh, "window": w_end, "index": w + 1, "skip": 0}]
                    else:
                        here = []
                    rest = here + shares[i + 1 :]
                    after = (
                        LoaderPosition(
                            epoch=epoch,
                            batch=batch_i + 1,
                            stream={"processes": n_old, "shares": rest},
                        )
                        if rest
                        else LoaderPosition(epoch=epoch + 1, batch=0)
                    )
                    yield after, _pack(packer, pending, batch_i * bs, target)
                    batch_i += 1
                    pending, pending_n = [], 0
        finally:
            chunks.close()
    if pending_n and not drop_remainder:
        yield LoaderPosition(epoch=epoch + 1, batch=0), _pack(packer, pending, batch_i * bs, target)


class _OneIdWindow:
    """A window of examples whose every feature is one id a row, kept as the id matrix
    `BatchPacker.one_id_matrix` builds once for the window: a batch is then one row
    gather of it (instead of one per feature), shipped as is (`_put_compact`)."""

    def __init__(self, ids: np.ndarray, labels: np.ndarray, dense: np.ndarray):
        self.ids, self.labels, self.dense = ids, labels, dense

    def __len__(self) -> int:
        return self.ids.shape[0]

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.ids[idx], self.labels[idx], self.dense[idx]


def _window_rows(packer: BatchPacker, ex: Examples, target) -> Examples | _OneIdWindow:
    """`ex`, as a `_OneIdWindow` where its batches would be shipped as id matrices."""
    n = len(ex)
    if (
        target is True
        and not hasattr(packer, "share_of")
        and ex.dense.shape[1:] == (packer.num_dense,)
    ):
        ids = packer.one_id_matrix(ex.sparse, n)
        if ids is not None:
            return _OneIdWindow(ids, ex.labels, ex.dense)
    return ex


def _pack(packer: BatchPacker, parts: list[HostBatch], first: int, target):
    matrices = [isinstance(p[0], np.ndarray) for p in parts]
    if any(matrices) and not all(matrices):  # a batch across two kinds of window
        parts = [_as_jagged(packer, p) if m else p for p, m in zip(parts, matrices, strict=True)]
    return _ship(packer, *_concat_host(parts), first, target)


def _as_jagged(packer: BatchPacker, part) -> HostBatch:
    """A `_OneIdWindow.take` part as host arrays of a batch."""
    ids, labels, dense = part
    ones = np.ones(ids.shape[0], np.int32)
    sparse = {
        f.name: JaggedIds(lengths=ones, values=ids[:, j]) for j, f in enumerate(packer.features)
    }
    return sparse, labels, dense


def _ship(packer: BatchPacker, sparse, labels, dense, first: int, target):
    """The batch of these host arrays, packed by `packer` and put on `target`. A batch
    for the default device whose every feature is one id per example goes as one id
    matrix, unpacked on the device (`_put_compact`): the same batch at a third of the
    host work. `first` numbers the examples in error messages."""
    if isinstance(sparse, np.ndarray):  # an id matrix (`_OneIdWindow`)
        return _put_compact(packer, sparse, labels, dense)
    if target is True and not hasattr(packer, "share_of"):
        labels = np.asarray(labels)
        n = labels.shape[0]
        if dense is not None and np.shape(dense) == (n, packer.num_dense):
            ids = packer.one_id_matrix(sparse, n)
            if ids is not None:
                return _put_compact(packer, ids, labels, np.asarray(dense, np.float32))
    batch = packer.pack(sparse, labels=labels, dense=dense, first_example=first)
    return _to_device(batch, target)


def measure_throughput(loader: Loader, *, num_batches: int = 50, warmup: int = 2) -> float:
    """Host throughput of `loader` in batches per second (nothing else running).

    Consumes `warmup + num_batches` batches from it (fewer if it ends first); when the
    loader device-puts, each batch is waited for, so the time includes the transfer.
    """
    it = iter(loader)
    for _ in range(warmup):
        if next(it, None) is None:
            raise ValueError("loader ended during warm-up")
    count, t0 = 0, time.perf_counter()
    for batch in it:
        if loader.device_put is not False:
            jax.block_until_ready(batch)
        count += 1
        if count == num_batches:
            break
    elapsed = time.perf_counter() - t0
    if count == 0:
        raise ValueError("loader ended before any batch was timed")
    return count / elapsed


def pack_examples(examples: Examples, packer: BatchPacker) -> list[SparseBatch]:
    """Every example of `examples` in order, as batches (the last one padded with mask-0
    rows): an eval set that counts each example exactly once."""
    b, out = packer.batch_size, []
    for start in range(0, len(examples), b):
        sparse, labels, dense = examples.take(np.arange(start, min(start + b, len(examples))))
        out.append(packer.pack(sparse, labels=labels, dense=dense, first_example=start))
    return out
