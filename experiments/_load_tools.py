"""Native load tools for the serving benchmark (`bench_serving.py --loadgen native`):
the request bodies of the three paths, `wrk` (closed loop, and an open loop of Poisson
arrivals through a Lua `delay()`, over HTTP/1.1) and `h2load` (nghttp2: closed loop
over h2c for gRPC, and an open loop at a fixed arrival rate for HTTP/1.1 and gRPC), and
the CPU seconds of a process and its descendants.

Both tools are native, so the load generator takes little of the cores the server runs
on; each run's CPU seconds are measured (`resource.getrusage(RUSAGE_CHILDREN)` around
the tool, the only child reaped meanwhile).

h2load's open loop: `--rps R` per client, clients * R the offered rate. h2load's rate
timer fires at most every 10 ms, so each client is kept at <= `client_rps` (default 50)
requests/s: one request per tick. One h2load's clients send in step (measured: 200
clients of one h2load at 10/s each waited 18.7 ms at the least, the burst's length), so
the clients are split over h2load processes of `CLIENTS_A_TOOL` clients each, started
evenly over a client's interval 1 / R: at most that many requests arrive together.
Over HTTP/1.1 a client has one request in flight at a time: a request that takes longer
than 1 / R delays that client's next one (latency is from the send; the achieved rate
then falls below the offered one, which the caller flags). Over h2c a client has up
to `max_streams` requests in flight, so a slow answer delays nothing.

h2load counts HTTP statuses only: a gRPC error is an HTTP 200 whose status is in the
trailers. A good answer of the server is one DATA frame of known length (the 5-byte
gRPC prefix and the ModelInferResponse), an error none, so the gRPC runs have a fixed
request count (`-n`, never `-D`, whose byte counts include the warm-up) and the good
answers are h2load's DATA bytes / that length.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence

import numpy as np

GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"
CLIENTS_A_TOOL = 4  # open loop: the clients of one h2load, which send in step
GRPC_HEADERS = ("content-type: application/grpc", "te: trailers")
JSON_HEADERS = ("content-type: application/json",)
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None  # h2load's logs: tmpfs


def need(*tools: str) -> None:
    """Exit with the package to install when a tool is missing."""
    packages = {"wrk": "wrk", "h2load": "nghttp2-client"}
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise SystemExit(
            f"needs {', '.join(missing)}: apt-get install " + " ".join(packages[t] for t in missing)
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for `serve --grpc-port`, which each worker
    binds itself, so 0 would give each worker its own port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- CPU of a process tree ----------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (e.g. a `serve --workers N` supervisor and its workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(k) for k in f.read().split()]
        except OSError:
            pass
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of the processes `pids` together (nan if one is gone)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class TreeCpu:
    """CPU seconds a process tree spends between `start()` and `stop()` (None if its
    processes changed meanwhile: a worker died and was restarted)."""

    def __init__(self, pid: int):
        self.pid = pid

    def start(self) -> None:
        self.pids = process_tree(self.pid)
        self.t0 = cpu_seconds(self.pids)

    def stop(self) -> float | None:
        if sorted(process_tree(self.pid)) != sorted(self.pids):
            return None
        dt = cpu_seconds(self.pids) - self.t0
        return None if math.isnan(dt) else round(dt, 3)


# -- request bodies ---------------------------------------------------------------------


def v1_body(example: Mapping) -> bytes:
    """A single-example POST /v1/predict body."""
    return json.dumps({"examples": [example]}).encode()


def _tensors(example: Mapping, inputs: Sequence[Mapping]):
    """(name, datatype, shape, values) per model input the example has (a feature left
    out is missing, as in the JSON API); a list value is one example's several ids."""
    for t in inputs:
        v = example.get(t["name"])
        if v is None:
            continue
        values = list(v) if isinstance(v, list) else [v]
        shape = [1, len(values)] if isinstance(v, list) else [1]
        yield t["name"], t["datatype"], shape, values


def v2_body(example: Mapping, inputs: Sequence[Mapping]) -> bytes:
    """A single-example KServe v2 REST infer body (JSON tensor data, JSON answer);
    `inputs`: the model metadata's (GET /v2/models/NAME)."""
    tensors = [
        {"name": n, "datatype": d, "shape": s, "data": [str(x) for x in v] if d == "BYTES" else v}
        for n, d, s, v in _tensors(example, inputs)
    ]
    return json.dumps({"inputs": tensors}).encode()


