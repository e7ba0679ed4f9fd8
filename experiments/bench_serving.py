#!/usr/bin/env python3
"""Serving (issues 12 and 27): throughput and latency through the HTTP and gRPC server,
with and without dynamic batching, on 1 and 2 server processes, in closed and open loop,
per model dir (e.g. fp32 vs int8 tables), and the Python predictor's own throughput.

For each model dir (--model [LABEL=]DIR, e.g. fp32=models/fp32 int8=models/int8),
--loadgen python (the default) measures (a) and (b), --loadgen native (c):

(a) predictor: `Predictor.load(DIR)` in this process; `predict(examples)` on batches of
    --predictor-batches raw examples (default 1, 32, 256: parse + pad + model, raw
    feature values in, probabilities out), the examples rotated over the model's
    example_request.json (or --examples); --reps timed repetitions of at least
    --min-seconds each after a warm-up call; predictions/s = the median repetition's.
(b) server: `python -m sparsejax serve DIR --port 0 --poll-seconds 0` in a subprocess,
    once per mode:
      batch1   --max-batch 1 --max-wait-ms 0: every request is its own model call (the
               baseline);
      dynamic  --max-wait-ms --max-wait-ms (default 2) and the model's largest bucket as
               the max batch: dynamic batching.
    At each --concurrency C: C keep-alive HTTP/1.1 connections on loopback (a minimal
    asyncio client in this process), each sending single-example POST /v1/predict
    requests back to back ({"examples": [one example]}, rotated), for --warmup-seconds
    unrecorded, then until --requests requests or --seconds seconds, whichever comes
    first. Throughput = answered requests / wall time; latency p50/p99 is the client's
    (send to last byte of the answer). The mean batch size is the server's own
    (sparsejax_batch_size_examples in /metrics, over the cell); CPU seconds of the
    server process and of this client over the cell are shown, since both share the
    machine's cores.

The table gives dynamic / batch1 throughput at the same concurrency. Checks (the
issue's Must reach, on the 2-core machine): the predictor at batch 256 >= 20,000
predictions/s; the best concurrency for dynamic batching - its highest throughput with
a p99 under 20 ms - exists, and there its throughput is >= 5x batch-1 serving's at the
same concurrency (the highest throughput at any p99 is printed beside it). They are
printed; --strict makes a failed check exit with status 1.

--malformed 0.05 breaks that fraction of the bodies (truncated JSON, an unknown feature,
a value of the wrong type, in turn): every good request must still get 200 and every
malformed one 400 (a check); throughput counts the 200s only.

--url LABEL=URL measures a server that is already running (one mode, "given"; no
predictor section; --examples gives the bodies).

    python experiments/bench_serving.py --model fp32=/tmp/m_fp32 int8=/tmp/m_int8 \\
        --concurrency 1 4 16 64 --seconds 5 --out serving.json

(c) native load tools (issue 27), so that the load generator takes little of the 2
    cores the server runs on (a Python client competes with the server for them):
    `wrk` (Debian package wrk) and `h2load` (nghttp2-client); the gRPC request is built
    with tritonclient's protobuf messages. Helpers in experiments/_load_tools.py.
    Servers: per --workers N (default 1 2) one `sparsejax serve DIR --workers N
    --grpc-port P --name bench` with dynamic batching (--max-wait-ms, --max-batch as in
    (b)). N = 1 is the single process (no supervisor); N >= 2 a supervisor and N
    worker processes on one port (SO_REUSEPORT; P is picked free beforehand, as every
    worker binds it). All the servers are up at once, and their cells go in turn (see
    --load-reps), so the VM's drift over minutes reaches every server alike. Paths
    (--paths, default all), single-example requests, the model's first example
    (example_request.json, or --examples):
      v1    POST /v1/predict, {"examples": [example]};
      v2    POST /v2/models/bench/infer (KServe v2 REST: JSON tensors, a JSON answer);
      v2bin the same with binary tensors (Inference-Header-Content-Length), as Triton's
            HTTP client sends them, a JSON answer;
      grpc  inference.GRPCInferenceService/ModelInfer (KServe v2 gRPC over h2c, the
            tensors as raw_input_contents, as Triton's client sends them).
    One request on each path first checks that they get the same score. Then per path,
    after a --warmup-seconds closed loop:
      closed loop (the peak): at each --peak-connections C (default 64), REST: `wrk -t1
            -cC` for --seconds (rounded up to whole seconds, wrk's unit); gRPC: `h2load
            -cC -m1`, each of C connections one request in flight, a request count
            that fills about --seconds. The path's peak is its highest (median)
            throughput among the C.
      open loop: at each --open-loop-fractions f (default 0.5 0.8 0.95) of the peak,
            requests at the rate f * peak. REST: `wrk` with a Lua schedule of Poisson
            arrivals (experiments/_load_tools.py `wrk_open`), sent by whichever of
            rate / --client-rps (default 50) keep-alive connections is free, one
            request in flight a connection; latency over the whole --seconds (whole
            seconds). It takes a third of h2load's CPU for the same rate (h2load's
            clients of one process send in step, so it needed one process per 4
            clients). gRPC: h2load at the fixed rate, clients of --client-rps
            requests/s each (h2load's rate timer ticks at most every 10 ms), their
            connections made over one interval so their requests do not arrive
            together, up to 64 in flight a connection; the first 0.5 s is not counted,
            p50/p99 are over the requests sent in the next --seconds. The achieved rate
            is the good answers a second; a loop that achieves < 97% of its rate fell
            behind (marked *; its latency, from the send, is then a lower bound).
      the rate under the line (--slo-steps K, default 0: not run): the highest open-loop
            rate whose median p99 is < 10 ms, bisected K times between the fractions
            above (the highest that met the line, the lowest that did not); the
            capacity a 10 ms p99 allows, beside the Must reach at 80% of the peak.
    Errors: non-200 answers and failed streams; for gRPC also the errors h2load cannot
    see (an HTTP 200 with the gRPC status in its trailers): a good answer is one DATA
    frame of known length, an error none, so good answers = h2load's DATA bytes / that
    length. CPU seconds over each cell: the load tool's (getrusage of the children this
    process reaps) and the server's (the sum over its processes: the supervisor and its
    workers, from /proc; none if a worker was restarted meanwhile). --load-reps R runs
    each cell R times, interleaved (every server's closed-loop cells once, the servers'
    order alternating, then again; then the open-loop cells so), and the
    table gives the medians, the p99 range and ratios from the same run: 2 workers / 1
    worker throughput at the same C, p99 / 10 ms. Checks: the paths' scores agree; per
    worker count and path, single-example p99 < 10 ms at 80% of the peak (no errors,
    not behind; the Must reach); 2 workers >= 1.5x one worker's peak per path; the
    load tool's CPU <= --max-tool-cpu (default 15%) of the machine's cores in every
    cell (its share of the server's CPU is printed beside).

    apt-get install wrk nghttp2-client
    python experiments/bench_serving.py --model DIR --loadgen native --seconds 3 \\
        --load-reps 3 --out serving_native.json                   # 1 and 2 workers
    python experiments/bench_serving.py --model DIR --loadgen native --workers 1 \\
        --paths v1 --open-loop-fractions 0.8                      # one process, v1 only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # however it is loaded
import _load_tools as lt  # noqa: E402
from _machine import cpu_name, cpu_steadiness, load_average, mem_available  # noqa: E402

MODES = {
    "batch1": lambda a: ["--max-batch", "1", "--max-wait-ms", "0"],
    "dynamic": lambda a: [
        "--max-wait-ms",
        f"{a.max_wait_ms:g}",
        *(["--max-batch", str(a.max_batch)] if a.max_batch else []),
    ],
}

# -- the load client --------------------------------------------------------------------


def request_bytes(host: str, path: str, body: bytes) -> bytes:
    """One HTTP/1.1 keep-alive POST, ready to write."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, the server closes the connection) of one response."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    i = lower.find(b"\r\ncontent-length:")
    if i < 0:
        raise ConnectionError(f"response without a Content-Length: {head[:200]!r}")
    n = int(lower[i + 17 : lower.index(b"\r\n", i + 2)])
    body = await reader.readexactly(n) if n else b""
    return status, body, b"\r\nconnection: close" in lower


