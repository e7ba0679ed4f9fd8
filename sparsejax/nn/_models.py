"""Recommendation models as Flax modules: each maps a `SparseBatch` to its outputs.

CTR models (`task = "binary"`) return one logit per example. The two-tower model
(`task = "retrieval"`) returns the `[B, B]` in-batch score matrix whose diagonal holds
the (user, item) pairs of the rows; the rows labelled positive are its positive pairs.
Every model trains sparsely through `EmbeddingBagCollection`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..embedding import FeatureSpec, TableSpec
from ._embedding import EmbeddingBagCollection
from ._layers import (
    MLP,
    CrossNetwork,
    DotInteraction,
    FactorizationMachine,
    TargetAttention,
    l2_normalize,
)


def sequence_mask(jagged, batch_size: int, max_len: int) -> jax.Array:
    """bool[B, max_len]: which positions of a sequence feature hold an id."""
    filled = jnp.zeros(batch_size * max_len, jnp.bool_).at[jagged.segments].max(jagged.ids >= 0)
    return filled.reshape(batch_size, max_len)


def linear_specs(tables: Sequence[TableSpec], features: Sequence[FeatureSpec]):
    """1-dim "first-order" tables mirroring `tables` (for FM / wide parts), composed as
    their table is (but for "concat", which cannot split one column: whole); sequence
    features are left out."""
    pooled = [f for f in features if not f.is_sequence]
    used = {f.table for f in pooled}

    def linear(t):
        concat = t.compose is not None and t.compose.op == "concat"
        return dataclasses.replace(
            t, name=f"{t.name}_linear", dim=1, compose=None if concat else t.compose
        )

    lin_tables = [linear(t) for t in tables if t.name in used]
    lin_features = [dataclasses.replace(f, table=f"{f.table}_linear") for f in pooled]
    return lin_tables, lin_features


class _CTRModel(nn.Module):
    tables: Sequence[TableSpec]
    features: Sequence[FeatureSpec]
    dtype: jnp.dtype | None = None
    """Computation dtype of the dense layers (bfloat16 for mixed precision)."""
    implementation: str | None = None
    dropout: float = 0.0
    """Dropout rate after every hidden ReLU of the model's MLPs, in training only
    (`train=True`; evaluation is deterministic)."""
    embedding_dim: int | None = None
    """Mixed-dimension embeddings (Ginart et al., 2019): a pooled feature whose table
    has another dim is projected to this one by a learned `[dim, embedding_dim]` matrix
    (`project_<feature>`). None: every table must have one dim."""

    task: ClassVar[str] = "binary"

    def embed(self, batch, name="embedding"):
        out = EmbeddingBagCollection(self.tables, self.features, self.implementation, name=name)(
            batch.features, batch.batch_size
        )
        out = {k: v.astype(self.dtype or jnp.float32) for k, v in out.items()}
        if self.embedding_dim is not None and name == "embedding":
            dims = {t.name: t.dim for t in self.tables}
            for f in self.features:
                if not f.is_sequence and dims[f.table] != self.embedding_dim:
                    out[f.name] = nn.Dense(
                        self.embedding_dim,
                        use_bias=False,
                        dtype=self.dtype,
                        name=f"project_{f.name}",
                    )(out[f.name])
        return out

    def pooled_stack(self, emb) -> jax.Array:
        """[B, F, D] of the pooled features, in spec order.

        Built as concatenate-reshape-transpose, not `jnp.stack`: when the features are
        consecutive pieces of one lookup output (one table stack), XLA folds the
        concatenate of those pieces back into that output, so forward and gradient are
        one transposing copy each instead of one slice per feature plus a concatenate.
        """
        pooled = [emb[f.name] for f in self.features if not f.is_sequence]
        batch = pooled[0].shape[0]
        return jnp.concatenate(pooled, axis=0).reshape(len(pooled), batch, -1).transpose(1, 0, 2)

    def flat_with_dense(self, vecs, batch) -> jax.Array:
        """[B, F*D + num_dense]: the embeddings side by side, then the dense features."""
        return jnp.concatenate(
            [vecs.reshape(vecs.shape[0], -1), batch.dense.astype(vecs.dtype)], axis=1
        )

    def deep_logit(self, hidden, vecs, batch, train) -> jax.Array:
        """[B] f32: the "deep" MLP (hidden widths, then 1) on `flat_with_dense`."""
        out = MLP((*hidden, 1), dropout=self.dropout, dtype=self.dtype, name="deep")(
            self.flat_with_dense(vecs, batch), train=train
        )
        return out[:, 0].astype(jnp.float32)

    def first_order(self, batch) -> jax.Array:
        lin_tables, lin_features = linear_specs(self.tables, self.features)
        lin = EmbeddingBagCollection(lin_tables, lin_features, self.implementation, name="linear")(
            batch.features, batch.batch_size
        )
        total = sum(v[:, 0].astype(jnp.float32) for v in lin.values())
        if batch.dense.shape[1]:
            total = total + nn.Dense(1, use_bias=False, name="dense_linear")(batch.dense)[:, 0]
        return total


class DLRM(_CTRModel):
    """DLRM: bottom MLP on dense features, pairwise dot products of it with every
    pooled embedding, top MLP. The bottom MLP's last width must equal the tables' dim.
    One pooled feature and no dense features leave no pair to dot: the top MLP then
    reads that feature's embedding."""

    bottom: Sequence[int] = (64, 16)
    """Widths of the bottom MLP over the dense features (ReLU after each layer); the last
    must equal the embedding dim. Unused without dense features."""
    top: Sequence[int] = (64, 32, 1)
    """Widths of the top MLP over [bottom output, pairwise dot products] (over the
    embedding when there is one pooled feature and no dense one); the last is the output
    unit, 1."""

    @nn.compact
    def __call__(self, batch, *, train: bool = False) -> jax.Array:
        emb = self.embed(batch)
        vecs = self.pooled_stack(emb)
        parts = []
        if batch.dense.shape[1]:
            x = MLP(
                self.bottom,
                final_activation=True,
                dropout=self.dropout,
                dtype=self.dtype,
                name="bottom",
            )(batch.dense.astype(self.dtype or jnp.float32), train=train)
            if x.shape[-1] != vecs.shape[-1]:
                raise ValueError(
                    f"DLRM: the bottom MLP ends at width {x.shape[-1]}, the "
                    f"embeddings have dim {vecs.shape[-1]}; they must match"
                )
            vecs = jnp.concatenate([x[:, None, :], vecs], axis=1)
            parts.append(x)
        if vecs.shape[1] > 1:
            parts.append(DotInteraction(self.implementation)(vecs))
        else:  # one vector, no pairs: the top MLP reads it (a zero-width input is no model)
            parts.append(vecs[:, 0])
        return MLP(self.top, dropout=self.dropout, dtype=self.dtype, name="top")(
            jnp.concatenate(parts, axis=1), train=train
        )[:, 0].astype(jnp.float32)