def _raw(datatype: str, values: Sequence) -> bytes:
    """A tensor's values as the v2 binary tensor extension lays them out (little-endian;
    BYTES: each a 4-byte length, then the bytes)."""
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(b)) + b for b in (str(x).encode() for x in values))
    numpy_types = {"FP32": "<f4", "FP64": "<f8", "INT32": "<i4", "INT64": "<i8"}
    return np.asarray(values, numpy_types[datatype]).tobytes()


def v2_binary_body(example: Mapping, inputs: Sequence[Mapping]) -> tuple[bytes, int]:
    """A single-example KServe v2 REST infer body with binary tensors, as Triton's HTTP
    client sends them (a JSON answer asked for), and the length of its JSON part (the
    request's Inference-Header-Content-Length)."""
    tensors, raws = [], []
    for n, d, s, v in _tensors(example, inputs):
        raws.append(_raw(d, v))
        tensors.append({"name": n, "datatype": d, "shape": s,
                        "parameters": {"binary_data_size": len(raws[-1])}})  # fmt: skip
    header = json.dumps({"inputs": tensors, "outputs": [{"name": "scores"}]}).encode()
    return header + b"".join(raws), len(header)


def grpc_request(example: Mapping, inputs: Sequence[Mapping], model: str) -> bytes:
    """A single-example ModelInferRequest, serialized, with its tensors as
    `raw_input_contents` (as Triton's client sends them)."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model)
    for name, datatype, shape, values in _tensors(example, inputs):
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(_raw(datatype, values))
    return request.SerializeToString()


def grpc_frame(message: bytes) -> bytes:
    """One gRPC length-prefixed message: uncompressed flag, 4-byte big-endian length."""
    return b"\0" + struct.pack(">I", len(message)) + message


def grpc_call(address: str, message: bytes, timeout: float = 30.0) -> bytes:
    """One raw ModelInfer call (serialized request in, serialized response out)."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        return channel.unary_unary(GRPC_METHOD)(message, timeout=timeout)


def grpc_scores(response: bytes) -> list[float]:
    from tritonclient.grpc import service_pb2

    r = service_pb2.ModelInferResponse.FromString(response)
    return np.frombuffer(r.raw_output_contents[0], "<f4").tolist()


# -- running a tool -----------------------------------------------------------------------


def _run(cmd: list[str], timeout: float) -> tuple[str, float, float]:
    """(stdout + stderr, the tool's CPU seconds, wall seconds) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        out += f"\n(killed after {timeout:.0f} s)"
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-2000:]}")
    return out, round(cpu, 3), wall


def _run_staggered(
    cmds: list[list[str]], gap_s: float, timeout: float
) -> tuple[list, float, float]:
    """Run `cmds` side by side, each started `gap_s` after the one before: (their
    outputs, the tools' CPU seconds together, wall seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    procs = []
    for i, cmd in enumerate(cmds):
        if i:
            time.sleep(gap_s)
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = []
    for cmd, proc in zip(cmds, procs, strict=True):
        try:
            out, _ = proc.communicate(timeout=max(timeout - (time.perf_counter() - t0), 1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += f"\n(killed after {timeout:.0f} s)"
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-2000:]}")
        outs.append(out)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return outs, round(cpu, 3), wall


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def _post_lua(body: bytes, headers: Mapping[str, str] | None = None) -> str:
    """A wrk script's lines that make each request a POST of `body` (JSON, or bytes with
    `headers` that say what they are), as a Lua string of decimal escapes."""
    lines = ['wrk.method = "POST"', 'wrk.headers["Content-Type"] = "application/json"']
    lines += [f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in (headers or {}).items()]
    lines.append('wrk.body = "' + "".join(f"\\{b}" for b in body) + '"')
    return "\n".join(lines) + "\n"


def _run_wrk(url: str, lua: str, *, connections: int, seconds: float, threads: int = 1) -> dict:
    """wrk with the script `lua` for `seconds` (whole seconds: wrk takes no less): its
    counts and latency (`_wrk_result`), its CPU and wall seconds."""
    seconds = max(1, math.ceil(seconds))
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(lua)
    try:
        out, cpu, wall = _run(
            ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--latency",
             "-s", script.name, url],
            timeout=seconds + 60,
        )  # fmt: skip
    finally:
        os.unlink(script.name)
    return {**_wrk_result(out), "seconds": seconds, "tool_cpu_s": cpu, "wall_s": round(wall, 3)}


