"""Dense building blocks of recommendation models: MLP and feature interactions."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from .. import ops

default_kernel_init = nn.initializers.glorot_uniform()


class MLP(nn.Module):
    """Dense layers with ReLU between them (and after the last if `final_activation`)."""

    features: Sequence[int]
    final_activation: bool = False
    dropout: float = 0.0
    dtype: jnp.dtype | None = None
    """Computation dtype (e.g. bfloat16 for mixed precision); params stay f32."""

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        for i, width in enumerate(self.features):
            x = nn.Dense(
                width, dtype=self.dtype, kernel_init=default_kernel_init, name=f"dense_{i}"
            )(x)
            if i < len(self.features) - 1 or self.final_activation:
                x = nn.relu(x)
                if self.dropout > 0:
                    x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return x


class DotInteraction(nn.Module):
    """DLRM's interaction: all pairwise dot products of the F input vectors (i < j, row
    major), `[B, F, D] -> [B, F(F-1)/2]`."""

    implementation: str | None = None
    """Kernel choice (None: the platform's best; "xla" for a portable export)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.pairwise_dots(x, implementation=self.implementation)


class CrossNetwork(nn.Module):
    """DCNv2 cross layers: x_{l+1} = x0 * (W_l x_l + b_l) + x_l, with an optional
    low-rank W = U V^T (`rank`)."""

    num_layers: int = 3
    rank: int | None = None
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x0: jax.Array) -> jax.Array:
        x, d = x0, x0.shape[-1]
        for i in range(self.num_layers):
            if self.rank is None:
                wx = nn.Dense(
                    d, dtype=self.dtype, kernel_init=default_kernel_init, name=f"cross_{i}"
                )(x)
            else:
                v = nn.Dense(
                    self.rank,
                    use_bias=False,
                    dtype=self.dtype,
                    kernel_init=default_kernel_init,
                    name=f"cross_{i}_v",
                )(x)
                wx = nn.Dense(
                    d, dtype=self.dtype, kernel_init=default_kernel_init, name=f"cross_{i}_u"
                )(v)
            x = x0 * wx + x
        return x


class FactorizationMachine(nn.Module):
    """Second-order FM term: 0.5 * sum_d((sum_f e)^2 - sum_f e^2), `[B, F, D] -> [B]`."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = x.sum(axis=1)
        return 0.5 * (s * s - (x * x).sum(axis=1)).sum(axis=-1)


class TargetAttention(nn.Module):
    """DIN's activation unit: weights each behavior by an MLP of (behavior, target,
    difference, product) and sums them (no softmax, as in DIN), masking padding.

    `keys [B, L, D]`, `query [B, D]`, `mask [B, L]` -> `[B, D]`; or `query [B, C, D]`, C
    targets of each row attending its one history -> `[B, C, D]` (how DIN scores a
    user's candidates without repeating the history per candidate).
    """

    hidden: Sequence[int] = (36,)
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, keys: jax.Array, query: jax.Array, mask: jax.Array) -> jax.Array:
        queries = query[:, None, :] if query.ndim == 2 else query  # [B, C, D]
        widths = (*self.hidden, 1)
        names = [f"att_{i}" for i in range(len(self.hidden))] + ["att_out"]
        h = _PairDense(widths[0], dtype=self.dtype, name=names[0])(keys, queries)
        for width, name in zip(widths[1:], names[1:], strict=True):
            h = nn.Dense(width, dtype=self.dtype, name=name)(nn.sigmoid(h))
        score = jnp.where(mask[:, None, :], h[..., 0], 0.0)  # [B, C, L]
        out = jnp.einsum("bcl,bld->bcd", score, keys)
        return out[:, 0] if query.ndim == 2 else out


class _PairDense(nn.Module):
    """`nn.Dense(features)` of `[k, q, k - q, k * q]` for every (query, key) pair, without
    building that `[B, C, L, 4D]` concatenation: with the kernel's four `[D, features]`
    blocks W1..W4 it is `k (W1 + W3) + q (W2 - W3) + (k * q) W4 + bias`, the first term
    once per key, the second once per query. Keys `[B, L, D]`, queries `[B, C, D]` ->
    `[B, C, L, features]`; the parameters (and their initialization) are the Dense's."""

    features: int
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, keys: jax.Array, queries: jax.Array) -> jax.Array:
        d = keys.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (4 * d, self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        keys, queries, kernel, bias = nn.dtypes.promote_dtype(
            keys, queries, kernel, bias, dtype=self.dtype
        )
        w1, w2, w3, w4 = jnp.split(kernel, 4)
        per_key = keys @ (w1 + w3)  # [B, L, F]
        per_query = queries @ (w2 - w3) + bias  # [B, C, F]
        pair = jnp.einsum("bld,bcdf->bclf", keys, queries[..., None] * w4)
        return pair + per_key[:, None] + per_query[:, :, None]


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x / max(|x|, eps)` along the last axis, with finite gradients at `x = 0`: the
    norm's square is clamped before the root (the gradient of `|x|` at 0 is 0/0, and
    `jnp.maximum` still multiplies it by 0, which gives NaN)."""
    sq = jnp.sum(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.maximum(sq, eps * eps))