class _Phase:
    """One phase of a cell (warm-up or measured), shared by its connections."""

    def __init__(self, max_requests: int, seconds: float, record: bool):
        self.left = max_requests
        self.stop_at = time.perf_counter() + seconds
        self.record = record
        self.latencies: list[float] = []
        self.statuses: dict[int, int] = {}
        self.first_error: str | None = None
        self.unexpected = 0  # answers whose status is not the body's expected one
        self.first_unexpected: str | None = None


async def _drive(host, port, conns, k, requests: list[bytes], expect: list[int], phase: _Phase):
    """Connection k sends requests back to back until the phase ends."""
    reader, writer, i = conns[k]
    perf = time.perf_counter
    n = len(requests)
    record = phase.record
    lat = phase.latencies
    statuses = phase.statuses
    while phase.left > 0 and perf() < phase.stop_at:
        phase.left -= 1
        t0 = perf()
        writer.write(requests[i % n])
        want = expect[i % n]
        i += 1
        try:
            status, body, closing = await _read_response(reader)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            status, body, closing = 599, repr(e).encode(), True
        t1 = perf()
        if record:
            lat.append(t1 - t0)
            statuses[status] = statuses.get(status, 0) + 1
            if status != 200 and phase.first_error is None:
                phase.first_error = f"{status}: {body[:300].decode(errors='replace')}"
            if status != want:
                phase.unexpected += 1
                if phase.first_unexpected is None:
                    text = body[:300].decode(errors="replace")
                    phase.first_unexpected = f"expected {want}, got {status}: {text}"
        if closing:  # the server closed it (e.g. after a 413): open another
            writer.close()
            reader, writer = await asyncio.open_connection(host, port)
    conns[k] = (reader, writer, i)


async def _load(host, port, requests, expect, concurrency, max_requests, seconds, warmup_seconds):
    conns = []
    for k in range(concurrency):
        reader, writer = await asyncio.open_connection(host, port)
        conns.append((reader, writer, k * 7919))  # each starts at another body
    try:
        if warmup_seconds > 0:
            warm = _Phase(1 << 62, warmup_seconds, False)
            await asyncio.gather(
                *(_drive(host, port, conns, k, requests, expect, warm) for k in range(concurrency))
            )
        phase = _Phase(max_requests, seconds, True)
        t0 = time.perf_counter()
        await asyncio.gather(
            *(_drive(host, port, conns, k, requests, expect, phase) for k in range(concurrency))
        )
        return phase, time.perf_counter() - t0
    finally:
        for _, writer, _ in conns:
            writer.close()
        for _, writer, _ in conns:
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass


def run_load(
    url: str,
    bodies: list[bytes],
    *,
    concurrency: int,
    requests: int,
    seconds: float,
    warmup_seconds: float = 1.0,
    expect: list[int] | None = None,
    path: str = "/v1/predict",
) -> dict:
    """Closed-loop load on `url` (http://host:port): `concurrency` connections, each
    sending `bodies` (rotated) back to back; see the module docstring. `expect`: each
    body's expected status (default 200); "unexpected" counts the other answers."""
    host, port = _host_port(url)
    reqs = [request_bytes(host, path, b) for b in bodies]
    expect = [200] * len(bodies) if expect is None else list(expect)
    measured, wall = asyncio.run(
        _load(host, port, reqs, expect, concurrency, requests, seconds, warmup_seconds)
    )
    lat = np.asarray(measured.latencies) * 1000.0
    ok = measured.statuses.get(200, 0)
    out = {
        "concurrency": concurrency,
        "requests": int(lat.size),
        "ok": ok,
        "errors": int(lat.size) - ok,
        "statuses": {str(k): v for k, v in sorted(measured.statuses.items())},
        "seconds": round(wall, 4),
        "throughput": ok / wall if wall > 0 else 0.0,
        "unexpected": measured.unexpected,
    }
    for q in (50, 90, 99):
        out[f"p{q}_ms"] = float(np.percentile(lat, q)) if lat.size else None
    out["max_ms"] = float(lat.max()) if lat.size else None
    if measured.first_error:
        out["first_error"] = measured.first_error
    if measured.first_unexpected:
        out["first_unexpected"] = measured.first_unexpected
    return out


