"""Row-wise quantized tables: the format, quantizing on the host, dequantizing in numpy or
jnp, the reference bag and the "xla" implementation.

Format (inference only; row-wise as FBGEMM's fused 8-bit rows, with an ONNX-style
integer zero point so that a row costs its codes plus 3 bytes): row r, column d holds a
code q[r, d] in [0, 2**bits - 1] and dequantizes to

    float32(scale[r]) * (q[r, d] - zero_point[r])        (f16 scale, u8 zero point)

int8 rows keep one code per byte, int4 rows two (column 2j in the low nibble, 2j+1 in
the high one; an odd D leaves the last high nibble 0). The zero point is an integer, so
0.0 is exactly representable: padding-like zero rows stay zero.

Quantizing a row: its range [min(row, 0), max(row, 0)] in 2**bits - 1 steps, the step
rounded *up* to float16 (rounding to nearest could leave the range one step short, and
the top value would then clip by more than half a step), the zero point and the codes
computed with that float16 step, so dequantizing gives what was meant: every element is
within scale / 2 of its float value.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from .._embedding_bag.base import embedding_bag_ref
from .._segment_spmm.base import DEFAULT_CHUNK_SIZE, valid_entries

__all__ = [
    "BITS",
    "QuantizedTable",
    "quantize_rows",
    "dequantize_rows",
    "check_table",
    "quantized_embedding_bag_ref",
    "quantized_bag",
]

BITS = (8, 4)
"""The supported code widths."""

QUANTIZE_CHUNK_ELEMENTS = 1 << 22
"""Elements quantize_rows converts to float64 at a time (32 MiB): its extra host memory
is this, whatever the table's size."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedTable:
    """A `[V, D]` embedding table stored as row-wise int8 or int4 codes.

    A pytree: `data`, `scale` and `zero_point` are its leaves (numpy arrays on the host,
    jax arrays on a device, tracers under `jit`); `bits` and `dim` are static. Made by
    `quantize_rows`; `dequantize_rows` gives the float32 table back.
    """

    data: jax.Array | np.ndarray
    """u8[V, D] (bits=8) or u8[V, ceil(D/2)] (bits=4: column 2j in the low nibble, 2j+1
    in the high one)."""
    scale: jax.Array | np.ndarray
    """f16[V], the step of each row."""
    zero_point: jax.Array | np.ndarray
    """u8[V], the code of 0.0 in each row."""
    bits: int = dataclasses.field(metadata=dict(static=True))
    """8 or 4 (static)."""
    dim: int = dataclasses.field(metadata=dict(static=True))
    """D, the float table's row width (static)."""

    def __post_init__(self):
        # Only the static fields: pytree unflattening may fill the leaves with anything.
        if self.bits not in BITS:
            raise ValueError(f"QuantizedTable: bits must be 8 or 4, got {self.bits!r}")
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"QuantizedTable: dim must be an int >= 0, got {self.dim!r}")

    @property
    def vocab(self) -> int:
        """V, the number of rows."""
        return int(self.data.shape[0])

    @property
    def row_bytes(self) -> int:
        """Bytes of one row's codes: D (int8) or ceil(D / 2) (int4)."""
        return code_width(self.bits, self.dim)

    @property
    def nbytes(self) -> int:
        """Bytes of the three arrays: V * (row_bytes + 3) for a well-formed table."""
        return sum(
            int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
            for x in (self.data, self.scale, self.zero_point)
        )


# Exported functions that take or return a QuantizedTable serialize it by this name.
jax.export.register_pytree_node_serialization(
    QuantizedTable,
    serialized_name="sparsejax.ops.QuantizedTable",
    serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),  # (bits, dim)
    deserialize_auxdata=lambda b: tuple(json.loads(b)),
)


def code_width(bits: int, dim: int) -> int:
    """Bytes of codes per row."""
    return dim if bits == 8 else (dim + 1) // 2


