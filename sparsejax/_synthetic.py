"""A short end-to-end sparse training run on synthetic click data (no download).

The smallest complete use of the ops: several features, each one id per example from
a Zipf distribution over its own table; the tables are stacked into one array (one
lookup and one sparse update per step); an MLP on the pooled embeddings; BCE loss;
row-wise Adagrad on the touched rows, in place; Adagrad on the MLP. Labels come from a
hidden per-id score, so the loss must fall if training works.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import ops


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticRunConfig:
    steps: int = 300
    """Training steps."""
    batch_size: int = 1024
    vocab: int = 1_000_000
    """Rows of each feature's table."""
    features: int = 8
    """Sparse features, one id per example each, one table each."""
    dim: int = 16
    learning_rate: float = 0.05
    seed: int = 0
    implementation: str | None = None
    """Kernel choice for the sparse ops (None: best for the platform)."""

    def __post_init__(self):
        for name in ("steps", "batch_size", "vocab", "features", "dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _batches(cfg: SyntheticRunConfig, rng: np.random.Generator):
    """Endless batches: Zipf ids per feature (shifted into the stacked table) and labels."""
    hidden = rng.normal(size=cfg.vocab * cfg.features).astype(np.float32)
    offsets = np.arange(cfg.features) * cfg.vocab
    while True:
        ids = (rng.zipf(1.2, (cfg.batch_size, cfg.features)) - 1) % cfg.vocab + offsets
        logit = hidden[ids].sum(1) / np.sqrt(cfg.features)
        y = (rng.random(cfg.batch_size) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        yield ids.reshape(-1).astype(np.int32), y[:, None]


def run_synthetic(cfg: SyntheticRunConfig, log=print) -> dict:
    """Train; returns first/final loss (mean of 20 steps) and samples per second."""
    import flax.linen as nn

    rows, b, f, d = cfg.vocab * cfg.features, cfg.batch_size, cfg.features, cfg.dim
    mlp = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(32), nn.relu, nn.Dense(1)])
    key_table, key_mlp = jax.random.split(jax.random.key(cfg.seed))
    table = jax.random.normal(key_table, (rows, d), jnp.float32) * 0.01
    params = mlp.init(key_mlp, jnp.zeros((1, f * d)))
    opt = ops.RowWiseAdagrad(learning_rate=cfg.learning_rate)
    tx = optax.adagrad(cfg.learning_rate)
    segments = jnp.arange(b * f, dtype=jnp.int32)  # one bag per (example, feature)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
    def step(table, slots, params, opt_state, step_no, ids, y):
        pooled = ops.embedding_bag(table, ids, segments, b * f,
                                   implementation=cfg.implementation)

        def loss_fn(pooled, params):
            logits = mlp.apply(params, pooled.reshape(b, f * d))
            return optax.sigmoid_binary_cross_entropy(logits, y).mean()

        loss, (g_pooled, g_params) = jax.value_and_grad(loss_fn, (0, 1))(pooled, params)
        table, slots = ops.sparse_apply(table, slots, ids, segments, g_pooled, optimizer=opt,
                                        step=step_no, implementation=cfg.implementation)
        updates, opt_state = tx.update(g_params, opt_state, params)
        return table, slots, optax.apply_updates(params, updates), opt_state, loss

    log(f"sparsejax train (synthetic): {f} tables x {cfg.vocab:,} rows x {d} dims, batch {b}, "
        f"{cfg.steps} steps, kernels: "
        f"{cfg.implementation or ops.default_implementation()}")
    state = [table, opt.init_slots(rows, d), params, tx.init(params)]
    data = _batches(cfg, np.random.default_rng(cfg.seed))
    losses, t0 = [], None
    for i in range(1, cfg.steps + 1):
        ids, y = next(data)
        *state, loss = step(*state, jnp.int32(i), jnp.asarray(ids), jnp.asarray(y))
        losses.append(loss)
        if i == 1:
            jax.block_until_ready(loss)
            t0 = time.perf_counter()  # exclude compilation from throughput
        if i % max(1, cfg.steps // 10) == 0 or i == cfg.steps:
            value = float(loss)
            if not np.isfinite(value):
                raise FloatingPointError(f"loss is {value} at step {i}; stopping")
            rate = (i - 1) * b / max(time.perf_counter() - t0, 1e-9)
            log(f"step {i:6d}  loss {value:.4f}  {rate:,.0f} samples/s")
    losses = np.asarray(jax.device_get(losses))
    window = min(20, len(losses))
    return dict(first_loss=float(losses[:window].mean()),
                final_loss=float(losses[-window:].mean()),
                samples_per_s=(cfg.steps - 1) * b / max(time.perf_counter() - t0, 1e-9))
