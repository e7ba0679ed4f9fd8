"""Flax adapter: an embedding layer that trains sparsely inside any Flax model.

Tables live in their own variable collection (`"embedding"`), never in `"params"`, so
`jax.grad` over params never builds a dense table gradient. The layer marks its pooled
outputs with `Module.perturb` (collection `"embedding_grads"`): the gradient of the loss
w.r.t. those zeros is the gradient w.r.t. the pooled rows, and `apply_embedding_gradients`
turns it into sparse row updates using what the layer recorded in `"embedding_lookups"`.
`sparsejax.train` does all of this; a custom training loop does:

    variables = model.init(key, batch)
    def loss_fn(params, grads_probe):
        out, aux = model.apply({**variables, "params": params, EMBEDDING_GRADS: grads_probe},
                               batch, mutable=[EMBEDDING_LOOKUPS])
        return loss(out), aux[EMBEDDING_LOOKUPS]
    (l, lookups), (g_params, g_rows) = jax.value_and_grad(loss_fn, (0, 1), has_aux=True)(
        variables["params"], variables[EMBEDDING_GRADS])
    tables = apply_embedding_gradients(variables[EMBEDDING], lookups, g_rows, step=step)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import traverse_util
from jax.sharding import Mesh

from ..embedding import Expansion, FeatureSpec, TableSpec, TableStore, expand, subtree, with_subtree
from ..sharding import make_store

EMBEDDING = "embedding"
"""Variable collection of the tables (the table store's state)."""
EMBEDDING_GRADS = "embedding_grads"
"""Perturbation collection: zeros added to the store's lookup outputs, to take their
gradient."""
EMBEDDING_LOOKUPS = "embedding_lookups"
"""Collection where each layer records its lookups for the sparse update."""
_LOOKUPS = "lookups"
_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("sparsejax_mesh", default=None)
_STORE: contextvars.ContextVar[Callable[..., TableStore] | None] = contextvars.ContextVar(
    "sparsejax_store", default=None
)


@contextlib.contextmanager
def tables_on(mesh: Mesh | None) -> Iterator[None]:
    """Inside, every `EmbeddingBagCollection` without a mesh of its own places its tables
    on `mesh` (the `Trainer` wraps its traces in it, so a model's layers need no mesh
    argument)."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


@contextlib.contextmanager
def tables_stored_by(make: Callable[..., TableStore] | None) -> Iterator[None]:
    """Inside, every `EmbeddingBagCollection` keeps its tables in
    `make(tables, features, implementation=...)` instead of the store their placement
    picks: how `sparsejax.serving` runs a trained model on read-only (e.g. quantized)
    tables without the model knowing."""
    token = _STORE.set(make)
    try:
        yield
    finally:
        _STORE.reset(token)


@dataclasses.dataclass(frozen=True)
class StoreLookups:
    """What one layer looked up: its store (static) and the store's residuals, so the
    sparse update needs nothing but the collections (`apply_embedding_gradients`)."""

    store: TableStore
    residuals: Any


jax.tree_util.register_dataclass(StoreLookups, data_fields=["residuals"], meta_fields=["store"])


class EmbeddingBagCollection(nn.Module):
    """Pooled (or sequence) embeddings of many sparse features over many tables.

    Named after TorchRec's pooled module: each feature is pooled by its combiner
    (`[B, D]`); a feature with `combiner=None` keeps its ids as a sequence
    (`[B, max_ids, D]`, what TorchRec's unpooled `EmbeddingCollection` gives), so one
    layer serves both kinds with one lookup per table stack.

    Input: `{feature: PaddedIds}` (e.g. `SparseBatch.features`) and the batch size.
    The tables live in a `TableStore` (`store`; chosen by the tables' `placement`), whose
    state is this layer's `"embedding"` variables, one per `store.state_names` entry.
    """

    tables: Sequence[TableSpec]
    features: Sequence[FeatureSpec]
    implementation: str | None = None
    """Kernel choice for the sparse ops (None: the platform's best)."""
    mesh: Mesh | None = None
    """Devices the tables live on (None: the mesh of `tables_on`, e.g. the `Trainer`'s;
    outside one, one device)."""

    @property
    def expansion(self) -> Expansion:
        """The plain tables and features the store holds: composed tables (`compose`) as
        their parts."""
        return expand(self.tables, self.features)

    @property
    def store(self) -> TableStore:
        """The table store behind this layer (a pure function of the fields)."""
        ex = self.expansion
        make = _STORE.get()
        if make is not None:
            return make(ex.tables, ex.features, implementation=self.implementation)
        mesh = self.mesh if self.mesh is not None else _MESH.get()
        return make_store(ex.tables, ex.features, mesh=mesh, implementation=self.implementation)

    @property
    def collection(self) -> TableStore:
        """Old name of `store`."""
        return self.store

    @nn.compact
    def __call__(self, features: Mapping, batch_size: int) -> dict[str, jax.Array]:
        ex = self.expansion
        features = ex.split_features(features)
        store = self.store
        state = {}
        for name in store.state_names:
            var = self.variable(
                EMBEDDING, name, lambda n=name: store.init_part(self.make_rng("params"), n)
            )
            state[name] = var.value
        with jax.named_scope("embedding_lookup"):  # `sparsejax profile` attributes by it
            outputs, residuals = store.lookup(state, features, batch_size)
        outputs = {
            g: self.perturb(g, out, collection=EMBEDDING_GRADS) for g, out in outputs.items()
        }
        self.sow(
            EMBEDDING_LOOKUPS,
            _LOOKUPS,
            StoreLookups(store, residuals),
            init_fn=lambda: None,
            reduce_fn=lambda _, new: new,
        )
        return ex.combine_outputs(store.split(outputs, batch_size))


def apply_embedding_gradients(
    tables: Mapping,
    lookups: Mapping,
    grads: Mapping,
    *,
    step: jax.Array | int,
    learning_rate: jax.Array | float | None = None,
    learning_rate_scale: jax.Array | float | None = None,
    l2: float = 0.0,
    implementation: str | None = None,
) -> dict:
    """Sparse update of every `EmbeddingBagCollection` in a model, each by its store.

    Args:
      tables: the model's `"embedding"` collection.
      lookups: the `"embedding_lookups"` collection returned by `apply(..., mutable=...)`.
      grads: gradient w.r.t. the `"embedding_grads"` collection.
      step: 1-based optimizer step; learning_rate: optional override of every table's.
      learning_rate_scale: optional multiplier of every table's learning rate (a
        schedule's value; traced, so it changes without recompiling).
      l2: L2 regularization of the touched rows (see `apply_group_gradients`).
      implementation: optional kernel override for the update (None: each layer's own).

    Returns:
      The new `"embedding"` collection (in place under donation).
    """
    tables, grads = _unfreeze(tables), _unfreeze(grads)
    flat_lookups = traverse_util.flatten_dict(
        _unfreeze(lookups), is_leaf=lambda _, v: isinstance(v, StoreLookups)
    )
    new = dict(tables)
    for path, lk in flat_lookups.items():
        layer = path[:-1]  # path = (*layer_path, "lookups")
        kw = {} if implementation is None else {"implementation": implementation}
        if learning_rate_scale is not None:
            kw["learning_rate_scale"] = learning_rate_scale
        if l2:
            kw["l2"] = l2
        updated = lk.store.apply_gradients(
            subtree(tables, layer),
            lk.residuals,
            subtree(grads, layer),
            step=step,
            learning_rate=learning_rate,
            **kw,
        )
        new = with_subtree(new, layer, {**subtree(tables, layer), **updated})
    return new


def _unfreeze(tree):
    from flax.core import unfreeze

    return unfreeze(tree) if hasattr(tree, "unfreeze") else tree