def check_table(op: str, table, name: str = "table") -> None:
    """Trace-time check that `table` is a well-formed QuantizedTable (shapes, dtypes)."""
    where = f"sparsejax.ops.{op}"
    if not isinstance(table, QuantizedTable):
        raise TypeError(
            f"{where}: `{name}` must be a QuantizedTable (see quantize_rows), got "
            f"{type(table).__name__}"
        )
    expect = {
        "data": (np.uint8, 2),
        "scale": (np.float16, 1),
        "zero_point": (np.uint8, 1),
    }
    for field, (dtype, ndim) in expect.items():
        x = getattr(table, field)
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{where}: {name}.{field} must be an array, got {type(x).__name__}")
        if np.dtype(x.dtype) != dtype:
            raise TypeError(
                f"{where}: {name}.{field} must be {np.dtype(dtype).name}, got {np.dtype(x.dtype)}"
            )
        if x.ndim != ndim:
            raise ValueError(
                f"{where}: {name}.{field} must have rank {ndim}, got shape {tuple(x.shape)}"
            )
    v, width = table.data.shape
    if width != table.row_bytes:
        raise ValueError(
            f"{where}: {name}.data must have {table.row_bytes} columns for bits={table.bits}, "
            f"dim={table.dim}, got shape {tuple(table.data.shape)}"
        )
    for field in ("scale", "zero_point"):
        if getattr(table, field).shape[0] != v:
            raise ValueError(
                f"{where}: {name}.{field} must have one entry per row ({v}), got shape "
                f"{tuple(getattr(table, field).shape)}"
            )


# ---------------------------------------------------------------- quantizing (host)
def _scale_up_f16(step: np.ndarray) -> np.ndarray:
    """The smallest float16 >= step (f64), inf past float16's largest finite value."""
    with np.errstate(over="ignore", under="ignore"):
        s = step.astype(np.float16)
    low = s.astype(np.float64) < step
    s[low] = np.nextafter(s[low], np.float16(np.inf))
    return s


