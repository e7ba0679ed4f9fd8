"""Many processes (that `sparsejax launch -n 2` trains one run with the losses of one
process, with one run directory: tests/runner/test_prepared_data.py): a process that
dies stops the launch with one line naming it; a second launch on a running run
directory is refused (process 0's message, the others exit with it instead of waiting);
`plan --help`; the environment the processes join by; each process's share of a global
batch."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from sparsejax import runner
from sparsejax.__main__ import main
from sparsejax.data import BatchPacker, JaggedIds
from sparsejax.embedding import FeatureSpec, TableSpec
from sparsejax.runner._data import ProcessSharePacker
from sparsejax.sharding import _distributed, _launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = {
    "steps": 6,
    "log_every": 1,
    "eval_every": 3,
    "checkpoint_every": 3,
    "progress": False,
    "name": "r",
    "data": {
        "batch_size": 64,
        "eval_batches": 1,
        "synthetic_options": {"vocab_sizes": [50, 40, 30], "num_dense": 2},
    },
    "model": {"embedding_dim": 8, "options": {"bottom": [8, 8], "top": [8, 1]}},
    "sharding": {"device_memory": "1GB"},  # the plan's, not measured
}


def _config(tmp_path, **extra) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, "out_dir": str(tmp_path / "runs"), **extra}))
    return str(path)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SPARSEJAX_TRACEBACK", None)
    return env


def _sparsejax(*args, timeout=120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sparsejax", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        **kw,
    )


def _losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


# ---------------------------------------------------------------------------------------
# Failures


def test_a_dead_process_stops_the_launch_with_one_line(tmp_path):
    """Process 1 killed: the launcher stops process 0 and exits non-zero, naming
    process 1, how it ended and its log (bounded: here well under a minute)."""
    config = _config(tmp_path, steps=100_000)
    t0 = time.monotonic()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "sparsejax", "launch", "-n", "2", config],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    log = tmp_path / "runs" / "r" / "launch" / "p1.log"
    pid = None
    while pid is None and time.monotonic() - t0 < 60:
        if log.exists():
            lines = [x for x in log.read_text().splitlines() if x.startswith("=== pid ")]
            pid = int(lines[0].split()[-1]) if lines else None
        time.sleep(0.05)
    assert pid is not None, "the launcher never started process 1"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _, err = launcher.communicate(timeout=60)
    assert time.monotonic() - killed < 30
    assert launcher.returncode == 128 + signal.SIGKILL
    last = err.strip().splitlines()[-1]
    assert last.startswith("sparsejax launch: process 1 of 2 was killed by SIGKILL")
    assert str(log) in last and "stopped process 0" in last


def test_launch_timeout_stops_every_process(tmp_path):
    t0 = time.monotonic()
    out = _sparsejax("launch", "-n", "2", "--timeout", "1", _config(tmp_path, steps=100_000))
    assert out.returncode == 124 and time.monotonic() - t0 < 60
    assert out.stderr.strip().splitlines()[-1] == (
        "sparsejax launch: the 2 processes ran past --timeout 1 s; stopped them all"
    )


def test_a_second_launch_on_a_running_run_directory_is_refused(tmp_path):
    """Process 0 finds the run directory locked and says so; process 1 learns it from
    process 0 and exits with the same message instead of waiting."""
    config = _config(tmp_path)
    run_dir = tmp_path / "runs" / "r"
    with runner._lock.RunLock(str(run_dir)):
        out = _sparsejax("launch", "-n", "2", config)
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert err[-2].startswith("sparsejax: process 0: error: run directory")
    assert "is in use by another sparsejax process" in err[-2]
    assert err[-1].startswith("sparsejax launch: process 0 of 2 exited with status 2")
    assert "stopped" not in err[-1]  # process 1 ended by itself, with process 0's message
    # its error line (other libraries' threads, e.g. gloo's, may write after it)
    log = (run_dir / "launch" / "p1.log").read_text().strip().splitlines()
    mine = [ln for ln in log if ln.startswith("sparsejax:")][-1]
    assert mine.startswith("sparsejax: process 1: error: run directory")
    assert mine.split("error: ", 1)[1] == err[-2].split("error: ", 1)[1].split(" (traceback")[0]


class _Scripted:
    """A child that exits with `code` once `at` polls have passed (None: runs on)."""

    pid = -1  # no such process (never frozen)

    def __init__(self, code, at):
        self.code, self.at, self.polls = code, at, 0

    def poll(self):
        self.polls += 1
        return self.code if self.at is not None and self.polls > self.at else None

    def terminate(self):
        self.code, self.at = -signal.SIGTERM, 0

    kill = terminate

    def send_signal(self, sig):
        pass

    def wait(self, timeout=None):
        return self.code


@pytest.mark.parametrize(
    ("p0", "reported"),
    [
        ((2, 3), "process 0 of 2 exited with status 2"),  # p1 relayed p0's error, exited first
        ((1, 3), "process 1 of 2 exited with status 2"),  # p0 failed otherwise: p1 is the cause
        ((None, None), "process 1 of 2 exited with status 2"),
    ],  # p0 still running: stopped
)
def test_the_launcher_reports_the_failure_at_its_source(tmp_path, p0, reported):
    log = tmp_path / "p1.log"
    log.write_text(  # gloo's thread may write after the error
        "sparsejax: process 1: error: run directory r is in use\n"
        "[Gloo] Rank 1 is connected to 1 peer ranks.\n"
    )
    lines = []
    code = _launch._watch(
        [_Scripted(*p0), _Scripted(2, 0)],
        {1: str(log)},
        timeout=None,
        grace=0,
        linger=0.05,
        say=lines.append,
        poll=0.01,
    )
    assert code == 2 and lines[-1].startswith(f"sparsejax launch: {reported}")
    assert ("stopped process 0" in lines[-1]) == (p0[0] is None)
    if "process 1" in reported:  # its error, not the last line of its log
        assert "error: run directory r is in use" in lines[-1] and "Gloo" not in lines[-1]


def test_a_frozen_process_is_named_not_the_one_its_silence_aborted(tmp_path):
    """Process 1 stopped (SIGSTOP): its heartbeats stop and the coordination service
    aborts process 0. The launcher names process 1 as the cause, and ends it at once
    (SIGTERM, then SIGCONT) rather than after the SIGKILL grace."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    p1 = subprocess.Popen(sleeper)
    os.kill(p1.pid, signal.SIGSTOP)
    p0 = subprocess.Popen([sys.executable, "-c", "import os; os.abort()"])
    log = tmp_path / "p1.log"
    log.write_text("=== pid 1\n")
    lines = []
    t0 = time.monotonic()
    try:
        code = _launch._watch(
            [p0, p1], {1: str(log)}, timeout=None, grace=30, linger=30, say=lines.append, poll=0.01
        )
    finally:
        p1.kill()
        p1.wait()
    assert time.monotonic() - t0 < 15  # neither the linger nor the grace waited for it
    assert code == 128 + signal.SIGABRT
    assert lines == [
        f"sparsejax launch: process 1 of 2 was frozen (stopped by a signal such as SIGSTOP; "
        f"log {log}), then process 0 was killed by SIGABRT (its output is above); "
        "stopped process 1"
    ]
    assert p1.returncode == -signal.SIGTERM


