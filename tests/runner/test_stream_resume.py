"""A streamed run saved by 2 processes (`sparsejax launch -n 2`) resumes on 1: the
checkpoint's per-process data positions are re-split (`resplit_stream_positions`)."""

import json
import os
import subprocess
import sys

import numpy as np
import yaml

from sparsejax.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_streamed_run_of_2_processes_resumes_on_1(tmp_path):
    rng = np.random.default_rng(8)
    for name, n in (("train", 400), ("eval", 40)):
        rows = [
            f"{int(rng.random() < 0.4)},u{rng.integers(0, 20)},{rng.random():.3f}" for _ in range(n)
        ]
        (tmp_path / f"{name}.csv").write_text("y,user,x\n" + "\n".join(rows) + "\n")
    cfg = {
        "out_dir": str(tmp_path / "runs"),
        "name": "s",
        "steps": 4,
        "log_every": 1,
        "eval_every": None,
        "checkpoint_every": 2,
        "progress": False,
        "data": {
            "kind": "delimited",
            "train": str(tmp_path / "train.csv"),
            "eval": str(tmp_path / "eval.csv"),
            "schema": {"label": "y", "categorical": ["user"], "dense": ["x"]},
            "id_mapping": "hash",
            "hash_buckets": 50,
            "batch_size": 32,
            "stream": True,
        },
        "model": {"embedding_dim": 4, "options": {"bottom": [4, 4], "top": [4, 1]}},
        "sharding": {"device_memory": "1GB"},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    two = subprocess.run(
        [sys.executable, "-m", "sparsejax", "launch", "-n", "2", str(path)],
        capture_output=True, text=True, env=env, timeout=180,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    run = tmp_path / "runs" / "s"
    meta = json.loads((run / "run.json").read_text())
    assert [(h["event"], h["processes"]) for h in meta["history"]] == [("start", 2)]
    assert main(["train", str(path), "steps=8"]) == 0  # one process, from step 4
    history = json.loads((run / "run.json").read_text())["history"]
    assert [(h["event"], h.get("processes", 1)) for h in history] == [
        ("start", 2),
        ("resume", 1),
    ], history
    steps = [json.loads(x).get("step") for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 8
