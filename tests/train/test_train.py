"""Trainer, metrics, checkpoints and the runner's guarantees: exact resume across a
process restart, clear errors for truncated or mismatched checkpoints, NaN stops."""

import dataclasses
import json
import os
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import sparsejax.checkpoint
from sparsejax import runner, train
from sparsejax.train import CheckpointError

TINY = [
    "log_every=5",
    "data.batch_size=64",
    "data.eval_batches=2",
    "data.synthetic_options={vocab_sizes: [300, 50, 7, 120], num_dense: 3}",
    "progress=false",
    "model.embedding_dim=8",
    "model.options={bottom: [16, 8], top: [16, 1]}",
]


def _cfg(tmp_path, *overrides):
    return runner.load_config([], [*TINY, f"out_dir={tmp_path}", *overrides])


def _state_arrays(cfg):
    """The latest checkpoint of a run, restored through the runner."""
    run = runner.build_run(cfg, log=lambda *_: None)
    return int(run.state.step), jax.tree.map(np.asarray, run.state)


def test_metrics_against_brute_force():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 300)
    s = rng.integers(0, 15, 300).astype(np.float64)  # many ties
    pos, neg = s[y == 1], s[y == 0]
    brute = (pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean()
    assert train.auc(y, s) == pytest.approx(brute, abs=1e-12)
    mask = (rng.random(300) < 0.7).astype(np.float32)
    keep = mask > 0
    assert train.auc(y, s, mask) == pytest.approx(train.auc(y[keep], s[keep]), abs=1e-12)
    z = rng.normal(size=300)
    p = 1 / (1 + np.exp(-z))
    assert train.logloss(y, z) == pytest.approx(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
    assert train.calibration(y, z) == pytest.approx(p.mean() / y.mean())
    scores = np.eye(4) + 0.1 * rng.random((4, 4))
    assert train.recall_at_k(scores, 1) == 1.0
    scores[2, 0] = 5.0  # row 2's own item ranks second
    assert train.recall_at_k(scores, 1) == 0.75 and train.recall_at_k(scores, 2) == 1.0
    assert np.isnan(train.auc(np.ones(5), np.arange(5.0)))


def test_resume_after_process_restart_is_bit_identical(tmp_path):
    """The first half and the uninterrupted run train here; the resume is a new process
    (the command line), so only one interpreter starts."""
    runner.train(_cfg(tmp_path, "name=split", "steps=12"), log=lambda *_: None)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "sparsejax", "train", *TINY, f"out_dir={tmp_path}"]
    out = subprocess.run(
        [*cmd, "name=split", "steps=24"], check=True, env=env, capture_output=True, text=True
    )
    assert "resumed from" in out.stdout
    runner.train(_cfg(tmp_path, "name=whole", "steps=24"), log=lambda *_: None)
    step_a, a = _state_arrays(_cfg(tmp_path, "name=split", "steps=24"))
    step_b, b = _state_arrays(_cfg(tmp_path, "name=whole", "steps=24"))
    assert step_a == step_b == 24
    jax.tree.map(np.testing.assert_array_equal, a, b)
    # the resumed run's log continues the first one without duplicates
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert steps == [5, 10, 12, 15, 20, 24]  # 12: the end of the first run


def test_a_resume_restores_into_tables_it_never_initialized(tmp_path, monkeypatch):
    """The restore template describes the tables without filling them, so a resumed
    run never holds a table twice (its initial values and the restored ones)."""
    from sparsejax.embedding import DeviceTableStore

    runner.train(_cfg(tmp_path, "name=r", "steps=3"), log=lambda *_: None)

    def refuse(*args, **kwargs):
        raise AssertionError("a table was initialized")

    monkeypatch.setattr(DeviceTableStore, "init", refuse)
    step, state = _state_arrays(_cfg(tmp_path, "name=r", "steps=3"))
    assert step == 3 and all(np.isfinite(x).all() for x in jax.tree.leaves(state.tables))
    with pytest.raises(AssertionError, match="initialized"):  # a fresh run fills them
        _state_arrays(_cfg(tmp_path, "name=fresh", "steps=3"))


class _Killed(Exception):
    """What `_KillAfter` raises: the run dies as a killed process would, unsaved."""


class _KillAfter(train.Hook):
    def __init__(self, step):
        self.step = step

    def after_step(self, step, state, metrics):
        if step == self.step:
            raise _Killed(step)


def _training_records(run_dir):
    """metrics.jsonl's records without the throughput (which no two runs share)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k != "samples_per_s"} for x in lines]


def test_metrics_of_a_killed_and_resumed_run_match_an_uninterrupted_run(tmp_path, monkeypatch):
    """Checkpoint 7 of log_every 5, killed at step 12 (after the records of step 10),
    resumed: the record of step 10 averages steps 6-10 (the losses of 6 and 7 come from
    the checkpoint), as the uninterrupted run's does; metrics.jsonl and TensorBoard's
    view of the event files drop the killed run's records past step 7."""
    knobs = ["steps=20", "checkpoint_every=7", "log_every=5", "eval_every=10"]
    fit = runner._run.fit
    with monkeypatch.context() as m:
        m.setattr(
            runner._run,
            "fit",
            lambda *a, hooks=(), **kw: fit(*a, hooks=[*hooks, _KillAfter(12)], **kw),
        )
        with pytest.raises(_Killed):
            runner.train(_cfg(tmp_path, "name=split", *knobs), log=lambda *_: None)
    logs = []
    runner.train(_cfg(tmp_path, "name=split", *knobs), log=logs.append)
    assert any("resumed from" in line and "/7 " in line for line in logs)
    runner.train(_cfg(tmp_path, "name=whole", *knobs), log=lambda *_: None)
    split, whole = _training_records(tmp_path / "split"), _training_records(tmp_path / "whole")
    assert [(r["kind"], r["step"]) for r in whole] == [
        ("train", 5),
        ("train", 10),
        ("eval", 10),
        ("train", 15),
        ("train", 20),
        ("eval", 20),
    ]
    assert split == whole
    tensorboard = [_tensorboard_scalars(tmp_path / n / "tensorboard") for n in ("split", "whole")]
    assert len(os.listdir(tmp_path / "split" / "tensorboard")) == 2  # the killed run's, and
    tensorboard[0].pop("train/samples_per_s")  # the resumed run's (its purge hides 10)
    tensorboard[1].pop("train/samples_per_s")
    assert tensorboard[0] == tensorboard[1]


def _tensorboard_scalars(logdir):
    """`{tag: [(step, value)]}` of the event files in `logdir` as TensorBoard shows them,
    read with tensorboardX's protos and the TFRecord framing (u64 length, u32 its crc,
    the data, u32 its crc): a file that starts a session at step s (`purge_step`) hides
    the earlier files' values of steps >= s."""
    from tensorboardX.proto import event_pb2

    out = {}
    for name in sorted(os.listdir(logdir)):
        data, i = (logdir / name).read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            if event.session_log.status == event_pb2.SessionLog.START:
                out = {t: [(s, v) for s, v in sv if s < event.step] for t, sv in out.items()}
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_the_tensorboard_log_writes_scalars_without_importing_pytorch(tmp_path):
    """tensorboardX imports torch where it is installed (2 s of a run's start); the run's
    log writes its scalars without it, and `import torch` works afterwards."""
    code = (
        "import importlib.util, sys\n"
        "from sparsejax.runner._report import TensorBoardLog\n"
        f"log = TensorBoardLog({str(tmp_path)!r}, 0)\n"
        "log.on_log(1, {'loss': 0.5})\n"
        "log.close()\n"
        "assert 'torch' not in sys.modules\n"
        "if importlib.util.find_spec('torch'):\n"
        "    import torch\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
    assert _tensorboard_scalars(tmp_path) == {"train/loss": [(1, 0.5)]}


def test_tensorboard_event_files_and_summary_hold_the_metrics_of_metrics_jsonl(
    tmp_path, monkeypatch
):
    runner.train(_cfg(tmp_path, "name=tb", "steps=12", "eval_every=5"), log=lambda *_: None)
    expected = {}
    for r in _training_records(tmp_path / "tb"):  # the throughput aside
        for k, v in r.items():
            if k not in ("kind", "step"):
                expected.setdefault(f"{r['kind']}/{k}", []).append((r["step"], np.float32(v)))
    assert {"train/loss", "eval/auc", "eval/logloss"} <= expected.keys()
    # without early_stopping summary.json names the best eval by auc (nothing kept)
    evals = [r for r in _training_records(tmp_path / "tb") if r["kind"] == "eval"]
    summary = json.loads((tmp_path / "tb" / "summary.json").read_text())
    best = max(evals, key=lambda r: r["auc"])
    assert [r["step"] for r in evals] == [5, 10, 12]
    assert summary["last_eval"] == {k: v for k, v in evals[-1].items() if k != "kind"}
    assert summary["best_eval"] == {
        "metric": "auc",
        "mode": "max",
        "checkpoint": None,
        **{k: v for k, v in best.items() if k != "kind"},
    }
    scalars = _tensorboard_scalars(tmp_path / "tb" / "tensorboard")
    assert [s for s, _ in scalars.pop("train/samples_per_s")] == [5, 10, 12]
    assert scalars == expected  # float32 in the event file
    # without tensorboardX: one line says how to get it; the run trains as before
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    logs = []
    runner.train(_cfg(tmp_path, "name=no_tb", "steps=2"), log=logs.append)
    assert [line for line in logs if line.startswith("tensorboard")] == [
        "tensorboard: no event files (tensorboardX is not installed; pip install "
        "tensorboardX, or sparsejax[tensorboard]); metrics.jsonl has the same metrics"
    ]
    assert not (tmp_path / "no_tb" / "tensorboard").exists()
    assert (tmp_path / "no_tb" / "summary.json").exists()


def test_truncated_checkpoint_is_named_and_earlier_ones_stay_usable(tmp_path):
    cfg = _cfg(tmp_path, "name=t", "steps=10", "checkpoint_every=5")
    runner.train(cfg, log=lambda *_: None)
    ckpt_dir = tmp_path / "t" / "checkpoints"
    assert sorted(int(p) for p in os.listdir(ckpt_dir) if p.isdigit()) == [5, 10]
    for root, _, files in os.walk(ckpt_dir / "10"):  # truncate every data file of step 10
        for f in files:
            path = os.path.join(root, f)
            if os.path.getsize(path) > 64:
                with open(path, "r+b") as fh:
                    fh.truncate(os.path.getsize(path) // 2)
    run = runner.build_run(
        runner.load_config(
            [], [*TINY, f"out_dir={tmp_path}", "name=t", "steps=10", "resume=false"]
        ),
        log=lambda *_: None,
    )
    with pytest.raises(CheckpointError, match=r"checkpoint 10 .*other checkpoints: \[5\]"):
        run.checkpointer.restore(run.state)
    state, meta = run.checkpointer.restore(run.state, step=5)
    assert int(state.step) == 5 and meta["data_position"] == {"epoch": 0, "batch": 5}


def test_mismatched_checkpoint_names_the_table(tmp_path):
    runner.train(_cfg(tmp_path, "name=m", "steps=3"), log=lambda *_: None)
    with pytest.raises(
        CheckpointError,
        match=r"table 'C1' was saved with dim=8, the model has "
        r"dim=4",
    ):
        runner.build_run(
            _cfg(
                tmp_path,
                "name=m",
                "steps=3",
                "model.embedding_dim=4",
                "model.options={bottom: [16, 4], top: [16, 1]}",
            ),
            log=lambda *_: None,
        )


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    explode = [
        "name=nan",
        "steps=40",
        "checkpoint_every=1",
        "optimizer.dense=sgd",
        "optimizer.dense_learning_rate=1e30",
        "optimizer.sparse=sgd",
        "optimizer.sparse_learning_rate=1e30",
    ]
    cfg = _cfg(tmp_path, *explode)
    with pytest.raises(FloatingPointError, match=r"(at step \d+|not saving step \d+)") as e:
        runner.train(cfg, log=lambda *_: None)
    failed = int(__import__("re").search(r"step (\d+)", str(e.value)).group(1))
    step, state = _state_arrays(_cfg(tmp_path, *explode))
    assert step < failed
    assert all(
        np.isfinite(x).all() for x in jax.tree.leaves(state) if np.issubdtype(x.dtype, np.floating)
    )


def test_bfloat16_mixed_precision_trains(tmp_path):
    cfg = _cfg(
        tmp_path,
        "name=bf16",
        "steps=40",
        "model.dtype=bfloat16",
        "model.table_dtype=bfloat16",
        "eval_every=null",
    )
    run = runner.build_run(cfg, log=lambda *_: None)
    weights = [g["weights"] for layer in run.state.tables.values() for g in layer.values()]
    assert weights and all(w.dtype == np.dtype("bfloat16") for w in weights)  # slots: f32
    first = run.trainer.evaluate(run.state, run.data.eval_batches)["loss"]
    summary = runner.train_run(run, log=lambda *_: None)
    assert summary["last_eval"]["loss"] < first - 0.05


def _small(tmp_path, *overrides):
    """Model, data and first batch of a tiny synthetic run (no run directory)."""
    cfg = _cfg(tmp_path, "steps=10", *overrides)
    data = runner.build_data(cfg)
    model = runner.build_model(cfg, data.tables, data.features)
    return cfg, data, model, runner.first_train_batch(data)


def _batches(data, n):
    """Training batches 0..n-1 of a synthetic source, packed on the host."""
    b = data.packer.batch_size
    return [
        data.packer.pack(s, labels=y, dense=d)
        for s, y, d in (data.train_source.batch(i, b) for i in range(n))
    ]


class _Recorder(train.Hook):
    """Sees every step; stops training after `stop_at`."""

    def __init__(self, stop_at=None):
        self.stop_at, self.before, self.after, self.logs, self.evals = stop_at, [], [], [], []
        self.ended = None

    def before_step(self, step, batch):
        self.before.append(step)

    def after_step(self, step, state, metrics):
        assert int(state.step) == step
        self.after.append((step, float(metrics["loss"])))
        return step == self.stop_at

    def on_log(self, step, record):
        self.logs.append(record["step"])

    def on_eval(self, step, result):
        self.evals.append(step)

    def on_end(self, step, state):
        self.ended = (step, int(state.step))


def test_fit_calls_hooks_every_step_and_a_hook_stops_training(tmp_path):
    _, data, model, first = _small(tmp_path)
    trainer = train.Trainer(model, runner.dense_optimizer(runner.RunConfig().optimizer))
    state = trainer.init(jax.random.key(0), first)
    hook = _Recorder()
    result = train.fit(
        trainer,
        state,
        _batches(data, 7),
        steps=7,
        log_every=3,
        eval_batches=data.eval_batches,
        eval_every=2,
        hooks=[hook],
    )
    assert hook.before == [s for s, _ in hook.after] == [1, 2, 3, 4, 5, 6, 7]
    assert all(np.isfinite(loss) for _, loss in hook.after)
    assert hook.logs == [3, 6, 7] and hook.evals == [2, 4, 6, 7]
    assert hook.ended == (7, 7) and int(result.state.step) == 7
    assert result.eval["examples"] == sum(int(b.mask.sum()) for b in data.eval_batches)

    stopper = _Recorder(stop_at=10)
    result = train.fit(
        trainer, result.state, _batches(data, 20), steps=20, log_every=5, hooks=[stopper]
    )
    assert stopper.before == [8, 9, 10] and stopper.ended == (10, 10)
    assert int(result.state.step) == 10 and stopper.logs == [10]  # the partial window

    short = _Recorder()  # the data runs out before `steps`: the last batch ends training
    result = train.fit(
        trainer, result.state, _batches(data, 3), steps=20, log_every=5, hooks=[short]
    )
    assert short.before == [11, 12, 13] and short.logs == [13] and short.ended == (13, 13)
    assert int(result.state.step) == 13


def test_fit_stops_on_a_nan_loss_naming_the_step(tmp_path):
    _, data, model, first = _small(tmp_path)
    trainer = train.Trainer(model, runner.dense_optimizer(runner.RunConfig().optimizer))
    state = trainer.init(jax.random.key(0), first)
    batches = _batches(data, 6)
    batches[3] = dataclasses.replace(batches[3], dense=np.full_like(batches[3].dense, np.nan))
    hook = _Recorder()
    with pytest.raises(
        train.NonFiniteLossError,
        match=r"training loss is nan at step 4; "
        r"stopped \(no checkpoint",
    ):
        train.fit(trainer, state, batches, steps=6, hooks=[hook])
    assert hook.before[-1] in (4, 5)  # checked while the next step runs


def test_checkpointer_needs_the_layouts_and_serving_restores_tables_alone(tmp_path):
    _, _, model, first = _small(tmp_path)
    layouts = train.embedding_layouts(model, first)
    assert [sparsejax.checkpoint.layer_key(p) for p in layouts] == ["embedding"]
    trainer = train.Trainer(model, runner.dense_optimizer(runner.RunConfig().optimizer))
    with pytest.raises(RuntimeError, match="call Trainer.init first"):
        trainer.layouts  # noqa: B018
    # built before the trainer's init: the layouts come from the model and a batch
    ckpt = train.Checkpointer(tmp_path / "ok", layouts)
    empty = train.Checkpointer(tmp_path / "empty", {})
    state = trainer.init(jax.random.key(0), first)
    with pytest.raises(
        CheckpointError,
        match=r"table state 'embedding/.*' of an embedding "
        r"layer this checkpointer has no layout for",
    ):
        empty.save(state)
    assert empty.steps() == []
    ckpt.save(state)
    tables, meta = ckpt.restore_tables()  # no trainer, no template
    assert meta["step"] == 0 and sorted(meta["tables"]["embedding"]) == sorted(
        t.name for t in model.tables
    )
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.tree.map(np.asarray, tables),
        jax.tree.map(np.asarray, state.tables),
    )
    by_name = trainer.tables_by_name(state)["embedding"]
    assert set(by_name) == {t.name for t in model.tables}
    ckpt.close()
    empty.close()


@pytest.mark.parametrize("implementation", ["xla", None])
def test_data_parallel_step_on_4_devices_matches_one_device(tmp_path, implementation):
    devices = jax.devices()
    assert len(devices) >= 4, "conftest provides 4 CPU devices"
    _, data, model, first = _small(tmp_path)
    model = model.clone(implementation=implementation)
    tx = runner.dense_optimizer(runner.RunConfig().optimizer)
    one = train.Trainer(model, tx)
    four = train.Trainer(model, tx, mesh=Mesh(np.array(devices[:4]), ("data",)))
    s1, s4 = one.init(jax.random.key(0), first), four.init(jax.random.key(0), first)
    assert all(
        len(x.sharding.device_set) == 4 and x.sharding.is_fully_replicated
        for x in jax.tree.leaves(s4)
    )
    batches = _batches(data, 3)
    assert four.batch_sharding(64).dense.spec == P("data")
    assert four.batch_sharding(63).dense.spec == P()  # does not divide: replicated
    for batch in batches:
        placed = four.put_batch(batch)
        assert placed.dense.sharding.shard_shape(placed.dense.shape)[0] == 16
        s1, m1 = one.train_step(s1, batch)
        s4, m4 = four.train_step(s4, placed)
        np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-5)
    assert int(s4.step) == 3
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
        s4,
        s1,
    )
    e1, e4 = one.evaluate(s1, data.eval_batches), four.evaluate(s4, data.eval_batches)
    assert e4["auc"] == pytest.approx(e1["auc"], abs=1e-5)


