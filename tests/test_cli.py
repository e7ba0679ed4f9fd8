"""The command line: `sparsejax train` (the README's main command), `eval`, config errors."""

import json
import os

import pytest

from sparsejax.__main__ import main

TINY = [
    "steps=30",
    "log_every=10",
    "eval_every=15",
    "data.batch_size=64",
    "data.max_vocab=500",
    "data.eval_batches=2",
    "progress=false",
]


def test_train_then_eval(tmp_path, capsys):
    assert main(["train", *TINY, f"out_dir={tmp_path}", "name=r"]) == 0
    run = tmp_path / "r"
    assert {"config.yaml", "metrics.jsonl", "summary.json", "curves.png", "checkpoints"} <= set(
        os.listdir(run)
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [10, 20, 30]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [15, 30]
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    final = json.loads((run / "summary.json").read_text())["eval"]
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    printed = capsys.readouterr().out
    assert f"auc {final['auc']:.4f}" in printed  # same checkpoint, same eval set, same AUC


def test_config_errors_name_the_key(tmp_path, capsys):
    assert main(["train", "data.batch_sise=3", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'data.batch_sise'" in err and "did you mean 'batch_size'" in err
    assert main(["train", "steps=abc", f"out_dir={tmp_path}"]) == 2
    assert "'steps': expected an int, got 'abc'" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "train" in out and "eval" in out


def test_info_names_versions_and_kernels(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sparsejax ") and "jax " in out and "default implementation: " in out
