"""The native HTTP front of `sparsejax serve` (csrc/http_front.cc, serving/_front.py):
the same answers as the aiohttp server, byte for byte, on the same raw HTTP."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _serving_fake import write_model

from sparsejax.serving import _front

TESTS = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not _front.available(), reason="the C++ extension is not built")


def _start(model: Path, native: bool, max_body: int = 4096):
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from _serving_fake import load;"
        "from sparsejax.serving._server import serve;"
        f"sys.exit(serve(sys.argv[2], port=0, loader=load, poll_seconds=None, max_wait_ms=5,"
        f" max_body_bytes={max_body}, log=lambda s: print(s, flush=True)))"
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]),
        SPARSEJAX_SERVE_NATIVE_HTTP="1" if native else "0",
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(TESTS), str(model)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "listening on http://" in line:
            break
    else:
        raise AssertionError("".join(lines))
    front = "native HTTP front" if native else "aiohttp server"
    assert any(f"/v1/predict on the {front}" in line for line in lines), lines
    host, port = lines[-1].split("listening on http://")[1].split()[0].split(":")
    return proc, (host, int(port))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = Path(write_model(tmp_path_factory.mktemp("front") / "m", version="v7", offset=0.5))
    procs = {native: _start(model, native) for native in (True, False)}
    yield {native: address for native, (_, address) in procs.items()}
    for proc, _ in procs.values():
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()


def _read_answer(sock: socket.socket, buf: bytearray) -> tuple[int, dict, bytes] | None:
    """One HTTP/1.1 answer (status, headers, body) from `sock`; None if it closed."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of a body"
        rest += chunk
    buf[:] = rest[length:]
    return status, headers, rest[:length]


def _exchange(address, pieces: list[bytes], answers: int, pause: float = 0.0) -> list:
    """Send `pieces` (with `pause` between them), read `answers` answers, then whether
    the server closed the connection: [(status, body), ..., closed]."""
    with socket.create_connection(address, timeout=20) as sock:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(pause)
        buf = bytearray()
        got = []
        for _ in range(answers):
            answer = _read_answer(sock, buf)
            assert answer is not None, f"closed after {len(got)} answers: {got}"
            got.append((answer[0], answer[2]))
        sock.settimeout(0.3)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        return [*got, closed]