def test_a_mesh_axis_the_table_store_cannot_use_is_named(tmp_path):
    _, _, model, first = _small(tmp_path)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "expert"))
    trainer = train.Trainer(model, runner.dense_optimizer(runner.RunConfig().optimizer), mesh=mesh)
    with pytest.raises(ValueError, match="mesh axis 'expert'"):
        trainer.init(jax.random.key(0), first)


def _labelled_two_tower(batch_size=8, real=7, labels=(1, 0, 1, 1, 0, 1, 1)):
    """A two-tower over one user id and one item id, and a batch of `real` rows (user r,
    item r) with `labels`, padded to `batch_size`."""
    import optax

    from sparsejax import data as sd
    from sparsejax import nn as snn
    from sparsejax.embedding import FeatureSpec, TableSpec
    from sparsejax.ops import RowWiseAdagrad

    tables = [
        TableSpec(name=t, vocab_size=16, dim=4, optimizer=RowWiseAdagrad(learning_rate=0.1))
        for t in ("user", "item")
    ]
    features = [FeatureSpec(name=t, table=t) for t in ("user", "item")]
    model = snn.TwoTower(
        tables=tables,
        features=features,
        user_features=("user",),
        item_features=("item",),
        tower=(8,),
        temperature=0.2,
    )
    packer = sd.BatchPacker(tables, features, batch_size=batch_size)
    one = np.ones(real, int)
    sparse = {f: sd.JaggedIds(lengths=one, values=np.arange(real)) for f in ("user", "item")}
    batch = packer.pack(sparse, labels=np.asarray(labels, np.float32))
    return train.Trainer(model, optax.sgd(0.1)), batch


