"""Checksums of a checkpoint's arrays that do not depend on how they are sharded.

Orbax checks nothing it reads: flipped bytes in a table's data restore as any value.
Each array a checkpoint holds gets a sum per fixed global block of rows, computed at
save by each process over the rows it writes and combined across processes, and again
at restore over the rows each process reads, whichever processes, devices and
placements save and restore.

For an array of global shape `[R, ...]`, its row `r` (index along the first axis; a
scalar is one row) is hashed as `key(r) * sum_j word_j * c_j` (uint32, wrapping): `word_j`
the row's j-th 32-bit word (elements of 1 or 2 bytes widened to one word each, of 8
bytes split in two), `c_j` an odd constant of the word's global column index, and
`key(r)` an odd mix of `r`. Rows `[b * B, (b + 1) * B)` form block `b`, whose sum mod
2^32 is stored. The hash is linear in the words, so any shard of rows or of columns
(column-wise tables) adds its part of a row and the parts add up the same; it changes
under any single flipped bit (an odd multiple of a power of two below 2^32) and under
any other change with probability about 1 - 2^-32. Rows from `rows` up (padding rows of
a table, never read) are left out, so paddings of other process counts agree.
`B` = 2^16, or the power of two that keeps an array to 4096 blocks."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

MIN_BLOCK = 1 << 16
MAX_BLOCKS = 4096
_CHUNK_WORDS = 1 << 22  # words hashed at a time (16 MiB of uint32 temporaries)

_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def block_rows(rows: int) -> int:
    """Rows per block of an array whose first `rows` rows are checked."""
    b = MIN_BLOCK
    while -(-rows // b) > MAX_BLOCKS:
        b *= 2
    return b


def num_blocks(rows: int) -> int:
    return max(1, -(-rows // block_rows(rows)))


def _fmix(h: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finalizer (uint32 in, uint32 out)."""
    h = h ^ (h >> np.uint32(16))
    h = h * _M1
    h = h ^ (h >> np.uint32(13))
    h = h * _M2
    return h ^ (h >> np.uint32(16))


def _words(a: np.ndarray) -> np.ndarray:
    """`a` `[n, ...]` as uint32 words `[n, ..., k]` (k words per element)."""
    size = a.dtype.itemsize
    if a.dtype == np.bool_:
        a = a.view(np.uint8)
    if size == 8:
        return a.view(np.uint32).reshape(*a.shape, 2)
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
    return a.view(view).astype(np.uint32, copy=False)[..., None]


def _columns(global_shape: tuple, index: tuple, k: int) -> np.ndarray:
    """`c_j` of a shard's columns: `[*shard's trailing shape, k]`, odd uint32."""
    tail = global_shape[1:]
    strides = np.cumprod((1, *tail[::-1]))[:-1][::-1] if tail else ()
    j = np.zeros([1] * len(tail), np.int64)
    for d, (sl, stride) in enumerate(zip(index[1:], strides, strict=True)):
        start, stop, _ = sl.indices(tail[d])
        shape = [1] * len(tail)
        shape[d] = stop - start
        j = j + (np.arange(start, stop, dtype=np.int64) * int(stride)).reshape(shape)
    j = j[..., None] * k + np.arange(k, dtype=np.int64)
    c = _fmix((j.astype(np.uint32) * np.uint32(0x9E3779B1)) + np.uint32(0x7F4A7C15))
    return c | np.uint32(1)


def _floating(dtype) -> bool:
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
    )


