"""`InferenceTableStore`: read-only tables for serving, in fp32, fp16, bf16 or row-wise
int8 / int4 (dequantized on the fly by the lookup kernels).

It is a `DeviceTableStore` (same stacking, groups and lookups) whose state holds the
serving form of each stack: `{"weights": [rows, D]}` in a float storage dtype, or
`{"data", "scale", "zero_point"}` of a `sparsejax.ops.QuantizedTable`. There are no
optimizer slots and no updates. A trained model runs on it unchanged, inside
`sparsejax.nn._embedding.tables_stored_by` (what the exporter does).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..embedding import DeviceTableStore, FeatureSpec, GroupLookups, TableSpec
from ..ops import SGD, QuantizedTable, quantize_rows, quantized_embedding_bag

FLOAT_KINDS = {"float32": "float32", "fp32": "float32", "float16": "float16",
               "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}  # fmt: skip
INT_KINDS = {"int8": 8, "int4": 4}
QUANTIZE_CHOICES = ("fp32", "fp16", "bf16", "int8", "int4")


def storage_kind(quantize: str | None) -> str:
    """The canonical name of a `--quantize` choice: float32, float16, bfloat16, int8 or int4."""
    q = "float32" if quantize is None else str(quantize).lower()
    if q in FLOAT_KINDS:
        return FLOAT_KINDS[q]
    if q in INT_KINDS:
        return q
    raise ValueError(f"quantize={quantize!r} is not one of {QUANTIZE_CHOICES}")


def serving_spec(spec: TableSpec, rows: int) -> TableSpec:
    """`spec` as a plain table of `rows` rows: one device, no dynamic keys or host cache,
    no optimizer slots (what a model dir holds); a composed table keeps its parts."""
    return TableSpec(
        name=spec.name,
        vocab_size=int(rows),
        dim=spec.dim,
        dtype="float32",
        optimizer=SGD(learning_rate=0.0),
        compose=spec.compose,
    )


def quantize_table(weights: np.ndarray, kind: str, name: str) -> dict[str, np.ndarray]:
    """One table's serving arrays: `{"weights"}` (float kinds) or the row-wise
    `{"data", "scale", "zero_point"}` (int8 / int4)."""
    kind = storage_kind(kind)
    if kind in INT_KINDS:
        q = quantize_rows(np.asarray(weights, np.float32), INT_KINDS[kind], name=name)
        return {"data": q.data, "scale": q.scale, "zero_point": q.zero_point}
    w = np.asarray(weights, np.float32)
    if kind != "float32" and np.isfinite(w).all():
        big = np.abs(w).max(initial=0.0)
        if kind == "float16" and big > np.finfo(np.float16).max:
            raise ValueError(
                f"table {name!r}: a value of magnitude {big:.3g} overflows float16; "
                f"use --quantize bf16 or int8"
            )
    return {"weights": np.asarray(jnp.asarray(w, kind))}


class InferenceTableStore(DeviceTableStore):
    """Read-only serving tables (see the module docstring); `quantize` is one of
    `QUANTIZE_CHOICES` (None: fp32)."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        features: Sequence[FeatureSpec],
        *,
        quantize: str | None = None,
        mesh=None,
        implementation: str | None = None,
    ):
        super().__init__(tables, features, mesh=mesh, implementation=implementation)
        self.kind = storage_kind(quantize)

    def _key(self):
        return (*super()._key(), self.kind)

    @classmethod
    def factory(cls, quantize: str | None, implementation: str | None = None):
        """A `tables_stored_by` maker: every layer's tables in this store."""

        def make(tables, features, *, implementation=implementation):
            return cls(tables, features, quantize=quantize, implementation=implementation)

        return make

    def with_mesh(self, mesh) -> InferenceTableStore:
        tables, features, _ = self._specs
        return InferenceTableStore(
            tables, features, quantize=self.kind, mesh=mesh, implementation=self.implementation
        )

    def _stack_shapes(self, rows: int, dim: int) -> dict:
        r = self._replicated()
        sds = functools.partial(jax.ShapeDtypeStruct, sharding=r)
        if self.kind in INT_KINDS:
            width = dim if self.kind == "int8" else (dim + 1) // 2
            return {
                "data": sds((rows, width), jnp.uint8),
                "scale": sds((rows,), jnp.float16),
                "zero_point": sds((rows,), jnp.uint8),
            }
        return {"weights": sds((rows, dim), jnp.dtype(self.kind))}

    def abstract_state(self) -> dict:
        return {n: self._stack_shapes(s.rows, s.dim) for n, s in self.stacks.items()}

    def init_part(self, key: jax.Array, name: str) -> dict:
        """Zeros of the serving form (a model dir's arrays replace them: `import_tables`)."""
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.abstract_state()[name])

    def import_tables(self, tables: Mapping) -> dict:
        """The state from `{table: quantize_table(...)}`, stacked and placed; names a
        missing table or one whose arrays do not fit its spec."""
        state = {}
        for name, stack in self.stacks.items():
            want = self._stack_shapes(1, stack.dim)
            parts = []
            for t in stack.tables:
                got = tables.get(t.name)
                if got is None:
                    raise KeyError(f"no arrays for table {t.name!r} (have {sorted(tables)})")
                if set(got) != set(want):
                    raise ValueError(
                        f"table {t.name!r}: arrays {sorted(got)}, a {self.kind} table "
                        f"needs {sorted(want)}"
                    )
                for k, s in want.items():
                    a = got[k]
                    if (
                        a.shape[0] != t.vocab_size
                        or a.shape[1:] != s.shape[1:]
                        or (a.dtype != s.dtype)
                    ):
                        raise ValueError(
                            f"table {t.name!r}: {k} is {a.dtype}{list(a.shape)}, expected "
                            f"{s.dtype}{[t.vocab_size, *s.shape[1:]]}"
                        )
                parts.append(got)
            state[name] = {k: np.concatenate([p[k] for p in parts]) for k in want}
        return jax.device_put(state, self.state_shardings())

    def export_tables(self, state: Mapping) -> dict:
        raise TypeError("InferenceTableStore holds serving arrays; it has no training state")

    def apply_gradients(self, *args, **kwargs):
        raise TypeError("InferenceTableStore is read-only: serving tables take no updates")

    def _bag(self, stack_state: Mapping, lk: GroupLookups, num_bags: int) -> jax.Array:
        if self.kind not in INT_KINDS:
            return super()._bag(stack_state, lk, num_bags).astype(jnp.float32)
        stack = self.stacks[lk.stack]
        table = QuantizedTable(
            data=stack_state["data"],
            scale=stack_state["scale"],
            zero_point=stack_state["zero_point"],
            bits=INT_KINDS[self.kind],
            dim=stack.dim,
        )
        return quantized_embedding_bag(
            table,
            lk.ids,
            lk.segments,
            num_bags,
            weights=lk.coefficients,
            combiner=lk.combiner,
            implementation=self.implementation,
        )