def test_two_tower_label_0_rows_are_not_positive_pairs():
    """A row labelled 0 (an item shown and not clicked, on CTR-style data) is not a
    positive pair: the loss and in-batch recall@k are those of the batch without its query
    row, its item still a negative of the other rows (it was trained and scored as a
    positive, a silent wrong answer). Padded rows are neither."""
    trainer, batch = _labelled_two_tower()
    state = trainer.init(jax.random.key(0), batch)
    s = np.asarray(trainer.eval_step(state, batch), np.float64)
    queries, items = [0, 2, 3, 5, 6], np.arange(7)  # label-1 rows; every real row's item
    sub = s[queries][:, items]
    own = sub[np.arange(5), queries]
    loss = np.mean(np.log(np.exp(sub).sum(1)) - own)
    rank = (sub > own[:, None]).sum(1)
    assert float(train.retrieval_loss(s, batch)) == pytest.approx(loss, rel=1e-5)
    got = trainer.evaluate(state, [batch], recall_k=(1, 3))
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert got["recall@1"] == np.mean(rank < 1) and got["recall@3"] == np.mean(rank < 3)
    assert train.recall_at_k(s, 3, batch.mask, queries=train.retrieval_queries(batch)) == (
        np.mean(rank < 3)
    )
    # training: a label-0 row's user gets no gradient, its item does (as a negative)
    before = jax.device_get(trainer.tables_by_name(state))
    for _ in range(3):
        state, metrics = trainer.train_step(state, batch)
        assert np.isfinite(float(metrics["loss"]))
    after = jax.device_get(trainer.tables_by_name(state))
    (layer,) = before
    user = [np.asarray(t[layer]["user"]["weights"]) for t in (before, after)]
    item = [np.asarray(t[layer]["item"]["weights"]) for t in (before, after)]
    moved = lambda w: np.abs(w[1][:7] - w[0][:7]).max(1) > 0  # noqa: E731
    np.testing.assert_array_equal(moved(user), np.asarray(batch.labels[:7]) > 0)
    assert moved(item).all()


