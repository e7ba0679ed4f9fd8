"""The command line: config errors, `sparsejax config` (resolved config, schema), argument
parsing of `eval`, help, info, and the README's first code snippet. Training and
evaluating through the CLI: tests/runner/test_run_dir.py."""

import pathlib
import re

import pytest
import yaml

from sparsejax import runner
from sparsejax.__main__ import _parsers, main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_config_errors_name_the_key(tmp_path, capsys):
    assert main(["train", "data.batch_sise=3", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'data.batch_sise'" in err and "did you mean 'batch_size'" in err
    assert main(["train", "steps=abc", f"out_dir={tmp_path}"]) == 2
    assert "'steps': expected an int, got 'abc'" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("steps: [1\nseed: 2\n")
    assert main(["config", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not valid YAML (line 2, column 5: " in err


def test_config_prints_the_resolved_config(capsys):
    criteo = ROOT / "configs" / "criteo_sample.yaml"
    assert (
        main(["config", str(criteo), "optimizer.sparse=lazy_adam", "steps=50", "epochs=null"]) == 0
    )
    printed = yaml.safe_load(capsys.readouterr().out)
    assert runner.config_from_dict(printed) == runner.load_config(
        [criteo], ["optimizer.sparse=lazy_adam", "steps=50", "epochs=null"]
    )
    assert printed["optimizer"]["sparse_options"] == {} and printed["steps"] == 50
    assert main(["config", "--schema"]) == 0
    assert capsys.readouterr().out == runner.config_reference()


def test_eval_takes_options_between_and_after_overrides():
    _, commands = _parsers()
    args = commands["eval"].parse_intermixed_args(
        [
            "runs/x",
            "--step",
            "5",
            "data.eval_batch_size=8",
            "--split",
            "test",
            "--k",
            "5,10",
            "seed=1",
        ]
    )
    assert (args.run_dir, args.step, args.split, args.k) == ("runs/x", 5, "test", (5, 10))
    assert args.overrides == ["data.eval_batch_size=8", "seed=1"]
    assert commands["eval"].parse_intermixed_args(["r", "--step", "best"]).step == "best"
    args = commands["train"].parse_intermixed_args(["a.yaml", "--restart", "steps=3"])
    assert args.restart and args.config == ["a.yaml", "steps=3"]


def test_eval_of_a_missing_run_dir_is_one_line(tmp_path, capsys):
    assert main(["eval", str(tmp_path), "--step", "3", "seed=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a run directory" in err


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "train" in out and "eval" in out and "config" in out


def test_info_names_versions_and_kernels(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sparsejax ") and "jax " in out and "default implementation: " in out


def test_readme_first_code_snippet_runs_as_written():
    readme = (ROOT / "README.md").read_text()
    snippet = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    assert int(scope["state"].step) == 1 and float(scope["metrics"]["loss"]) > 0


def test_schema_errors_come_before_any_data_is_read(tmp_path, capsys):
    argv = ["train", f"out_dir={tmp_path}", "data.kind=criteo", "data.path=nope.tsv"]
    assert main([*argv, "model.name=dlrn"]) == 2
    err = capsys.readouterr().err
    assert "'model.name': 'dlrn' is not one of" in err and "nope.tsv" not in err
    assert not (tmp_path / "default").exists()  # no run directory either
