"""Synthetic user-behavior data for sequence (DIN) and retrieval (two-tower) models.

Items fall into `num_categories` categories; each user prefers a few of them. A
user's history is a variable-length sequence of items mostly from the preferred
categories; the candidate item is clicked with high probability when it is in one of
them. So the signal lives in the (candidate, history) relation, which target attention
can use and a model without the history cannot. Batch `i` depends only on (seed, i).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..embedding import FeatureSpec, TableSpec
from ._batch import JaggedIds


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticBehavior:
    num_users: int = 10_000
    """Users, each with its own preferred categories."""
    num_items: int = 50_000
    """Items; item i has category i % num_categories."""
    num_categories: int = 100
    """Item categories (<= num_items)."""
    preferred: int = 3
    """Categories each user prefers."""
    max_history: int = 20
    """Longest history; lengths are uniform in [1, max_history]."""
    focus: float = 0.8
    """Share of history items (and of candidates) drawn from preferred categories."""
    positives_only: bool = False
    """Every candidate from a preferred category, label 1 (retrieval training pairs)."""
    seed: int = 0

    def __post_init__(self):
        for f in ("num_users", "num_items", "num_categories", "preferred", "max_history"):
            if getattr(self, f) < 1:
                raise ValueError(f"SyntheticBehavior: {f} must be >= 1")
        if self.num_items < self.num_categories:
            raise ValueError("SyntheticBehavior: num_items must be >= num_categories")

    def _items_in(self, rng, categories: np.ndarray) -> np.ndarray:
        """A random item of each given category (item i has category i % C)."""
        per_cat = self.num_items // self.num_categories
        return rng.integers(0, per_cat, categories.shape) * self.num_categories + categories

    def _draw(self, rng, users, prefs, n):
        own = prefs[users[:, None], rng.integers(0, self.preferred, (users.shape[0], n))]
        other = rng.integers(0, self.num_categories, own.shape)
        cats = np.where(rng.random(own.shape) < self.focus, own, other)
        return self._items_in(rng, cats), cats

    def batch(self, index: int, batch_size: int):
        prefs = self._prefs
        rng = np.random.default_rng([self.seed, index])
        users = rng.integers(0, self.num_users, batch_size)
        lengths = rng.integers(1, self.max_history + 1, batch_size)
        hist, _ = self._draw(rng, users, prefs, self.max_history)
        hist = hist[np.arange(self.max_history)[None, :] < lengths[:, None]]
        if self.positives_only:
            cand_cat = prefs[users, rng.integers(0, self.preferred, batch_size)]
            labels = np.ones(batch_size, np.float32)
        else:
            cand_cat = np.where(
                rng.random(batch_size) < 0.5,
                prefs[users, rng.integers(0, self.preferred, batch_size)],
                rng.integers(0, self.num_categories, batch_size),
            )
            liked = (prefs[users] == cand_cat[:, None]).any(1)
            labels = (rng.random(batch_size) < np.where(liked, 0.8, 0.1)).astype(np.float32)
        cand = self._items_in(rng, cand_cat)
        one = np.ones(batch_size, np.int64)
        sparse = {
            "user": JaggedIds(one, users),
            "item": JaggedIds(one, cand),
            "category": JaggedIds(one, cand_cat),
            "history": JaggedIds(lengths, hist),
        }
        return sparse, labels, np.zeros((batch_size, 0), np.float32)

    def catalog(self) -> dict[str, JaggedIds]:
        """Every item with its item-side features (item i has category i % C): the
        candidates a retrieval model ranks (`sparsejax export` embeds them all)."""
        items = np.arange(self.num_items, dtype=np.int64)
        one = np.ones(self.num_items, np.int64)
        return {
            "item": JaggedIds(one, items),
            "category": JaggedIds(one, items % self.num_categories),
        }

    @functools.cached_property
    def _prefs(self) -> np.ndarray:
        return np.random.default_rng([self.seed, 0xBE]).integers(
            0, self.num_categories, (self.num_users, self.preferred)
        )

    def specs(self, *, dim: int, **table_kwargs) -> tuple[list[TableSpec], list[FeatureSpec]]:
        """Tables user/item/category; features user, item, category (one id each) and
        history (a sequence over the item table)."""
        tables = [
            TableSpec(name=n, vocab_size=v, dim=dim, **table_kwargs)
            for n, v in (
                ("user", self.num_users),
                ("item", self.num_items),
                ("category", self.num_categories),
            )
        ]
        features = [
            FeatureSpec(name="user", table="user"),
            FeatureSpec(name="item", table="item"),
            FeatureSpec(name="category", table="category"),
            FeatureSpec(name="history", table="item", combiner=None, max_ids=self.max_history),
        ]
        return tables, features
