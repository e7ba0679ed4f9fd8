"""Vectorized parsing of text fields: a chunk of lines is one uint8 array, fields are
(start, length) arrays into it, and numbers and ids are converted for all fields at once
with numpy. Each converter returns a `bad` mask instead of raising; readers re-check only
the flagged lines with exact per-line Python code, to name the reason and the field (or,
for values the fast path does not handle, such as 20-digit numbers, to accept them).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

MAX_DECIMAL_DIGITS = 18
"""Longer integers are flagged (int64 holds 18 decimal digits safely)."""
_MAX_FLOAT_WIDTH = 40
_POW10 = 10.0 ** np.arange(23)  # exact doubles

_HEX_LUT = np.full(256, 255, np.uint8)
for _c in b"0123456789":
    _HEX_LUT[_c] = _c - 48
for _c in b"abcdef":
    _HEX_LUT[_c] = _c - 87
    _HEX_LUT[_c - 32] = _c - 87  # upper case


def _load_native():
    try:
        from .. import _cpu_ext
    except ImportError:
        return None
    return _cpu_ext if hasattr(_cpu_ext, "parse_criteo") else None


NATIVE = _load_native()
"""`sparsejax._cpu_ext` when it has the text functions (csrc/text.cc), else None."""


def count_lines(data: bytes) -> int:
    """The newlines in `data` (memchr in C++ when built: ~10x `bytes.count`)."""
    return NATIVE.count_lines(data) if NATIVE is not None else data.count(b"\n")


def split_fields(arr: np.ndarray, delim: int, n_fields: int):
    """Lines and fields of a chunk (`arr`: bytes ending with a newline, no carriage
    returns). Returns `(n_lines, start[n, k], length[n, k], good[n], line_lo[n],
    line_hi[n])`: field j of line i is arr[start:start+length]; `good` marks lines with
    exactly `n_fields` fields (the others have length 0 everywhere); a line spans
    arr[line_lo:line_hi] without its newline."""
    sep = np.flatnonzero((arr == delim) | (arr == 10))
    nl = arr[sep] == 10
    line_last = np.flatnonzero(nl)  # index in `sep` of each line's newline
    n = line_last.shape[0]
    if n and sep.shape[0] == n * n_fields and (line_last % n_fields == n_fields - 1).all():
        # Every line has n_fields fields (the common case): a reshape, no gathers.
        end = sep.reshape(n, n_fields)
        start = np.empty(sep.shape[0], np.int64)
        start[0] = 0
        start[1:] = sep[:-1] + 1
        start = start.reshape(n, n_fields)
        return n, start, end - start, np.ones(n, bool), start[:, 0], end[:, -1]
    line_first = np.empty(n, np.int64)
    line_first[:1] = 0
    line_first[1:] = line_last[:-1] + 1
    good = (line_last - line_first + 1) == n_fields
    field_start = np.empty(sep.shape[0], np.int64)
    field_start[:1] = 0
    field_start[1:] = sep[:-1] + 1
    k = np.minimum(line_first[:, None] + np.arange(n_fields), max(sep.shape[0] - 1, 0))
    if sep.shape[0]:
        start, end = field_start[k], sep[k]
    else:
        start = end = np.zeros((0, n_fields), np.int64)
    length = np.where(good[:, None], end - start, 0)
    line_lo = field_start[line_first] if n else np.zeros(0, np.int64)
    line_hi = sep[line_last]
    return n, start, length, good, line_lo, line_hi


def gather_matrix(arr: np.ndarray, start: np.ndarray, length: np.ndarray, width: int):
    """Bytes of the fields as a zero-padded [..., width] uint8 matrix."""
    last = max(arr.shape[0] - 1, 0)
    j = np.arange(width)
    mat = arr[np.minimum(start[..., None] + j, last)] if arr.shape[0] else None
    if mat is None:
        return np.zeros((*start.shape, width), np.uint8)
    return np.where(j < length[..., None], mat, 0).astype(np.uint8)


def field_strings(arr: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The fields arr[start:start+length] (1-D) as a numpy str array, decoded as UTF-8
    (invalid bytes replaced): one gather of fixed-width windows, then ASCII at numpy's
    speed (other text by `np.char.decode`)."""
    n = start.shape[0]
    width = max(int(length.max(initial=0)), 1)
    padded = np.zeros(arr.shape[0] + width, np.uint8)
    padded[: arr.shape[0]] = arr
    windows = np.ndarray((arr.shape[0] + 1,), f"S{width}", padded, 0, (1,))
    m = windows[start].view(np.uint8).reshape(n, width)
    m[np.arange(width) >= length[:, None]] = 0
    s = m.view(f"S{width}").reshape(n)
    if not (m >= 128).any():
        return s.astype(f"U{width}")
    return np.char.decode(s, "utf-8", "replace")