def wrk(url: str, body: bytes, *, connections: int, seconds: float, threads: int = 1,
        headers: Mapping[str, str] | None = None) -> dict:  # fmt: skip
    """Closed loop: `connections` HTTP/1.1 keep-alive connections, each POSTing `body`
    (JSON; or as `headers` say) to `url` back to back for `seconds` (whole seconds: wrk
    takes no less). wrk's own throughput and latency."""
    return _run_wrk(url, _post_lua(body, headers), connections=connections, seconds=seconds,
                    threads=threads)  # fmt: skip


# wrk's open loop: `delay()` runs before each request a connection sends and returns how
# long it waits (whole ms); each call takes the next arrival of one Poisson schedule, so
# the free connections send at the offered rate between them.
_OPEN_LUA = """\
local ffi = require("ffi")
ffi.cdef[[
typedef struct {{ long tv_sec; long tv_nsec; }} sj_timespec;
int clock_gettime(int clock, sj_timespec *tp);
]]
local ts = ffi.new("sj_timespec")
local function now()
  ffi.C.clock_gettime(1, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end
local gap, nxt = {gap!r}, nil
math.randomseed({seed})
function delay()
  local t = now()
  nxt = (nxt or t) - math.log(1 - math.random()) * gap
  local ms = (nxt - t) * 1000
  if ms < 0 then return 0 end
  return ms
end
"""


def wrk_open(
    url: str,
    body: bytes,
    *,
    rate: float,
    connections: int,
    seconds: float,
    seed: int = 0,
    headers: Mapping[str, str] | None = None,
) -> dict:
    """Open loop over HTTP/1.1: POSTs of `body` to `url` at Poisson arrivals of `rate`
    requests/s for `seconds` (whole seconds), sent by whichever of `connections`
    keep-alive connections is free (one request in flight a connection: when all wait
    for answers, the next arrivals go as soon as one is free, and the achieved rate
    falls below `rate`). One wrk thread; latency is from the send (wrk's), over the
    whole run. A schedule in whole milliseconds: an arrival due within 1 ms goes at
    once."""
    lua = _post_lua(body, headers) + _OPEN_LUA.format(gap=1.0 / rate, seed=seed)
    r = _run_wrk(url, lua, connections=connections, seconds=seconds)
    return {**r, "clients": connections, "offered": float(rate)}


