"""Training knobs typed in the config: embedding initializer, dropout, L2 on touched rows,
dense weight decay, learning-rate schedules (dense and sparse, no recompiles), early
stopping with a keep-best checkpoint, eval every epoch."""

import dataclasses
import json
import math
import os
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparsejax import runner, train
from sparsejax.data import PaddedIds
from sparsejax.embedding import (
    DeviceTableStore,
    FeatureSpec,
    TableSpec,
    constant_init,
    normal_init,
    truncated_normal_init,
    uniform_init,
)
from sparsejax.nn import MLP
from sparsejax.ops.optimizers import SGD, RowWiseAdagrad
from sparsejax.runner import ConfigError
from sparsejax.runner._knobs import RunKnobs, build_trainer, eval_every
from sparsejax.runner._model import configured_model
from sparsejax.train import EarlyStopping, Schedule

TINY = [
    "log_every=5",
    "data.batch_size=32",
    "data.eval_batches=2",
    "progress=false",
    "model.embedding_dim=8",
]
DLRM = "model.options={bottom: [16, 8], top: [16, 1]}"
SYNTHETIC = "data.synthetic_options={vocab_sizes: [300, 50, 7, 120], num_dense: 3}"


def _cfg(tmp_path, *overrides):
    """A tiny config (DLRM on synthetic data unless `model.name` / `data.kind` say)."""
    dlrm = [] if any(o.startswith("model.name=") for o in overrides) else [DLRM]
    synthetic = [] if "data.kind=behavior" in overrides else [SYNTHETIC]
    return runner.load_config([], [*TINY, *synthetic, *dlrm, f"out_dir={tmp_path}", *overrides])


# ---- 1. embedding initializer -----------------------------------------------------------
def _drawn(init, vocab=3000, dim=16):
    """The table as the trainer draws it (numpy, in the store) and as `init` draws it
    with jax.random (inside a traced init)."""
    store = DeviceTableStore(
        [TableSpec(name="t", vocab_size=vocab, dim=dim, initializer=init)],
        [FeatureSpec(name="f", table="t")],
    )
    (stack,) = store.stacks
    host = np.asarray(store.init_part(jax.random.key(0), stack)["weights"])
    return host, np.asarray(init(jax.random.key(0), (vocab, dim), jnp.float32))


@pytest.mark.parametrize(
    "yaml,init,check",
    [
        ("{}", uniform_init(), lambda x: np.abs(x).max() <= math.sqrt(1 / 3000)),
        ("{kind: uniform, scale: 0.2}", uniform_init(0.2), lambda x: np.abs(x).max() <= 0.2),
        ("{kind: normal, stddev: 0.05}", normal_init(0.05), lambda x: abs(x.std() - 0.05) < 2e-3),
        (
            "{kind: truncated_normal}",  # stddev 1/sqrt(dim) = 0.25, cut at 2 stddev
            truncated_normal_init(),
            lambda x: np.abs(x).max() <= 0.5 and 0.2 < x.std() < 0.25,
        ),
        ("{kind: zeros}", constant_init(0.0), lambda x: not x.any()),
    ],
)
def test_embedding_init_from_the_config(tmp_path, yaml, init, check):
    cfg = _cfg(tmp_path, f"model.embedding_init={yaml}")
    assert cfg.model.embedding_init.initializer() == init
    host, traced = _drawn(init)  # numpy fill (the trainer's path) and jax.random (traced)
    assert check(host) and check(traced), (host.std(), traced.std())
    assert abs(host.mean()) < 5e-3 and abs(traced.mean()) < 5e-3