def shard_sums(
    data: np.ndarray,
    global_shape: tuple,
    index: tuple,
    rows: int,
    out: np.ndarray,
    *,
    finite: bool = False,
) -> bool:
    """Add the block sums of one shard (`data`, at `index` of an array of `global_shape`
    whose first `rows` rows are checked) into `out` (uint32 `[num_blocks(rows)]`).
    Returns False when `finite` and a checked row holds NaN or inf."""
    if not global_shape:  # a scalar: one row of one element
        data, global_shape, index = np.reshape(data, (1, 1)), (1, 1), (slice(0, 1),) * 2
    elif len(global_shape) == 1:
        data, global_shape = np.reshape(data, (-1, 1)), (*global_shape, 1)
        index = (*index, slice(0, 1))
    start, _, _ = index[0].indices(global_shape[0])
    n = data.shape[0]
    stop = min(start + n, rows)
    if stop <= start:
        return True
    data = np.asarray(data)
    finite = finite and _floating(data.dtype)
    ok = True
    k = 2 if data.dtype.itemsize == 8 else 1
    c = _columns(tuple(global_shape), tuple(index), k).reshape(1, -1)
    width = max(1, c.shape[1])
    b = block_rows(rows)
    per_chunk = max(1, _CHUNK_WORDS // width)
    r0 = start
    while r0 < stop:
        r1 = min(stop, r0 + per_chunk)
        part = data[r0 - start : r1 - start]
        if finite and ok:
            ok = bool(np.isfinite(part).all())
        chunk = _words(part).reshape(r1 - r0, -1)
        s = np.einsum("ij,j->i", chunk, c[0])  # uint32, wrapping (fast for narrow rows)
        r = np.arange(r0, r1, dtype=np.int64)
        key = _fmix(
            _fmix((r // b).astype(np.uint32) ^ np.uint32(0xA5A5A5A5)) + (r % b).astype(np.uint32)
        )
        s = s * (key | np.uint32(1))
        first = r0 // b
        edges = np.concatenate([[r0], np.arange((first + 1) * b, r1, b, dtype=np.int64)])
        sums = np.add.reduceat(s, edges - r0, dtype=np.uint32)
        out[first : first + len(sums)] += sums
        r0 = r1
    return ok


def _host(shard_data) -> np.ndarray:
    """A shard's data as a numpy array (no copy on CPU)."""
    if jax.dtypes.issubdtype(shard_data.dtype, jax.dtypes.prng_key):
        shard_data = jax.random.key_data(shard_data)
    return np.asarray(shard_data)


def local_sums(
    arrays: Mapping[str, jax.Array], rows: Mapping[str, int], *, finite: bool = False
) -> tuple[dict, list]:
    """`({key: uint32[num_blocks]}, [keys holding NaN/inf])`: the block sums of the
    shards this process holds of each array (its replica 0 only, so every row counts
    once across processes), and with `finite`, the float arrays whose checked rows this
    process holds hold NaN or inf."""
    out, bad = {}, []
    for key, a in arrays.items():
        n = rows[key]
        sums = np.zeros(num_blocks(n), np.uint32)
        if isinstance(a, jax.Array):
            shape = tuple(a.shape)
            if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                shape = shape + tuple(jax.random.key_data(a).shape[a.ndim :])
            for sh in a.addressable_shards:
                if sh.replica_id == 0:
                    index = tuple(sh.index) + (slice(None),) * (len(shape) - len(sh.index))
                    if not shard_sums(_host(sh.data), shape, index, n, sums, finite=finite):
                        bad.append(key)
        elif jax.process_index() == 0:  # a host value (numpy, scalar): process 0 counts it
            x = np.asarray(a)
            if not shard_sums(x, x.shape, (slice(None),) * x.ndim, n, sums, finite=finite):
                bad.append(key)
        out[key] = sums
    return out, sorted(set(bad))


def combine(local: Mapping[str, np.ndarray], flags: Mapping[str, bool]) -> tuple[dict, list]:
    """Every process's `local_sums` added up, and the keys any process flagged (a
    collective: every process calls it with the same keys and sizes); a single
    process gets its own back."""
    keys = sorted(local)
    if jax.process_count() == 1 or not keys:
        return {k: local[k] for k in keys}, sorted(k for k in keys if flags.get(k))
    from jax.experimental import multihost_utils

    flat = np.concatenate(
        [np.asarray([bool(flags.get(k)) for k in keys], np.uint32)] + [local[k] for k in keys]
    ).astype(np.uint32)
    every = np.asarray(multihost_utils.process_allgather(flat))
    total = every.reshape(jax.process_count(), -1).sum(axis=0, dtype=np.uint32)
    flagged = [k for k, f in zip(keys, total[: len(keys)], strict=True) if f]
    out, at = {}, len(keys)
    for k in keys:
        n = len(local[k])
        out[k] = total[at : at + n]
        at += n
    return out, flagged


def first_mismatch(saved: list[int], got: np.ndarray, rows: int) -> tuple[int, int] | None:
    """The rows `[lo, hi)` of the first block whose sums differ, or None."""
    bad = np.nonzero(np.asarray(saved, np.uint32) != got)[0]
    if not len(bad):
        return None
    b = block_rows(rows)
    lo = int(bad[0]) * b
    return lo, min(rows, lo + b)