@dataclasses.dataclass(frozen=True)
class TextFields:
    """Some columns of some lines of delimited text, not converted yet: field j of row i
    is `data[start[i, j] : start[i, j] + length[i, j]]`, from line `lines[i]`. Readers
    that keep raw values (the event log's ids and dates) convert each column as its
    values allow: `ints`, `floats` or `strings`, each exactly as Python's `int`, `float`
    and `str` of the field would, at numpy's speed for the common forms."""

    data: np.ndarray  # u8[bytes]
    lines: np.ndarray  # i64[n] 1-based line numbers
    start: np.ndarray  # i64[n, k]
    length: np.ndarray  # i64[n, k]

    def __len__(self) -> int:
        return int(self.lines.shape[0])

    @staticmethod
    def concat(parts: Sequence[TextFields], k: int) -> TextFields:
        """The rows of `parts` (of `k` columns) in order, over one buffer."""
        offsets = np.cumsum([0] + [p.data.shape[0] for p in parts])
        return TextFields(
            np.concatenate([np.zeros(0, np.uint8), *(p.data for p in parts)]),
            np.concatenate([np.zeros(0, np.int64), *(p.lines for p in parts)]),
            np.concatenate(
                [
                    np.zeros((0, k), np.int64),
                    *(p.start + o for p, o in zip(parts, offsets[:-1], strict=True)),
                ]
            ),
            np.concatenate([np.zeros((0, k), np.int64), *(p.length for p in parts)]),
        )

    def take(self, rows: np.ndarray) -> TextFields:
        return TextFields(self.data, self.lines[rows], self.start[rows], self.length[rows])

    def value(self, i: int, j: int) -> str:
        s = int(self.start[i, j])
        return bytes(self.data[s : s + int(self.length[i, j])]).decode(errors="replace")

    def strings(self, j: int) -> np.ndarray:
        return field_strings(self.data, self.start[:, j], self.length[:, j])

    def ints(self, j: int) -> np.ndarray | None:
        """Column j as int64 when Python's `int` takes every value, else None."""
        val, bad = parse_decimal(self.data, self.start[:, j], self.length[:, j])
        bad |= self.length[:, j] == 0
        rows = np.flatnonzero(bad)
        try:
            val[rows] = [int(self.value(i, j)) for i in rows]
        except (ValueError, OverflowError):
            return None
        return val

    def floats(self, j: int) -> np.ndarray:
        """Column j as float64 by Python's `float`, NaN where it refuses a value (an empty
        field too). (`parse_float`'s fast path covers short fields only; times such as
        Unix seconds are longer.)"""
        values = self.strings(j).tolist()
        try:
            return np.fromiter(map(float, values), np.float64, len(values))
        except ValueError:
            return np.array([_float_or_nan(v) for v in values], np.float64)


