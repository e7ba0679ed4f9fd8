"""Run directories that cannot mislead: one config per run directory (a different one is
refused naming the keys, resumable keys resume and are recorded, --restart moves the old
run aside), one process at a time (a lock naming the pid, stale locks taken over), an
unreadable newest checkpoint falls back to the previous one, user errors are one line
with the traceback in the run's log, throughput excludes evals and saves."""

import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from sparsejax import runner
from sparsejax.__main__ import main
from sparsejax.runner import ConfigError, RunLockedError, _evaluate, _lock, _run, _run_dir

TINY = {
    "steps": 4,
    "log_every": 2,
    "eval_every": 2,
    "checkpoint_every": 2,
    "progress": False,
    "name": "r",
    "data": {
        "batch_size": 64,
        "eval_batches": 1,
        "synthetic_options": {"vocab_sizes": [50, 40, 30], "num_dense": 2},
    },
    "model": {"embedding_dim": 8, "options": {"bottom": [8, 8], "top": [8, 1]}},
}


def _write_config(path, **extra):
    import yaml

    path.write_text(yaml.safe_dump({**TINY, **extra}))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run trained by `sparsejax train` (checkpoints 2 and 4); tests copy it
    before changing it."""
    root = tmp_path_factory.mktemp("trained")
    config = _write_config(root / "tiny.yaml", out_dir=str(root / "runs"))
    assert main(["train", config]) == 0
    return root, config


def _copy(trained, tmp_path):
    """A copy of the trained run under tmp_path; (config file, run dir)."""
    root, _ = trained
    shutil.copytree(root / "runs" / "r", tmp_path / "runs" / "r")
    with open(tmp_path / "runs" / "r" / "config.yaml") as f:
        text = f.read().replace(str(root / "runs"), str(tmp_path / "runs"))
    (tmp_path / "runs" / "r" / "config.yaml").write_text(text)
    return _write_config(
        tmp_path / "tiny.yaml", out_dir=str(tmp_path / "runs")
    ), tmp_path / "runs" / "r"


def test_run_dir_records_config_and_hash(trained):
    root, config = trained
    run = root / "runs" / "r"
    assert {"config.yaml", "run.json", "run.log", "checkpoints", "summary.json", "curves.png"} <= (
        set(os.listdir(run))
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4]
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((run / "run.json").read_text())
    cfg = runner.load_config([config])
    assert record["config_sha256"] == runner.config_hash(cfg)
    assert [h["event"] for h in record["history"]] == ["start"]
    # resumable keys do not change the hash; anything else does
    assert (
        runner.config_hash(runner.load_config([config], ["steps=9", "progress=true"]))
        == (record["config_sha256"])
    )
    assert runner.config_hash(runner.load_config([config], ["seed=1"])) != record["config_sha256"]
    assert "config sha256" in (run / "run.log").read_text()


def test_a_different_config_is_refused_in_one_line_naming_the_keys(trained, capsys):
    root, config = trained
    other = ["model.embedding_dim=4", "model.options.bottom=[8, 4]"]
    assert main(["train", config, *other]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "model.embedding_dim: 8 -> 4" in err and "model.options.bottom: [8, 8] -> [8, 4]" in err
    assert "new name=" in err and "--restart" in err and ".replaced-<time>" in err
    with pytest.raises(ConfigError, match=r"optimizer.sparse: lazy_adam -> sgd"):
        runner.train(runner.load_config([config], ["optimizer.sparse=sgd"]), log=print)
    assert len(os.listdir(root / "runs" / "r" / "checkpoints")) == 2  # untouched


def test_restart_moves_the_old_run_aside(trained, tmp_path):
    config, run_dir = _copy(trained, tmp_path)
    cfg = _run_dir.resolved_config(runner.load_config([config], ["model.embedding_dim=4"]))
    with _lock.RunLock(str(run_dir)):
        notes, entry = _run_dir._prepare_run_dir(cfg, restart=True)
    old = entry["previous_run"]
    assert os.path.basename(old).startswith("r.replaced-") and notes == [
        f"--restart: moved the previous run of {run_dir} to {old}"
    ]
    assert os.listdir(run_dir) == [".lock"]
    assert sorted(os.listdir(os.path.join(old, "checkpoints"))) == ["2", "4"]


def test_unreadable_newest_checkpoint_falls_back_and_resumable_change_is_recorded(
    trained, tmp_path
):
    config, run_dir = _copy(trained, tmp_path)
    for root, _, files in os.walk(run_dir / "checkpoints" / "4"):  # truncate step 4
        for f in files:
            path = os.path.join(root, f)
            if os.path.getsize(path) > 64:
                with open(path, "r+b") as fh:
                    fh.truncate(os.path.getsize(path) // 2)
    lines = []
    summary = runner.train(runner.load_config([config], ["steps=6"]), log=lines.append)
    assert summary["step"] == 6
    warning = next(x for x in lines if x.startswith("warning: checkpoint 4"))
    assert "unreadable" in warning and "using checkpoint 2" in warning and "\n" not in warning
    assert any("moved unreadable checkpoint 4" in x for x in lines)
    assert any(
        x.startswith("resumed from") and x.endswith("{'epoch': 0, 'batch': 2})") for x in lines
    )
    assert "resuming with steps: 4 -> 6" in lines
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4", "6"]  # 4 saved anew
    assert os.listdir(tmp_path / "runs" / "r" / "checkpoints_unreadable") == ["4"]
    history = json.loads((run_dir / "run.json").read_text())["history"]
    assert history[-1]["event"] == "resume" and history[-1]["changed"] == {"steps": [4, 6]}
    assert "warning: checkpoint 4" in (run_dir / "run.log").read_text()


def test_eval_from_another_directory_with_step_overrides_and_predictions(
    trained, tmp_path, monkeypatch, capsys
):
    root, _ = trained
    run = root / "runs" / "r"
    monkeypatch.chdir(tmp_path)  # config.yaml names its data by absolute paths
    # options after the positional, then overrides (argparse's intermixed parsing)
    argv = ["eval", str(run), "--step", "4", "data.prefetch=2", "--predictions"]
    assert main([*argv, "p.parquet"]) == 0
    out = capsys.readouterr().out
    final = json.loads((run / "summary.json").read_text())["last_eval"]
    # the same checkpoint on the same eval set gives the same AUC
    assert f"eval of {run} @ step 4: loss {final['loss']:.4f}, auc {final['auc']:.4f}" in out
    assert "wrote 64 predictions" in out
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(tmp_path / "p.parquet").to_pydict()
    assert table["row"] == list(range(64)) and set(table["label"]) <= {0.0, 1.0}
    assert all(0.0 < p < 1.0 for p in table["score"])
    assert main(["eval", str(run), "--step", "best"]) == 2
    assert "no best checkpoint" in capsys.readouterr().err
    assert main(["eval", str(run), "--split", "test"]) == 2
    assert "has no test split" in capsys.readouterr().err
    assert main(["eval", str(run), "--predictions", "p.txt"]) == 2
    assert "expected a .parquet, .csv or .tsv" in capsys.readouterr().err


def test_csv_predictions_match_the_scores():
    class Batch:
        def __init__(self, out, labels, mask):
            self.out, self.labels, self.mask = out, labels, mask

    trainer = types.SimpleNamespace(task="binary", eval_step=lambda state, b: b.out)
    batches = [
        Batch(np.array([0.0, 2.0]), np.array([0.0, 1.0]), np.array([1.0, 1.0])),
        Batch(np.array([-1.0, 5.0]), np.array([1.0, 0.0]), np.array([1.0, 0.0])),  # 1 padded
    ]
    cols = _evaluate.predictions(trainer, None, batches)
    assert cols["row"].tolist() == [0, 1, 2] and cols["label"].tolist() == [0.0, 1.0, 1.0]
    np.testing.assert_allclose(cols["score"], 1 / (1 + np.exp(-np.array([0.0, 2.0, -1.0]))))


def test_a_second_process_is_refused_naming_the_first_pid(trained, tmp_path, capsys):
    config, run_dir = _copy(trained, tmp_path)
    with _lock.RunLock(str(run_dir)):
        with pytest.raises(
            RunLockedError, match=f"in use by another sparsejax process \\(pid {os.getpid()} "
        ):
            _lock.RunLock(str(run_dir)).acquire()
        assert main(["train", config]) == 2
        err = capsys.readouterr().err
        assert f"(pid {os.getpid()} on " in err and err.count("\n") == 1
    assert (run_dir / ".lock").read_text() == ""  # released


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(f"pid {dead.pid} on host since then\n")
    said = []
    with _lock.RunLock(str(tmp_path), log=said.append):
        assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} ")
    assert said == [f"took over the lock of {tmp_path} from pid {dead.pid} (ended)"]


def test_user_errors_are_one_line_exit_2_with_the_traceback_in_the_run_log(
    tmp_path, capsys, monkeypatch
):
    def one_line_error(*argv):
        assert main(list(argv)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        return err

    # a strict parse error, found while reading: file:line in the message; the refused
    # run leaves no run directory (tests/runner/test_config.py: a previous run's files stay)
    data = tmp_path / "d.tsv"
    data.write_text("\n".join(["0\t1" + "\t1" * 12 + "\ta" * 26] * 20 + ["x\t1"]) + "\n")
    base = [f"out_dir={tmp_path}", "data.kind=criteo", f"data.path={data}", "progress=false"]
    err = one_line_error("train", *base, "data.strict=true", "name=strict")
    assert f"{data}:21" in err and "traceback in" not in err
    assert not (tmp_path / "strict").exists()
    # a file with no usable line: the parse report says why nothing was kept
    data.write_text("x\t1\ny\t2\n")
    err = one_line_error("train", *base, "name=empty")
    assert "kept 0 of 2 lines" in err
    # a missing data file, a batch size <= 0: before anything runs
    assert "no such file" in one_line_error("train", *base[:2], "data.path=nope.tsv")
    assert "batch_size must be >= 1" in one_line_error("train", "data.batch_size=0")

    # the NaN stop (and any error of the loop) ends the run the same way
    def nan(*args, **kwargs):
        raise runner.NonFiniteLossError("training loss is nan at step 3; stopped")

    monkeypatch.setattr(_run, "build_run", nan)
    err = one_line_error("train", f"out_dir={tmp_path}", "name=nan")
    assert "loss is nan at step 3" in err
    assert "NonFiniteLossError" in (tmp_path / "nan" / "run.log").read_text()


def test_all_checkpoints_unreadable_is_one_line(trained, tmp_path, capsys):
    config, run_dir = _copy(trained, tmp_path)
    for step in ("2", "4"):
        for root, _, files in os.walk(run_dir / "checkpoints" / step):
            for f in files:
                if f.endswith(".json") or os.path.getsize(os.path.join(root, f)) > 64:
                    with open(os.path.join(root, f), "r+b") as fh:
                        fh.truncate(3)
    assert main(["train", config]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint in" in err and "is readable" in err


def test_throughput_excludes_evals_and_saves(monkeypatch):
    from sparsejax.embedding.host import HostSides
    from sparsejax.train import _loop

    clock = [0.0]
    monkeypatch.setattr(_loop, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class Trainer:
        host = HostSides()  # no host work

        def train_step(self, state, batch):
            clock[0] += 0.01  # 10 ms per step of 100 examples: 10,000 samples/s
            return types.SimpleNamespace(step=state.step + 1), {"loss": np.float32(0.5)}

        def evaluate(self, state, batches):
            clock[0] += 100.0
            return {"loss": 0.5}

    class Saver:
        directory = "nowhere"

        def save(self, state, **kwargs):
            clock[0] += 50.0

        def latest_step(self):
            return None

    class Log(_loop.Hook):
        rates = []

        def on_log(self, step, record):
            self.rates.append(record["samples_per_s"])

    result = _loop.fit(
        Trainer(),
        types.SimpleNamespace(step=0),
        [types.SimpleNamespace(batch_size=100)] * 40,
        steps=40,
        eval_batches=[object()],
        eval_every=10,
        checkpointer=Saver(),
        checkpoint_every=10,
        log_every=5,
        hooks=[Log()],
    )
    np.testing.assert_allclose(Log.rates[1:], 10_000, rtol=1e-6)  # before and after evals
    np.testing.assert_allclose(result.samples_per_s, 10_000, rtol=1e-6)


def _truncate(run_dir, step: int) -> None:
    """Truncate the array data files of checkpoint `step` (its metadata and manifests
    read: orbax fails while reading the arrays, with many reads under way)."""
    for root, _, files in os.walk(run_dir / "checkpoints" / str(step)):
        if os.path.basename(root) == "d" and ".process_" in os.path.dirname(root):
            for f in files:
                with open(os.path.join(root, f), "r+b") as fh:
                    fh.truncate(50)


_LIMITED = """import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]),) * 2)
sys.argv = ["sparsejax", *sys.argv[2:]]
runpy.run_module("sparsejax", run_name="__main__")
"""


def _cli(*argv, file_size_limit: int | None = None) -> tuple[int, str, str]:
    """`sparsejax ARGV` in a subprocess (optionally with RLIMIT_FSIZE: a write past it
    fails as on a full disk); (status, stdout, stderr)."""
    start = ["-m", "sparsejax"] if file_size_limit is None else ["-c", _LIMITED, file_size_limit]
    p = subprocess.run(
        [sys.executable, *map(str, start), *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "SPARSEJAX_TRACEBACK"},
    )
    return p.returncode, p.stdout, p.stderr


def _noise(text: str) -> list[str]:
    """Lines of tracebacks and library logs (absl, asyncio) in the terminal output."""
    marks = ("Traceback", "Event loop is closed", "absl", "asyncio", 'File "')
    return [ln for ln in text.splitlines() if any(m in ln for m in marks)]


def test_an_unreadable_checkpoint_is_one_line_in_eval_and_quiet_in_train(trained, tmp_path):
    """Reading a truncated checkpoint fails in orbax with hundreds of lines of asyncio
    noise ("Event loop is closed") on the terminal; eval says it in one line, the
    traceback in its log file; a resume falls back with a warning (export: below)."""
    config, run_dir = _copy(trained, tmp_path)
    _truncate(run_dir, 4)
    rc, out, err = _cli("eval", run_dir, "--step", "4")
    assert rc == 2 and len((out + err).splitlines()) <= 5 and not _noise(out + err), out + err
    assert err.startswith(f"sparsejax: error: checkpoint 4 in {run_dir}/checkpoints ")
    assert f"(traceback in {run_dir}/eval.log)" in err
    assert "CheckpointUnreadableError" in (run_dir / "eval.log").read_text()
    # without --step, eval falls back to the newest readable checkpoint with a warning; the
    # failed read's unfinished coroutines raise their copies of its error when collected
    # ("Exception ignored in: <coroutine ...>", thousands of lines): none reach the terminal
    rc, out, err = _cli("eval", run_dir)
    assert rc == 0 and len((out + err).splitlines()) == 2 and not _noise(out + err), out + err
    assert out.startswith(f"warning: checkpoint 4 in {run_dir}/checkpoints unreadable (")
    assert "TensorStore details" not in out and "@ step 2:" in out
    rc, out, err = _cli("train", config, "steps=6")
    assert rc == 0 and not _noise(out + err), out + err
    assert "warning: checkpoint 4" in out and "resumed from" in out


def test_export_refuses_an_unreadable_newest_checkpoint_unless_a_step_is_named(
    trained, tmp_path, capsys
):
    _, run_dir = _copy(trained, tmp_path)
    _truncate(run_dir, 4)
    model = tmp_path / "model"
    assert main(["export", str(run_dir), "--out", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the newest checkpoint is unreadable: checkpoint 4 in " in err
    assert "(--step N, or --step last: the newest readable)" in err and not model.exists()
    assert main(["export", str(run_dir), "--out", str(model), "--step", "2"]) == 0
    assert json.loads((model / "model.json").read_text())["source"]["step"] == 2
    assert main(["export", str(run_dir), "--out", str(model), "--overwrite", "--step", "last"]) == 0
    assert "using checkpoint 2" in capsys.readouterr().out


def test_a_full_disk_during_a_save_is_one_line_and_leaves_only_complete_checkpoints(tmp_path):
    """A checkpoint write that fails (here: the file size limit, as a full disk) ends
    the run in one line (before: ~400 lines of orbax's absl errors, exit 1 or 2) and
    removes the partial checkpoint; orbax's logs and the traceback are in run.log."""
    config = _write_config(
        tmp_path / "big.yaml",
        out_dir=str(tmp_path / "runs"),
        data={**TINY["data"], "synthetic_options": {"vocab_sizes": [20000, 40, 30]}},
    )
    rc, out, err = _cli("train", config, file_size_limit=300_000)  # the tables' file is larger
    run_dir = tmp_path / "runs" / "r"
    assert rc == 2 and not _noise(out + err), out + err
    assert err.count("\n") == 1 and err.startswith(
        f"sparsejax: error: checkpoint 2 could not be written to {run_dir}/checkpoints ("
    )
    assert "its partial files were removed" in err
    assert os.listdir(run_dir / "checkpoints") == []  # no N.orbax-checkpoint-tmp
    log = (run_dir / "run.log").read_text()
    assert "CheckpointWriteError" in log and "ERROR absl" in log


def test_a_full_disk_while_saving_host_tables_is_one_line(tmp_path, monkeypatch, capsys):
    from sparsejax.checkpoint import _host_tables

    def full(path, a):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(_host_tables, "write_array", full)
    config = _write_config(
        tmp_path / "dyn.yaml",
        out_dir=str(tmp_path / "runs"),
        tables={"*": {"dynamic": True, "cache_rows": 128}},
        data={**TINY["data"], "synthetic_options": {"vocab_sizes": [5000, 40, 30]}},
    )
    assert main(["train", config]) == 2
    err = capsys.readouterr().err
    run_dir = tmp_path / "runs" / "r"
    assert err.count("\n") == 1 and "checkpoint 2 could not be written to " in err
    assert "(OSError: [Errno 28] No space left on device: " in err
    assert os.listdir(run_dir / "checkpoints" / "host_tables") == []  # its temp folder went
    assert "CheckpointWriteError" in (run_dir / "run.log").read_text()


def test_a_table_too_large_for_memory_is_one_line(tmp_path, monkeypatch, capsys):
    from sparsejax.embedding import _device_store

    monkeypatch.setattr(_device_store, "available_memory", lambda devices: (1000, "a test"))
    config = _write_config(tmp_path / "c.yaml", out_dir=str(tmp_path / "runs"))
    assert main(["train", config]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs " in err and "but 1000 B is available (a test" in err
    assert f"(traceback in {tmp_path}/runs/r/run.log)" in err
    assert "MemoryError" in (tmp_path / "runs" / "r" / "run.log").read_text()


def test_eval_of_a_run_being_trained_leaves_its_log_alone(trained, tmp_path, capsys):
    """The traceback of `sparsejax eval` goes to RUN/eval.log: a run that another
    process trains (holds the lock) keeps run.log to itself."""
    _, run_dir = _copy(trained, tmp_path)
    _truncate(run_dir, 4)
    before = (run_dir / "run.log").read_bytes()
    with _lock.RunLock(str(run_dir)):
        assert main(["eval", str(run_dir), "--step", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"(traceback in {run_dir}/eval.log)" in err
    assert (run_dir / "run.log").read_bytes() == before
    assert "Traceback" in (run_dir / "eval.log").read_text()
