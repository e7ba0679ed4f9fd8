"""libSVM / libFM text (`label idx:val idx:val ...` or `label field:idx:val ...`).

Each line is a label and a variable number of features separated by spaces or tabs.
Without a field map all of a line's features become one weighted bag (feature
`"features"`: ids = the indices, weights = the values). With a field map the data is
field-aware: each field becomes its own weighted multi-hot feature, so a model can give
each field its own table and pooling, as FFM / DeepFM papers do. The map sends
libFM field ids (`field:idx:val` tokens) or ranges of feature indices (`idx:val` tokens)
to feature names:

    {0: "user", 1: "item", 2: "tags"}                       # libFM field ids
    {"1-1000": "user", "1001-5000": "item", 5001: "bias"}   # libSVM index ranges

A feature that no entry covers is a malformed line (`unmapped_feature`, counted in the
report, or the error in strict mode), never dropped silently. `qid:N` tokens and
`# comments` are ignored. The label is mapped and checked by a `LabelRule` (default: 0 or
1; libSVM's -1/+1 need `{"map": {-1: 0}}`). Parsing is vectorized over a chunk (tokens,
colons and numbers found with numpy); only flagged lines are re-parsed in Python to name
the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ._batch import JaggedIds
from ._csv import ParseErrors
from ._labels import LabelRule
from ._loader import Examples
from ._text import parse_decimal, parse_float

DEFAULT_FEATURE = "features"
"""The feature that holds every id when no field map is given."""


class _Bad(Exception):
    def __init__(self, reason: str, field: str, value: str):
        super().__init__(reason)
        self.reason, self.field, self.value = reason, field, value


def parse_field_map(field_map: Mapping | None) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """(lows, highs, feature index of each range; sorted by low) and the feature names,
    from {int | "lo-hi" | "n": name}; overlapping ranges are an error."""
    if not field_map:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), ()
    names: list[str] = []
    ranges = []
    for key, name in field_map.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"field_map: {key!r} must map to a feature name, got {name!r}")
        try:
            if isinstance(key, int) and not isinstance(key, bool):
                lo = hi = key
            else:
                text = str(key).strip()
                lo_s, dash, hi_s = text.partition("-")
                lo, hi = (int(lo_s), int(hi_s)) if dash else (int(text), int(text))
        except ValueError:
            raise ValueError(
                f"field_map: key {key!r} is not a field id or an index range like '1-1000'"
            ) from None
        if lo < 0 or hi < lo:
            raise ValueError(f"field_map: key {key!r} is not a non-empty non-negative range")
        if name not in names:
            names.append(name)
        ranges.append((lo, hi, names.index(name), key))
    ranges.sort()
    for (_, hi1, _, k1), (lo2, _, _, k2) in zip(ranges, ranges[1:], strict=False):
        if lo2 <= hi1:
            raise ValueError(f"field_map: keys {k1!r} and {k2!r} overlap")
    lows = np.array([r[0] for r in ranges], np.int64)
    highs = np.array([r[1] for r in ranges], np.int64)
    feat = np.array([r[2] for r in ranges], np.int64)
    return np.stack([lows, highs, feat]), feat, tuple(names)


class LibsvmParser:
    """Parses chunks of whole libSVM / libFM lines into `Examples` (see the module
    docstring); `feature` names the single bag when there is no field map."""

    def __init__(
        self,
        *,
        field_map: Mapping | None = None,
        label: LabelRule | None = None,
        feature: str = DEFAULT_FEATURE,
    ):
        self.rule = label if label is not None else LabelRule()
        table, _, names = parse_field_map(field_map)
        self.ranges = table  # [3, k]: lows, highs, feature index
        self.names = names if names else (feature,)
        self.field_aware = bool(names)

    def _feature_of(self, keys: np.ndarray) -> np.ndarray:
        """Feature index of each key (-1: not covered by the map)."""
        if not self.field_aware:
            return np.zeros(keys.shape, np.int64)
        lows, highs, feat = self.ranges
        k = np.searchsorted(lows, keys, side="right") - 1
        kk = np.maximum(k, 0)
        return np.where((k >= 0) & (keys <= highs[kk]), feat[kk], -1)

    # -- the exact per-line path, to name the reason of a flagged line ------------------
    def exact_line(self, line: bytes) -> None:
        toks = line.split()
        for i, t in enumerate(toks):
            if t.startswith(b"#"):
                toks = toks[:i]
                break
        if not toks:
            raise _Bad("empty_line", "(line)", "")
        try:
            y = float(toks[0])
        except ValueError:
            raise _Bad("bad_label", "label", toks[0].decode(errors="replace")) from None
        if not math.isfinite(y):
            raise _Bad("bad_label", "label", toks[0].decode(errors="replace"))
        for t in toks[1:]:
            if t.startswith(b"qid:"):
                continue
            parts = t.split(b":")
            text = t.decode(errors="replace")
            if len(parts) not in (2, 3):
                raise _Bad("bad_feature", "(token)", text)
            for p in parts[:-1]:
                if not p.isdigit() or len(p) > 18:
                    raise _Bad("bad_feature", "(token)", text)
            try:
                v = float(parts[-1])
            except ValueError:
                raise _Bad("bad_value", "(token)", text) from None
            if not math.isfinite(v):
                raise _Bad("bad_value", "(token)", text)
            key = int(parts[0])
            if self._feature_of(np.array([key]))[0] < 0:
                kind = "field" if len(parts) == 3 else "index"
                raise _Bad("unmapped_feature", f"{kind} {key}", text)

    # -- the vectorized path ---------------------------------------------------------
    def parse(self, data: bytes, first_line: int, path: str, errs: ParseErrors):
        """`(Examples, lines read)` of a chunk of whole lines starting at `first_line`."""
        if b"\r" in data:
            data = data.replace(b"\r", b" ")
        if data and not data.endswith(b"\n"):
            data += b"\n"
        arr = np.frombuffer(data, np.uint8)
        nl = np.flatnonzero(arr == 10)
        n = nl.shape[0]
        is_tok = (arr != 32) & (arr != 9) & (arr != 10)
        edge = np.diff(np.concatenate([[False], is_tok, [False]]).astype(np.int8))
        t_start = np.flatnonzero(edge == 1)
        t_end = np.flatnonzero(edge == -1)
        t_line = np.searchsorted(nl, t_start)  # line index of each token
        # Comments: a token starting with '#' ends the line's tokens.
        comment = arr[t_start] == ord("#") if t_start.size else np.zeros(0, bool)
        if comment.any():
            first_tok = np.searchsorted(t_line, t_line, side="left")
            c = np.cumsum(comment)
            before = c[first_tok] - comment[first_tok]
            live = (c - before) == 0
            t_start, t_end, t_line = t_start[live], t_end[live], t_line[live]
        # The first token of a line is its label.
        is_label = np.ones(t_start.shape[0], bool)
        is_label[1:] = t_line[1:] != t_line[:-1]
        bad = np.ones(n, bool)  # a line without a label token is bad (empty)
        bad[t_line[is_label]] = False
        lab_line = t_line[is_label]
        raw_labels = np.zeros(n)
        lval, lbad = parse_float(arr, t_start[is_label], t_end[is_label] - t_start[is_label])
        raw_labels[lab_line] = lval
        bad[lab_line[lbad]] = True
        # Feature tokens: [field:]idx:val; qid:N is skipped.
        f_start, f_end, f_line = t_start[~is_label], t_end[~is_label], t_line[~is_label]
        qid = (
            (f_end - f_start > 4)
            & (arr[np.minimum(f_start, arr.shape[0] - 1)] == ord("q"))
            & (arr[np.minimum(f_start + 3, arr.shape[0] - 1)] == ord(":"))
        )
        f_start, f_end, f_line = f_start[~qid], f_end[~qid], f_line[~qid]
        colons = np.flatnonzero(arr == ord(":"))
        c_lo = np.searchsorted(colons, f_start)
        n_col = np.searchsorted(colons, f_end) - c_lo
        bad[f_line[(n_col < 1) | (n_col > 2)]] = True
        ok = (n_col == 1) | (n_col == 2)
        nc = colons.shape[0]
        c1 = colons[np.minimum(c_lo, max(nc - 1, 0))] if nc else f_end
        c2 = colons[np.minimum(c_lo + 1, max(nc - 1, 0))] if nc else f_end
        three = n_col == 2
        key_end = c1
        idx_start = np.where(three, c1 + 1, f_start)
        idx_end = np.where(three, c2, c1)
        val_start = np.where(three, c2, c1) + 1
        key, kbad = parse_decimal(arr, f_start, np.where(ok, key_end - f_start, 0), signed=False)
        idx, ibad = parse_decimal(arr, idx_start, np.where(ok, idx_end - idx_start, 0), False)
        vlen = np.where(ok, f_end - val_start, 0)
        val, vbad = parse_float(arr, val_start, vlen)
        for k in np.flatnonzero(vbad & ok):  # exotic numbers: Python decides
            try:
                x = float(data[int(val_start[k]) : int(f_end[k])])
                val[k] = x
                vbad[k] = not math.isfinite(x)
            except ValueError:
                pass
        tbad = ok & (
            kbad | ibad | vbad | (key_end == f_start) | (idx_end == idx_start) | (vlen == 0)
        )
        bad[f_line[tbad]] = True
        feat = self._feature_of(key)
        bad[f_line[ok & (feat < 0)]] = True
        # Lines the fast path refused: the exact path names the reason.
        lo = np.zeros(n, np.int64)
        lo[1:] = nl[:-1] + 1
        for i in np.flatnonzero(bad):
            line = data[int(lo[i]) : int(nl[i])]
            try:
                self.exact_line(line)
                errs.add(first_line + int(i), "malformed", "(line)", line[:80].decode("latin-1"))
            except _Bad as e:
                errs.add(first_line + int(i), e.reason, e.field, e.value)
        keep = ~bad
        kept = np.flatnonzero(keep)
        labels = self.rule.apply(raw_labels[kept], path=path, lines=first_line + kept)
        tk = np.flatnonzero(keep[f_line])
        rows, fk = f_line[tk], feat[tk]
        nf = len(self.names)
        # Group the kept tokens by feature in one stable sort (rows stay in order).
        order = np.argsort(fk, kind="stable")
        bounds = np.searchsorted(fk[order], np.arange(nf + 1))
        counts = np.bincount(fk * n + rows, minlength=nf * n).reshape(nf, n)[:, kept]
        ids, ws = idx[tk][order], val[tk][order].astype(np.float32)
        sparse = {
            name: JaggedIds(
                lengths=counts[j].astype(np.int32),
                values=ids[bounds[j] : bounds[j + 1]],
                weights=ws[bounds[j] : bounds[j + 1]],
            )
            for j, name in enumerate(self.names)
        }
        ex = Examples(labels=labels, dense=np.zeros((kept.shape[0], 0), np.float32), sparse=sparse)
        return ex, n