def test_embedding_init_default_and_errors(tmp_path):
    """The runner's default is N(0, 0.01^2) (measured: experiments/RESULTS.md); replacing
    it with {kind: uniform} gives a TableSpec's own default."""
    assert runner.RunConfig().model.embedding_init.initializer() == normal_init(0.01)
    uniform = _cfg(tmp_path, "model.embedding_init!={kind: uniform}").model.embedding_init
    assert uniform.initializer() == TableSpec(name="t", vocab_size=2, dim=2).initializer
    with pytest.raises(ConfigError, match=r"model\.embedding_init.*`stddev`.*kind normal"):
        _cfg(tmp_path, "model.embedding_init={kind: uniform, stddev: 0.1}")
    base = Path(__file__).resolve().parents[2] / "configs" / "base.yaml"  # sets stddev
    with pytest.raises(ConfigError, match=r"model\.embedding_init!=\{kind: zeros\}"):
        runner.load_config([base], ["model.embedding_init.kind=zeros"])
    with pytest.raises(ConfigError, match=r"model\.embedding_init\.kind.*'glorot'"):
        _cfg(tmp_path, "model.embedding_init.kind=glorot")


# ---- 2. dropout -------------------------------------------------------------------------
BEHAVIOR = [
    "data.kind=behavior",
    "data.synthetic_options={num_users: 50, num_items: 100, num_categories: 5, max_history: 4}",
]
MODELS = [
    ("dlrm", [DLRM]),
    ("deepfm", ["model.options={hidden: [16]}"]),
    ("wide_deep", ["model.options={hidden: [16]}"]),
    ("dcnv2", ["model.options={cross_layers: 1, hidden: [16]}"]),
    ("din", ["model.options={hidden: [16], attention_hidden: [8]}", *BEHAVIOR]),
    (
        "two_tower",
        [
            "model.options={user_features: [user, history], item_features: [item], tower: [16, 8]}",
            *BEHAVIOR,
        ],
    ),
]


def _model(tmp_path, name, extra):
    cfg = _cfg(tmp_path, f"model.name={name}", *extra, "model.dropout=0.5")
    data = runner.build_data(cfg)
    batch = runner.first_train_batch(data)
    model = configured_model(cfg, data.tables, data.features)
    return model, batch, jax.eval_shape(model.init, jax.random.key(0), batch)


def _apply(model, variables, batch, train, key):
    rngs = {"dropout": jax.random.key(key)}
    return model.apply(variables, batch, train=train, rngs=rngs, mutable=["embedding_lookups"])[0]


@pytest.mark.parametrize("name,extra", MODELS, ids=[m for m, _ in MODELS])
def test_dropout_reaches_every_mlp_of_every_model(tmp_path, name, extra):
    model, batch, shapes = _model(tmp_path, name, extra)
    assert model.dropout == 0.5
    calls = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, MLP) and context.method_name == "__call__":
            calls.append((context.module.name, context.module.dropout, kwargs.get("train")))
        return next_fun(*args, **kwargs)

    for training in (True, False):  # traced only: no compile
        with nn.intercept_methods(record):
            jax.eval_shape(lambda v, t=training: _apply(model, v, batch, t, 0), shapes)
    names = sorted({c[0] for c in calls})
    assert names and sorted(calls) == sorted(
        [(n, 0.5, True) for n in names] + [(n, 0.5, False) for n in names]
    ), calls


def test_dropout_in_training_only(tmp_path):
    model, batch, shapes = _model(tmp_path, *MODELS[0])  # DLRM: bottom and top MLPs
    rng = np.random.default_rng(0)  # any parameter values do (no init compile)
    variables = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype) * 0.3, shapes)

    @jax.jit
    def outputs(variables, batch):
        plain = model.clone(dropout=0.0)
        return [
            _apply(model, variables, batch, True, 1),
            _apply(model, variables, batch, True, 2),
            _apply(model, variables, batch, False, 1),
            _apply(plain, variables, batch, True, 1),
        ]

    a, b, evaluated, plain = outputs(variables, batch)
    assert not np.allclose(a, b)  # a different mask per key, in training
    np.testing.assert_array_equal(evaluated, plain)  # evaluation: no dropout at all