def test_launch_refuses_a_bad_config_before_starting(tmp_path, capsys):
    assert main(["launch", "-n", "2", _config(tmp_path), "data.batch_sise=3"]) == 2
    err = capsys.readouterr().err
    assert "batch_sise" in err and "launch" not in os.listdir(tmp_path)


def test_plan_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--devices-per-host" in text and "--device-memory" in text


def test_launch_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["launch", "--help"])
    assert e.value.code == 0
    assert "--devices-per-process" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# Pieces


def test_process_env():
    pe = _distributed.process_env
    assert not pe({}).distributed
    env = {"SPARSEJAX_COORDINATOR": "h:1", "SPARSEJAX_NUM_PROCESSES": "2"}
    assert pe({**env, "SPARSEJAX_PROCESS_ID": "1"}) == _distributed.ProcessEnv(
        "sparsejax", "h:1", 2, 1
    )
    assert not pe({**env, "SPARSEJAX_NUM_PROCESSES": "1"}).distributed
    with pytest.raises(_distributed.DistributedConfigError, match="SPARSEJAX_PROCESS_ID unset"):
        pe(env)
    with pytest.raises(_distributed.DistributedConfigError, match="need 0 <= JAX_PROCESS_ID"):
        pe({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"})
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    assert pe(slurm).source == "slurm"
    assert not pe({**slurm, "SLURM_NTASKS": "1"}).distributed
    assert not pe({**slurm, "SPARSEJAX_DISTRIBUTED": "0"}).distributed
    assert pe({"SPARSEJAX_DISTRIBUTED": "1"}).source == "auto"


def test_child_env_sets_the_device_count_instead_of_xla_flags():
    env = _launch.child_env(
        1,
        2,
        "127.0.0.1:9",
        devices_per_process=4,
        base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1"},
    )
    assert env["SPARSEJAX_LOCAL_DEVICES"] == "4" and env["XLA_FLAGS"] == "--xla_foo=1"
    assert (env["SPARSEJAX_PROCESS_ID"], env["SPARSEJAX_NUM_PROCESSES"]) == ("1", "2")


def test_process_shares_make_up_the_global_batch():
    """The P shares of a batch, side by side in process order, are the batch (ragged
    bags, weights, a short last batch's padding included)."""
    tables = [TableSpec(name="t", vocab_size=100, dim=4)]
    features = [FeatureSpec(name="f", table="t", max_ids=3, weighted=True)]
    whole = BatchPacker(tables, features, batch_size=8, num_dense=1)
    rng = np.random.default_rng(0)
    for n in (8, 5):
        lengths = rng.integers(0, 4, n)
        col = JaggedIds(
            lengths=lengths,
            values=rng.integers(0, 100, lengths.sum()),
            weights=rng.random(lengths.sum()).astype(np.float32),
        )
        labels, dense = rng.random(n).astype(np.float32), rng.random((n, 1)).astype(np.float32)
        ref = whole.pack({"f": col}, labels=labels, dense=dense)
        shares = [
            ProcessSharePacker(whole, p, 4).pack({"f": col}, labels=labels, dense=dense)
            for p in range(4)
        ]
        assert all(s.batch_size == 2 for s in shares)
        for name in ("labels", "dense", "mask"):
            got = np.concatenate([getattr(s, name) for s in shares])
            np.testing.assert_array_equal(got, getattr(ref, name))
        f = ref.features["f"]
        real = np.asarray(f.ids) >= 0
        ids = np.concatenate([np.asarray(s.features["f"].ids) for s in shares])
        w = np.concatenate([np.asarray(s.features["f"].weights) for s in shares])
        np.testing.assert_array_equal(ids[ids >= 0], np.asarray(f.ids)[real])
        np.testing.assert_array_equal(w[ids >= 0], np.asarray(f.weights)[real])
    assert ProcessSharePacker(whole, 1, 4).batch_size == 8
    with pytest.raises(ValueError, match="does not split over 3 processes"):
        ProcessSharePacker(whole, 0, 3)


# slow (~45 s, two training processes then two exporting): the default run exports row
# shards piece by piece in one process (tests/serving/test_sharded_export.py) and exports
# a 2-process run's parts (tests/runner/test_dynamic_processes.py)
@pytest.mark.slow
def test_two_processes_export_their_own_row_shards_and_serve_as_one(tmp_path):
    from sparsejax.serving import Predictor

    config = _config(tmp_path, steps=3, eval_every=None, tables={"*": {"placement": "row_wise"}})
    got = _sparsejax("launch", "-n", "2", config, "name=two")
    assert got.returncode == 0, got.stderr[-3000:]
    run = tmp_path / "runs" / "two"
    got = _sparsejax(
        "launch", "-n", "2", "export", str(run), "--out", str(tmp_path / "m2"), "--buckets", "1,8"
    )
    assert got.returncode == 0, got.stderr[-3000:]
    one = runner.export_run(str(run), str(tmp_path / "m1"), buckets=(1, 8), log=lambda _: None)
    two = json.loads((tmp_path / "m2" / "model.json").read_text())
    assert two["processes"] == 2 and two["check"]["max_abs_diff"] <= 1e-5
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # the temp dir renamed
    for table, rows in (("C1", 50), ("C2", 40), ("C3", 30)):
        pieces = sorted(
            (p["table_rows"], p["process"])
            for e in two["arguments"].values()
            for p in e.get("pieces", ())
            if p["table"] == table
        )
        # each process wrote the rows it holds: one half each, together the table
        assert pieces == [([0, rows // 2], 0), ([rows // 2, rows], 1)]
    p2, p1 = Predictor.load(str(tmp_path / "m2")), Predictor.load(str(tmp_path / "m1"))
    examples = p2.example_request["examples"]
    assert len(examples) > 0 and one["processes"] == 1
    np.testing.assert_array_equal(p2.predict(examples), p1.predict(examples))
