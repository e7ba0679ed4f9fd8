#!/usr/bin/env python3
"""Freshness (issue 27): how long after a training step the server answers with it,
and the request latency while deltas are applied.

A training run publishes (`sparsejax train ... "publish={dir: DIR, every_s: E}"`) while
`sparsejax serve DIR` follows it, and an open-loop client in this process sends single-
example POST /v1/predict requests at --rate a second (each timed from its scheduled
send, so queueing counts) over --connections keep-alive connections. For each version
the run publishes: when it was published (the delta's `created`, right after its
training step), when the first answer carrying it arrived, the difference (freshness),
and the delta's size (the table rows it carries, and their share of the table rows).
Latency p50/p99 of the requests sent within --window seconds after a version first
appears (the server applying and swapping it in) against all the others (steady).

Checks (the issue's Must reach): every version served within 10 s of its publish; p99
while deltas apply <= 2x the steady p99.

    python experiments/bench_freshness.py --steps 3000 --every-s 5 --rate 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np


def _wait_for(path: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.time()
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise SystemExit(f"training exited ({proc.returncode}) before {path} appeared")
        if time.time() - t0 > timeout:
            raise SystemExit(f"{path} did not appear in {timeout:.0f} s")
        time.sleep(0.2)


def _start_server(pub: str, poll_s: float, log) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "sparsejax", "serve", pub, "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--poll-seconds", str(poll_s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    for line in proc.stdout:
        log.write(line)
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            return proc, int(m.group(1))
    raise SystemExit("the server exited before it listened")


async def _client(port: int, body: bytes, rate: float, connections: int, until) -> list:
    """Open-loop requests at `rate`/s until `until()`: [(scheduled send, latency s,
    model_version)]."""
    req = (
        f"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    free: asyncio.Queue = asyncio.Queue()
    for _ in range(connections):
        free.put_nowait(await asyncio.open_connection("127.0.0.1", port))
    out, tasks = [], set()

    async def one(t_sched: float):
        reader, writer = await free.get()
        try:
            writer.write(req)
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            answer = json.loads(await reader.readexactly(n))
            out.append((t_sched, time.time() - t_sched, answer.get("model_version")))
        finally:
            free.put_nowait((reader, writer))

    t0, i = time.time(), 0
    while not until():
        t_sched = t0 + i / rate
        delay = t_sched - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(t_sched))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
    await asyncio.gather(*tasks)
    while not free.empty():
        _, writer = free.get_nowait()
        writer.close()
    return out


def _versions(pub: str) -> dict[int, dict]:
    """Per published version: created (s), kind, rows carried, table rows."""
    out = {}
    for name in os.listdir(pub):
        path = os.path.join(pub, name)
        if name.isdigit():
            m = json.load(open(os.path.join(path, "model.json")))
            rows = sum(t["rows"] for t in m["tables"].values())
            out[int(name)] = {
                "kind": "full",
                "created": os.path.getmtime(os.path.join(path, "model.json")),
                "table_rows": rows,
            }
        elif name.endswith(".delta"):
            m = json.load(open(os.path.join(path, "delta.json")))
            carried = sum(p["rows"]["shape"][0] for p in m["arguments"].values() if "rows" in p)
            whole = sum(1 for p in m["arguments"].values() if "whole" in p)
            out[m["version"]] = {"kind": "delta", "created": m["created"], "rows": carried,
                                 "whole_arguments": whole}  # fmt: skip
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--every-s", type=float, default=5.0, help="publish.every_s")
    p.add_argument("--poll-s", type=float, default=2.0, help="serve --poll-seconds")
    p.add_argument("--rate", type=float, default=200.0, help="requests a second")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--window", type=float, default=1.0)
    p.add_argument("--train-args", nargs="*", default=[], help="more `key=value` overrides")
    p.add_argument("--out", help="write the results here (JSON)")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="sparsejax_fresh_")
    pub = os.path.join(tmp, "pub")
    log = open(os.path.join(tmp, "log.txt"), "w")
    train = subprocess.Popen(
        [sys.executable, "-m", "sparsejax", "train", f"out_dir={tmp}/runs", f"steps={args.steps}",
         "progress=false", "log_every=1000000", "eval_every=null",
         f"publish={{dir: {pub}, every_s: {args.every_s}}}", *args.train_args],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    server = None
    try:
        _wait_for(os.path.join(pub, "1", "model.json"), train, 600)
        server, port = _start_server(pub, args.poll_s, log)
        example = json.load(open(os.path.join(pub, "1", "example_request.json")))["examples"][0]
        body = json.dumps({"examples": [example]}).encode()
        end = [None]

        def until():  # training done, then one more poll and publish's worth
            if train.poll() is None:
                return False
            end[0] = end[0] or time.time()
            return time.time() - end[0] > args.poll_s + 3

        records = asyncio.run(_client(port, body, args.rate, args.connections, until))
    finally:
        if train.poll() is None:
            train.terminate()
        if server is not None:
            server.terminate()
            server.wait(30)
        log.close()
    versions = _versions(pub)
    rows = versions[min(versions)]["table_rows"]
    first_seen = {}
    for t, lat, v in sorted(records):
        v = int(v)
        if v not in first_seen:
            first_seen[v] = t + lat
    table = []
    for v, info in sorted(versions.items()):
        seen = next((first_seen[u] for u in sorted(first_seen) if u >= v), None)
        fresh = None if seen is None else seen - info["created"]
        table.append({"version": v, **info, "freshness_s": fresh})
    t = np.asarray([r[0] for r in records])
    lat = np.asarray([r[1] for r in records]) * 1000
    near = np.zeros(t.shape, bool)
    for v, s in first_seen.items():
        if v != min(first_seen):
            near |= (t >= s - args.window) & (t <= s + args.window)
    steady, applying = lat[~near], lat[near]

    def pct(a, q):
        return float(np.percentile(a, q)) if a.size else float("nan")

    print(f"\nFreshness: {args.steps} training steps, publish every {args.every_s:g} s, serve "
          f"--poll-seconds {args.poll_s:g}, {args.rate:g} requests/s open loop over "
          f"{args.connections} connections; {rows:,} table rows\n")  # fmt: skip
    print("| version | kind | rows carried (% of the table) | freshness s |")
    print("|---|---|---|---|")
    for r in table:
        carried = (
            "full" if r["kind"] == "full" else f"{r['rows']:,} ({100 * r['rows'] / rows:.1f}%)"
        )
        fresh = "not seen" if r["freshness_s"] is None else f"{r['freshness_s']:.2f}"
        print(f"| {r['version']} | {r['kind']} | {carried} | {fresh} |")
    print("\n| requests | p50 ms | p99 ms |\n|---|---|---|")
    print(f"| steady ({steady.size:,}) | {pct(steady, 50):.2f} | {pct(steady, 99):.2f} |")
    print(f"| within {args.window:g} s of a version change ({applying.size:,}) | "
          f"{pct(applying, 50):.2f} | {pct(applying, 99):.2f} |")  # fmt: skip
    deltas = [r for r in table if r["kind"] == "delta"]
    worst = max((r["freshness_s"] or float("inf") for r in deltas), default=float("nan"))
    ratio = pct(applying, 99) / pct(steady, 99)
    print(f"\nchecks: every delta served within 10 s: worst {worst:.2f} s -> "
          f"{'ok' if worst <= 10 else 'FAIL'}; p99 while applying / steady p99 = {ratio:.2f} "
          f"-> {'ok' if ratio <= 2 else 'FAIL'}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"versions": table, "steady_p99_ms": pct(steady, 99),
                       "applying_p99_ms": pct(applying, 99)}, fh, indent=1)  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