def _wrk_result(out: str) -> dict:
    """wrk's request count, errors (non-2xx, socket errors), good answers a second and
    p50/p99 (ms)."""
    n = int(re.search(r"(\d+) requests in ([\d.]+)(\w+)", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(bad.group(1)) if bad else 0) + (sum(int(g) for g in sock.groups()) if sock else 0)
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    pct = {
        q: _ms(*re.search(rf"^\s+{q}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups())
        for q in (50, 99)
    }
    return {
        "tool": "wrk",
        "requests": n,
        "errors": errors,
        "throughput": rate * (n - errors) / n if n else 0.0,
        "p50_ms": pct[50],
        "p99_ms": pct[99],
    }


def _h2load_counts(out: str) -> dict:
    m = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
        r"(\d+) errored, (\d+) timeout",
        out,
    )
    if m is None:
        raise RuntimeError(f"h2load's output has no request counts:\n{out[-2000:]}")
    keys = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
    counts = dict(zip(keys, (int(g) for g in m.groups()), strict=True))
    data = re.search(r"traffic: .*?, [^,]*headers.*?, \S+ \((\d+)\) data", out)
    counts["data_bytes"] = int(data.group(1)) if data else None
    fin = re.search(r"finished in ([\d.]+)(us|ms|s),", out)
    counts["finished_s"] = _ms(*fin.groups()) / 1e3 if fin else None
    return counts


def h2load(
    url: str,
    body: bytes,
    *,
    grpc: bool,
    clients: int,
    requests: int,
    rate: float | None = None,
    client_rps: float = 50.0,
    max_streams: int = 64,
    skip_seconds: float = 0.0,
    seconds: float | None = None,
    grpc_answer_bytes: int | None = None,
    timeout: float = 120.0,
) -> dict:
    """`requests` POSTs of `body` to `url` through h2load: HTTP/1.1 JSON, or with `grpc`
    h2c gRPC (`body` one framed message). Without `rate` a closed loop: `clients`
    connections, one request in flight each. With `rate` an open loop at `rate`
    requests/s (see the module docstring): `clients` is then at least rate /
    `client_rps`. In the window [first start + skip_seconds, + seconds] (default: the
    whole run), p50/p99 are over the requests sent in it and the throughput is the good
    answers that arrive in it: an open loop the server cannot keep up with shows as a
    throughput below `rate`, over h2c too, where sending never waits.
    `grpc_answer_bytes`: the length of a good answer's DATA (the framed response), to
    count gRPC errors."""
    opts, groups, gap_s = ["-t1"], 1, 0.0
    if rate is not None:
        clients = max(clients, math.ceil(rate / client_rps))
        # an h2load's --rps clients send together: groups of CLIENTS_A_TOOL clients, one
        # h2load each, started evenly over a client's interval, spread the arrivals
        groups = max(1, math.ceil(clients / CLIENTS_A_TOOL))
        clients = groups * math.ceil(clients / groups)
        gap_s = clients / rate / groups
        opts += ["--rps", f"{rate / clients:.6f}"]
    requests = max(requests, clients)
    opts += ["-c", str(clients // groups), "-n", str(math.ceil(requests / groups))]
    if grpc:
        opts += ["-m", str(max_streams if rate is not None else 1)]
        opts += [x for h in GRPC_HEADERS for x in ("-H", h)]
    else:
        opts += ["--h1", *(x for h in JSON_HEADERS for x in ("-H", h))]
    with tempfile.TemporaryDirectory(dir=_SCRATCH) as tmp:
        data = os.path.join(tmp, "body")
        with open(data, "wb") as f:
            f.write(body)
        logs = [os.path.join(tmp, f"log{g}") for g in range(groups)]
        cmds = [["h2load", *opts, "-d", data, "--log-file", log, url] for log in logs]
        outs, cpu, wall = _run_staggered(cmds, gap_s, timeout)
        rows = []
        for log in logs:
            with open(log) as f:  # start (us since the epoch), status (-1: failed), us
                rows.append(np.array(f.read().split(), dtype=np.int64).reshape(-1, 3))
        rows = np.concatenate(rows)
    per_tool = [_h2load_counts(out) for out in outs]
    counts = {
        k: None if any(c[k] is None for c in per_tool) else sum(c[k] for c in per_tool)
        for k in per_tool[0]
        if k != "finished_s"
    }
    counts["finished_s"] = max((c["finished_s"] or 0.0) for c in per_tool)
    counts["tools"] = groups
    http_ok = rows[:, 1] == 200
    errors = int((~http_ok).sum()) + counts["total"] - len(rows)  # never answered too
    good_share, grpc_errors = 1.0, None
    if grpc and grpc_answer_bytes and counts["data_bytes"] is not None:
        good, rest = divmod(counts["data_bytes"], grpc_answer_bytes)
        if rest == 0:  # every answer is one whole frame or none; else the count is unsure
            grpc_errors = int(http_ok.sum()) - good
            errors += max(grpc_errors, 0)
            good_share = good / max(int(http_ok.sum()), 1)
    t0 = rows[:, 0].min() if len(rows) else 0
    start, end = (rows[:, 0] - t0) / 1e6, (rows[:, 0] + rows[:, 2] - t0) / 1e6
    if seconds is None:  # all of the run: first start to last answer
        sent = done = np.ones(len(rows), bool)
        measured = float(end.max()) if len(rows) else 0.0
    else:  # latency of the requests sent in the window, throughput of the answers in it
        sent = (start >= skip_seconds) & (start < skip_seconds + seconds)
        done = (end >= skip_seconds) & (end < skip_seconds + seconds)
        measured = seconds
    lat = rows[sent, 2] / 1e3
    result = {
        "tool": "h2load",
        "clients": clients,
        "requests": int(sent.sum()),
        "errors": errors,
        "throughput": float(int(http_ok[done].sum()) * good_share / max(measured, 1e-9)),
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
        "seconds": round(float(measured), 3),
        "run_s": counts["finished_s"],
        "tool_cpu_s": cpu,
        "wall_s": round(wall, 3),
        "h2load": counts,
    }
    if grpc:
        result["grpc_errors"] = grpc_errors
    if rate is not None:
        result["offered"] = float(rate)
        result["client_rps"] = round(rate / clients, 3)
    return result
