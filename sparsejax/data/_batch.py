"""`SparseBatch`: one batch of keyed padded ids, dense features and labels, with fixed
capacities so a training run compiles once; `JaggedIds`, the host-side ragged ids; and
`BatchPacker`, which turns the one into the other."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from ..embedding import FeatureSpec, TableSpec, check_specs


@dataclasses.dataclass(frozen=True)
class PaddedIds:
    """One feature's ids in a device batch: flat, padded to the feature's fixed capacity.

    The device form of a feature (what `BatchPacker` builds from `JaggedIds`): fixed
    shapes so a run compiles once. `ids[k]` belongs to bag `segments[k]`; ids of one
    example are contiguous and `segments` is non-decreasing (CSR order), so the lookup
    primitives take them as they are. Padding: id -1, weight 0, segment equal to the
    last bag (keeps the order). Named for what it is, padded ids, so it does not read as
    TorchRec's `JaggedTensor` (lengths + values), which is `JaggedIds` here.

    Ids are int32, or int64 on the host for a dynamic table's raw keys and for a table
    of 2**31 rows or more. The sharded store's batch (`sparsejax.sharding.shard_batch`)
    may add two things: `owners`, when the host routed a row-split table's ids (then
    `ids` holds each id's int32 row on its owner shard, so no int64 reaches a device),
    and `exchange`, the send-buffer capacity per lookup group (static: part of the
    compiled step's signature; empty means room for every id).
    """

    ids: jax.Array | np.ndarray  # i32[capacity] (i64 on the host, see above), -1 = padding
    segments: jax.Array | np.ndarray  # i32[capacity], bag of each id
    weights: jax.Array | np.ndarray | None = None  # f32[capacity] or None
    owners: jax.Array | np.ndarray | None = None  # i32[capacity]: owner shard (host-routed)
    exchange: tuple[tuple[str, int], ...] = ()  # ((group, ids per owner), ...)


jax.tree_util.register_dataclass(
    PaddedIds, data_fields=["ids", "segments", "weights", "owners"], meta_fields=["exchange"]
)


@dataclasses.dataclass(frozen=True)
class SparseBatch:
    """A batch: sparse features by name, dense features, labels and a row mask.

    `mask` is 1 for real examples and 0 for rows that pad the last batch of a dataset
    to the fixed batch size (losses and metrics weight by it, so no example is lost or
    counted twice).
    """

    features: Mapping[str, PaddedIds]
    dense: jax.Array | np.ndarray  # f32[B, num_dense]
    labels: jax.Array | np.ndarray  # f32[B] (or [B, ...] for other tasks)
    mask: jax.Array | np.ndarray  # f32[B]

    @property
    def batch_size(self) -> int:
        return int(self.mask.shape[0])


jax.tree_util.register_dataclass(
    SparseBatch, data_fields=["features", "dense", "labels", "mask"], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class JaggedIds:
    """Host-side ids of one feature: `lengths[i]` ids for example i, all ids flat in `values`.

    The ragged form, as TorchRec's `JaggedTensor` (lengths + values, optional weights):
    what readers and generators produce, of any length. `BatchPacker` turns it into the
    fixed-capacity device form, `PaddedIds`.
    """

    lengths: np.ndarray  # int[B]
    values: np.ndarray  # int[sum(lengths)]
    weights: np.ndarray | None = None  # float[sum(lengths)]

    @classmethod
    def from_dense(cls, ids: np.ndarray, weights: np.ndarray | None = None) -> JaggedIds:
        """`ids[B]` (one id each) or `ids[B, k]` with negative entries meaning absent."""
        ids = np.asarray(ids)
        if ids.ndim == 1:
            ids = ids[:, None]
            weights = None if weights is None else np.asarray(weights)[:, None]
        present = ids >= 0
        return cls(
            lengths=present.sum(1),
            values=ids[present],
            weights=None if weights is None else np.asarray(weights)[present],
        )


_INT32_MAX = 2**31 - 1


def _example(lengths: np.ndarray, k: int) -> int:
    """The example (0-based, within the chunk) that flat id position `k` belongs to."""
    return int(np.searchsorted(np.cumsum(lengths), k, side="right"))


class BatchPacker:
    """Packs host arrays into `SparseBatch`es of fixed shapes for the given specs.

    Errors name the feature, the example and the value: an id outside its table, a bag
    longer than `max_ids`, more ids than the feature's capacity, a weight missing or
    unexpected. Sequences longer than `max_ids` keep their last `max_ids` ids (the
    sliding window of a behavior sequence); that is the one documented truncation.

    Features of a dynamic table (`TableSpec.dynamic`) keep their raw keys: `PaddedIds.ids`
    is int64 (-1 pads), and their ids must be int64 or uint64 in [0, 2**63); other
    features get int32 rows, but those of a table of 2**31 rows or more int64 rows (the
    sharded store routes them to their owners on the host: `shard_batch`).
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        features: Sequence[FeatureSpec],
        *,
        batch_size: int,
        num_dense: int = 0,
    ):
        check_specs(tables, features)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.features = tuple(features)
        self.vocab = {t.name: t.vocab_size for t in tables}
        self.dynamic = {t.name for t in tables if t.dynamic is not None}
        """Tables keyed by raw int64 ids (their features' ids stay int64)."""
        self.batch_size = batch_size
        self.num_dense = num_dense

    def pack(
        self,
        sparse: Mapping[str, JaggedIds | np.ndarray],
        *,
        labels: np.ndarray,
        dense: np.ndarray | None = None,
        mask: np.ndarray | None = None,
        first_example: int = 0,
    ) -> SparseBatch:
        """Build a batch; fewer than `batch_size` examples are padded (mask 0).

        `first_example` only offsets the example numbers in error messages (e.g. the
        line number in a file).
        """
        labels = np.asarray(labels, np.float32)
        n = labels.shape[0]
        b = self.batch_size
        if n > b:
            raise ValueError(f"{n} examples do not fit a batch of {b}")
        unknown = set(sparse) - {f.name for f in self.features}
        if unknown:
            raise ValueError(
                f"unknown sparse features {sorted(unknown)}; the specs declare "
                f"{[f.name for f in self.features]}"
            )
        out = self._pack_one_id(sparse, n)
        for spec in self.features:
            if spec.name in out:
                continue
            if spec.name not in sparse:
                raise ValueError(f"feature {spec.name!r} is missing from the batch")
            col = sparse[spec.name]
            col = col if isinstance(col, JaggedIds) else JaggedIds.from_dense(col)
            out[spec.name] = self._pack_feature(spec, col, n, first_example)
        out = {spec.name: out[spec.name] for spec in self.features}
        dense_out = np.zeros((b, self.num_dense), np.float32)
        if not self.num_dense and dense is not None and np.size(dense):
            raise ValueError(
                f"dense features of shape {np.shape(dense)} given, but the packer "
                f"was built with num_dense=0"
            )
        if self.num_dense:
            if dense is None or np.shape(dense) != (n, self.num_dense):
                raise ValueError(
                    f"dense features must have shape ({n}, {self.num_dense}), "
                    f"got {None if dense is None else np.shape(dense)}"
                )
            dense_out[:n] = dense
        labels_out = np.zeros((b, *labels.shape[1:]), np.float32)
        labels_out[:n] = labels
        mask_out = np.zeros(b, np.float32)
        mask_out[:n] = 1.0 if mask is None else mask
        return SparseBatch(features=out, dense=dense_out, labels=labels_out, mask=mask_out)

    def _pack_one_id(self, sparse: Mapping, n: int) -> dict[str, PaddedIds]:
        """The features with exactly one in-range id per example and no weights (most
        features of CTR data), packed together: one range check and one copy for all
        of them instead of a dozen small operations each. Others are left out (the
        per-feature path packs them, and names any error)."""
        groups: dict[int, list] = {}
        for spec in self.features:
            if not self._maybe_one_id(spec, sparse.get(spec.name), n):
                continue
            dynamic = spec.table in self.dynamic
            groups.setdefault((spec.capacity_for(self.batch_size), dynamic), []).append(spec)
        out: dict[str, PaddedIds] = {}
        if n == 0:
            return out
        for (cap, dynamic), specs in groups.items():
            if cap < n:
                continue
            lengths = np.stack([sparse[s.name].lengths for s in specs])
            values = np.stack([sparse[s.name].values for s in specs])
            ok = (lengths.max(1) <= 1) & (lengths.sum(1) == n)  # so every length is 1
            ok &= values.min(1) >= 0
            if not dynamic:
                ok &= values.max(1) < np.array([self.vocab[s.table] for s in specs])
            if not ok.any():
                continue
            ids = np.full((len(specs), cap), -1, np.int64 if dynamic else np.int32)
            if not dynamic and max(self.vocab[s.table] for s in specs) > _INT32_MAX:
                continue  # int64 rows: the per-feature path
            ids[:, :n] = values
            seg = np.full((len(specs), cap), self.batch_size - 1, np.int32)
            seg[:, :n] = np.arange(n, dtype=np.int32)
            for j, spec in enumerate(specs):
                if ok[j]:
                    out[spec.name] = PaddedIds(ids=ids[j], segments=seg[j])
        return out

    def _maybe_one_id(self, spec: FeatureSpec, col, n: int) -> bool:
        """Whether `col` has the shapes of one id per example for `spec` (its lengths and
        ids are checked by the caller)."""
        return not (
            spec.is_sequence
            or spec.weighted
            or not isinstance(col, JaggedIds)
            or col.weights is not None
            or np.shape(col.values) != (n,)
            or np.shape(col.lengths) != (n,)
            # a dynamic table's uint64 and wrong dtypes: the per-feature path
            or (spec.table in self.dynamic and getattr(col.values, "dtype", None) != np.int64)
        )

    def one_id_matrix(self, sparse: Mapping, n: int) -> np.ndarray | None:
        """`ids i32[n, F]` (columns in `features` order) when every feature of the batch
        has exactly one in-range id per example, no weights and a static table of under
        2**31 rows: the whole sparse part of what `pack` would build, as one matrix that
        is shipped as is and unpacked on the device (`Loader`). None otherwise (then
        `pack` builds the batch, and names any error)."""
        if n == 0 or set(sparse) != {f.name for f in self.features}:
            return None
        b = self.batch_size
        for spec in self.features:
            if (
                spec.table in self.dynamic
                or self.vocab[spec.table] > _INT32_MAX
                or spec.capacity_for(b) < min(n, b)
                or not self._maybe_one_id(spec, sparse[spec.name], n)
            ):
                return None
        cols = [sparse[f.name] for f in self.features]
        lengths = np.stack([c.lengths for c in cols], 1)
        if lengths.min() != 1 or lengths.max() != 1:
            return None
        ids = np.stack([c.values for c in cols], 1)
        vocab = np.array([self.vocab[f.table] for f in self.features])
        if ids.min() < 0 or (ids.max(0) >= vocab).any():
            return None
        return ids.astype(np.int32, copy=False)

    def _pack_feature(self, spec: FeatureSpec, col: JaggedIds, n: int, first: int) -> PaddedIds:
        lengths = np.asarray(col.lengths, np.int64)
        values = np.asarray(col.values)
        name = f"feature {spec.name!r}"
        if lengths.shape != (n,):
            raise ValueError(f"{name}: {lengths.shape[0]} examples, the labels have {n}")
        if lengths.size and lengths.min() < 0:
            raise ValueError(
                f"{name}: negative length {lengths.min()} for example "
                f"{first + int(np.argmin(lengths))}"
            )
        if values.shape[0] != lengths.sum():
            raise ValueError(
                f"{name}: {values.shape[0]} ids for lengths summing to {lengths.sum()}"
            )
        if (col.weights is not None) != spec.weighted:
            raise ValueError(
                f"{name}: weights {'missing' if spec.weighted else 'given'}, "
                f"but FeatureSpec.weighted={spec.weighted}"
            )
        dynamic = spec.table in self.dynamic
        if dynamic:
            values = self._keys(spec, values, lengths, first)
        else:
            vocab = self.vocab[spec.table]
            bad = np.flatnonzero((values < 0) | (values >= vocab))
            if bad.size:
                k = bad[0]
                raise ValueError(
                    f"{name}: id {int(values[k])} of example {first + _example(lengths, k)} "
                    f"is outside table {spec.table!r} of {vocab} rows"
                )
        example = np.repeat(np.arange(n), lengths)
        starts = np.cumsum(lengths) - lengths
        pos = np.arange(values.shape[0]) - starts[example]
        weights = col.weights
        if spec.is_sequence:  # keep the last max_ids of each sequence
            keep = pos >= (lengths[example] - spec.max_ids)
            pos = (pos - np.maximum(lengths[example] - spec.max_ids, 0))[keep]
            values, example = values[keep], example[keep]
            weights = None if weights is None else weights[keep]
            segments = example * spec.max_ids + pos
            num_bags = self.batch_size * spec.max_ids
        else:
            long = np.flatnonzero(lengths > spec.max_ids)
            if long.size:
                i = long[0]
                raise ValueError(
                    f"{name}: example {first + i} has {lengths[i]} ids, more "
                    f"than FeatureSpec.max_ids={spec.max_ids}"
                )
            segments = example
            num_bags = self.batch_size
        cap = spec.capacity_for(self.batch_size)
        if values.shape[0] > cap:
            raise ValueError(
                f"{name}: the batch holds {values.shape[0]} ids but the "
                f"capacity is {cap}; set FeatureSpec(capacity>={values.shape[0]})"
            )
        wide = dynamic or self.vocab[spec.table] > _INT32_MAX  # 64-bit rows stay int64
        ids_out = np.full(cap, -1, np.int64 if wide else np.int32)
        seg_out = np.full(cap, num_bags - 1, np.int32)
        ids_out[: values.shape[0]] = values
        seg_out[: values.shape[0]] = segments
        w_out = None
        if spec.weighted:
            w_out = np.zeros(cap, np.float32)
            w_out[: values.shape[0]] = weights
        return PaddedIds(ids=ids_out, segments=seg_out, weights=w_out)

    @staticmethod
    def _keys(spec: FeatureSpec, values: np.ndarray, lengths: np.ndarray, first: int):
        """The raw ids of a dynamic table's feature as int64 keys; a dtype other than
        int64/uint64, or an id outside [0, 2**63) is an error naming the feature and the
        example."""
        name = f"feature {spec.name!r}"
        if values.dtype == np.uint64:
            bad = np.flatnonzero(values >= np.uint64(1 << 63))
            what = "is >= 2**63"
        elif values.dtype == np.int64:
            bad = np.flatnonzero(values < 0)
            what = "is negative"
        else:
            raise ValueError(
                f"{name}: ids of dtype {values.dtype}, but table {spec.table!r} is dynamic "
                f"(raw 64-bit keys): give int64 or uint64 ids"
            )
        if bad.size:
            k = bad[0]
            raise ValueError(
                f"{name}: id {int(values[k])} of example {first + _example(lengths, k)} "
                f"{what}; the "
                f"keys of dynamic table {spec.table!r} are in [0, 2**63) (missing values: "
                f"MISSING_KEY, as RawIdMapping gives; larger ids: hash them)"
            )
        return values.astype(np.int64, copy=False)