def _host_port(url: str) -> tuple[str, int]:
    m = re.fullmatch(r"http://([^:/]+):(\d+)/?", url)
    if not m:
        raise SystemExit(f"expected a URL like http://127.0.0.1:8000, got {url!r}")
    return m.group(1), int(m.group(2))


def http_get(url: str, path: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def http_post(
    url: str, path: str, body: bytes, timeout: float = 30.0, headers: dict | None = None
) -> tuple[int, str]:
    request = urllib.request.Request(
        url.rstrip("/") + path,
        data=body,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def metric_samples(url: str) -> dict[str, float]:
    """Every sample of the server's /metrics, {name with its labels: value} (with several
    workers the scrape reaches one of them)."""
    status, text = http_get(url, "/metrics")
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def batch_counters(url: str) -> tuple[float, float]:
    """(examples, model calls) so far, from the server's /metrics."""
    got = metric_samples(url)
    return got.get("sparsejax_batch_size_examples_sum", 0.0), got.get(
        "sparsejax_batch_size_examples_count", 0.0
    )


def server_latency_counts(url: str, endpoint: str) -> dict[str, float]:
    """The server's latency histogram for `endpoint` so far, {le: requests}, from its
    /metrics: its own time for a request (from the front's framing of it, or the
    aiohttp handler's start, to its answer), without the network and the load tool."""
    prefix = f'sparsejax_request_latency_seconds_bucket{{endpoint="{endpoint}",le="'
    return {
        name[len(prefix) : -2]: n
        for name, n in metric_samples(url).items()
        if name.startswith(prefix)
    }


# -- the server ---------------------------------------------------------------------------


class ServerProcess:
    """`python -m sparsejax serve MODEL_DIR --port 0 ...` in a subprocess; `url` once it
    listens and answers /healthz. Stopped with SIGTERM (then killed) on exit."""

    def __init__(
        self, model_dir: str, args: list[str], *, timeout: float = 300.0, workers: int = 1
    ):
        cmd = [sys.executable, "-m", "sparsejax", "serve", model_dir, "--port", "0"]
        cmd += ["--poll-seconds", "0", *args]
        self.cmd = cmd
        self.timeout = timeout
        self.workers = workers  # `args` has --workers N: wait until N processes answer
        self.pids: set[int] = set()
        self.lines: list[str] = []
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        found = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                m = re.search(r"listening on (http://[^\s,]+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    found.set()
            found.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not found.wait(self.timeout) or self.url is None:
            self.__exit__(None, None, None)
            tail = "\n".join(self.lines[-15:])
            raise RuntimeError(f"the server did not start ({' '.join(self.cmd)}):\n{tail}")
        # The other workers may still be loading: they get the start-up timeout too.
        deadline = time.monotonic() + 30 + (self.timeout if self.workers > 1 else 0)
        while True:  # each call a new connection: SO_REUSEPORT spreads them over workers
            status, text = http_get(self.url, "/healthz")
            if status == 200:
                self.pids.add(json.loads(text)["pid"])
                if len(self.pids) >= self.workers:
                    break
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(
                    f"{self.url}/healthz: {len(self.pids)} of {self.workers} processes answered 200"
                )
            time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)
        self.proc.stdout.close()


# -- the predictor ------------------------------------------------------------------------


def predictor_throughput(
    predictor, examples: list[dict], batches, *, reps: int = 5, min_seconds: float = 0.2
) -> dict:
    """Predictions/s of `predictor.predict` per batch size (the median of `reps`
    repetitions, each at least `min_seconds`; examples rotated)."""
    out = {}
    for b in batches:
        calls = [[examples[(s + j) % len(examples)] for j in range(b)] for s in range(4)]
        predictor.predict(calls[0])  # warm-up
        rates = []
        for _ in range(reps):
            n, t0 = 0, time.perf_counter()
            while True:
                predictor.predict(calls[n % len(calls)])
                n += 1
                dt = time.perf_counter() - t0
                if dt >= min_seconds:
                    break
            rates.append(n * b / dt)
        med = statistics.median(rates)
        out[str(b)] = {
            "predictions_per_s": med,
            "ms_per_call": 1000.0 * b / med,
            "min": min(rates),
            "max": max(rates),
            "reps": reps,
        }
    return out


# -- native load tools: paths, workers, closed and open loop (--loadgen native) -----------

PATHS = ("v1", "v2", "v2bin", "grpc")
V2_NAME = "bench"  # the model's name in the v2 APIs (serve --name)
P99_LINE_MS = 10.0  # the Must reach: single-example p99 < 10 ms at 80% of the peak rate
AT_FRACTION = 0.8
OPEN_SKIP_S = 0.5  # an open-loop run's first half second (connecting) is not counted
OPEN_MIN_CLIENTS = 8  # connections of an open loop at least (spread over the workers)
BEHIND = 0.97  # an open loop that achieves less than this share of its rate fell behind


def _targets(server: ServerProcess, grpc_port: int, example: dict, paths) -> tuple[dict, dict]:
    """Per path, what the load tools send: {"url", "body", "grpc", "answer_bytes"} (the
    length of a good gRPC answer, to count gRPC errors), and the score one request on
    each path got (they must agree)."""
    url = server.url
    status, text = http_get(url, f"/v2/models/{V2_NAME}")
    if status != 200:
        raise RuntimeError(f"GET /v2/models/{V2_NAME}: {status} {text[:300]}")
    inputs = json.loads(text)["inputs"]
    grpc_url = f"http://{_host_port(url)[0]}:{grpc_port}{lt.GRPC_METHOD}"
    # one worker's histogram is the server's (with more, a scrape reaches one of them)
    own = {"base": url} if server.workers == 1 else {}
    targets = {
        "v1": {
            "url": url + "/v1/predict",
            "body": lt.v1_body(example),
            "grpc": False,
            **own,
            "endpoint": "predict",
        },
        "v2": {
            "url": url + f"/v2/models/{V2_NAME}/infer",
            "body": lt.v2_body(example, inputs),
            "grpc": False,
            **own,
            "endpoint": "v2_infer",
        },
        "grpc": {"url": grpc_url, "grpc": True},
    }
    body, json_length = lt.v2_binary_body(example, inputs)
    header = {"Inference-Header-Content-Length": str(json_length)}
    targets["v2bin"] = {**targets["v2"], "body": body, "headers": header}
    scores = {}
    for path in paths:
        t = targets[path]
        if path == "grpc":
            message = lt.grpc_request(example, inputs, V2_NAME)
            answer = lt.grpc_call(f"{_host_port(url)[0]}:{grpc_port}", message)
            t["body"], t["answer_bytes"] = lt.grpc_frame(message), len(lt.grpc_frame(answer))
            scores[path] = lt.grpc_scores(answer)[0]
            continue
        status, text = http_post(t["url"], "", t["body"], headers=t.get("headers"))
        if status != 200:
            raise RuntimeError(f"POST {t['url']}: {status} {text[:300]}")
        answer = json.loads(text)
        scores[path] = answer["scores"][0] if path == "v1" else answer["outputs"][0]["data"][0]
        t["answer_bytes"] = None
    return targets, scores


def _native_cell(target: dict, cpu: lt.TreeCpu, args, *, connections=None, rate=None,
                 estimate=500.0, seconds=None) -> dict:  # fmt: skip
    """One run of a load tool on one path: closed loop over `connections` (REST: wrk;
    gRPC: h2load, about `estimate` requests/s), or open loop at `rate` (REST: wrk with
    Poisson arrivals; gRPC: h2load)."""
    seconds = args.seconds if seconds is None else seconds
    own = "base" in target  # the server's own latency histogram, before and after
    before = server_latency_counts(target["base"], target["endpoint"]) if own else None
    cpu.start()
    if rate is not None and not target["grpc"]:
        r = lt.wrk_open(
            target["url"],
            target["body"],
            rate=rate,
            connections=max(OPEN_MIN_CLIENTS, math.ceil(rate / args.client_rps)),
            seconds=seconds,
            headers=target.get("headers"),
        )
        r["behind"] = bool(r["throughput"] < BEHIND * rate)
    elif rate is not None:
        r = lt.h2load(
            target["url"],
            target["body"],
            grpc=target["grpc"],
            clients=OPEN_MIN_CLIENTS,
            requests=math.ceil(rate * (OPEN_SKIP_S + seconds)),
            rate=rate,
            client_rps=args.client_rps,
            skip_seconds=OPEN_SKIP_S,
            seconds=seconds,
            grpc_answer_bytes=target["answer_bytes"],
            timeout=3 * (OPEN_SKIP_S + seconds) + 30,
        )
        r["behind"] = bool(r["throughput"] < BEHIND * rate)
    elif target["grpc"]:
        r = lt.h2load(
            target["url"],
            target["body"],
            grpc=True,
            clients=connections,
            requests=max(4 * connections, round(estimate * seconds)),
            grpc_answer_bytes=target["answer_bytes"],
            timeout=10 * seconds + 30,
        )
    else:
        r = lt.wrk(target["url"], target["body"], connections=connections, seconds=seconds,
                   headers=target.get("headers"))  # fmt: skip
    r["server_cpu_s"] = cpu.stop()
    r["server_over_10ms"] = None
    if own:
        after = server_latency_counts(target["base"], target["endpoint"])
        n = after["+Inf"] - before["+Inf"]
        if n:
            r["server_over_10ms"] = 1 - (after["0.01"] - before["0.01"]) / n
    r["tool_cores"] = round(r["tool_cpu_s"] / max(r["wall_s"], 1e-9), 3)  # busy cores
    r["connections"] = connections if rate is None else r["clients"]
    return r


def _median(reps: list[dict]) -> dict:
    """The repetitions of a cell and their medians (errors: the sum)."""

    def med(key):
        values = [r[key] for r in reps if r.get(key) is not None]
        return statistics.median(values) if values and len(values) == len(reps) else None

    p99 = [r["p99_ms"] for r in reps if r["p99_ms"] is not None]
    out = {k: med(k) for k in ("throughput", "p50_ms", "p99_ms", "tool_cpu_s", "tool_cores",
                               "server_cpu_s", "seconds", "connections",
                               "server_over_10ms")}  # fmt: skip
    out.update(
        p99_ms_min=min(p99, default=None),
        p99_ms_max=max(p99, default=None),
        errors=sum(r["errors"] for r in reps),
        tool=reps[0]["tool"],
        reps=reps,
    )
    if "offered" in reps[0]:
        out["offered"] = reps[0]["offered"]
        out["behind"] = bool(out["throughput"] < BEHIND * out["offered"])
    return out


def _cell_line(path: str, what: str, r: dict) -> str:
    cpu = r["server_cpu_s"]
    offered = f"offered {r['offered']:8,.0f}  " if "offered" in r else ""
    late = "  BEHIND" if r.get("behind") else ""
    own = r.get("server_over_10ms")
    late = ("" if own is None else f"  server's own > 10 ms {own:.2%}") + late
    return (
        f"    {path:<5} {what:<18} {offered}{r['throughput']:8,.0f} req/s  p50 "
        f"{r['p50_ms'] or float('nan'):7.2f} ms  p99 {r['p99_ms'] or float('nan'):7.2f} ms  "
        f"errors {r['errors']}  cpu {r['tool']} {r['tool_cpu_s']:.2f} s server "
        f"{float('nan') if cpu is None else cpu:.2f} s{late}"
    )


def native_load(model_dir: str, label: str, examples: list[dict], args) -> dict:
    """Per worker count a server (`serve --workers N --grpc-port P`, dynamic batching),
    all up at once; per path the peak (closed loop), then the open loop at fractions of
    each server's own peak. The servers' cells go rep by rep, the servers' order
    alternating: this VM's speed drifts within minutes, and a ratio of two servers
    measured minutes apart would carry the drift."""
    lt.need("wrk", "h2load")
    out: dict = {"example": examples[0], "workers": {}}
    with contextlib.ExitStack() as stack:  # each server stopped (SIGTERM) on the way out
        runs: dict[int, _NativeServer] = {}
        for w in args.workers:
            grpc_port = lt.free_port()
            flags = ["--workers", str(w), "--grpc-port", str(grpc_port), "--name", V2_NAME,
                     *MODES["dynamic"](args)]  # fmt: skip
            server = stack.enter_context(
                ServerProcess(model_dir, flags, timeout=args.startup_timeout, workers=w)
            )
            print(
                f"[{label}] {w} worker(s): {server.url}, gRPC port {grpc_port}, pids "
                f"{sorted(server.pids)} ({' '.join(server.cmd[3:])})",
                flush=True,
            )
            runs[w] = _NativeServer(server, grpc_port, examples[0], args)

        def in_turn(step) -> None:
            for rep in range(args.load_reps):
                for w in list(runs) if rep % 2 == 0 else list(runs)[::-1]:
                    step(runs[w])

        in_turn(_NativeServer.closed_rep)
        in_turn(_NativeServer.open_rep)
        for w, run in runs.items():
            out["workers"][str(w)] = run.finish()
    return out


class _NativeServer:
    """One server's cells: its targets and warm-up (made with it), a repetition of its
    closed-loop cells, then of its open-loop cells (at fractions of its own peak, from
    the medians of all its closed-loop repetitions), and its result."""

    def __init__(self, server: ServerProcess, grpc_port: int, example: dict, args):
        self.server, self.args = server, args
        self.targets, self.scores = _targets(server, grpc_port, example, args.paths)
        print(f"    one request a path, score: {self.scores}", flush=True)
        self.cpu = lt.TreeCpu(server.proc.pid)
        self.estimate = {}
        for path in args.paths:  # warm-up; for gRPC, how many requests fill --seconds
            r = _native_cell(self.targets[path], self.cpu, args,
                             connections=max(args.peak_connections),
                             seconds=args.warmup_seconds)  # fmt: skip
            self.estimate[path] = max(r["throughput"], 100.0)
        self.closed = {p: {c: [] for c in args.peak_connections} for p in args.paths}
        self.opened = {p: {f: [] for f in args.open_loop_fractions} for p in args.paths}
        self.result: dict | None = None

    def closed_rep(self) -> None:
        for path in self.args.paths:
            for c in self.args.peak_connections:
                r = _native_cell(self.targets[path], self.cpu, self.args, connections=c,
                                 estimate=self.estimate[path])  # fmt: skip
                self.estimate[path] = max(r["throughput"], 100.0)
                self.closed[path][c].append(r)
                print(_cell_line(path, f"{self.server.workers}w closed C={c}", r), flush=True)

    def _peaks(self) -> dict:
        if self.result is None:
            self.result = {"pids": sorted(self.server.pids), "scores": self.scores, "paths": {}}
            for path in self.args.paths:
                cells = {str(c): _median(reps) for c, reps in self.closed[path].items()}
                peak_c = max(cells, key=lambda c: cells[c]["throughput"])
                self.result["paths"][path] = {
                    "closed": cells,
                    "peak": {"throughput": cells[peak_c]["throughput"], "connections": int(peak_c)},
                    "open": {},
                }
        return self.result

    def open_rep(self) -> None:
        result = self._peaks()
        for path in self.args.paths:
            peak = result["paths"][path]["peak"]["throughput"]
            for f in self.args.open_loop_fractions:
                r = _native_cell(self.targets[path], self.cpu, self.args, rate=f * peak)
                self.opened[path][f].append(r)
                print(_cell_line(path, f"{self.server.workers}w open {f:.0%}", r), flush=True)

    def finish(self) -> dict:
        result = self._peaks()
        for path in self.args.paths:
            result["paths"][path]["open"] = {
                f"{f:g}": _median(reps) for f, reps in self.opened[path].items()
            }
            if self.args.slo_steps:
                result["paths"][path]["slo"] = _slo_rate(
                    path, self.targets[path], self.cpu, self.args, result["paths"][path]
                )
        return result


def _meets_slo(r: dict) -> bool:
    p99 = r["p99_ms"]
    return p99 is not None and p99 < P99_LINE_MS and not r["errors"] and not r["behind"]


def _slo_rate(path: str, target: dict, cpu: lt.TreeCpu, args, cells: dict) -> dict:
    """The highest open-loop rate whose median p99 is under the 10 ms line, to within
    peak / 2**--slo-steps: bisection between the open-loop fractions measured already
    (the highest that met it, the lowest that did not), --load-reps runs a step."""
    peak = cells["peak"]["throughput"]
    met = [float(f) for f, r in cells["open"].items() if _meets_slo(r)]
    missed = [float(f) for f, r in cells["open"].items() if not _meets_slo(r)]
    lo = max(met, default=0.0)
    hi = min([f for f in missed if f > lo], default=1.0)
    steps = []
    for _ in range(args.slo_steps):
        f = (lo + hi) / 2
        r = _median([_native_cell(target, cpu, args, rate=f * peak) for _ in range(args.load_reps)])
        steps.append({"fraction": f, **r})
        print(_cell_line(path, f"slo {f:.0%}", r), flush=True)
        lo, hi = (f, hi) if _meets_slo(r) else (lo, f)
    return {"rate": lo * peak, "fraction": lo, "below": hi * peak, "steps": steps}


def _native_checks(results: dict, args) -> list[dict]:
    checks = []
    for label, entry in results["models"].items():
        native = entry.get("native")
        if not native:
            continue
        for w, server in native["workers"].items():
            scores = list(server["scores"].values())
            checks.append(
                {
                    "label": label,
                    "ok": max(scores) - min(scores) <= 1e-5,
                    "what": f"{w} worker(s): one request on each path gets the same score "
                    f"({', '.join(f'{p} {v:.6f}' for p, v in server['scores'].items())})",
                }
            )
            for path, cells in server["paths"].items():
                at = cells["open"].get(f"{AT_FRACTION:g}")
                if at is None:
                    continue
                peak = cells["peak"]
                ok = _meets_slo(at)
                checks.append(
                    {
                        "label": label,
                        "ok": ok,
                        "what": f"{w} worker(s), {path}: single-example p99 "
                        f"{at['p99_ms'] or float('nan'):.2f} ms at {AT_FRACTION:.0%} of peak "
                        f"(offered {at['offered']:,.0f}, achieved {at['throughput']:,.0f} "
                        f"req/s; peak {peak['throughput']:,.0f} at C={peak['connections']}; "
                        f"{at['errors']} errors{_own_share(at)}) (< {P99_LINE_MS:g} ms)",
                    }
                )
        by_w = native["workers"]
        if "1" in by_w and "2" in by_w:
            for path in by_w["1"]["paths"]:
                one = by_w["1"]["paths"][path]["peak"]["throughput"]
                two = by_w["2"]["paths"].get(path, {}).get("peak", {}).get("throughput")
                if two is None:
                    continue
                checks.append(
                    {
                        "label": label,
                        "ok": two >= 1.5 * one,
                        "what": f"{path}: 2 workers / 1 worker peak throughput "
                        f"{two:,.0f} / {one:,.0f} = {two / max(one, 1e-9):.2f}x (>= 1.5)",
                    }
                )
        cores = os.cpu_count() or 1
        share = [
            (r["tool_cores"] / cores, w, path, r)
            for w, server in native["workers"].items()
            for path, cells in server["paths"].items()
            for r in [*cells["closed"].values(), *cells["open"].values()]
            if r["tool_cores"] is not None
        ]
        if share:
            worst, w, path, r = max(share, key=lambda x: x[0])
            server = r["server_cpu_s"]
            vs = f", {r['tool_cpu_s'] / server:.0%} of the server's" if server else ""
            checks.append(
                {
                    "label": label,
                    "ok": worst <= args.max_tool_cpu,
                    "what": f"load tool CPU at most {worst:.1%} of the machine's {cores} cores "
                    f"in any cell ({w} worker(s) {path}, {r['tool']}: {r['tool_cores']:.2f} "
                    f"cores{vs}) (<= {args.max_tool_cpu:.0%})",
                }
            )
    return checks


def _own_share(r: dict) -> str:
    own = r.get("server_over_10ms")
    return "" if own is None else f"; the server's own time over 10 ms for {own:.2%}"


def _native_table(results: dict) -> None:
    cores = os.cpu_count() or 1
    head = (
        f"{'model':<8} {'w':>2} {'path':<4} {'load':<11} {'tool':<6} {'offered':>8} "
        f"{'req/s':>8} {'vs 1w':>6} {'p50 ms':>7} {'p99 ms':>7} {'p99 range':>13} "
        f"{'/10ms':>6} {'err':>4} {'tool s':>6} {'tool %':>6} {'server s':>8} {'>10ms':>6}"
    )
    print()
    print(head)
    print("-" * len(head))
    for label, entry in results["models"].items():
        native = entry.get("native")
        if not native:
            continue
        for w, server in native["workers"].items():
            for path, cells in server["paths"].items():
                base = native["workers"].get("1", {}).get("paths", {}).get(path)
                rows = [(f"closed C={c}", r, base and base["closed"].get(c))
                        for c, r in cells["closed"].items()]  # fmt: skip
                rows += [(f"open {float(f):.0%}", r, None) for f, r in cells["open"].items()]
                for what, r, b in rows:
                    vs = f"{r['throughput'] / b['throughput']:5.2f}x" if b else f"{'':>6}"
                    offered = f"{r['offered']:8,.0f}" if "offered" in r else f"{'':>8}"
                    p99 = r["p99_ms"] or float("nan")
                    spread = (
                        f"{r['p99_ms_min']:.1f}-{r['p99_ms_max']:.1f}" if r["p99_ms_min"] else "-"
                    )
                    cpu = float("nan") if r["server_cpu_s"] is None else r["server_cpu_s"]
                    own = r.get("server_over_10ms")
                    own = f"{own:6.2%}" if own is not None else f"{'-':>6}"
                    print(
                        f"{label:<8} {w:>2} {path:<5} {what:<11} {r['tool']:<6} {offered} "
                        f"{r['throughput']:8,.0f}{'*' if r.get('behind') else ' '}{vs} "
                        f"{r['p50_ms'] or float('nan'):7.2f} {p99:7.2f} {spread:>13} "
                        f"{p99 / P99_LINE_MS:6.2f} {r['errors']:4d} {r['tool_cpu_s']:6.2f} "
                        f"{r['tool_cores'] / cores:6.1%} {cpu:8.2f} {own}"
                    )
    for label, entry in results["models"].items():
        for w, server in (entry.get("native") or {"workers": {}})["workers"].items():
            for path, cells in server["paths"].items():
                slo = cells.get("slo")
                if slo:
                    print(
                        f"{label:<8} {w:>2} {path:<5} p99 < {P99_LINE_MS:g} ms up to "
                        f"{slo['rate']:,.0f} req/s ({slo['fraction']:.0%} of the closed-loop "
                        f"peak; not at {slo['below']:,.0f})"
                    )
    print(
        "\nmedians over the repetitions; p99 range: their lowest and highest; /10ms: p99 "
        "against the 10 ms line; * an open loop that fell behind its rate (its latency is "
        "from the send, so a lower bound); tool s and server s: CPU seconds of the load "
        "tool and of the server's processes over the cell; tool %: the tool's share of the "
        f"machine's {cores} cores; >10ms: the share of requests whose time in the server "
        "(its own latency histogram: from the request's framing, or its handler's start, "
        "to its answer; one worker only) was over 10 ms"
    )
    print()


# -- the run ------------------------------------------------------------------------------


def _labelled(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        label, sep, value = item.partition("=")
        if not sep:
            label, value = os.path.basename(os.path.normpath(item)), item
        out.append((label, value))
    return out


def _examples(path: str) -> list[dict]:
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # JSON lines: one example per line
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    examples = data["examples"] if isinstance(data, dict) and "examples" in data else data
    if not isinstance(examples, list) or not examples:
        raise SystemExit(f"{path}: expected {{'examples': [...]}} with at least one example")
    return examples


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=[], metavar="[LABEL=]DIR")
    p.add_argument("--url", nargs="+", default=[], metavar="LABEL=URL")
    p.add_argument("--examples", help="a JSON body {'examples': [...]} or JSON lines")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--requests", type=int, default=20000, help="per cell, at most")
    p.add_argument("--seconds", type=float, default=5.0, help="per cell, at most")
    p.add_argument("--warmup-seconds", type=float, default=1.0)
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="dynamic mode's")
    p.add_argument("--max-batch", type=int, default=None, help="dynamic mode's (model's)")
    p.add_argument("--predictor-batches", nargs="+", type=int, default=[1, 32, 256])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-seconds", type=float, default=0.2)
    p.add_argument("--no-predictor", action="store_true")
    p.add_argument(
        "--malformed",
        type=float,
        default=0.0,
        help="this fraction of the requests is malformed (e.g. 0.05); a check: every good "
        "request gets 200 and every malformed one 400",
    )
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out", help="write the results here (JSON)")
    p.add_argument("--strict", action="store_true", help="exit 1 if a check fails")
    n = p.add_argument_group("native load tools (--loadgen native; see the docstring's (c))")
    n.add_argument(
        "--loadgen",
        choices=["python", "native"],
        default="python",
        help="python: (a) and (b), this process's asyncio client; native: (c), wrk and "
        "h2load against 1 and 2 workers, every path, closed and open loop",
    )
    n.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    n.add_argument("--workers", nargs="+", type=int, default=[1, 2], help="serve --workers")
    n.add_argument(
        "--peak-connections",
        nargs="+",
        type=int,
        default=[64],
        help="closed-loop connections; the peak is the highest throughput among them",
    )
    n.add_argument(
        "--open-loop-fractions",
        nargs="+",
        type=float,
        default=[0.5, 0.8, 0.95],
        help="open-loop arrival rates, as fractions of the path's peak",
    )
    n.add_argument("--load-reps", type=int, default=1, help="repetitions of each cell (median)")
    n.add_argument(
        "--slo-steps",
        type=int,
        default=0,
        help="then per path bisect this many times for the highest open-loop rate with "
        "p99 under 10 ms (0: not run)",
    )
    n.add_argument(
        "--client-rps",
        type=float,
        default=50.0,
        help="open loop: the offered rate / this = its connections (REST, wrk) or h2load "
        "clients (gRPC)",
    )
    n.add_argument(
        "--max-tool-cpu",
        type=float,
        default=0.15,
        help="a check: the load tool's CPU at most this share of the machine's cores",
    )
    args = p.parse_args(argv)
    if not args.model and not args.url:
        p.error("give --model DIR ... or --url LABEL=URL ...")
    if args.url and not args.examples:
        p.error("--url needs --examples")
    if args.loadgen == "native" and (args.url or args.malformed):
        p.error("--loadgen native starts its own servers (--model) and sends good requests")
    return args


def _cell(url, bodies, expect, args, c, server_pid) -> dict:
    before = batch_counters(url)
    cpu0 = (lt.cpu_seconds([server_pid]) if server_pid else 0.0, time.process_time())
    r = run_load(
        url,
        bodies,
        concurrency=c,
        requests=args.requests,
        seconds=args.seconds,
        warmup_seconds=args.warmup_seconds,
        expect=expect,
    )
    cpu1 = (lt.cpu_seconds([server_pid]) if server_pid else 0.0, time.process_time())
    after = batch_counters(url)
    calls = after[1] - before[1]
    # The counters include the warm-up phase: the mean is over the whole cell.
    r["mean_batch"] = (after[0] - before[0]) / calls if calls else None
    r["server_cpu_s"] = None if server_pid is None else round(cpu1[0] - cpu0[0], 3)
    r["client_cpu_s"] = round(cpu1[1] - cpu0[1], 3)
    print(
        f"    C={c:<4d} {r['throughput']:9.0f} req/s  p50 {r['p50_ms']:7.2f} ms  "
        f"p99 {r['p99_ms']:7.2f} ms  batch {r['mean_batch'] or 0:6.1f}  "
        f"errors {r['errors']} (unexpected {r['unexpected']})  cpu server "
        f"{r['server_cpu_s'] or float('nan'):.1f} s "
        f"client {r['client_cpu_s']:.1f} s",
        flush=True,
    )
    if r.get("first_unexpected"):
        print(f"      first unexpected answer: {r['first_unexpected']}", flush=True)
    return r


def _bodies(examples: list[dict], malformed: float = 0.0) -> tuple[list[bytes], list[int]]:
    """Single-example bodies and the status each should get. With `malformed` > 0,
    that fraction of them (spread evenly) is broken in turn: truncated JSON, an unknown
    feature, a feature value of the wrong type (an object) - each should get 400."""
    good = [json.dumps({"examples": [ex]}).encode() for ex in examples]
    if not malformed:
        return good, [200] * len(good)
    n = len(good) * max(1, round(1 / malformed))
    bodies, expect, kind = [], [], 0
    for j in range(n):
        ex = examples[j % len(examples)]
        if int((j + 1) * malformed) > int(j * malformed):
            kind += 1
            if kind % 3 == 1:
                body = good[j % len(good)][:-1]
            elif kind % 3 == 2:
                body = json.dumps({"examples": [{**ex, "no_such_feature": 1}]}).encode()
            else:
                name = next(iter(ex))
                body = json.dumps({"examples": [{**ex, name: {"an": "object"}}]}).encode()
            bodies.append(body)
            expect.append(400)
        else:
            bodies.append(good[j % len(good)])
            expect.append(200)
    return bodies, expect


def _steadiness(s: dict) -> str:
    return (
        f"a fixed CPU loop took {s['min_ms']:.0f}-{s['max_ms']:.0f} ms (median "
        f"{s['median_ms']:.0f}; max/min {s['max_ms'] / s['min_ms']:.2f})"
    )


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    results: dict = {
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "load_average_start": load_average(),
            "mem_available_gib": round(mem_available() / 2**30, 1),
            "steadiness_start": cpu_steadiness(),
        },
        "args": {k: v for k, v in vars(args).items()},
        "models": {},
    }
    print(
        f"{results['machine']['cpu']}, {os.cpu_count()} cores, load average {load_average()}; "
        f"{_steadiness(results['machine']['steadiness_start'])}",
        flush=True,
    )
    extra = _examples(args.examples) if args.examples else None
    if args.loadgen == "native":
        _estimate(args)
    for label, model_dir in _labelled(args.model) if args.loadgen == "native" else []:
        examples = extra or _examples(os.path.join(model_dir, "example_request.json"))
        results["models"][label] = {
            "dir": model_dir,
            "server": {},
            "native": native_load(model_dir, label, examples, args),
        }
    for label, url in _labelled(args.url):
        print(f"[{label}] {url}", flush=True)
        bodies, expect = _bodies(extra, args.malformed)
        cells = {str(c): _cell(url, bodies, expect, args, c, None) for c in args.concurrency}
        results["models"][label] = {"url": url, "server": {"given": cells}}
    for label, model_dir in _labelled(args.model) if args.loadgen == "python" else []:
        entry: dict = {"dir": model_dir, "server": {}}
        results["models"][label] = entry
        examples = extra
        if examples is None:
            examples = _examples(os.path.join(model_dir, "example_request.json"))
        entry["examples"] = len(examples)
        if not args.no_predictor:
            from sparsejax.serving import Predictor

            predictor = Predictor.load(model_dir)
            entry["info"] = {k: predictor.info.get(k) for k in ("version", "quantize", "buckets")}
            entry["predictor"] = predictor_throughput(
                predictor,
                examples,
                args.predictor_batches,
                reps=args.reps,
                min_seconds=args.min_seconds,
            )
            del predictor
            line = ", ".join(
                f"batch {b}: {v['predictions_per_s']:,.0f}/s" for b, v in entry["predictor"].items()
            )
            print(f"[{label}] predictor: {line}", flush=True)
        bodies, expect = _bodies(examples, args.malformed)
        for mode in args.modes:
            with ServerProcess(
                model_dir, MODES[mode](args), timeout=args.startup_timeout
            ) as server:
                print(f"[{label}] {mode}: {server.url} ({' '.join(server.cmd[3:])})", flush=True)
                entry["server"][mode] = {
                    str(c): _cell(server.url, bodies, expect, args, c, server.proc.pid)
                    for c in args.concurrency
                }
    results["machine"]["load_average_end"] = load_average()
    results["machine"]["steadiness_end"] = cpu_steadiness()
    results["checks"] = checks = _checks(results, args) + _native_checks(results, args)
    if args.loadgen == "native":
        _native_table(results)
        print(
            f"load average: {results['machine']['load_average_start']} at the start, "
            f"{results['machine']['load_average_end']} at the end; "
            f"{time.monotonic() - started:.0f} s in all\n"
            f"at the end, {_steadiness(results['machine']['steadiness_end'])}\n"
        )
    else:
        _table(results, args)
    for c in checks:
        print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['label']}: {c['what']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.out}")
    return 1 if args.strict and not all(c["ok"] for c in checks) else 0