def _post(body: bytes, path: str = "/v1/predict", extra: str = "", version: str = "1.1") -> bytes:
    return (
        f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


GOOD = [
    b'{"examples": [{"a": 1, "b": 2.5}, {"c": 3}]}',
    b'{"example": {"a": 4}}',
    b'{"a": 1, "b": 1}',
    b'{"examples": []}',
]
BAD = [
    b"{not json",
    b"",
    b"[1, 2]",
    b'{"examples": [{"zzz": 1}]}',
    b'{"examples": [{"a": "x"}], "more": 1}',
    b'{"examples": [{"a": 1}, 5]}',
    b"\xff\xfe",
]


@pytest.mark.parametrize("body", GOOD + BAD)
def test_a_predict_request_gets_the_same_answer_as_from_aiohttp(servers, body):
    native, plain = (_exchange(servers[k], [_post(body)], 1) for k in (True, False))
    assert native == plain
    assert native[0][0] == (200 if body in GOOD else 400)


def test_pipelined_and_split_requests_are_answered_in_order(servers):
    bodies = [b'{"example": {"a": %d}}' % i for i in range(150)]  # over 64 in flight
    stream = b"".join(_post(b) for b in bodies)
    byte_by_7 = [stream[i : i + 7] for i in range(0, 301, 7)] + [stream[301:]]
    for pieces in ([stream], byte_by_7):
        got = _exchange(servers[True], pieces, len(bodies))
        assert got[:-1] == [
            (200, b'{"scores":[%s],"model_version":"v7"}' % repr(i + 0.5).encode())
            for i in range(150)
        ]
        assert got[-1] is False  # keep-alive
    # a header and a body that arrive in pieces, a moment apart
    req = _post(GOOD[0])
    got = _exchange(servers[True], [req[:20], req[20:-5], req[-5:]], 1, pause=0.05)
    assert got[0] == _exchange(servers[False], [req], 1)[0]


def test_other_requests_move_the_connection_to_aiohttp_after_the_answers_before_them(servers):
    chunked = (
        b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"b\r\n" + b'{"a": 2.25}' + b"\r\n0\r\n\r\n"
    )
    stream = [
        _post(b'{"a": 1}'),
        b"GET /v1/model HTTP/1.1\r\nHost: x\r\n\r\n",
        _post(b'{"a": 2}'),
        chunked,
        _post(b'{"a": 3}', path="/v1/predict?x=1"),
        _post(b'{"a": 4}', version="1.0", extra="Connection: keep-alive\r\n"),
    ]
    for native in (True, False):
        got = _exchange(servers[native], [b"".join(stream)], len(stream))
        statuses = [status for status, _ in got[:-1]]
        assert statuses == [200] * 6, got
        scores = (b"1.5", b"2.5", b"2.75", b"3.5", b"4.5")
        assert [got[i][1] for i in (0, 2, 3, 4, 5)] == [
            b'{"scores":[%s],"model_version":"v7"}' % s for s in scores
        ]
        assert b'"version":"v7"' in got[1][1]


def test_connection_close_oversized_bodies_and_a_client_that_goes_away(servers):
    for native in (True, False):
        got = _exchange(servers[native], [_post(b'{"a": 1}', extra="Connection: close\r\n")], 1)
        assert got == [(200, b'{"scores":[1.5],"model_version":"v7"}'), True]
        big = b'{"a": 1' + b" " * 5000 + b"}"
        got = _exchange(servers[native], [_post(b'{"a": 1}') + _post(big)], 2)
        assert got[0] == (200, b'{"scores":[1.5],"model_version":"v7"}')
        assert got[1][0] == 413 and b"over the limit of 4096 bytes" in got[1][1]
    # clients that send and leave before their answer, or mid-request, cost nothing
    for piece in (_post(b'{"a": 1}'), _post(b'{"a": 1}')[:30]):
        with socket.create_connection(servers[True]) as sock:
            sock.sendall(piece)
    assert _exchange(servers[True], [_post(b'{"a": 5}')], 1)[0] == (
        200,
        b'{"scores":[5.5],"model_version":"v7"}',
    )


def test_metrics_count_the_native_answers(servers):
    def counts():
        get = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        (status, body), _ = _exchange(servers[True], [get], 1)
        lines = body.decode().splitlines()
        return {
            code: sum(
                float(line.split()[-1])
                for line in lines
                if line.startswith("sparsejax_requests_total")
                and 'endpoint="predict"' in line
                and f'code="{code}"' in line
            )
            for code in ("200", "400")
        }

    before = counts()
    _exchange(servers[True], [_post(GOOD[0]), _post(BAD[0]), _post(GOOD[1])], 3)
    after = counts()
    assert after["200"] - before["200"] == 2 and after["400"] - before["400"] == 1


def test_the_front_closes_idle_connections_and_only_those():
    from sparsejax._cpu_ext import HttpFront

    with socket.create_server(("127.0.0.1", 0)) as listener:
        front = HttpFront(listener.fileno(), ["/p"], 1000, 0.5)
        idle = socket.create_connection(listener.getsockname(), timeout=10)
        busy = socket.create_connection(listener.getsockname(), timeout=10)
        with idle, busy:
            try:
                busy.sendall(_post(b"{}", path="/p"))  # queued, never answered: in flight
                deadline = time.monotonic() + 10
                while front.connections() < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert front.connections() == 2
                ((token, body, _, route, json_length),) = front.take(10, 5.0)
                assert body == b"{}" and json_length is None
                assert idle.recv(1) == b""  # closed after 0.5-1.5 s without a request
                assert front.connections() == 1  # the one with a request in flight stays
                front.respond([(token, 200, b"[1]")])
                buf = bytearray()
                assert _read_answer(busy, buf)[::2] == (200, b"[1]")
                assert busy.recv(1) == b""  # idle now, and closed in turn
            finally:
                front.close()


def test_the_front_passes_a_v2_json_length_header_on_as_sent():
    """A v2 body with binary tensors is framed like any other; its
    Inference-Header-Content-Length value comes with it as sent (trimmed), for Python
    to check; requests without one get None."""
    from sparsejax._cpu_ext import HttpFront

    with socket.create_server(("127.0.0.1", 0)) as listener:
        front = HttpFront(listener.fileno(), ["/p"], 1000, 5.0)
        with socket.create_connection(listener.getsockname(), timeout=10) as client:
            try:
                client.sendall(
                    _post(b"{}ab", path="/p", extra="Inference-Header-Content-Length:  2 \r\n")
                    + _post(b"{}", path="/p")
                    + _post(b"{}", path="/p", extra="inference-header-content-length: x\r\n")
                )
                got, deadline = [], time.monotonic() + 10
                while len(got) < 3 and time.monotonic() < deadline:
                    got += front.take(10, 1.0)
                assert [(body, n) for _, body, _, _, n in got] == [
                    (b"{}ab", "2"),
                    (b"{}", None),
                    (b"{}", "x"),
                ]
            finally:
                front.close()


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")
def test_the_benchs_open_loop_sends_at_the_offered_rate_not_as_fast_as_it_can(servers):
    spec = importlib.util.spec_from_file_location(
        "_load_tools", TESTS.parent / "experiments" / "_load_tools.py"
    )
    lt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lt)
    host, port = servers[True]
    url = f"http://{host}:{port}/v1/predict"
    r = lt.wrk_open(url, b'{"example": {"a": 1}}', rate=300, connections=16, seconds=2)
    assert r["errors"] == 0 and r["tool"] == "wrk" and r["offered"] == 300
    assert 0.85 * 300 <= r["throughput"] <= 1.15 * 300, r  # a closed loop does thousands