class DeepFM(_CTRModel):
    """DeepFM: bias + first-order (1-dim tables, linear on dense) + FM over the
    embeddings + an MLP on the concatenated embeddings and dense features."""

    hidden: Sequence[int] = (200, 200)
    """Widths of the deep MLP's hidden layers (one output unit follows)."""

    @nn.compact
    def __call__(self, batch, *, train: bool = False) -> jax.Array:
        vecs = self.pooled_stack(self.embed(batch))
        bias = self.param("bias", nn.initializers.zeros, ())
        return (
            bias
            + self.first_order(batch)
            + FactorizationMachine()(vecs).astype(jnp.float32)
            + self.deep_logit(self.hidden, vecs, batch, train)
        )


class WideAndDeep(_CTRModel):
    """Wide & Deep: a linear model over ids (1-dim tables) and dense features, plus an
    MLP over the embeddings and dense features."""

    hidden: Sequence[int] = (256, 128)
    """Widths of the deep MLP's hidden layers (one output unit follows)."""

    @nn.compact
    def __call__(self, batch, *, train: bool = False) -> jax.Array:
        vecs = self.pooled_stack(self.embed(batch))
        bias = self.param("bias", nn.initializers.zeros, ())
        return bias + self.first_order(batch) + self.deep_logit(self.hidden, vecs, batch, train)


class DCNv2(_CTRModel):
    """DCN-V2: cross network on [embeddings, dense] and an MLP, stacked (MLP after the
    cross layers) or parallel (side by side), then one output unit."""

    cross_layers: int = 3
    """Cross layers of the cross network."""
    rank: int | None = None
    """Low-rank cross layers (DCN-Mix style) when set."""
    hidden: Sequence[int] = (256, 128)
    """Widths of the MLP's layers (ReLU after each; one output unit follows)."""
    structure: str = "stacked"
    """"stacked": the MLP after the cross layers; "parallel": side by side."""

    @nn.compact
    def __call__(self, batch, *, train: bool = False) -> jax.Array:
        if self.structure not in ("stacked", "parallel"):
            raise ValueError(
                f"DCNv2: structure must be 'stacked' or 'parallel', got {self.structure!r}"
            )
        x0 = self.flat_with_dense(self.pooled_stack(self.embed(batch)), batch)
        cross = CrossNetwork(self.cross_layers, self.rank, dtype=self.dtype, name="cross")(x0)
        mlp = MLP(
            self.hidden,
            final_activation=True,
            dropout=self.dropout,
            dtype=self.dtype,
            name="deep",
        )
        h = (
            mlp(cross, train=train)
            if self.structure == "stacked"
            else jnp.concatenate([cross, mlp(x0, train=train)], axis=1)
        )
        return nn.Dense(1, dtype=self.dtype, name="out")(h)[:, 0].astype(jnp.float32)


