"""PeerExchange: exact round trips between threads (1 to 4 processes, many dtypes), large
messages both ways at once, real processes (a clean job, a killed peer, a jax.distributed
job), a hung peer, processes out of step, and refused strangers."""

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from _cli import one_device_env

from sparsejax._peers import (
    TIMEOUT_ENV,
    DirRendezvous,
    JaxRendezvous,
    MemoryRendezvous,
    PeerExchange,
    PeerLostError,
    PeerTimeoutError,
)


def _message(call: int, src: int, dst: int) -> list[np.ndarray]:
    """The arrays process `src` sends `dst` in exchange `call` (any process rebuilds them)."""
    rng = np.random.default_rng([call, src, dst])
    n = int(rng.integers(0, 100))
    wide = rng.integers(-(2**40), 2**40, (n, 3))
    return [
        rng.integers(-(2**62), 2**62, n),
        rng.integers(-(2**31), 2**31, n, dtype=np.int32),
        rng.standard_normal((n, 2), dtype=np.float32),
        rng.integers(0, 256, n, dtype=np.uint8),
        rng.random(n) < 0.5,
        np.zeros((0, 4), np.float32),
        np.array(1000 * call + 10 * src + dst),  # 0-d
        wide[:, ::2],  # not contiguous
        np.asfortranarray(wide),
        np.array([(src, 1.5)] * (n % 3), dtype=[("id", "<i4"), ("w", ">f8", (2,))]),
        np.arange(n % 5).astype("M8[D]"),
    ]


def _assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, np.ndarray)
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        assert np.array_equal(g, w)


def _threads(n: int, fn, timeout: float = 60) -> list:
    """fn(process_id) in n threads at once; their results, or the exceptions they raised."""
    results: list = [None] * n

    def target(i):
        try:
            results[i] = fn(i)
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "an exchange hung"
    return results


def _ok(results: list) -> list:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_threads_receive_exactly_what_was_sent(n):
    rv = MemoryRendezvous()

    def run(me):
        with PeerExchange(me, n, rv, name=f"n{n}", timeout=30) as ex:
            sent = received = 0
            for call in range(4):
                msgs = [_message(call, me, j) for j in range(n)]
                out = ex.all_to_all(msgs)
                assert all(a is b for a, b in zip(out[me], msgs[me], strict=True))
                for j in range(n):
                    _assert_same(msgs[j], _message(call, me, j))  # inputs untouched
                    if j != me:
                        _assert_same(out[j], _message(call, j, me))
                        sent += sum(a.nbytes for a in msgs[j])
                        received += sum(a.nbytes for a in out[j])
            assert (ex.bytes_sent, ex.bytes_received, ex.calls) == (sent, received, 4)
            return sent, received

    totals = _ok(_threads(n, run))
    assert sum(s for s, _ in totals) == sum(r for _, r in totals)


