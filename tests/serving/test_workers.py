"""`sparsejax serve --workers 2`: two server processes answer on one port with the same
model (deltas applied), map the same table files in shared memory, a worker killed with
SIGKILL is restarted while the other keeps answering, and SIGTERM stops them all and
removes the shared folder; their v2 gRPC API shares one port too."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from sparsejax import runner
from sparsejax.serving._workers import model_cores

grpcclient = pytest.importorskip("tritonclient.grpc")
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SO_REUSEPORT and /proc")


def _get(port: int, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
    with urllib.request.urlopen(req, timeout=30) as r:  # a new connection each time
        return json.load(r)


def _pids_answering(port: int, want: set, timeout: float = 120.0) -> set:
    seen, deadline = set(), time.monotonic() + timeout
    while not want <= seen and time.monotonic() < deadline:
        try:
            seen.add(_get(port, "/healthz")["pid"])
        except OSError:
            time.sleep(0.2)
    return seen


def test_two_workers_share_tables_and_one_killed_is_restarted(tmp_path):
    pub = tmp_path / "pub"
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp_path / 'runs'}",
            "data.kind=synthetic",
            "data.max_vocab=5000",
            "data.batch_size=32",
            "model.embedding_dim=8",
            "model.options={bottom: [16, 8], top: [16, 1]}",
            "progress=false",
            "eval_every=null",
            "steps=3",
            f"publish={{dir: {pub}, every_s: 1.0e-9, buckets: [1, 8]}}",
        ],
    )
    runner.train(cfg, log=lambda _: None)
    stale = "/dev/shm/sparsejax-serve-999999999-left"  # a supervisor killed with SIGKILL
    os.makedirs(stale, exist_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sparsejax",
            "serve",
            str(pub),
            "--workers",
            "2",
            "--port",
            "0",
            "--poll-seconds",
            "0.5",
            "--grpc-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={  # the workers' own compilation cache, not the suite's
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
        },
    )
    try:
        # first a process that loads and compiles the model, then the workers
        first = proc.stdout.readline()
        assert first == "[warm-up] sparsejax serve: loaded and compiled for the workers\n"
        second = proc.stdout.readline()
        m = re.search(r"2 workers on http://127.0.0.1:(\d+), v2 gRPC on 127.0.0.1:(\d+) "
                      r"\(pids (\d+), (\d+)\); tables shared in (\S+)", second)  # fmt: skip
        assert m, second
        warmed = set(os.listdir(os.path.join(m.group(5), "xla")))  # its computations
        assert warmed
        port, grpc_port = int(m.group(1)), int(m.group(2))
        pids, shared = {int(m.group(3)), int(m.group(4))}, m.group(5)
        assert _pids_answering(port, pids) >= pids
        # one gRPC port for both workers too (the supervisor picked the free one)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        assert all(grpc.is_model_ready("pub") for _ in range(8))
        example = json.loads((pub / "1" / "example_request.json").read_text())["examples"][:1]
        deadline = time.monotonic() + 60
        while True:  # each worker follows the publish folder's deltas on its first poll
            answers = [_get(port, "/v1/predict", {"examples": example}) for _ in range(20)]
            if {a["model_version"] for a in answers} == {"3"} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert {a["model_version"] for a in answers} == {"3"}
        assert len({a["scores"][0] for a in answers}) == 1
        assert not os.path.exists(stale)  # removed at start
        manifest = json.loads((pub / "1" / "model.json").read_text())
        tables = [e for e in manifest["arguments"].values() if "pieces" in e]
        deadline = time.monotonic() + 30
        while len(os.listdir(shared)) != len(tables) + 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        files = set(os.listdir(shared)) - {"xla"}  # version 3's tables: older ones removed
        assert len(files) == len(tables), (files, len(tables))
        for pid in pids:  # each worker maps the shared table files
            maps = pathlib_text(f"/proc/{pid}/maps")
            assert any(f in maps for f in files), pid
        # each worker's model threads (XLA's pool among them) on its own share of the
        # cores; its main thread, which runs the event loop, on every core
        cores = sorted(os.sched_getaffinity(0))
        shares = {tuple(s) for s in model_cores(cores, 2)}
        for pid in pids:
            threads = _thread_cores(pid)
            assert threads[pid][1] == tuple(cores), threads[pid]
            xla = {c for t, (name, c) in threads.items() if name.startswith("tf_XLAEigen")}
            assert len(xla) == 1 and xla <= shares, (pid, threads)
        compiled = set(os.listdir(os.path.join(shared, "xla")))
        assert compiled == warmed  # the workers compiled nothing: they read the cache
        victim = min(pids)
        os.kill(victim, signal.SIGKILL)
        # once the supervisor has reaped it (every thread gone, its socket closed), no new
        # connection goes to it (one that came while it died was in flight on it)
        while _exists(victim):
            time.sleep(0.05)
        ok = [_get(port, "/v1/predict", {"examples": example}) for _ in range(10)]
        assert all(a["model_version"] == "3" for a in ok)  # the other one answers
        restarted = _pids_answering(port, pids - {victim} | {-1}, timeout=15)
        deadline = time.monotonic() + 120
        while not (restarted - pids) and time.monotonic() < deadline:
            restarted |= _pids_answering(port, {-1}, timeout=2)
        assert restarted - pids, "no new worker answered"
        # it compiled nothing either: its computations were in the cache, the same keys
        assert set(os.listdir(os.path.join(shared, "xla"))) == warmed
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out
        assert f"worker 0 (pid {victim}) died (killed by SIGKILL); restarting" in out or (
            f"worker 1 (pid {victim}) died (killed by SIGKILL); restarting" in out
        )
        assert not os.path.exists(shared)
        for k, share in enumerate(model_cores(cores, 2)):
            assert (
                f"[worker {k}] sparsejax serve: the model's threads on cores "
                + ",".join(map(str, share))
                in out
            ), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _thread_cores(pid: int) -> dict[int, tuple[str, tuple[int, ...]]]:
    """{thread id: (its name, the cores it may run on)} of process `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        name = pathlib_text(f"/proc/{pid}/task/{tid}/comm").strip()
        out[int(tid)] = (name, tuple(sorted(os.sched_getaffinity(int(tid)))))
    return out


def test_each_worker_gets_its_own_share_of_the_cores():
    """As OMP_NUM_THREADS=cores/N would size them: disjoint shares that cover the cores,
    as even as they can be; fewer cores than workers: one each, round-robin."""
    assert model_cores([0, 1], 2) == [[0], [1]]
    assert model_cores([7, 2, 5, 3], 2) == [[2, 3], [5, 7]]
    assert model_cores(range(8), 3) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert model_cores([4], 3) == [[4], [4], [4]]
    assert model_cores([0, 1], 3) == [[0], [1], [0]]
    assert model_cores(range(4), 1) == [[0, 1, 2, 3]]


def _exists(pid: int) -> bool:
    """Whether process `pid` exists (running, or dead and not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pathlib_text(path: str) -> str:
    with open(path) as fh:
        return fh.read()


_ORPHAN = """
import os, signal, sys, time
from sparsejax.serving._workers import _term_when_parent_dies

r, w = os.pipe()
supervisor = os.fork()
if supervisor == 0:
    worker = os.fork()
    if worker == 0:
        signal.signal(signal.SIGTERM, lambda *_: (os.write(w, b"SIGTERM"), os._exit(0)))
        _term_when_parent_dies(os.getppid())
        os.write(w, b"ready;")
        time.sleep(30)
        os._exit(1)
    time.sleep(30)  # killed first
    os._exit(1)
os.close(w)
got = b""
while not got.endswith(b"ready;"):
    got += os.read(r, 64)
os.kill(supervisor, signal.SIGKILL)
os.waitpid(supervisor, 0)
got += os.read(r, 64)  # the worker's handler writes at once, or the read waits 30 s
print(got.decode())
"""


def test_a_model_that_does_not_load_stops_the_workers_with_one_line(tmp_path):
    """The first process (which loads the model for the workers) fails: its one-line
    reason, then the supervisor's, exit 1, no worker started and no folder left."""
    (tmp_path / "model.json").write_text('{"format": "something else"}')
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparsejax", "serve", str(tmp_path), "--workers", "2",
         "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (out, err)
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[warm-up] sparsejax serve: cannot load ")
    assert "is not a sparsejax-model manifest" in lines[0], lines
    assert lines[1] == "sparsejax serve: the model did not load (exit status 2); stopping"
    assert not [d for d in os.listdir("/dev/shm") if d.startswith(f"sparsejax-serve-{proc.pid}-")]


def test_a_worker_gets_sigterm_when_its_supervisor_is_killed():
    """A supervisor killed with SIGKILL takes its workers with it: the kernel sends each
    SIGTERM (which a worker's server takes as "finish the requests in flight"). In a
    process of its own: this one may have started JAX's threads, which forking dislikes."""
    got = subprocess.run(
        [sys.executable, "-c", _ORPHAN], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == "ready;SIGTERM"


def test_return_free_heap_gives_the_freed_heap_back_to_the_os():
    """The warm-up compile's freed heap would stay in each worker's memory: glibc keeps
    the pages of free chunks below one in use. After `return_free_heap` they are gone."""
    code = """
import ctypes, os
from sparsejax.serving._server import return_free_heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
size = 64 << 10  # under glibc's mmap threshold: from the heap
blocks = [libc.malloc(size) for _ in range(1024)]
for b in blocks:
    ctypes.memset(b, 1, size)
keep = libc.malloc(size)  # above the freed ones: the heap's top stays in use
for b in blocks:
    libc.free(b)
before = rss()
assert return_free_heap()
print(before - rss())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) > 48 << 20  # of the 64 MiB freed


def test_auto_workers_count_the_cores_this_process_may_use(monkeypatch):
    """`--workers auto` is one per core of the process's CPU affinity (a container's
    cpuset), not the machine's; where the OS has no affinity, the machine's cores."""
    from sparsejax.serving import usable_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cores() == 2
    monkeypatch.delattr(os, "sched_getaffinity")
    assert usable_cores() == 64