def _estimate(args) -> None:
    """Print how long the native run's load takes (server start-ups not included)."""
    per_cell = args.seconds + 0.3  # the tool's start and its log
    cells = len(args.paths) * args.load_reps * len(args.peak_connections) * per_cell
    open_cells = len(args.open_loop_fractions) + args.slo_steps
    cells += len(args.paths) * args.load_reps * open_cells * (per_cell + OPEN_SKIP_S)
    cells += len(args.paths) * (args.warmup_seconds + 0.3)
    total = cells * len(args.workers) * max(len(args.model), 1)
    print(
        f"native load: about {total:.0f} s of load ({len(args.workers)} server start-ups besides)",
        flush=True,
    )


def _checks(results: dict, args) -> list[dict]:
    checks = []
    for label, entry in results["models"].items():
        if args.malformed:
            cells = [r for cells in entry["server"].values() for r in cells.values()]
            bad = sum(r["unexpected"] for r in cells)
            checks.append(
                {
                    "label": label,
                    "ok": bad == 0,
                    "what": f"{args.malformed:.0%} malformed requests: {bad} of "
                    f"{sum(r['requests'] for r in cells)} answers not the expected status "
                    "(200 for a good request, 400 for a malformed one)",
                }
            )
        pred = entry.get("predictor", {}).get("256")
        if pred:
            v = pred["predictions_per_s"]
            checks.append(
                {
                    "label": label,
                    "ok": v >= 20000,
                    "what": f"predictor at batch 256: {v:,.0f} predictions/s (>= 20,000)",
                }
            )
        server = entry["server"]
        if "dynamic" in server and server["dynamic"]:
            # The best concurrency: dynamic batching's highest throughput with p99 < 20 ms
            # (a higher concurrency may give more requests/s at a longer p99: shown too).
            cells = server["dynamic"].items()
            top_c, top = max(cells, key=lambda kv: kv[1]["throughput"])
            within = [(c, r) for c, r in cells if r["p99_ms"] is not None and r["p99_ms"] < 20]
            best_c, best = (
                max(within, key=lambda kv: kv[1]["throughput"])
                if within
                else (min(cells, key=lambda kv: kv[1]["p99_ms"] or float("inf")))
            )
            checks.append(
                {
                    "label": label,
                    "ok": bool(within),
                    "what": f"dynamic batching's best concurrency with p99 < 20 ms: {best_c} "
                    f"({best['throughput']:,.0f} req/s, p99 {best['p99_ms']:.2f} ms); its "
                    f"highest throughput: {top['throughput']:,.0f} req/s at {top_c} (p99 "
                    f"{top['p99_ms']:.2f} ms)",
                }
            )
            base = server.get("batch1", {}).get(best_c)
            if base:
                ratio = best["throughput"] / max(base["throughput"], 1e-9)
                checks.append(
                    {
                        "label": label,
                        "ok": ratio >= 5.0,
                        "what": f"dynamic / batch-1 throughput at concurrency {best_c}: "
                        f"{ratio:.2f}x (>= 5)",
                    }
                )
    return checks