class DIN(_CTRModel):
    """DIN-style sequence model: target attention of the candidate item over the user's
    behavior sequence (its last `max_ids` items), then an MLP over [attended history,
    candidate, other pooled features, dense]."""

    target: str = "item"
    """Pooled feature holding the candidate item."""
    history: str = "history"
    """Sequence feature holding the behavior history; share the candidate's table."""
    attention_hidden: Sequence[int] = (36,)
    """Widths of the attention unit's MLP, which weights each history item."""
    hidden: Sequence[int] = (200, 80)
    """Widths of the final MLP's hidden layers (one output unit follows)."""

    @nn.compact
    def __call__(self, batch, *, train: bool = False, candidates=None) -> jax.Array:
        """`[B]` logits; with `candidates` (`[B, C, D]`: rows of the target's table, as its
        embedding layer gives them, at the model's embedding dim) the `[B, C]` logits of
        each example's user and history against each of its C candidates in place of its
        target: the history is looked up, and its attention inputs computed, once per
        user, not once per candidate."""
        specs = {f.name: f for f in self.features}
        for name, want_seq in ((self.target, False), (self.history, True)):
            if name not in specs or specs[name].is_sequence != want_seq:
                raise ValueError(
                    f"DIN: feature {name!r} must be a "
                    f"{'sequence' if want_seq else 'pooled'} feature"
                )
        emb = self.embed(batch)
        hist = specs[self.history]
        mask = sequence_mask(batch.features[self.history], batch.batch_size, hist.max_ids)
        keys, target = emb[self.history], emb[self.target]
        others = [emb[f.name] for f in self.features if not f.is_sequence and f.name != self.target]
        dense = batch.dense.astype(target.dtype)
        if candidates is not None:  # C targets a row, attending its one history
            target = candidates.astype(target.dtype)
            c = target.shape[1]
            dense, *others = (jnp.repeat(x[:, None], c, axis=1) for x in (dense, *others))
        attended = TargetAttention(self.attention_hidden, dtype=self.dtype, name="attention")(
            keys, target, mask
        )
        x = jnp.concatenate([attended, target, *others, dense], axis=-1)
        mlp = MLP((*self.hidden, 1), dropout=self.dropout, dtype=self.dtype, name="mlp")
        return mlp(x, train=train)[..., 0].astype(jnp.float32)


class TwoTower(nn.Module):
    """Two-tower (DSSM) retrieval: user and item towers over their own features, L2-
    normalized outputs, in-batch scores `u @ i.T / temperature` (`[B, B]`). The loss
    takes each row labelled positive as a positive pair and the other rows' items as its
    negatives; a row labelled 0 is no positive pair (its item stays a negative), padded
    examples (mask 0) are neither."""

    tables: Sequence[TableSpec]
    features: Sequence[FeatureSpec]
    user_features: Sequence[str] = ()
    """Features of the user tower (sequences enter as their mean)."""
    item_features: Sequence[str] = ()
    """Features of the item tower."""
    tower: Sequence[int] = (128, 64)
    """Widths of each tower's MLP; the last is the dim of the user and item vectors."""
    temperature: float = 0.05
    """Scores are cosine similarities divided by this."""
    dtype: jnp.dtype | None = None
    implementation: str | None = None
    dropout: float = 0.0
    """Dropout rate after every hidden ReLU of the towers, in training only."""

    task: ClassVar[str] = "retrieval"

    def towers(self, batch, *, train: bool = False) -> tuple[jax.Array, jax.Array]:
        emb = EmbeddingBagCollection(
            self.tables, self.features, self.implementation, name="embedding"
        )(batch.features, batch.batch_size)
        names = {f.name for f in self.features}
        for side, feats in (("user", self.user_features), ("item", self.item_features)):
            if not feats or set(feats) - names:
                raise ValueError(
                    f"TwoTower: {side}_features {list(feats)} must be non-empty "
                    f"and among the features {sorted(names)}"
                )
        specs = {f.name: f for f in self.features}
        for f in self.user_features + self.item_features:
            if specs[f].is_sequence:  # a history enters a tower as its mean
                mask = sequence_mask(batch.features[f], batch.batch_size, specs[f].max_ids)
                emb[f] = jnp.einsum("bl,bld->bd", mask.astype(emb[f].dtype), emb[f]) / jnp.maximum(
                    mask.sum(1, keepdims=True), 1
                ).astype(emb[f].dtype)
        out = []
        for side, feats in (("user", self.user_features), ("item", self.item_features)):
            x = jnp.concatenate([emb[f].astype(self.dtype or jnp.float32) for f in feats], 1)
            tower = MLP(self.tower, dropout=self.dropout, dtype=self.dtype, name=f"{side}_tower")
            x = tower(x, train=train).astype(jnp.float32)
            out.append(l2_normalize(x))  # finite gradient at 0 (e.g. an empty history)
        return out[0], out[1]

    @nn.compact
    def __call__(self, batch, *, train: bool = False, towers: bool = False):
        """In-batch scores `[B, B]`; with `towers`, the (user, item) tower outputs
        (`[B, E]` each: what serving embeds the catalog and the users with)."""
        user, item = self.towers(batch, train=train)
        if towers:
            return user, item
        return user @ item.T / self.temperature


MODELS = {
    "dlrm": DLRM,
    "deepfm": DeepFM,
    "wide_deep": WideAndDeep,
    "dcnv2": DCNv2,
    "din": DIN,
    "two_tower": TwoTower,
}
