"""`sparsejax data` and `data.kind: prepared`: a config's data written once as table rows
trains exactly as the data it was written from (generated data, a Criteo file with a
fitted vocabulary, dynamic tables' raw keys; one process, and two of two devices each,
which also checks the launch's run directory), and a prepared
directory that does not fit the run is refused with one line naming the column."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from _cli import ROOT, sparsejax_env
from _data import write_criteo_like

from sparsejax import runner
from sparsejax.__main__ import main

FAST = ["progress=false", "log_every=1", "eval_every=null", "checkpoint_every=null"]
SMALL = "data.synthetic_options={vocab_sizes: [300, 200, 50, 7]}"


def _losses(run_dir) -> list[float]:
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r.get("kind") == "train"]


def _train(tmp_path, name, *overrides) -> list[float]:
    cfg = runner.load_config(
        [], [f"out_dir={tmp_path / 'runs'}", f"name={name}", *FAST, *overrides]
    )
    runner.train(cfg)
    return _losses(cfg.run_dir)


@pytest.mark.parametrize(
    "source",
    [
        [SMALL, "data.batch_size=64"],
        [SMALL, "data.batch_size=64", "tables={'*': {dynamic: true, cache_rows: 128}}"],
        ["data.kind=criteo", "data.split={by: rows, train: 300}", "data.batch_size=50"],
    ],
    ids=["synthetic", "dynamic", "criteo"],
)
def test_a_prepared_copy_trains_as_the_data_it_was_written_from(tmp_path, source):
    if "data.kind=criteo" in source:
        write_criteo_like(tmp_path / "c.tsv", 400)
        source = [*source, f"data.train={tmp_path / 'c.tsv'}"]
    steps = ["steps=9", "data.shuffle=false"]  # the file: 6 batches, then a second epoch
    want = _train(tmp_path, "raw", *source, *steps)
    cfg = runner.load_config([], [f"out_dir={tmp_path / 'runs'}", *FAST, *source, *steps])
    info = runner.prepare_data(cfg, str(tmp_path / "prepared"), log=lambda _: None)
    assert info["splits"]["train"] == (300 if "data.kind=criteo" in source else 9 * 64)
    tables = [s for s in source if s.startswith("tables=")]
    got = _train(
        tmp_path,
        "prepared",
        "data.kind=prepared",
        f"data.path={tmp_path / 'prepared'}",
        "data.batch_size=" + next(s for s in source if "batch_size" in s).split("=")[1],
        *tables,
        *steps,
    )
    assert len(got) == len(want) == 9
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_two_processes_of_two_devices_read_their_shares_and_train_as_one(tmp_path):
    """`launch -n 2 --devices-per-process 2` on prepared data (each process reads its
    share of the files) against one process on this test's 8 devices, run meanwhile:
    the same losses and evals, and one run directory, written by process 0 alone."""
    cfg = runner.load_config([], [SMALL, "data.batch_size=64", "data.eval_batches=1"])
    runner.prepare_data(cfg, str(tmp_path / "prepared"), log=lambda _: None)
    args = [
        f"out_dir={tmp_path / 'runs'}",
        "progress=false",
        "log_every=1",
        "eval_every=3",
        "checkpoint_every=3",
        "data.kind=prepared",
        f"data.path={tmp_path / 'prepared'}",
        "data.batch_size=64",
        "data.eval_batches=1",
        "steps=6",
    ]
    launch = subprocess.Popen(
        [sys.executable, "-m", "sparsejax", "launch", "-n", "2", "--devices-per-process", "2"]
        + [*args, "name=two"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=sparsejax_env(),
        cwd=ROOT,
    )
    assert main(["train", *args, "name=one"]) == 0  # the reference, in this process meanwhile
    _, err = launch.communicate(timeout=240)
    assert launch.returncode == 0, err[-3000:]
    one, two = tmp_path / "runs" / "one", tmp_path / "runs" / "two"
    assert {"config.yaml", "run.json", "metrics.jsonl", "summary.json", "checkpoints"} <= set(
        os.listdir(two)
    )
    assert os.listdir(two / "launch") == ["p1.log"]
    history = json.loads((two / "run.json").read_text())["history"]
    assert [(h["event"], h["processes"]) for h in history] == [("start", 2)]
    assert sorted(int(s) for s in os.listdir(two / "checkpoints") if s.isdigit()) == [3, 6]
    a, b = _losses(one), _losses(two)
    assert len(a) == 6
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    evals = [
        [
            r
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") == "eval"
        ]
        for run in (one, two)
    ]
    assert [e["step"] for e in evals[0]] == [e["step"] for e in evals[1]] == [3, 6]
    for ea, eb in zip(*evals, strict=True):
        assert ea["examples"] == eb["examples"] == 64
        assert abs(ea["loss"] - eb["loss"]) < 1e-5


def _error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_prepared_data_is_refused_with_one_line(tmp_path, capsys):
    out = tmp_path / "prepared"
    base = [f"out_dir={tmp_path / 'runs'}", *FAST, SMALL, "data.batch_size=32", "steps=2"]
    assert main(["data", "--out", str(out), *base]) == 0
    capsys.readouterr()
    err = _error(capsys, "data", "--out", str(out), *base)
    assert "exists" in err
    use = ["data.kind=prepared", f"data.path={out}"]
    err = _error(capsys, "train", *base, *use, "tables={C2: {dynamic: true, cache_rows: 64}}")
    assert "column 'C2' was prepared with table rows 200, the run has None" in err
    err = _error(capsys, "train", *base, "data.kind=prepared", f"data.path={tmp_path}")
    assert "no prepared data there" in err
    err = _error(capsys, "train", *base, *use, "data.split={by: rows, train: 10}")
    assert "data.split is for the data it was prepared from" in err
    (out / "train" / "ids.bin").write_bytes(b"\0" * 100)
    err = _error(capsys, "train", *base, *use)
    assert "ids.bin: 100 bytes" in err and "truncated in row group 0" in err
