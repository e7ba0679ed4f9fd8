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

from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
from flax import traverse_util

from ..embedding._collection import EmbeddingCollection, GroupLookups, apply_group_gradients
from ..embedding._spec import FeatureSpec, TableSpec

EMBEDDING = "embedding"
"""Variable collection of the tables (weights and optimizer slots)."""
EMBEDDING_GRADS = "embedding_grads"
"""Perturbation collection: zeros added to the pooled rows, to take their gradient."""
EMBEDDING_LOOKUPS = "embedding_lookups"
"""Collection where each layer records its lookups for the sparse update."""
_LOOKUPS = "lookups"


class EmbeddingBagCollection(nn.Module):
    """Pooled (or sequence) embeddings of many sparse features over many tables.

    Input: `{feature: Jagged}` (e.g. `SparseBatch.features`) and the batch size. Output:
    `{feature: [B, D]}` for pooled features, `[B, max_ids, D]` for sequences.
    """

    tables: Sequence[TableSpec]
    features: Sequence[FeatureSpec]
    implementation: str | None = None
    """Kernel choice for the sparse ops (None: the platform's best)."""

    @property
    def collection(self) -> EmbeddingCollection:
        return EmbeddingCollection(self.tables, self.features, implementation=self.implementation)

    @nn.compact
    def __call__(self, features: Mapping, batch_size: int) -> dict[str, jax.Array]:
        ec = self.collection
        state = {}
        for name in ec.stacks:
            var = self.variable(EMBEDDING, name,
                                lambda n=name: ec.init_stack(self.make_rng("params"), n))
            state[name] = var.value
        outputs, lookups = ec.lookup(state, features, batch_size)
        outputs = {g: self.perturb(g, out, collection=EMBEDDING_GRADS)
                   for g, out in outputs.items()}
        self.sow(EMBEDDING_LOOKUPS, _LOOKUPS, lookups,
                 init_fn=lambda: None, reduce_fn=lambda _, new: new)
        return ec.split(outputs, batch_size)


def apply_embedding_gradients(tables: Mapping, lookups: Mapping, grads: Mapping, *,
                              step: jax.Array | int,
                              learning_rate: jax.Array | float | None = None,
                              implementation: str | None = None) -> dict:
    """Sparse update of every `EmbeddingBagCollection` in a model.

    Args:
      tables: the model's `"embedding"` collection.
      lookups: the `"embedding_lookups"` collection returned by `apply(..., mutable=...)`.
      grads: gradient w.r.t. the `"embedding_grads"` collection.
      step: 1-based optimizer step; learning_rate: optional override (a schedule).

    Returns:
      The new `"embedding"` collection (in place under donation).
    """
    flat_tables = traverse_util.flatten_dict(_unfreeze(tables), keep_empty_nodes=True)
    flat_grads = traverse_util.flatten_dict(_unfreeze(grads))
    new = dict(flat_tables)
    flat_lookups = traverse_util.flatten_dict(
        _unfreeze(lookups), is_leaf=lambda _, v: isinstance(v, GroupLookups))
    by_layer: dict[tuple, dict[str, GroupLookups]] = {}
    for path, lk in flat_lookups.items():
        # path = (*layer_path, "lookups", group)
        by_layer.setdefault(path[:-2], {})[path[-1]] = lk
    for layer, groups in by_layer.items():
        state = {lk.stack: {"weights": new[(*layer, lk.stack, "weights")],
                            "slots": {k[-1]: v for k, v in new.items()
                                      if k[:-1] == (*layer, lk.stack, "slots")}}
                 for lk in groups.values()}
        g = {name: flat_grads[(*layer, name)] for name in groups}
        state = apply_group_gradients(state, groups, g, step=step, learning_rate=learning_rate,
                                      implementation=implementation)
        for stack, st in state.items():
            new[(*layer, stack, "weights")] = st["weights"]
            for k, v in st["slots"].items():
                new[(*layer, stack, "slots", k)] = v
    return traverse_util.unflatten_dict(new)


def _unfreeze(tree):
    from flax.core import unfreeze

    return unfreeze(tree) if hasattr(tree, "unfreeze") else tree