def _float_or_nan(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return np.nan


_ONES = 0x0101010101010101
_U = np.uint64


def _words(arr: np.ndarray, start: np.ndarray) -> np.ndarray:
    """The 8 bytes at each `start` as little-endian uint64 (bytes past the end are 0):
    an unaligned uint64 view of the buffer, so one gather reads 8 bytes."""
    n = arr.shape[0]
    start = np.asarray(start, np.int64)
    tail = np.zeros(16, np.uint8)
    k = min(8, n)
    tail[:k] = arr[n - k :]
    tail_view = np.ndarray((9,), "<u8", tail, 0, (1,))
    if n < 8:
        return tail_view[np.clip(start, 0, 8)]
    view = np.ndarray((n - 7,), "<u8", np.ascontiguousarray(arr), 0, (1,))
    out = view[np.minimum(start, n - 8)]
    near = np.flatnonzero(start > n - 8)
    if near.size:
        out[near] = tail_view[np.minimum(start[near] - (n - 8), 8)]
    return out


def _between(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Per byte of x: 0x80 where lo < byte < hi (bytes >= 0x80 never), else 0."""
    low7 = x & _U(_ONES * 127)
    t = (_U(_ONES * (127 + hi)) - low7) & ~x & (low7 + _U(_ONES * (127 - lo)))
    return t & _U(_ONES * 128)


def _decimal8(arr: np.ndarray, start: np.ndarray, ndig: np.ndarray):
    """1-8 decimal digits at each start, by SWAR arithmetic on one uint64 per field
    (Lemire's 8-digit parse); returns (values, bad)."""
    x = _words(arr, start)
    shift = (_U(8) * (_U(8) - ndig.astype(np.uint64))).astype(np.uint64)
    mask = ~_U(0) >> shift
    xm = x & mask
    zeros = _U(_ONES * 0x30)
    bad = _between(xm | (zeros & ~mask), 0x2F, 0x3A) != _U(_ONES * 128)
    with np.errstate(over="ignore"):
        v = (xm - (zeros & mask)) << shift  # right-aligned; leading bytes are digit 0
        v = v * _U(10) + (v >> _U(8))
        v = (
            (v & _U(0x000000FF000000FF)) * _U(100 + (1000000 << 32))
            + ((v >> _U(16)) & _U(0x000000FF000000FF)) * _U(1 + (10000 << 32))
        ) >> _U(32)
    return v.astype(np.int64), bad


def _hex8(arr: np.ndarray, start: np.ndarray):
    """Exactly 8 hex digits at each start, by SWAR arithmetic; returns (values, bad)."""
    x = _words(arr, start)
    ok = _between(x, 0x2F, 0x3A) | _between(x, 0x60, 0x67) | _between(x, 0x40, 0x47)
    bad = ok != _U(_ONES * 128)
    nib = (x & _U(_ONES * 0x0F)) + _U(9) * ((x >> _U(6)) & _U(_ONES))
    y = nib.byteswap()  # the first digit is the most significant
    y = (y | (y >> _U(4))) & _U(0x00FF00FF00FF00FF)
    y = (y | (y >> _U(8))) & _U(0x0000FFFF0000FFFF)
    y = (y | (y >> _U(16))) & _U(0x00000000FFFFFFFF)
    return y.astype(np.int64), bad


def parse_decimal(arr: np.ndarray, start: np.ndarray, length: np.ndarray, signed: bool = True):
    """Decimal integers at arr[start:start+length] (any shape); returns (int64 values,
    bad). Empty fields give 0 and are not bad; more than 18 digits are bad (re-check)."""
    shape = start.shape
    start, length = start.ravel(), length.ravel()
    if arr.shape[0] == 0 or start.shape[0] == 0:
        return np.zeros(shape, np.int64), (length > 0).reshape(shape)
    last = arr.shape[0] - 1
    neg = (length > 0) & (arr[np.minimum(start, last)] == ord("-")) if signed else False
    ndig = length - neg
    fast = (ndig >= 1) & (ndig <= 8)
    val = np.zeros(start.shape, np.int64)
    bad = np.asarray(neg & (ndig == 0), bool) | np.zeros(start.shape, bool)
    if fast.all():
        v, b = _decimal8(arr, start + neg, ndig)
        val, bad = np.where(neg, -v, v), bad | b
    else:
        f = np.flatnonzero(fast)
        if f.size:
            negf = neg[f] if signed else 0
            v, b = _decimal8(arr, start[f] + negf, ndig[f])
            val[f] = np.where(negf, -v, v) if signed else v
            bad[f] |= b
        slow = np.flatnonzero(~fast & (length > 0))
        if slow.size:
            v, b = _decimal_loop(arr, start[slow], length[slow], signed)
            val[slow], bad[slow] = v, b
    return val.reshape(shape), bad.reshape(shape)


def _decimal_loop(arr: np.ndarray, start: np.ndarray, length: np.ndarray, signed: bool):
    last = max(arr.shape[0] - 1, 0)
    if arr.shape[0] == 0:
        return np.zeros(start.shape, np.int64), length > 0
    neg = (length > 0) & (arr[np.minimum(start, last)] == ord("-"))
    if not signed:
        neg = np.zeros_like(neg)
    bad = (length > MAX_DECIMAL_DIGITS) | (neg & (length == 1))
    val = np.zeros(start.shape, np.int64)
    width = int(min(length.max(initial=0), MAX_DECIMAL_DIGITS))
    for j in range(width):
        valid = (j < length) & ~(neg & (j == 0))
        d = arr[np.minimum(start + j, last)].astype(np.int64) - 48
        ok = (d >= 0) & (d <= 9)
        bad |= valid & ~ok
        val = np.where(valid & ok, val * 10 + d, val)
    return np.where(neg, -val, val), bad


def parse_hex(arr: np.ndarray, start: np.ndarray, length: np.ndarray, max_digits: int = 8):
    """Hex ids of 1..max_digits digits; returns (int64 values, empty -> -1, bad)."""
    shape = start.shape
    start, length = start.ravel(), length.ravel()
    if max_digits >= 8 and arr.shape[0]:
        eight = length == 8
        if eight.any():
            val = np.full(start.shape, -1, np.int64)
            bad = np.zeros(start.shape, bool)
            f = np.flatnonzero(eight)
            val[f], bad[f] = _hex8(arr, start[f])
            rest = np.flatnonzero(~eight & (length > 0))
            if rest.size:
                val[rest], bad[rest] = _hex_loop(arr, start[rest], length[rest], max_digits)
            return val.reshape(shape), bad.reshape(shape)
    v, b = _hex_loop(arr, start, length, max_digits)
    return v.reshape(shape), b.reshape(shape)


def _hex_loop(arr: np.ndarray, start: np.ndarray, length: np.ndarray, max_digits: int):
    last = max(arr.shape[0] - 1, 0)
    bad = length > max_digits
    val = np.zeros(start.shape, np.uint64)
    for j in range(min(int(length.max(initial=0)), max_digits)):
        valid = j < length
        d = _HEX_LUT[arr[np.minimum(start + j, last)]]
        ok = d != 255
        bad |= valid & ~ok
        val = np.where(valid & ok, (val << np.uint64(4)) | d.astype(np.uint64), val)
    return np.where(length == 0, -1, val.astype(np.int64)), bad


def parse_float(arr: np.ndarray, start: np.ndarray, length: np.ndarray):
    """Decimal floats `[+-]digits[.digits][(e|E)[+-]digits]` (any shape); returns (float64
    values, bad). Exactly Python's `float()` on what it accepts: the mantissa has at most
    15 digits and the power of ten at most 22, so one IEEE multiply or divide of two exact
    doubles rounds correctly (Clinger's fast path). Anything else (more digits, "nan",
    spaces, "1_0") is flagged for the exact per-value path. Empty fields give 0, not bad."""
    shape = start.shape
    start, length = start.ravel(), length.ravel()
    if start.shape[0] and arr.shape[0]:
        # Integers of up to 8 digits (most dense columns) by the SWAR path; the rest below.
        v, b = parse_decimal(arr, start, np.minimum(length, 9))
        b |= length > 9
        if not b.any():
            return v.astype(np.float64).reshape(shape), b.reshape(shape)
        rest = np.flatnonzero(b)
        out = v.astype(np.float64)
        out[rest], bad = _parse_float(arr, start[rest], length[rest])
        b[rest] = bad
        return out.reshape(shape), b.reshape(shape)
    v, b = _parse_float(arr, start, length)
    return v.reshape(shape), b.reshape(shape)


def _parse_float(arr: np.ndarray, start: np.ndarray, length: np.ndarray):
    shape = start.shape
    n = start.shape[0]
    width = int(min(length.max(initial=0), _MAX_FLOAT_WIDTH))
    bad = length > _MAX_FLOAT_WIDTH
    if n == 0 or width == 0:
        return np.zeros(shape), bad.reshape(shape)
    m = gather_matrix(arr, start, np.minimum(length, width), width)
    j = np.arange(width)
    inside = j < length[:, None]
    sign = (m[:, 0] == ord("-")) | (m[:, 0] == ord("+"))
    neg = m[:, 0] == ord("-")
    is_e = ((m == ord("e")) | (m == ord("E"))) & inside
    has_e = is_e.any(1)
    e_pos = np.where(has_e, np.argmax(is_e, 1), length)
    mant = inside & (j < e_pos[:, None]) & ~((j == 0) & sign[:, None])
    digit = (m >= 48) & (m <= 57)
    dot = m == ord(".")
    mant_digits = mant & digit
    n_dots = (mant & dot).sum(1)
    n_mant = mant_digits.sum(1)
    bad |= (mant & ~digit & ~dot).any(1) | (n_dots > 1) | ((n_mant == 0) & (length > 0))
    bad |= n_mant > 15
    dot_pos = np.where(n_dots == 1, np.argmax(mant & dot, 1), e_pos)
    frac = (mant_digits & (j > dot_pos[:, None])).sum(1)
    # Mantissa value: digits in order (skipping the dot).
    val = np.zeros(n, np.int64)
    d = m.astype(np.int64) - 48
    for c in range(width):
        take = mant_digits[:, c]
        val = np.where(take, val * 10 + d[:, c], val)
    # Exponent: after the e, an optional sign and 1-3 digits.
    exp_part = inside & (j > e_pos[:, None])
    first = e_pos + 1
    esign = np.zeros(n, bool)
    eneg = np.zeros(n, bool)
    if has_e.any():
        c0 = m[np.arange(n), np.minimum(first, width - 1)]
        esign = has_e & (first < length) & ((c0 == ord("-")) | (c0 == ord("+")))
        eneg = esign & (c0 == ord("-"))
    exp_digits = exp_part & ~((j == first[:, None]) & esign[:, None])
    n_exp = exp_digits.sum(1)
    bad |= (exp_digits & ~digit).any(1) | (has_e & (n_exp == 0)) | (n_exp > 3)
    ev = np.zeros(n, np.int64)
    for c in range(width):
        take = exp_digits[:, c] & digit[:, c]
        ev = np.where(take, ev * 10 + d[:, c], ev)
    k = np.where(eneg, -ev, ev) - frac
    bad |= np.abs(k) > 22
    p = _POW10[np.minimum(np.abs(k), 22)]
    x = val.astype(np.float64)
    out = np.where(k >= 0, x * p, x / p)
    out = np.where(neg, -out, out)
    out = np.where(length == 0, 0.0, out)
    return out.reshape(shape), bad.reshape(shape)


def stable_hash(value: str) -> int:
    """A 63-bit id of a string, the same in every process and Python version (blake2b);
    never negative, so it cannot collide with the missing id -1."""
    return stable_hash_bytes(value.encode())


def stable_hash_bytes(value: bytes) -> int:
    """`stable_hash` of a string's UTF-8 bytes."""
    digest = hashlib.blake2b(value, digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


_MIX1 = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xBF58476D1CE4E5B9)
_MIX3 = np.uint64(0x94D049BB133111EB)


def _fingerprint(arr: np.ndarray, start: np.ndarray, length: np.ndarray):
    """A uint64 key per string and its 8-byte words. Strings of at most 7 bytes get an
    exact key (their bytes and length); longer ones a 64-bit mix of their words."""
    width = int(length.max(initial=0))
    nw = max(1, -(-width // 8))
    words = []
    for k in range(nw):
        rem = np.clip(length - 8 * k, 0, 8).astype(np.uint64)
        w = _words(arr, start + 8 * k)
        mask = np.where(rem >= 8, ~_U(0), (_U(1) << (rem * _U(8))) - _U(1))
        words.append(w & mask)
    ln = length.astype(np.uint64)
    if width <= 7:
        return words[0] | (ln << _U(56)), words, True
    h = ln * _MIX1
    with np.errstate(over="ignore"):
        for w in words:
            h = (h ^ w) * _MIX2
            h ^= h >> _U(31)
        h = (h ^ (h >> _U(30))) * _MIX3
        h ^= h >> _U(27)
    return h, words, False


class Hasher:
    """`stable_hash` of many byte strings at once, with a cache across chunks.

    Each string gets a vectorized uint64 fingerprint (exact for strings of up to 7
    bytes, a 64-bit mix of the bytes otherwise); strings that share a fingerprint in one
    call are checked to be equal. Distinct fingerprints are looked up in a sorted cache
    (numpy, no Python per string); only strings never seen before are hashed with
    blake2b in Python. Up to `cache_size` entries are kept. (For strings longer than 7
    bytes, two different strings in different chunks with the same 64-bit fingerprint
    would share an id: as likely as two strings sharing a 63-bit `stable_hash`.)
    """

    def __init__(self, cache_size: int = 1 << 22):
        self.cache_size = cache_size
        self._keys = np.zeros(0, np.uint64)  # sorted
        self._vals = np.zeros(0, np.int64)
        self._new_keys: list[np.ndarray] = []
        self._new_vals: list[np.ndarray] = []
        self._recent_keys = np.zeros(0, np.uint64)  # sorted, merged into _keys when large
        self._recent_vals = np.zeros(0, np.int64)

    @staticmethod
    def _find(keys, vals, q):
        if keys.shape[0] == 0:
            return np.zeros(q.shape, bool), np.zeros(q.shape, np.int64)
        i = np.minimum(np.searchsorted(keys, q), keys.shape[0] - 1)
        return keys[i] == q, vals[i]

    def _remember(self, keys: np.ndarray, vals: np.ndarray) -> None:
        if self._keys.shape[0] + self._recent_keys.shape[0] >= self.cache_size:
            return
        k = np.concatenate([self._recent_keys, keys])
        v = np.concatenate([self._recent_vals, vals])
        o = np.argsort(k, kind="stable")
        self._recent_keys, self._recent_vals = k[o], v[o]
        if self._recent_keys.shape[0] > max(1 << 14, self._keys.shape[0] // 8):
            k = np.concatenate([self._keys, self._recent_keys])
            v = np.concatenate([self._vals, self._recent_vals])
            o = np.argsort(k, kind="stable")
            self._keys, self._vals = k[o], v[o]
            self._recent_keys = np.zeros(0, np.uint64)
            self._recent_vals = np.zeros(0, np.int64)

    def __call__(self, arr: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
        """int64 hashes of arr[start:start+length] (1-D arrays; empty strings hashed too)."""
        n = start.shape[0]
        if n == 0:
            return np.zeros(0, np.int64)
        start = np.asarray(start, np.int64)
        length = np.asarray(length, np.int64)
        mv = memoryview(np.ascontiguousarray(arr))
        out = np.empty(n, np.int64)
        long = length > 64
        if long.any():  # long strings one by one (rare)
            for i in np.flatnonzero(long):
                out[i] = stable_hash_bytes(mv[int(start[i]) : int(start[i] + length[i])])
            short = np.flatnonzero(~long)
            out[short] = self(arr, start[short], length[short])
            return out
        fp, words, exact = _fingerprint(arr, start, length)
        keys, first, inv = np.unique(fp, return_index=True, return_inverse=True)
        inv = inv.ravel()
        collide = np.zeros(0, np.int64)
        if not exact:  # every string must equal its group's first string
            rep = first[inv]
            diff = length != length[rep]
            for w in words:
                diff |= w != w[rep]
            collide = np.flatnonzero(diff)
        found, vals = self._find(self._keys, self._vals, keys)
        f2, v2 = self._find(self._recent_keys, self._recent_vals, keys)
        vals = np.where(found, vals, v2)
        found |= f2
        miss = np.flatnonzero(~found)
        if miss.size:
            s0 = start[first[miss]].tolist()
            s1 = (start[first[miss]] + length[first[miss]]).tolist()
            digests = b"".join(
                [
                    hashlib.blake2b(mv[a:b], digest_size=8).digest()
                    for a, b in zip(s0, s1, strict=True)
                ]
            )
            new = (np.frombuffer(digests, "<u8") & _U(0x7FFF_FFFF_FFFF_FFFF)).astype(np.int64)
            vals[miss] = new
            self._remember(keys[miss], new)
        out[:] = vals[inv]
        for i in collide:
            out[i] = stable_hash_bytes(mv[int(start[i]) : int(start[i] + length[i])])
        return out


def items_of(arr: np.ndarray, start: np.ndarray, length: np.ndarray, sep: int):
    """Items of separator-joined cells (e.g. "3|17|5"): returns (item start, item
    length, cell of each item, items per cell). Empty cells have no items."""
    n = start.shape[0]
    nonempty = length > 0
    # The cells' bytes, each followed by a separator, in one buffer.
    total = int((length + 1).sum())
    offs = np.zeros(n + 1, np.int64)
    np.cumsum(length + 1, out=offs[1:])
    src = np.arange(total) - np.repeat(offs[:-1] - start, length + 1)
    buf = np.empty(total, np.uint8)
    if total:
        buf[:] = arr[np.minimum(src, max(arr.shape[0] - 1, 0))]
        buf[offs[1:] - 1] = sep
    seps = np.flatnonzero(buf == sep)  # item ends (including each cell's terminator)
    item_start_buf = np.empty(seps.shape[0], np.int64)
    item_start_buf[:1] = 0
    item_start_buf[1:] = seps[:-1] + 1
    cell = np.searchsorted(offs[1:], seps, side="right")
    keep = nonempty[cell]
    item_start_buf, item_end_buf, cell = item_start_buf[keep], seps[keep], cell[keep]
    # Back to positions in arr: a cell's bytes are contiguous in both.
    shift = start[cell] - offs[:-1][cell]
    counts = np.bincount(cell, minlength=n).astype(np.int64)
    return item_start_buf + shift, item_end_buf - item_start_buf, cell, counts
