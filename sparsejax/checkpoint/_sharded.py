"""Tables as sharded arrays in a checkpoint: their keys, what a process holds of them,
the groups a restore reads them in, and the memory a restore needs.

A checkpoint of format 2 holds each table as one orbax array per leaf (`weights`, each
slot) in its logical layout `[rows, dim]` (`rows` = the vocabulary padded to the saving
store's row shards), sharded as the store places it: each process writes the rows its
devices hold and a restore reads the rows the restoring store will hold
(`ArrayRestoreArgs(sharding, global_shape, strict=False)`: padding rows added or cut).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from ..embedding import rows_on_devices

FORMAT = 2
"""`meta["format"]` of checkpoints whose tables are sharded and checksummed (format 1,
no key: each table whole, replicated, no checksums; still restored)."""

GROUP_BYTES = 256 << 20
"""A restore reads tables in groups of about this many bytes per process (a table
larger alone): orbax's read buffers of one group at a time."""


def leaves(tree: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """`(key, leaf)` of a tree of dicts, sequences and dataclasses; keys "a/b/0/c"."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        yield "/".join([prefix, *names]), leaf


def table_of(key: str) -> tuple[str, str, str] | None:
    """`(layer, table, array)` of a table leaf's key ("tables/<layer>/<table>/weights",
    ".../slots/<slot>"), None for other keys. A layer key may hold "/"."""
    if not key.startswith("tables/"):
        return None
    parts = key.split("/")[1:]
    if parts[-1] == "weights":
        return "/".join(parts[:-2]), parts[-2], "weights"
    if len(parts) >= 4 and parts[-2] == "slots":
        return "/".join(parts[:-3]), parts[-3], f"slot {parts[-1]!r}"
    return None


def local_bytes(sds) -> int:
    """Bytes of the shards of `sds` (a `jax.ShapeDtypeStruct` or array with a sharding)
    this process's devices hold (each device's copy counted)."""
    sharding = getattr(sds, "sharding", None)
    itemsize = np.dtype(sds.dtype).itemsize if not _is_key(sds.dtype) else 8
    if sharding is None:
        return math.prod(sds.shape) * itemsize if jax.process_index() == 0 else 0
    total = 0
    for index in sharding.addressable_devices_indices_map(tuple(sds.shape)).values():
        n = 1
        for sl, dim in zip(index, sds.shape, strict=False):
            start, stop, step = sl.indices(dim)
            n *= len(range(start, stop, step))
        total += n * itemsize
    return total


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def groups(tables: Mapping[str, Mapping]) -> list[list[str]]:
    """Table names in read order, grouped up to `GROUP_BYTES` of this process's shards."""
    out: list[list[str]] = []
    size = GROUP_BYTES
    for name, tree in tables.items():
        n = sum(local_bytes(s) for s in jax.tree.leaves(tree))
        if not out or size + n > GROUP_BYTES:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def array_files(item_dir: str, array: str) -> dict[str, str]:
    """`{chunk key: data file}` of array `array` (its name in the item, "a.b.c") in the
    OCDBT database of an orbax item folder: where each of its chunks is stored (chunks
    of small arrays are inline in the tree: not listed). Empty when the database does
    not read (its manifest or tree nodes are what is broken)."""
    import tensorstore as ts

    prefix = f"{array}/".encode()
    out: dict[str, str] = {}
    try:
        kv = ts.KvStore.open(f"file://{os.path.abspath(item_dir)}/").result()
        root = ts.ocdbt.dump(kv).result()["versions"][-1]["root"]["location"]
        nodes = [root]
        while nodes:
            node = ts.ocdbt.dump(kv, "btreenode::" + nodes.pop().split("::", 1)[1]).result()
            for e in node.get("entries", []):
                for v in e.values():
                    if isinstance(v, str) and v.startswith("btreenode::"):
                        nodes.append(v)
                key = e.get("key", b"")
                ref = e.get("indirect_value")
                if isinstance(ref, str) and bytes(key).startswith(prefix):
                    _, base, path, *_ = ref.split(":")
                    out[bytes(key).decode()] = os.path.join(item_dir, base, path)
    except Exception:  # noqa: BLE001 - best effort: the caller's error stands without it
        return {}
    return out


READ_BYTES = 64 << 20
"""A direct read copies at most this many bytes at a time from tensorstore."""


def read_sharded(item_dir: str, name: str, sds) -> jax.Array:
    """Array `name` of an orbax item folder (OCDBT, zarr) read as `sds` says: each of
    this process's devices gets its rows (and columns) of it, rows past the saved ones
    zeros (padding), saved rows past `sds`'s cut. Each shard is read `READ_BYTES` at a
    time straight into its device buffer (`rows_on_devices`): the only transient is one
    read's bytes (orbax's own restore holds every array twice while it reads).

    Raises whatever tensorstore raises (the caller falls back to orbax's restore)."""
    import tensorstore as ts

    t = ts.open(
        {
            "driver": "zarr",
            "kvstore": {
                "driver": "ocdbt",
                "base": f"file://{os.path.abspath(item_dir)}/",
                "path": f"{name}/",
            },
            "open": True,
        },
        read=True,
    ).result()
    saved = tuple(t.shape)
    if len(saved) != len(sds.shape) or saved[1:] != tuple(sds.shape[1:]):
        raise ValueError(f"{name}: saved shape {saved}, restoring {tuple(sds.shape)}")
    dtype = np.dtype(sds.dtype)
    if np.dtype(t.dtype.numpy_dtype) != dtype:
        raise ValueError(f"{name}: saved dtype {t.dtype}, restoring {dtype}")
    parts = []
    for device, index in sds.sharding.addressable_devices_indices_map(tuple(sds.shape)).items():
        index = tuple(index) + (slice(None),) * (len(sds.shape) - len(index))
        bounds = [sl.indices(n)[:2] for sl, n in zip(index, sds.shape, strict=True)]
        shape = tuple(b - a for a, b in bounds)
        r0 = bounds[0][0]
        tail = tuple(slice(a, b) for a, b in bounds[1:])

        def fill(lo: int, hi: int, out: np.ndarray, r0=r0, tail=tail) -> None:
            have = max(0, min(r0 + hi, saved[0]) - r0 - lo)  # saved rows of the block
            if have:
                out[:have] = t[(slice(r0 + lo, r0 + lo + have), *tail)].read().result()
            out[have:] = 0

        parts += rows_on_devices(shape, dtype, [device], fill, READ_BYTES)
    return jax.make_array_from_single_device_arrays(
        tuple(sds.shape), sds.sharding, parts, dtype=dtype
    )
