"""Dynamic and host-cached tables across processes (`sparsejax launch -n 2`): two
processes train as one (the same losses, step for step, with admission and eviction
on), each owns about half of the keys and together exactly the keys one process holds;
checkpoints restore on the other process count and continue the losses; a save killed
midway leaves the last complete checkpoint, which restores on another count with every
key it held and none it had evicted; a process killed mid-training ends the other with
one line."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from _cli import ROOT, one_device_env, run_sparsejax

from sparsejax.checkpoint import Checkpointer
from sparsejax.checkpoint import _host_tables as ht

FEATURES = "data.synthetic_options={vocab_sizes: [3000, 2000, 800, 200]}"
TABLES = ["C1", "C2", "C3", "C4"]


def _args(tmp_path, *extra):
    return [
        "configs/default.yaml",
        f"out_dir={tmp_path / 'runs'}",
        FEATURES,
        "data.batch_size=120",  # splits over 1, 2 and 3 processes
        "progress=false",
        "eval_every=null",
        "log_every=1",
        "optimizer.sparse_learning_rate=0.05",
        *extra,
    ]


def _losses(run) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r.get("kind") == "train"}


def _host_keys(ckpt_dir, step, owners) -> list[dict[str, np.ndarray]]:
    """Per owner `{table: its live keys}` at checkpoint `step` (its whole chain)."""
    out = []
    for p in range(owners):
        live: dict[str, set] = {}
        for snaps in ht.read_chain(ht.part_root(ckpt_dir, p, owners), step):
            for key, snap in snaps.items():
                keys = live.setdefault(key.split("/")[-1], set())
                if snap.kind == "full":
                    keys.clear()
                keys.difference_update(snap.arrays.get("tombstones", np.zeros(0)).tolist())
                keys.update(snap.arrays["keys"].tolist())
        out.append(live)
    return out


def _drop_after(run, step) -> None:
    """The run's copy as it was at checkpoint `step` (later checkpoints deleted)."""
    with Checkpointer(run / "checkpoints", {}) as ckpt:
        for s in ckpt.steps():
            if s > step:
                ckpt.manager.delete(s)