def test_runner_trains_a_two_tower_on_labelled_rows(tmp_path):
    """Behavior data with negatives (label 0) trains a two-tower through the runner; its
    eval loss is the loss over the positive rows alone."""
    cfg = runner.load_config(
        [],
        [
            "data.kind=behavior",
            "data.synthetic_options={num_users: 200, num_items: 300, num_categories: 10, "
            "max_history: 5, positives_only: false}",
            "data.batch_size=64",
            "data.eval_batches=2",
            "model.name=two_tower",
            "model.embedding_dim=8",
            "model.options={user_features: [user, history], item_features: [item], tower: [8]}",
            "steps=5",
            "eval_every=null",
            "progress=false",
            f"out_dir={tmp_path}",
        ],
    )
    run = runner.build_run(cfg, log=lambda *_: None)
    batches = list(run.data.eval_batches)
    assert any((np.asarray(b.labels) == 0).any() for b in batches)  # it has label-0 rows
    got = runner.train_run(run, log=lambda *_: None)["last_eval"]
    assert np.isfinite(got["loss"])
    losses, weights = [], []
    for b in batches:
        s = np.asarray(run.trainer.eval_step(run.state, b), np.float64)
        q = (np.asarray(b.mask) > 0) & (np.asarray(b.labels) > 0)
        sub = np.where(np.asarray(b.mask)[None] > 0, s, -np.inf)[q]
        losses.append(np.sum(np.log(np.exp(sub).sum(1)) - np.diagonal(s)[q]))
        weights.append(q.sum())
    assert got["loss"] == pytest.approx(sum(losses) / sum(weights), rel=1e-5)
