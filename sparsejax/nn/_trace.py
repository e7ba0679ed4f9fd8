"""Where a model's embedding tables live: the `TableStore` of every embedding layer, by
the layer's module path, computed from the model and an example batch alone (an
abstract trace: nothing is allocated)."""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax

from ..embedding import Expansion, TableStore
from ._embedding import EmbeddingBagCollection


def embedding_layouts(model: nn.Module, batch) -> dict[tuple[str, ...], TableStore]:
    """The `TableStore` of every embedding layer of `model`, by module path.

    A pure function of the model and an example batch (any batch of the run's shapes):
    the model is traced abstractly (`jax.eval_shape`), nothing is allocated.
    """
    return trace_layouts(model, batch)[0]


def trace_layouts(model: nn.Module, batch) -> tuple[dict, Mapping]:
    """`embedding_layouts` and the shapes of the model's variables, from one trace."""
    layouts, _, shapes = trace_layers(model, batch)
    return layouts, shapes


def trace_layers(model: nn.Module, batch) -> tuple[dict, dict, Mapping]:
    """`embedding_layouts`, each layer's `Expansion` (its composed tables as the plain
    ones its store holds) and the shapes of the model's variables, from one trace."""
    found: dict[tuple[str, ...], TableStore] = {}
    expansions: dict[tuple[str, ...], Expansion] = {}

    def interceptor(next_fun, args, kwargs, context):
        if isinstance(context.module, EmbeddingBagCollection) and context.method_name == "__call__":
            found[tuple(context.module.path)] = context.module.store
            expansions[tuple(context.module.path)] = context.module.expansion
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), batch))
    return found, expansions, shapes