def test_large_messages_both_ways_at_once():
    rv = MemoryRendezvous()
    size = 64 << 20  # bytes each way

    def run(me):
        with PeerExchange(me, 2, rv, timeout=60) as ex:
            data = np.arange(size // 8, dtype=np.int64) + me
            start = time.perf_counter()
            out = ex.all_to_all([[data], [data]] if me else [[data], [data[::-1]]])
            seconds = time.perf_counter() - start
            want = np.arange(size // 8, dtype=np.int64) + (1 - me)
            np.testing.assert_array_equal(out[1 - me][0], want if me == 0 else want[::-1])
            return seconds

    seconds = max(_ok(_threads(2, run)))
    print(f"64 MiB each way between 2 threads: {seconds * 1e3:.0f} ms")


def test_many_large_messages_between_three():
    rv = MemoryRendezvous()
    size = 16 << 20  # bytes to each peer, in two arrays

    def run(me):
        with PeerExchange(me, 3, rv, name="many", timeout=60) as ex:
            for call in range(2):
                parts = [np.full(size // 16, 100 * call + 10 * me + j) for j in range(3)]
                out = ex.all_to_all([[p[::2], p[1::2]] for p in parts])
                for j in range(3):
                    want = np.full(size // 32, 100 * call + 10 * j + me)
                    np.testing.assert_array_equal(out[j][0], want)
                    np.testing.assert_array_equal(out[j][1], want)

    _ok(_threads(3, run))


def _worker(directory: str, me: int, n: int, kill_at: int | None) -> None:
    """One process of a job: 3 exchanges of `_message`; process n-1 kills itself before
    exchange `kill_at`. Writes what happened to directory/result{me}.json."""
    result: dict = {"error": None}
    start = time.monotonic()
    try:
        with PeerExchange(me, n, DirRendezvous(directory), name="job", timeout=60) as ex:
            for call in range(3):
                if call == kill_at and me == n - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                start = time.monotonic()
                out = ex.all_to_all([_message(call, me, j) for j in range(n)])
                for j in range(n):
                    _assert_same(out[j], _message(call, j, me))
    except Exception as e:
        result = {"error": type(e).__name__, "message": str(e)}
    result["seconds"] = time.monotonic() - start
    with open(os.path.join(directory, f"result{me}.json"), "w") as f:
        json.dump(result, f)


def _job(tmp_path, n: int, kill_at: int | None = None) -> list[dict | None]:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), i, n, kill_at)) for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert not any(p.is_alive() for p in procs), "a process hung"
    files = [tmp_path / f"result{i}.json" for i in range(n)]
    return [json.loads(f.read_text()) if f.exists() else None for f in files]


def test_processes_exchange(tmp_path):
    assert [r["error"] for r in _job(tmp_path, 3)] == [None] * 3


def test_killed_process_stops_the_others_at_once(tmp_path):
    *survivors, dead = _job(tmp_path, 3, kill_at=2)
    assert dead is None
    for r in survivors:
        assert r["error"] == "PeerLostError", r
        assert "process 2 closed its connection during exchange 2" in r["message"]
        assert "\n" not in r["message"]
        assert r["seconds"] < 5  # noticed from the connection, not the 60 s timeout


def test_hung_peer_times_out():
    rv = MemoryRendezvous()

    def run(me):
        with PeerExchange(me, 2, rv, name="hang", timeout=1) as ex:
            if me == 1:
                time.sleep(2)
            start = time.monotonic()
            with pytest.raises((PeerTimeoutError, PeerLostError)) as info:
                for _ in range(2):  # the late one may still read what was sent before
                    ex.all_to_all([[np.ones(3)], [np.ones(3)]])
            return info.value, time.monotonic() - start

    (waited, seconds), (late, _) = _ok(_threads(2, run))
    assert isinstance(waited, PeerTimeoutError)
    assert str(waited) == (
        "hang: process 1 sent nothing for 1 s in exchange 0 (hung or far behind); set "
        f"{TIMEOUT_ENV} (seconds) to wait longer"
    )
    assert 0.9 < seconds < 2.5
    # the hung one wakes to a closed connection
    assert isinstance(late, PeerLostError) and "process 0 closed" in str(late)


def test_lost_peer_error_sticks_and_close_after_last_exchange_is_quiet():
    rv = MemoryRendezvous()

    def run(me):
        ex = PeerExchange(me, 2, rv, name="close", timeout=10)
        ex.all_to_all([[np.arange(3)], [np.arange(3)]])
        if me == 1:
            ex.close()  # after the last exchange both ways: no error anywhere
            ex.close()
            return None
        time.sleep(0.2)
        errors = []
        for _ in range(2):  # unusable after the error: the same error again
            with pytest.raises(PeerLostError) as info:
                ex.all_to_all([[np.arange(3)], [np.arange(3)]])
            errors.append(str(info.value))
        ex.close()
        return errors

    errors, _ = _ok(_threads(2, run))
    assert errors[0] == errors[1]
    assert errors[0] == (
        "close: process 1 closed its connection during exchange 1 (it exited or was "
        "killed); stopping"
    )


def test_processes_out_of_step():
    rv = MemoryRendezvous()

    def run(me):
        with PeerExchange(me, 2, rv, name="step", timeout=10) as ex:
            ex.calls += 5 * me  # process 1 skipped ahead
            with pytest.raises(PeerLostError, match="out of step") as info:
                ex.all_to_all([[np.arange(3)], [np.arange(3)]])
            return str(info.value)

    first, second = _ok(_threads(2, run))
    assert "process 1 is at exchange 5, this process at 0" in first
    assert "process 0 is at exchange 0, this process at 5" in second


def test_garbage_from_a_peer():
    rv = MemoryRendezvous()

    def run(me):
        with PeerExchange(me, 2, rv, name="junk", timeout=10) as ex:
            if me == 1:
                ex._socks[0].sendall(b"\xff" * 64)  # not a message
                time.sleep(0.2)  # process 0 reads it before this one closes
                return None
            with pytest.raises(PeerLostError) as info:
                ex.all_to_all([[], []])
            return str(info.value)

    error, _ = _ok(_threads(2, run))
    assert error == "junk: process 1 sent garbage in exchange 0"


def test_stranger_is_refused():
    rv = MemoryRendezvous()
    errors = []

    def run():
        with pytest.raises(PeerLostError) as info:
            PeerExchange(0, 2, rv, name="job", timeout=10)
        errors.append(str(info.value))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    host, _, port = rv.fetch("sparsejax/job/0", 10).rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):  # a reset if it left bytes unread
            assert sock.recv(1) == b""  # closed, nothing answered
    thread.join(10)
    (error,) = errors
    assert "job: refused a connection from 127.0.0.1:" in error
    assert "it is not a sparsejax exchange" in error and "\n" not in error


def test_other_process_count_is_refused():
    rv = MemoryRendezvous()

    def run(me):  # process 1 thinks the job has 3 processes
        with pytest.raises(PeerLostError) as info:
            PeerExchange(me, 2 + me, rv, name="job", timeout=10)
        return str(info.value)

    acceptor, connector = _ok(_threads(2, run))
    assert "it belongs to another exchange name or number of processes" in acceptor
    assert "job: process 0 at 127.0.0.1:" in connector
    assert "closed the connection in the handshake" in connector
    assert "\n" not in acceptor + connector


def test_bad_calls_and_settings(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"process_id 2 not in \[0, 2\)"):
        PeerExchange(2, 2, MemoryRendezvous())
    single = PeerExchange(0, 1, MemoryRendezvous(), timeout=5)
    msgs = [[np.arange(3)]]
    (out,) = single.all_to_all(msgs)
    assert out[0] is msgs[0][0]
    with pytest.raises(ValueError, match=r"one message per process \(1\), got 2"):
        single.all_to_all([[], []])
    single.close()
    with pytest.raises(RuntimeError, match="closed"):
        single.all_to_all(msgs)
    rv = MemoryRendezvous()

    def run(me):
        with PeerExchange(me, 2, rv, name="obj") as ex:
            if me == 0:
                with pytest.raises(TypeError, match="dtype object"):
                    ex.all_to_all([[], [np.array([None])]])
            return ex.timeout

    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert _ok(_threads(2, run)) == [7.5, 7.5]
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}='soon' is not a number"):
        PeerExchange(0, 1, MemoryRendezvous())
    with pytest.raises(PeerTimeoutError, match="no 'k' in"):
        DirRendezvous(tmp_path).fetch("k", 0.05)
    with pytest.raises(PeerTimeoutError, match="no 'k' published"):
        MemoryRendezvous().fetch("k", 0.05)
    with pytest.raises(RuntimeError, match=r"needs jax.distributed.initialize\(\) first"):
        JaxRendezvous()


_JAX_CHILD = r"""
import sys
import jax
import numpy as np
from sparsejax._peers import JaxRendezvous, PeerExchange, PeerTimeoutError

port, me = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", 2, me, initialization_timeout=30)
rv = JaxRendezvous()
with PeerExchange(me, 2, rv, name="jax", timeout=30) as ex:
    (a,), (b,) = ex.all_to_all([[np.arange(4) + 10 * me], [np.arange(4) + 10 * me]])
    assert np.array_equal((a, b)[1 - me], np.arange(4) + 10 * (1 - me))
    assert rv.fetch("sparsejax/jax/0", 1).startswith("127.0.0.1:")  # routed to the coordinator
try:
    PeerExchange(me, 2, rv, name="jax", timeout=30)
    raise AssertionError("published twice")
except RuntimeError as e:
    assert "give each PeerExchange of a job its own name" in str(e), e
try:
    rv.fetch("never", 0.2)
    raise AssertionError("no timeout")
except PeerTimeoutError as e:
    assert "no 'never' in jax.distributed's key-value store" in str(e), e
jax.distributed.shutdown()
print("ok")
"""


def test_jax_distributed_rendezvous():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = one_device_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _JAX_CHILD, str(port), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0 and out.strip().endswith("ok"), out
