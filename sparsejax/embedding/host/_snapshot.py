"""`TableSnapshot`: the host-side state of one tiered table, as checkpoints store it."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np


@dataclasses.dataclass
class TableSnapshot:
    """One tiered table's rows, slots and metadata at a step: everything (`"full"`), or
    what changed since the previous save (`"delta"`: changed rows plus tombstones, the
    keys evicted since then, so a restore of full + deltas never resurrects one).

    `arrays` maps flat names to numpy arrays: "keys" (int64[n]: the table's raw keys, or
    row ids of a static table), "weights" ([n, D]), "slot/<name>" ([n] or [n, D]),
    "count" and "last_seen" (per key), "tombstones" (int64[m], deltas), and
    "admission/<name>" (the admission filter's state, whole in every snapshot).
    `meta` is JSON: the spec summary and the host counters (step, stats).
    """

    kind: Literal["full", "delta"]
    step: int
    arrays: dict[str, np.ndarray]
    meta: dict
