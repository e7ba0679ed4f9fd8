"""Trainer, metrics, checkpoints and the runner's guarantees: exact resume across a
process restart, clear errors for truncated or mismatched checkpoints, NaN stops."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from sparsejax import runner, train
from sparsejax.train import CheckpointError

TINY = ["log_every=5", "data.batch_size=64", "data.eval_batches=2",
        "data.synthetic_options={vocab_sizes: [300, 50, 7, 120], num_dense: 3}",
        "progress=false", "model.embedding_dim=8", "model.options={bottom: [16, 8], top: [16, 1]}"]


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
    brute = ((pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean())
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
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "sparsejax", "train", *TINY, f"out_dir={tmp_path}"]
    subprocess.run([*cmd, "name=split", "steps=12"], check=True, env=env, capture_output=True)
    out = subprocess.run([*cmd, "name=split", "steps=24"], check=True, env=env,
                         capture_output=True, text=True)
    assert "resumed from" in out.stdout
    subprocess.run([*cmd, "name=whole", "steps=24"], check=True, env=env, capture_output=True)
    step_a, a = _state_arrays(_cfg(tmp_path, "name=split", "steps=24"))
    step_b, b = _state_arrays(_cfg(tmp_path, "name=whole", "steps=24"))
    assert step_a == step_b == 24
    jax.tree.map(np.testing.assert_array_equal, a, b)
    # the resumed run's log continues the first one without duplicates
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == [5, 10, 12, 15, 20, 24]  # 12: the end of the first run


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
    run = runner.build_run(runner.load_config([], [*TINY, f"out_dir={tmp_path}", "name=t",
                                                   "steps=10", "resume=false"]),
                           log=lambda *_: None)
    with pytest.raises(CheckpointError, match=r"checkpoint 10 .*other checkpoints: \[5\]"):
        run.checkpointer.restore(run.state)
    state, meta = run.checkpointer.restore(run.state, step=5)
    assert int(state.step) == 5 and meta["data_position"] == {"epoch": 0, "batch": 5}


def test_mismatched_checkpoint_names_the_table(tmp_path):
    runner.train(_cfg(tmp_path, "name=m", "steps=3"), log=lambda *_: None)
    with pytest.raises(CheckpointError, match=r"table 'C1' was saved with dim=8, the model has "
                                              r"dim=4"):
        runner.build_run(_cfg(tmp_path, "name=m", "steps=3", "model.embedding_dim=4",
                              "model.options={bottom: [16, 4], top: [16, 1]}"),
                         log=lambda *_: None)


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    explode = ["name=nan", "steps=40", "checkpoint_every=1", "optimizer.dense=sgd",
               "optimizer.dense_learning_rate=1e30", "optimizer.sparse=sgd",
               "optimizer.sparse_learning_rate=1e30"]
    cfg = _cfg(tmp_path, *explode)
    with pytest.raises(FloatingPointError, match=r"(at step \d+|not saving step \d+)") as e:
        runner.train(cfg, log=lambda *_: None)
    failed = int(__import__("re").search(r"step (\d+)", str(e.value)).group(1))
    step, state = _state_arrays(_cfg(tmp_path, *explode))
    assert step < failed
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state)
               if np.issubdtype(x.dtype, np.floating))


def test_bfloat16_mixed_precision_trains(tmp_path):
    cfg = _cfg(tmp_path, "name=bf16", "steps=40", "model.dtype=bfloat16",
               "model.table_dtype=bfloat16", "eval_every=null")
    run = runner.build_run(cfg, log=lambda *_: None)
    assert all(x.dtype == np.dtype("bfloat16") for x in jax.tree.leaves(run.state.tables)
               if x.ndim == 2)
    first = run.trainer.evaluate(run.state, run.data.eval_batches)["loss"]
    summary = runner.fit(run, log=lambda *_: None)
    assert summary["eval"]["loss"] < first - 0.05