def test_dropout_option_is_the_typed_key(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.options\.dropout"):
        _cfg(tmp_path, "model.options={dropout: 0.1}")
    with pytest.raises(ConfigError, match=r"`dropout` must be in \[0, 1\)"):
        _cfg(tmp_path, "model.dropout=1.5")


# ---- 3. L2 on touched rows, dense weight decay -------------------------------------------
def _padded(bags, max_ids):
    ids, segs = [], []
    for i, bag in enumerate(bags):
        ids += bag
        segs += [i] * len(bag)
    cap = len(bags) * max_ids
    pad = cap - len(ids)
    return PaddedIds(
        ids=np.array(ids + [-1] * pad, np.int32),
        segments=np.array(segs + [len(bags) - 1] * pad, np.int32),
    )


BAGS = {  # feature: (combiner, max_ids, bags); rows 1 and 5 are looked up several times
    "a": ("sum", 3, [[1, 1, 5], [5], [], [7, 2]]),
    "b": ("mean", 2, [[2], [9, 9], [1], []]),
    "c": ("max", 2, [[3, 5], [11], [], [2, 3]]),
}


def _dense_pool(w, combiner, padded, batch):
    ids = jnp.asarray(padded.ids)
    valid = ids >= 0
    rows = jnp.where(valid[:, None], w[jnp.maximum(ids, 0)], 0.0)
    segs = jnp.asarray(padded.segments)
    if combiner == "max":
        out = jax.ops.segment_max(jnp.where(valid[:, None], rows, -jnp.inf), segs, batch)
        return jnp.where(jnp.isfinite(out), out, 0.0)
    total = jax.ops.segment_sum(rows, segs, batch)
    if combiner == "mean":
        n = jax.ops.segment_sum(valid.astype(jnp.float32), segs, batch)
        total = total / jnp.maximum(n, 1.0)[:, None]
    return total


@pytest.mark.parametrize(
    "optimizer,features",
    [(SGD(learning_rate=0.1), "abc"), (RowWiseAdagrad(learning_rate=0.1), "ab")],
    ids=["sgd_sum_mean_max", "rowwise_adagrad_sum_mean"],
)
def test_sparse_l2_matches_a_dense_reference(optimizer, features):
    """The update is implementation-independent code around `sparse_apply` (whose
    implementations agree: tests/ops/test_sparse_apply.py): the platform's default here."""
    vocab, dim, batch, l2 = 16, 4, 4, 0.3
    specs = [
        FeatureSpec(name=f, table="t", combiner=BAGS[f][0], max_ids=BAGS[f][1]) for f in features
    ]
    store = DeviceTableStore(
        [TableSpec(name="t", vocab_size=vocab, dim=dim, optimizer=optimizer)],
        specs,
    )
    stack = next(iter(store.stacks))
    padded = {f: _padded(BAGS[f][2], BAGS[f][1]) for f in features}
    cot = {f: jax.random.normal(jax.random.key(i), (batch, dim)) for i, f in enumerate(features)}
    state = store.init(jax.random.key(0))
    w0 = np.asarray(state[stack]["weights"])

    def loss(outs):
        return sum((store.split(outs, batch)[f] * cot[f]).sum() for f in features)

    @jax.jit
    def sparse_step(state, padded):
        outputs, lookups = store.lookup(state, padded, batch)
        return store.apply_gradients(state, lookups, jax.grad(loss)(outputs), step=1, l2=l2)

    got = np.asarray(sparse_step(state, padded)[stack]["weights"])

    touched = sorted({i for f in features for bag in BAGS[f][2] for i in bag})

    def ref_loss(w):  # the L2 term once per touched row
        pooled = [_dense_pool(w, BAGS[f][0], padded[f], batch) for f in features]
        data = sum((p * cot[f]).sum() for p, f in zip(pooled, features, strict=True))
        return data + 0.5 * l2 * (w[np.array(touched)] ** 2).sum()

    g = np.asarray(jax.jit(jax.grad(ref_loss))(jnp.asarray(w0)))
    want = w0.copy()
    rows = np.array(touched)
    if isinstance(optimizer, SGD):
        want[rows] -= 0.1 * g[rows]
    else:
        acc = (g[rows] ** 2).mean(axis=1)
        want[rows] -= 0.1 * g[rows] / (np.sqrt(acc)[:, None] + optimizer.eps)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    untouched = np.setdiff1d(np.arange(vocab), rows)
    np.testing.assert_array_equal(got[untouched], w0[untouched])  # never decayed
    assert set(np.flatnonzero(np.any(got != w0, axis=1))) == set(touched)


def _first_update(tx, grads, params):
    with jax.numpy_dtype_promotion("standard"):  # as in the Trainer: optax mixes int/float
        return tx.update(grads, tx.init(params), params)[0]


def test_dense_weight_decay_decays_matrices_not_biases(tmp_path):
    params = {"kernel": jnp.full((2, 3), 2.0), "bias": jnp.full((3,), 2.0)}
    grads = {"kernel": jnp.full((2, 3), 0.5), "bias": jnp.full((3,), 0.5)}
    sgd = _cfg(
        tmp_path,
        "optimizer.dense=sgd",
        "optimizer.dense_learning_rate=0.1",
        "optimizer.dense_weight_decay=0.01",
    ).optimizer
    up = _first_update(runner.dense_optimizer(sgd), grads, params)
    np.testing.assert_allclose(up["kernel"], -0.1 * (0.5 + 0.01 * 2.0), rtol=1e-6)
    np.testing.assert_allclose(up["bias"], -0.1 * 0.5, rtol=1e-6)
    adamw = _cfg(tmp_path, "optimizer.dense=adamw", "optimizer.dense_weight_decay=0.1").optimizer
    ref = optax.adamw(1e-3, weight_decay=0.1, mask={"kernel": True, "bias": False})
    jax.tree.map(
        np.testing.assert_allclose,
        _first_update(runner.dense_optimizer(adamw), grads, params),
        _first_update(ref, grads, params),
    )
    # unset: today's optimizers, adamw's own default decay included
    default = _cfg(tmp_path, "optimizer.dense=adamw").optimizer
    jax.tree.map(
        np.testing.assert_array_equal,
        _first_update(runner.dense_optimizer(default), grads, params),
        _first_update(optax.adamw(1e-3), grads, params),
    )
    with pytest.raises(ConfigError, match="`sparse_l2` must be >= 0"):
        _cfg(tmp_path, "optimizer.sparse_l2=-1")


# ---- 4. learning-rate schedules ----------------------------------------------------------
def test_schedule_values():
    t = np.arange(30)
    warm = Schedule(warmup_steps=4)
    np.testing.assert_allclose(warm(t), np.minimum((t + 1) / 4, 1.0), rtol=1e-6)
    cos = Schedule(warmup_steps=4, decay="cosine", final_lr_ratio=0.1).resolve(24)  # 20 decay
    p = np.clip((t - 4) / 20, 0, 1)
    want = np.where(t < 4, (t + 1) / 4, 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * p)))
    np.testing.assert_allclose(cos(t), want, rtol=1e-5, atol=1e-7)
    assert cos.decay_steps == 20 and float(cos(4)) == 1.0 and float(cos(29)) == pytest.approx(0.1)
    lin = Schedule(decay="linear", decay_steps=10)
    np.testing.assert_allclose(lin(t), np.maximum(1 - t / 10, 0.0), rtol=1e-6, atol=1e-7)
    exp = Schedule(decay="exponential", decay_steps=10, decay_rate=0.5, final_lr_ratio=0.3)
    np.testing.assert_allclose(exp(t), np.maximum(0.5 ** (t / 10), 0.3), rtol=1e-5)
    step = Schedule(decay="step", decay_steps=7, decay_rate=0.1)
    np.testing.assert_allclose(step(t), 0.1 ** (t // 7), rtol=1e-5)
    with pytest.raises(ValueError, match="decay 'step' needs `decay_steps`"):
        Schedule(decay="step")
    with pytest.raises(ValueError, match="set `decay_steps`"):
        Schedule(decay="cosine").resolve(None)


def test_dense_schedule_sets_the_learning_rate_of_every_step(tmp_path):
    cfg = _cfg(
        tmp_path,
        "optimizer.dense=sgd",
        "optimizer.dense_learning_rate=0.5",
        "optimizer.schedule={warmup_steps: 3, decay: linear, final_lr_ratio: 0.2}",
        "steps=13",
    )
    sched = cfg.optimizer.schedule.resolve(13)
    tx = runner.dense_optimizer(cfg.optimizer, 13)
    params, grads = {"w": jnp.ones(3)}, {"w": jnp.full(3, 2.0)}
    state = tx.init(params)
    for k in range(13):
        up, state = tx.update(grads, state, params)
        np.testing.assert_allclose(up["w"], -0.5 * float(sched(k)) * 2.0, rtol=1e-6)
    # the final ratio is reached after the run's last update (optax's convention)
    assert float(sched(12)) == pytest.approx(0.28) and float(sched(13)) == pytest.approx(0.2)


# ---- 5. early stopping, keep best ---------------------------------------------------------
class _FakeCheckpointer:
    directory = "/best"

    def __init__(self):
        self.saved, self.deleted = [], []
        self.manager = self

    def steps(self):
        return list(self.saved)

    def save(self, state, extra=None):
        self.saved.append(int(state.step))

    def delete(self, step):
        self.saved.remove(step)
        self.deleted.append(step)

    def close(self):
        pass


@dataclasses.dataclass
class _State:
    step: int


def test_early_stopping_hook_tracks_the_best_and_stops_after_patience():
    ckpt = _FakeCheckpointer()
    hook = EarlyStopping("logloss", patience=2, min_delta=0.01, checkpointer=ckpt)
    assert hook.mode == "min"
    evals = {1: 0.70, 2: 0.60, 3: 0.595, 4: 0.58, 5: 0.59, 6: 0.575}
    stops = []
    for step, v in evals.items():
        hook.after_step(step, _State(step), {})
        stops.append(hook.on_eval(step, {"logloss": v, "auc": 0.5}))
    # 3 is not better by > 0.01 (wait 1), 4 is (best), 5 and 6 are not: stop at 6
    assert stops == [False, False, False, False, False, True]
    assert (hook.best_step, hook.best_value, hook.stopped_at) == (4, 0.58, 6)
    assert ckpt.saved == [1, 2, 4]  # the fake keeps all; Checkpointer(max_to_keep=1) the last
    assert hook.summary()["best_eval"] == {
        "step": 4,
        "metric": "logloss",
        "mode": "min",
        "checkpoint": "/best/4",
        "logloss": 0.58,
        "auc": 0.5,
    }
    hook.on_eval(6, {"logloss": 0.1, "auc": 0.5})  # the same eval again is not counted
    assert hook.best_step == 4
    with pytest.raises(ValueError, match=r"no metric 'ndcg@10' \(they have \['auc'\]\)"):
        EarlyStopping("ndcg@10").on_eval(1, {"auc": 0.5, "examples": 3})

    resumed = EarlyStopping("logloss", patience=2, min_delta=0.01, checkpointer=ckpt)
    resumed.replay([(s, {"logloss": v}) for s, v in evals.items() if s <= 5])
    assert (resumed.best_step, resumed.wait, resumed.best_checkpoint) == (4, 1, "/best/4")
    ckpt.saved.append(9)  # a best of an abandoned continuation: replaced by a new best
    resumed.after_step(6, _State(6), {})
    assert not resumed.on_eval(6, {"logloss": 0.3})
    assert ckpt.saved == [1, 2, 4, 6] and ckpt.deleted == [9]


def test_keep_best_on_auc_warns_when_its_logloss_is_far_above_the_lowest():
    """Far: more than 1% of the lowest logloss and more than 0.005 above it."""
    evals = {1: (0.70, 0.450), 2: (0.72, 0.440), 3: (0.74, 0.470), 4: (0.73, 0.480)}

    def kept(evals, checkpointer):
        hook, logs = EarlyStopping("auc", checkpointer=checkpointer), []
        knobs = RunKnobs(None, hook, logs.append)
        for step, (auc, logloss) in evals.items():
            knobs.after_step(step, _State(step), {})
            knobs.on_eval(step, {"auc": auc, "logloss": logloss})
        knobs.on_end(max(evals), _State(max(evals)))
        return hook, [line for line in logs if line.startswith("warning")]

    hook, warnings = kept(evals, _FakeCheckpointer())
    assert hook.best_step == 3 and hook.lowest_logloss == (2, 0.44)
    assert warnings == [
        "warning: the best auc (step 3) has logloss 0.4700, 6.8% above the lowest logloss "
        "0.4400 (step 2): its probabilities are overfit; early_stopping.metric=logloss "
        "keeps the best calibrated state instead"
    ]
    near = {**evals, 3: (0.74, 0.4449)}  # 1.1% but under 0.005 above
    assert kept(near, _FakeCheckpointer())[1] == []
    assert kept(evals, None)[1] == []  # nothing kept: nothing to warn of
    by_logloss = EarlyStopping("logloss")
    by_logloss.on_eval(1, {"logloss": 0.4})
    assert by_logloss.logloss_warning() is None


@pytest.fixture(scope="module")
def knob_run(tmp_path_factory):
    """A run with every knob set, trained until early stopping ends it at step 6: (the
    `Run`, the log lines)."""
    tmp_path = tmp_path_factory.mktemp("knobs")
    cfg = _cfg(
        tmp_path,
        "name=es",
        "steps=40",
        "eval_every=2",
        "log_every=5",
        # min_delta so large that only the first eval is ever a best: stops at 2 + 2 * 2
        "early_stopping={metric: auc, patience: 2, min_delta: 1.0}",
        "optimizer.schedule={warmup_steps: 4, decay: cosine, final_lr_ratio: 0.1}",
        "optimizer.sparse=sgd",
        "optimizer.sparse_learning_rate=0.1",
        "optimizer.sparse_l2=0.001",
        "optimizer.dense_weight_decay=0.0001",
        "model.embedding_init={kind: truncated_normal, stddev: 0.02}",
    )
    run = runner.build_run(cfg, log=lambda *_: None)
    logs = []
    run.summary = runner.train_run(run, log=logs.append)
    run.compiled = run.trainer._steps[("train", 32)]._cache_size()
    return run, logs


def test_runner_early_stopping_keeps_the_best_and_reports_best_and_last(knob_run):
    run, logs = knob_run
    summary, run_dir = run.summary, Path(run.cfg.run_dir)
    assert run.trainer.sparse_l2 == 0.001 and run.trainer.sparse_schedule is not None
    assert summary["stopped_at"] == 6 and summary["step"] == 6
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {
        r["step"]: {k: v for k, v in r.items() if k != "kind"}
        for r in records
        if r["kind"] == "eval"
    }
    # summary.json says which eval is the last and which the best, by what metric
    assert summary["last_eval"] == evals[6] and "eval" not in summary
    best_dir = run_dir / "checkpoints_best"
    assert summary["best_eval"] == {
        "metric": "auc",
        "mode": "max",
        "checkpoint": str(best_dir.absolute() / "2"),
        **evals[2],
    }
    assert sorted(os.listdir(best_dir)) == ["2"] and "6" in os.listdir(run_dir / "checkpoints")
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4, 6]  # 6 not twice
    assert [r["step"] for r in records if r["kind"] == "train"] == [5, 6]
    assert any("early stopping at step 6" in line for line in logs)
    assert run.compiled == 1  # 6 steps, each at another learning rate: one compile
    # the best state restores through a Checkpointer on that directory
    ckpt = train.Checkpointer(best_dir, run.checkpointer.layouts)
    state, meta = ckpt.restore(run.state)
    ckpt.close()
    assert int(state.step) == 2 and meta["extra"]["best"]["metric"] == "auc"
    # eval (evaluate_run) builds its restore template the same way: same optimizer state
    _, again = build_trainer(run.cfg, run.data)
    assert jax.tree.structure(again.tx.init(run.state.params)) == jax.tree.structure(
        run.state.opt_state
    )
    # the model knobs reach the trainer's model (no compile needed to see it)
    knobs = dataclasses.replace(run.cfg.model, dropout=0.1)
    model, _ = build_trainer(dataclasses.replace(run.cfg, model=knobs), run.data)
    assert model.dropout == 0.1
    assert {t.initializer for t in run.model.tables} == {truncated_normal_init(0.02)}


def test_sparse_schedule_changes_the_rate_each_step_without_recompiling(knob_run):
    run, _ = knob_run
    trainer, cfg = run.trainer, run.cfg
    sched = trainer.sparse_schedule
    assert sched == cfg.optimizer.schedule.resolve(40) and sched.decay_steps == 36
    batch = runner.first_train_batch(run.data)
    state = run.state  # trained to step 6 with the schedule (see knob_run)
    w0 = jax.tree.map(np.asarray, state.tables)
    deltas, compiled = {}, []
    for k in (0, 1, 3, 4, 10, 39):  # the k-th update follows k earlier ones
        start = trainer.put_state(
            jax.tree.map(jnp.array, state).replace(step=jnp.asarray(k, jnp.int32))
        )
        new, _ = trainer.train_step(start, batch)  # sparse SGD: delta = -lr * sched(k) * g
        compiled.append(trainer._steps[("train", batch.batch_size)]._cache_size())
        diff = jax.tree.map(lambda a, b: np.asarray(a) - b, new.tables, w0)
        deltas[k] = np.concatenate([x.ravel() for x in jax.tree.leaves(diff)])
    assert np.abs(deltas[4]).max() > 0 and float(sched(4)) == 1.0  # the end of the warmup
    for k, d in deltas.items():
        np.testing.assert_allclose(d, float(sched(k)) * deltas[4], rtol=1e-4, atol=1e-7)
    assert float(sched(0)) == 0.25 and float(sched(39)) < 0.11
    assert len(set(compiled)) == 1  # another rate, no other compile


def test_eval_every_epoch_and_early_stopping_errors(tmp_path):
    cfg = _cfg(tmp_path, "eval_every=epoch")
    assert cfg.eval_every == "epoch"

    @dataclasses.dataclass
    class _Data:
        steps_per_epoch: int | None

    assert eval_every(cfg, _Data(17)) == 17
    assert eval_every(_cfg(tmp_path, "eval_every=50"), _Data(17)) == 50
    with pytest.raises(ConfigError, match="eval_every=epoch needs file data"):
        eval_every(cfg, _Data(None))
    with pytest.raises(ConfigError, match="eval_every"):
        _cfg(tmp_path, "eval_every=0")
    with pytest.raises(ConfigError, match="eval_every"):
        _cfg(tmp_path, "eval_every=weekly")
    with pytest.raises(ConfigError, match="patience"):
        _cfg(tmp_path, "early_stopping.patience=0")
    es = _cfg(tmp_path, "early_stopping={metric: logloss}").early_stopping
    assert (es.patience, es.keep_best, es.mode) == (5, True, None)
