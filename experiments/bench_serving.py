#!/usr/bin/env python3
"""Serving (issue 12): throughput and latency through the HTTP server, with and without
dynamic batching, per model dir (e.g. fp32 vs int8 tables), and the Python predictor's
own throughput.

For each model dir (--model [LABEL=]DIR, e.g. fp32=models/fp32 int8=models/int8):

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from _machine import cpu_name, load_average, mem_available  # noqa: E402

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


def batch_counters(url: str) -> tuple[float, float]:
    """(examples, model calls) so far, from the server's /metrics."""
    status, text = http_get(url, "/metrics")
    got = {}
    for line in text.splitlines():
        if line.startswith("sparsejax_batch_size_examples_"):
            name, value = line.rsplit(" ", 1)
            got[name] = float(value)
    return got.get("sparsejax_batch_size_examples_sum", 0.0), got.get(
        "sparsejax_batch_size_examples_count", 0.0
    )


def _cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` (None: this process)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# -- the server ---------------------------------------------------------------------------


class ServerProcess:
    """`python -m sparsejax serve MODEL_DIR --port 0 ...` in a subprocess; `url` once it
    listens and answers /healthz. Stopped with SIGTERM (then killed) on exit."""

    def __init__(self, model_dir: str, args: list[str], *, timeout: float = 300.0):
        cmd = [sys.executable, "-m", "sparsejax", "serve", model_dir, "--port", "0"]
        cmd += ["--poll-seconds", "0", *args]
        self.cmd = cmd
        self.timeout = timeout
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
                m = re.search(r"listening on (http://\S+)", line)
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
        deadline = time.monotonic() + 30
        while http_get(self.url, "/healthz")[0] != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.url}/healthz never answered 200")
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
    args = p.parse_args(argv)
    if not args.model and not args.url:
        p.error("give --model DIR ... or --url LABEL=URL ...")
    if args.url and not args.examples:
        p.error("--url needs --examples")
    return args


def _cell(url, bodies, expect, args, c, server_pid) -> dict:
    before = batch_counters(url)
    cpu0 = (_cpu_seconds(server_pid) if server_pid else 0.0, _cpu_seconds(None))
    r = run_load(
        url,
        bodies,
        concurrency=c,
        requests=args.requests,
        seconds=args.seconds,
        warmup_seconds=args.warmup_seconds,
        expect=expect,
    )
    cpu1 = (_cpu_seconds(server_pid) if server_pid else 0.0, _cpu_seconds(None))
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict = {
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "load_average_start": load_average(),
            "mem_available_gib": round(mem_available() / 2**30, 1),
        },
        "args": {k: v for k, v in vars(args).items()},
        "models": {},
    }
    print(
        f"{results['machine']['cpu']}, {os.cpu_count()} cores, load average {load_average()}",
        flush=True,
    )
    extra = _examples(args.examples) if args.examples else None
    for label, url in _labelled(args.url):
        print(f"[{label}] {url}", flush=True)
        bodies, expect = _bodies(extra, args.malformed)
        cells = {str(c): _cell(url, bodies, expect, args, c, None) for c in args.concurrency}
        results["models"][label] = {"url": url, "server": {"given": cells}}
    for label, model_dir in _labelled(args.model):
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
    results["checks"] = checks = _checks(results, args)
    _table(results, args)
    for c in checks:
        print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['label']}: {c['what']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.out}")
    return 1 if args.strict and not all(c["ok"] for c in checks) else 0


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