def _table(results: dict, args) -> None:
    modes = [
        m
        for m in ("batch1", "dynamic", "given")
        if any(m in e["server"] for e in results["models"].values())
    ]
    head = f"{'model':<10} {'C':>4} "
    for m in modes:
        head += f"| {m + ' req/s':>14} {'p50 ms':>7} {'p99 ms':>7} {'batch':>6} "
    if "batch1" in modes and "dynamic" in modes:
        head += "| dynamic/batch1"
    print()
    print(head)
    print("-" * len(head))
    for label, entry in results["models"].items():
        for c in args.concurrency:
            row = f"{label:<10} {c:>4} "
            for m in modes:
                r = entry["server"].get(m, {}).get(str(c))
                if r is None:
                    row += f"| {'-':>14} {'-':>7} {'-':>7} {'-':>6} "
                    continue
                row += (
                    f"| {r['throughput']:14,.0f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} "
                    f"{r['mean_batch'] or 0:6.1f} "
                )
            b = entry["server"].get("batch1", {}).get(str(c))
            d = entry["server"].get("dynamic", {}).get(str(c))
            if b and d:
                row += f"| {d['throughput'] / max(b['throughput'], 1e-9):13.2f}x"
            print(row)
    print()


if __name__ == "__main__":
    sys.exit(main())
