"""Where a model's embedding tables live, as checkpoints see it: `Layouts`, the
`TableStore` of every embedding layer by module path (`sparsejax.nn.embedding_layouts`
traces it from a model; here it is data, passed in).

The "embedding" variable collection of a model holds each layer's store state under
the layer's path; these helpers convert it to and from the per-table form
`{layer_key: {table: {"weights", "slots"}}}` that checkpoints store (the stores'
`export_tables` / `import_tables`, so a change of stacking, mesh or store never breaks
a restore).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax

from ..embedding import TableStore, subtree

Layouts = Mapping[tuple[str, ...], TableStore]
"""Each embedding layer's `TableStore`, by module path."""


def layer_key(path: tuple[str, ...]) -> str:
    """A layer's module path as one string ("embedding", "tower/embedding", "<root>")."""
    return "/".join(path) or "<root>"


@functools.lru_cache(maxsize=64)
def _export(store: TableStore):
    """`store.export_tables`, jitted once per store as the store jits it (one compile
    instead of one per slice and reshape of every table; the values are the same)."""
    return store.jitted_export()


def tables_by_name(layouts: Layouts, tables: Mapping) -> dict:
    """`{layer_key: {table: {"weights", "slots"}}}` of an "embedding" collection."""
    return {
        layer_key(path): _export(store)(subtree(tables, path)) for path, store in layouts.items()
    }


def tables_from_layers(layouts: Layouts, layers: Mapping) -> dict:
    """The nested "embedding" collection from `{path: stacked state of that layer}`."""
    tables: dict = {}
    for path, layer in layers.items():
        node = tables
        for k in path:
            node = node.setdefault(k, {})
        node.update(layer)
    return tables


def stack_tables(layouts: Layouts, by_name: Mapping) -> dict:
    """Inverse of `tables_by_name`: the nested "embedding" collection."""
    return tables_from_layers(
        layouts,
        {path: store.import_tables(by_name[layer_key(path)]) for path, store in layouts.items()},
    )


def uncovered_layer(layouts: Layouts, tables: Mapping) -> str | None:
    """The path of a leaf of `tables` that no layout covers, or None."""
    paths = set(layouts)
    for keys, _ in jax.tree_util.tree_leaves_with_path(tables):
        names = tuple(getattr(k, "key", getattr(k, "name", k)) for k in keys)
        if not any(names[:n] in paths for n in range(len(names) + 1)):
            return "/".join(map(str, names))
    return None
