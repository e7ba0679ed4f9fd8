"""Layers against direct formulas; every model builds from specs, trains sparsely and
learns on data it should be able to learn."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import nn as snn
from sparsejax import runner
from sparsejax.data import PaddedIds
from sparsejax.nn._layers import l2_normalize


def test_dot_interaction_is_all_pairs_row_major():
    x = np.random.default_rng(0).normal(size=(3, 5, 4)).astype(np.float32)
    got = snn.DotInteraction().apply({}, jnp.asarray(x))
    want = np.stack(
        [[x[b, i] @ x[b, j] for i in range(5) for j in range(i + 1, 5)] for b in range(3)]
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_fm_term_is_the_sum_of_pairwise_products():
    x = np.random.default_rng(1).normal(size=(2, 6, 3))
    got = snn.FactorizationMachine().apply({}, jnp.asarray(x, jnp.float32))
    want = [sum(x[b, i] @ x[b, j] for i in range(6) for j in range(i + 1, 6)) for b in range(2)]
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_cross_layer_formula():
    x0 = jnp.asarray(np.random.default_rng(2).normal(size=(4, 5)), jnp.float32)
    net = snn.CrossNetwork(num_layers=1)
    v = net.init(jax.random.key(0), x0)
    w, b = v["params"]["cross_0"]["kernel"], v["params"]["cross_0"]["bias"]
    np.testing.assert_allclose(net.apply(v, x0), x0 * (x0 @ w + b) + x0, rtol=1e-5)


def test_target_attention_ignores_padding():
    rng = np.random.default_rng(3)
    keys = jnp.asarray(rng.normal(size=(2, 4, 3)), jnp.float32)
    query = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
    mask = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool)
    att = snn.TargetAttention(hidden=(8,))
    v = att.init(jax.random.key(0), keys, query, mask)
    out = att.apply(v, keys, query, mask)
    noisy = keys.at[0, 2:].set(100.0)  # padding rows may hold anything
    np.testing.assert_allclose(att.apply(v, noisy, query, mask)[0], out[0], rtol=1e-6)


def test_target_attention_is_an_mlp_of_the_concatenated_pair():
    """The first layer is a Dense of [k, q, k - q, k * q] (computed without building it);
    C queries of a row attend its keys as C separate rows would."""
    rng = np.random.default_rng(4)
    keys = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)
    queries = jnp.asarray(rng.normal(size=(3, 2, 4)), jnp.float32)
    mask = jnp.asarray(rng.random((3, 5)) < 0.7)
    att = snn.TargetAttention(hidden=(6,))
    v = att.init(jax.random.key(1), keys, queries[:, 0], mask)
    p = v["params"]
    assert p["att_0"]["kernel"].shape == (16, 6) and p["att_0"]["bias"].shape == (6,)
    for c in range(2):
        q = jnp.broadcast_to(queries[:, c, None], keys.shape)
        feats = jnp.concatenate([keys, q, keys - q, keys * q], axis=-1)
        h = jax.nn.sigmoid(feats @ p["att_0"]["kernel"] + p["att_0"]["bias"])
        score = jnp.where(mask, (h @ p["att_out"]["kernel"] + p["att_out"]["bias"])[..., 0], 0.0)
        want = jnp.einsum("bl,bld->bd", score, keys)
        np.testing.assert_allclose(att.apply(v, keys, queries[:, c], mask), want, atol=1e-5)
        np.testing.assert_allclose(att.apply(v, keys, queries, mask)[:, c], want, atol=1e-5)


def test_sequence_mask_from_jagged():
    jag = PaddedIds(ids=jnp.array([5, 6, 7, -1]), segments=jnp.array([0, 1, 3, 5]))
    np.testing.assert_array_equal(
        snn.sequence_mask(jag, 2, 3), [[True, True, False], [True, False, False]]
    )


SMALL_CRITEO = [
    "data.synthetic_options={vocab_sizes: [200, 50, 30, 7, 100, 60], num_dense: 4}",
    "model.embedding_dim=8",
]
BEHAVIOR = [
    "data.kind=behavior",
    "data.synthetic_options={num_users: 300, num_items: 2000, "
    "num_categories: 20, preferred: 2, max_history: 10}",
]


@pytest.mark.parametrize(
    "name,extra,metric,floor",
    [
        ("dlrm", ["model.options={bottom: [16, 8], top: [16, 1]}"], "auc", 0.7),
        ("deepfm", ["model.options={hidden: [32, 16]}"], "auc", 0.7),
        ("wide_deep", ["model.options={hidden: [32, 16]}"], "auc", 0.7),
        (
            "dcnv2",
            ["model.options={cross_layers: 2, hidden: [32], structure: parallel}"],
            "auc",
            0.7,
        ),
        (
            "din",
            [
                "model.options={hidden: [32, 16], attention_hidden: [16]}",
                *BEHAVIOR,
                "optimizer.sparse_learning_rate=0.2",
                "optimizer.dense_learning_rate=0.003",
                "steps=250",
            ],
            "auc",
            0.7,
        ),
        (
            "two_tower",
            [
                "model.options={user_features: [user, history], item_features: "
                "[item, category], tower: [32, 16]}",
                *BEHAVIOR,
                "data.synthetic_options.positives_only=true",
                "optimizer.sparse_learning_rate=0.2",
            ],
            "recall@10",
            0.3,
        ),
    ],
)
def test_model_learns(tmp_path, name, extra, metric, floor):
    small = SMALL_CRITEO if "data.kind=behavior" not in extra else ["model.embedding_dim=8"]
    cfg = runner.load_config(
        [],
        [
            f"model.name={name}",
            "steps=150",
            "data.batch_size=128",
            "data.eval_batches=4",
            "progress=false",
            "eval_every=null",
            f"out_dir={tmp_path}",
            *small,
            *extra,
        ],
    )
    run = runner.build_run(cfg, log=lambda *_: None)
    before = run.trainer.evaluate(run.state, run.data.eval_batches)
    after = runner.train_run(run, log=lambda *_: None)["last_eval"]
    assert after["loss"] < before["loss"]
    assert after[metric] > floor, (before, after)
    # the tables live outside params: dense gradients never touch them
    assert not any(
        leaf.shape and leaf.shape[0] >= 200 and leaf.ndim == 2 and leaf.shape[1] == 8
        for leaf in jax.tree.leaves(run.state.params)
    )


def test_l2_normalize_has_finite_gradients_at_zero():
    """A zero tower output (e.g. an empty history through zero-bias layers) normalizes to
    zero with a finite gradient; `x / max(norm(x), eps)` back-propagates NaN there."""
    x = jnp.array([[0.0, 0.0, 0.0], [3.0, 0.0, 4.0]])
    np.testing.assert_allclose(l2_normalize(x), [[0, 0, 0], [0.6, 0, 0.8]], rtol=1e-6)
    g = jax.grad(lambda v: (l2_normalize(v) * jnp.array([1.0, 2.0, 3.0])).sum())(x)
    assert np.isfinite(np.asarray(g)).all()
    # away from zero it is the exact gradient of x / |x|
    ref = jax.grad(lambda v: (v / jnp.linalg.norm(v) * jnp.array([1.0, 2.0, 3.0])).sum())(x[1])
    np.testing.assert_allclose(g[1], ref, rtol=1e-6)


def test_two_tower_over_the_history_alone_trains_with_empty_histories():
    """user_features=[history]: users whose history is empty (their first event) pool to
    a zero vector; training stays finite (it gave NaN at step 2 at any learning rate)."""
    import optax

    from sparsejax import data as sd
    from sparsejax import train

    log = sd.synthetic_events(num_users=60, num_items=50, events_per_user=(3, 6), seed=1)
    seq = sd.build_sequences(
        log, sd.SequenceConfig(history_length=5, negatives=0, eval_negatives=5)
    )
    assert (seq.train.sparse["history"].lengths == 0).sum() >= 60  # each user's first event
    tables, features = seq.specs(dim=8)
    model = snn.TwoTower(
        tables=tables,
        features=features,
        user_features=("history",),
        item_features=("item",),
        tower=(16, 8),
    )
    trainer = train.Trainer(model, optax.adam(1e-3))
    packer = sd.BatchPacker(tables, features, batch_size=64)
    with sd.Loader(seq.train, packer, seed=0, epochs=None, drop_remainder=True) as loader:
        it = iter(loader)
        batch = next(it)
        state = trainer.init(jax.random.key(0), batch)
        for _ in range(5):
            state, metrics = trainer.train_step(state, batch)
            assert np.isfinite(float(metrics["loss"]))
            batch = next(it)
    assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(state.params))


def _one_feature_batch(n=16, vocab=50, dim=8, labels=None):
    """Specs and a batch of one pooled feature (one id per example) and no dense columns."""
    from sparsejax import data as sd
    from sparsejax.embedding import FeatureSpec, TableSpec

    tables = [TableSpec(name="t", vocab_size=vocab, dim=dim)]
    features = [FeatureSpec(name="f", table="t")]
    ids = np.arange(n) % vocab
    packer = sd.BatchPacker(tables, features, batch_size=n)
    labels = (ids % 2).astype(np.float32) if labels is None else labels
    sparse = {"f": sd.JaggedIds(lengths=np.ones(n, int), values=ids)}
    return tables, features, packer.pack(sparse, labels=labels)


def test_dlrm_of_one_pooled_feature_and_no_dense_columns_reads_the_embedding():
    """One pooled feature and no dense columns: the interaction has no pairs, so the top
    MLP reads the pooled embedding itself (it got a zero-width input, and its Dense's
    initializer raised ZeroDivisionError). The model trains and tells the ids apart."""
    import optax

    from sparsejax import train

    tables, features, batch = _one_feature_batch()
    model = snn.DLRM(tables=tables, features=features, top=(16, 1))
    trainer = train.Trainer(model, optax.adam(1e-2))
    state = trainer.init(jax.random.key(0), batch)
    assert state.params["top"]["dense_0"]["kernel"].shape == (8, 16)  # the embedding's dim
    logits = np.asarray(trainer.eval_step(state, batch))
    assert logits.shape == (16,) and len(np.unique(logits.round(6))) == 16, logits
    losses = []
    for _ in range(30):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses


def test_runner_trains_dlrm_on_one_categorical_column(tmp_path, capsys):
    """`sparsejax train` of DLRM on synthetic data of one categorical column and no dense
    columns trains (exit 0; it died with a ZeroDivisionError traceback while initializing)."""
    from sparsejax.__main__ import main

    code = main(
        [
            "train",
            "model.name=dlrm",
            "data.synthetic_options={vocab_sizes: [50], num_dense: 0}",
            "data.batch_size=32",
            "model.embedding_dim=8",
            "model.options={top: [16, 1]}",
            "steps=5",
            "eval_every=null",
            "progress=false",
            f"out_dir={tmp_path}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