# One test, as each `launch` costs ~20 s of start-up on 2 cores: the 2-process run is the
# reference of the 1-process run's losses and keys, of the export, and of the killed save.
# SGD with the killed save resumed on 3 processes: slow (3 processes on 2 cores).
@pytest.mark.parametrize(
    "sparse, resume_on", [("rowwise_adagrad", 1), pytest.param("sgd", 3, marks=pytest.mark.slow)]
)
def test_two_processes_train_dynamic_tables_as_one_and_restore_on_another_count(
    tmp_path, sparse, resume_on
):
    """Row-wise Adagrad (or SGD), admission (second sight) and TTL eviction (a norm check:
    each owner reads its cached rows back from its own devices), C4 static with a host
    cache, a full host save every third:

    - 2 processes train as 1: the same losses step for step; each owns about half of
      each table's keys, together exactly the 1 process's keys;
    - exported from the 2 processes' parts: every key once, the run's scores;
    - the 2-process run's last save broken as a kill -9 of process 1 mid-save leaves it
      (no orbax step, process 0's part complete, process 1's a temp folder): resumed on
      1 process (or 3) from the save before, it continues the 2-process losses and holds
      exactly its keys at the end (none lost, none that was evicted back);
    - the 1-process run restored on 2 processes continues its losses."""
    tables = (
        "tables={'*': {dynamic: true, cache_rows: 1024, admission: {min_count: 2},"
        " eviction: {ttl_steps: 15, every_steps: 5, min_norm: 1.0e-6}},"
        " C4: {dynamic: false, cache_rows: 150}}"
    )
    args = _args(
        tmp_path,
        tables,
        f"optimizer.sparse={sparse}",
        "steps=60",
        "checkpoint_every=20",
        "checkpoint_full_every=3",
        "keep_checkpoints=5",
    )
    run_sparsejax("launch", "-n", "2", *args, "name=two")
    run_sparsejax("train", *args, "name=one")
    runs = tmp_path / "runs"
    one, two = _losses(runs / "one"), _losses(runs / "two")
    assert sorted(one) == sorted(two) == list(range(1, 61))
    np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], atol=1e-5, rtol=0)
    (single,) = _host_keys(runs / "one" / "checkpoints", 60, 1)
    parts = _host_keys(runs / "two" / "checkpoints", 60, 2)
    for t in TABLES:  # each key in one owner's part, the union the one process's keys
        a, b = parts[0][t], parts[1][t]
        assert not a & b and a | b == single[t], t
        assert 0.4 <= len(a) / len(single[t]) <= 0.6, (t, len(a), len(single[t]))
    out = run_sparsejax("export", str(runs / "two"), "--out", str(tmp_path / "model"))
    diff = float(re.search(r"max \|score - score_run\| (\S+),", out).group(1))
    assert diff < 1e-5, out
    # the killed save: resumed on `resume_on` processes from step 40
    part1 = ht.part_root(runs / "two" / "checkpoints", 1, 2)
    assert [ht.read_manifest(part1, s)["kind"] for s in (20, 40, 60)] == ["full", "delta", "delta"]
    killed = runs / "killed"
    shutil.copytree(runs / "two", killed, ignore=shutil.ignore_patterns("launch"))
    _drop_after(killed, 40)  # step 60's orbax step never committed
    part1 = ht.host_dir(ht.part_root(killed / "checkpoints", 1, 2))
    os.rename(os.path.join(part1, "60"), os.path.join(part1, ".tmp-60-999999-dead"))
    launch = ["train"] if resume_on == 1 else ["launch", "-n", str(resume_on)]
    run_sparsejax(*launch, *args, "name=killed")
    got = _losses(killed)
    np.testing.assert_allclose(
        [got[s] for s in range(41, 61)], [two[s] for s in range(41, 61)], atol=1e-5
    )
    resumed = _host_keys(killed / "checkpoints", 60, resume_on)
    for t in TABLES:
        assert set().union(*(p[t] for p in resumed)) == parts[0][t] | parts[1][t], t
    # the 1-process run restored at step 40 on 2 processes
    shutil.copytree(runs / "one", runs / "two_from_one", ignore=shutil.ignore_patterns("launch"))
    _drop_after(runs / "two_from_one", 40)
    run_sparsejax("launch", "-n", "2", *args, "name=two_from_one")
    got = _losses(runs / "two_from_one")
    np.testing.assert_allclose(
        [got[s] for s in range(41, 61)], [one[s] for s in range(41, 61)], atol=1e-5
    )


def test_a_process_killed_mid_training_ends_the_other_with_one_line(tmp_path):
    """Two processes started by hand (no launcher to stop the survivor); process 1 is
    killed (SIGKILL) while they train: process 0 notices at its next exchange with it
    and exits within seconds, with one line naming what failed."""
    env = one_device_env()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tables = "tables={'*': {dynamic: true, cache_rows: 1024}}"
    args = _args(tmp_path, tables, "steps=100000", "name=killed")
    procs, logs = [], [open(tmp_path / f"p{i}.err", "w") for i in range(2)]
    for i in range(2):
        env_i = dict(
            env,
            SPARSEJAX_COORDINATOR=f"127.0.0.1:{port}",
            SPARSEJAX_NUM_PROCESSES="2",
            SPARSEJAX_PROCESS_ID=str(i),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "sparsejax", "train", *args],
                cwd=ROOT,
                env=env_i,
                stdout=subprocess.DEVNULL,
                stderr=logs[i],
            )
        )
    try:
        metrics = tmp_path / "runs" / "killed" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
            assert time.monotonic() < deadline and procs[0].poll() is None, "no training"
            time.sleep(0.2)
        procs[1].kill()
        procs[0].wait(timeout=30)  # never hangs
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for f in logs:
            f.close()
    err = (tmp_path / "p0.err").read_text()
    assert procs[0].returncode not in (0, None)
    ours = [ln for ln in err.splitlines() if ln.startswith("sparsejax:")]
    assert len(ours) == 1 and "process 0: error:" in ours[0], err[-2000:]
    assert "Traceback" not in err
