"""Label rules: which column holds the label, how raw values become labels, and the check
that stops a run whose labels are not what the loss expects.

Why: a binary cross-entropy fed -1/1 labels does not fail, it trains to a meaningless
negative loss (an unchecked libFM file once reached -48,467). Every reader applies its
`LabelRule` to each chunk it parses, so a label outside the allowed set stops the read
with a `LabelError` naming the file, the line and the value, and saying which option fixes
it (`label.map` or `label.threshold`).

Order: `map` first, then `threshold`, then `check`.

Example::

    rule = LabelRule.from_dict({"column": "rating", "threshold": 4})  # rating >= 4 -> 1
    rule = LabelRule(map={-1: 0})  # libFM / libSVM -1/1 labels
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import numpy as np

from ._options import options_from_dict

CHECKS = ("binary", "unit", "none")


class LabelError(ValueError):
    """A label outside the allowed set: names the file, line and value (one line)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LabelRule:
    """How a reader turns a raw label value into the training label, and what it allows."""

    column: str | None = None
    """Label column (delimited text, Parquet). None: the format's own label (the first
    field of Criteo and libSVM lines) or, for delimited text, `TableSchema.label`."""
    map: Mapping[float, float] | None = None
    """Replace raw values, e.g. {-1: 0} for -1/1 labels; values not in the map are kept."""
    threshold: float | None = None
    """label = 1 if value >= threshold else 0 (after `map`), e.g. 4 for `rating >= 4`."""
    check: Literal["binary", "unit", "none"] = "binary"
    """binary: every label must be 0 or 1; unit: in [0, 1] (soft labels); none: any
    finite value (regression)."""

    def __post_init__(self):
        if self.check not in CHECKS:
            raise ValueError(f"label.check must be one of {list(CHECKS)}, got {self.check!r}")
        if self.map is not None:
            if not isinstance(self.map, Mapping):
                raise ValueError(f"label.map must be a mapping like {{-1: 0}}, got {self.map!r}")
            try:
                m = {float(k): float(v) for k, v in self.map.items()}
            except (TypeError, ValueError):
                raise ValueError(
                    f"label.map must map numbers to numbers, got {dict(self.map)!r}"
                ) from None
            object.__setattr__(self, "map", m)
        if self.threshold is not None:
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float):
                raise ValueError(f"label.threshold must be a number, got {self.threshold!r}")
            object.__setattr__(self, "threshold", float(self.threshold))

    @classmethod
    def from_dict(cls, d: Mapping | LabelRule | None) -> LabelRule:
        """From a plain dict (a YAML `label:` section); an unknown key is an error naming
        it and the closest valid key. A `LabelRule` or None passes through (None: the
        default rule)."""
        if d is None:
            return cls()
        if isinstance(d, LabelRule):
            return d
        return options_from_dict(cls, d, where="label")

    def apply(
        self, raw: np.ndarray, *, path: str, lines: np.ndarray | None = None, unit: str = "line"
    ) -> np.ndarray:
        """Labels (f32) from raw values; raises `LabelError` at the first value the check
        refuses, naming `path`, its line (`lines[i]`, 1-based; `unit` says what it counts,
        e.g. "row" for Parquet; without `lines`, the position in `raw`) and the raw value."""
        raw = np.asarray(raw, np.float64)
        y = raw
        if self.map:
            y = raw.copy()
            for k, v in self.map.items():
                y[raw == k] = v
        if self.threshold is not None:
            y = (y >= self.threshold).astype(np.float64)
        if self.check == "binary":
            bad = (y != 0) & (y != 1)
        elif self.check == "unit":
            bad = ~((y >= 0) & (y <= 1))
        else:
            bad = ~np.isfinite(y)
        if bad.any():
            i = int(np.argmax(bad))
            where = f"{unit} {int(lines[i]) if lines is not None else i + 1}"
            allowed = {"binary": "{0, 1}", "unit": "[0, 1]", "none": "finite values"}[self.check]
            value = _fmt(raw[i]) + (f" (-> {_fmt(y[i])} after label.map)" if self.map else "")
            n_bad = int(bad.sum())
            more = f" ({n_bad:,} such labels in this chunk)" if n_bad > 1 else ""
            raise LabelError(
                f"{path}: {where}: label {value} is not in {allowed}{more}; set "
                f"label.map (e.g. {{-1: 0}}), label.threshold (e.g. 4: value >= 4 is 1)"
                + (" or label.check" if self.check != "none" else "")
            )
        return y.astype(np.float32)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))