def quantize_rows(weights, bits: int, *, name: str = "table") -> QuantizedTable:
    """Quantize a float `[V, D]` table row by row to int8 or int4 codes (on the host).

    Each row gets its own float16 step and uint8 zero point over its range
    [min(row, 0), max(row, 0)]; every element then dequantizes to within scale / 2 of its
    value. Runs in numpy over chunks of rows, so a table larger than memory can be read
    from a `np.memmap` (the result holds D or ceil(D/2) + 3 bytes per row).

    Args:
      weights: float `[V, D]` array (numpy, memmap or jax; any float dtype).
      bits: 8 or 4.
      name: the table's name, for error messages.

    Returns:
      A QuantizedTable of numpy arrays (put it on a device with `jax.device_put`).

    Raises:
      ValueError: a non-finite value, or a row whose range needs a step beyond float16
        (above 65504), naming the table and the row; bad `bits` or shape.
      TypeError: `weights` is not a float array.

    Example:
      >>> t = quantize_rows(np.array([[0.0, 1.0, -0.5]], np.float32), 8)
      >>> float(np.abs(dequantize_rows(t) - [0.0, 1.0, -0.5]).max()) <= t.scale[0] / 2
      True
    """
    if bits not in BITS:
        raise ValueError(f"quantize_rows: bits must be 8 or 4, got {bits!r}")
    if not hasattr(weights, "shape") or not hasattr(weights, "dtype"):
        weights = np.asarray(weights)
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"quantize_rows: table {name!r} must be a float array, got {weights.dtype}")
    if len(weights.shape) != 2:
        raise ValueError(
            f"quantize_rows: table {name!r} must be [V, D], got shape {tuple(weights.shape)}"
        )
    if isinstance(weights, jax.Array):
        weights = np.asarray(weights)  # one host copy in its own dtype
    vocab, dim = weights.shape
    levels = 2**bits - 1
    data = np.zeros((vocab, code_width(bits, dim)), np.uint8)
    scale = np.ones((vocab,), np.float16)
    zero_point = np.zeros((vocab,), np.uint8)
    step_rows = max(1, QUANTIZE_CHUNK_ELEMENTS // max(dim, 1))
    for r0 in range(0, vocab, step_rows):
        x = np.asarray(weights[r0 : r0 + step_rows], np.float64)
        bad = ~np.isfinite(x)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise ValueError(
                f"quantize_rows: table {name!r} row {r0 + r} holds {x[r, c]} (column {c}); "
                "only finite values can be quantized"
            )
        lo = np.minimum(x.min(axis=1, initial=0.0), 0.0)
        hi = np.maximum(x.max(axis=1, initial=0.0), 0.0)
        s = _scale_up_f16((hi - lo) / levels)
        over = ~np.isfinite(s)
        if over.any():
            r = int(np.argmax(over))
            raise ValueError(
                f"quantize_rows: table {name!r} row {r0 + r} spans [{lo[r]:.6g}, {hi[r]:.6g}]: "
                f"its step {(hi[r] - lo[r]) / levels:.6g} exceeds float16's 65504; scale the "
                "table down or keep it in float"
            )
        s[hi == lo] = 1.0  # an all-zero row: scale 1, zero point 0, codes 0
        s64 = s.astype(np.float64)
        z = np.clip(np.rint(-lo / s64), 0, levels)
        q = np.clip(np.rint(x / s64[:, None]) + z[:, None], 0, levels).astype(np.uint8)
        if bits == 4:
            if dim % 2:
                q = np.pad(q, ((0, 0), (0, 1)))
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        rows = slice(r0, r0 + x.shape[0])
        data[rows], scale[rows], zero_point[rows] = q, s, z.astype(np.uint8)
    return QuantizedTable(data=data, scale=scale, zero_point=zero_point, bits=bits, dim=dim)


# ---------------------------------------------------------------- dequantizing
def dequantize(data, scale, zero_point, *, bits: int, dim: int):
    """f32[..., D] rows from their codes u8[..., W], scale f16[...] and zero point u8[...]
    (numpy in, numpy out; jax in, jax out): float32(scale) * (q - zero_point)."""
    xp = np if isinstance(data, np.ndarray) else jnp
    q = data
    if bits == 4:
        q = xp.stack([data & 0xF, data >> 4], axis=-1)
        q = q.reshape(*data.shape[:-1], 2 * data.shape[-1])[..., :dim]
    diff = q.astype(xp.int32) - zero_point.astype(xp.int32)[..., None]
    return scale.astype(xp.float32)[..., None] * diff.astype(xp.float32)


def dequantize_rows(table: QuantizedTable) -> np.ndarray | jax.Array:
    """The float32 `[V, D]` table a QuantizedTable stands for: numpy for a host table,
    jnp (traceable) for a device one."""
    check_table("dequantize_rows", table)
    return dequantize(table.data, table.scale, table.zero_point, bits=table.bits, dim=table.dim)


def quantized_embedding_bag_ref(
    table,
    ids,
    segment_ids,
    num_segments,
    *,
    weights=None,
    combiner="sum",
    implementation=None,
    name="table",
):
    """Reference of `quantized_embedding_bag` (same signature): `embedding_bag_ref` on
    the dequantized table."""
    del implementation
    check_table("quantized_embedding_bag_ref", table, name)
    return embedding_bag_ref(
        jnp.asarray(dequantize_rows(table)),
        jnp.asarray(ids),
        jnp.asarray(segment_ids),
        num_segments,
        weights=None if weights is None else jnp.asarray(weights),
        combiner=combiner,
    )


# ---------------------------------------------------------------- the "xla" implementation
def quantized_bag(
    coef,
    ids,
    segment_ids,
    data,
    scale,
    zero_point,
    *,
    num_segments,
    bits,
    dim,
    combiner,
    unit_values=False,
    chunk_size=DEFAULT_CHUNK_SIZE,
):
    """f32[S, D]: per bag, the sum ("sum") or the elementwise max ("max") of
    coef[k] * dequantized row ids[k] over its valid lookups (an empty bag gives 0).

    Gathers codes (not float rows) in fixed chunks of lookups, so the peak memory is
    chunk x D floats whatever the number of lookups.
    """
    del unit_values  # coef is 1 on valid lookups then; reading it costs little here
    n = ids.shape[0]
    is_max = combiner == "max"
    valid = valid_entries(ids, segment_ids, data.shape[0], num_segments)
    coef = jnp.where(valid, coef.astype(jnp.float32), 0.0)
    ids = jnp.where(valid, ids, 0)
    segment_ids = jnp.where(valid, segment_ids, num_segments)  # dropped by the reduction

    def chunk(c, i, s):
        g = data.at[i].get(mode="promise_in_bounds")
        rows = dequantize(g, scale[i], zero_point[i], bits=bits, dim=dim) * c[:, None]
        if is_max:
            return jax.ops.segment_max(rows, s, num_segments)
        return jax.ops.segment_sum(rows, s, num_segments)

    if n <= chunk_size:
        out = chunk(coef, ids, segment_ids)
    else:
        n_chunks = -(-n // chunk_size)
        pad = n_chunks * chunk_size - n
        c = jnp.pad(coef, (0, pad)).reshape(n_chunks, chunk_size)
        i = jnp.pad(ids, (0, pad)).reshape(n_chunks, chunk_size)
        s = jnp.pad(segment_ids, (0, pad), constant_values=num_segments)
        s = s.reshape(n_chunks, chunk_size)
        init = jnp.full((num_segments, dim), -jnp.inf if is_max else 0.0, jnp.float32)
        combine = jnp.maximum if is_max else jnp.add
        out = jax.lax.fori_loop(
            0, n_chunks, lambda k, acc: combine(acc, chunk(c[k], i[k], s[k])), init
        )
    return jnp.where(jnp.isneginf(out), 0.0, out) if is_max else out
