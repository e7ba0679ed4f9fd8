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


def _first_full(pub: str) -> str:
    """The oldest full version left (the publisher prunes those before the last two)."""
    return str(_fulls(pub)[0])


def _files(x):
    """The array entries (a "file" each) anywhere in a delta's manifest."""
    if isinstance(x, dict):
        if "file" in x:
            yield x
        else:
            for v in x.values():
                yield from _files(v)
    elif isinstance(x, list):
        for v in x:
            yield from _files(v)


def _versions(pub: str) -> dict[int, dict]:
    """Per published version: created (s), kind, table rows it carries, bytes."""
    full = json.load(open(os.path.join(pub, _first_full(pub), "model.json")))
    table_args = {k for k, e in full["arguments"].items() if "pieces" in e}
    out = {}
    for name in os.listdir(pub):
        path = os.path.join(pub, name)
        if name.isdigit():
            out[int(name)] = {
                "kind": "full",
                "created": os.path.getmtime(os.path.join(path, "model.json")),
            }
        elif name.endswith(".delta"):
            m = json.load(open(os.path.join(path, "delta.json")))
            args = m["arguments"]
            carried = sum(
                sum(q["rows"]["shape"][0] for q in p["pieces"]) if "pieces" in p
                else p["whole"]["shape"][0]
                for k, p in args.items()
                if k in table_args
            )  # fmt: skip
            size = sum(e["bytes"] for e in _files(m))
            out[m["version"]] = {"kind": "delta", "created": m["created"], "rows": carried,
                                 "bytes": size}  # fmt: skip
    return out


def _fulls(pub: str) -> list[int]:
    return sorted(int(n) for n in os.listdir(pub) if n.isdigit())


def _table_rows(pub: str, version: int) -> int:
    """The table rows of the full version a delta `version` applies to (a dynamic
    table's rows grow with each full version)."""
    full = max(f for f in _fulls(pub) if f <= version)
    m = json.load(open(os.path.join(pub, str(full), "model.json")))
    return sum(e["shape"][0] for e in m["arguments"].values() if "pieces" in e)


def _train(tmp: str, name: str, steps: int, every_s: float, extra: list, log) -> tuple:
    pub = os.path.join(tmp, f"pub_{name}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparsejax", "train", f"out_dir={tmp}/runs", f"name={name}",
         f"steps={steps}", "progress=false", "log_every=1000000", "eval_every=null",
         f"publish={{dir: {pub}, every_s: {every_s}}}", *extra],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    return proc, pub


def _serve_and_load(pub, args, log, until, during=None) -> tuple[list, dict]:
    """A server on `pub` under the open-loop client until `until()`; `during(port)`
    runs in a thread meanwhile. Returns the records and {version: first seen}."""
    import threading

    server, port = _start_server(pub, args.poll_s, log)
    try:
        first = _first_full(pub)
        example = json.load(open(os.path.join(pub, first, "example_request.json")))["examples"][0]
        body = json.dumps({"examples": [example]}).encode()
        if during is not None:
            threading.Thread(target=during, daemon=True).start()
        records = asyncio.run(_client(port, body, args.rate, args.connections, until))
    finally:
        server.terminate()
        server.wait(30)
    first_seen: dict[int, float] = {}
    for t, lat, v in sorted(records):
        first_seen.setdefault(int(v), t + lat)
    return records, first_seen


def _latency(records, first_seen, window) -> tuple[np.ndarray, np.ndarray]:
    """Latencies (ms) of the requests sent within `window` s of a version's first
    answer (after the first version) and of the others."""
    t = np.asarray([r[0] for r in records])
    lat = np.asarray([r[1] for r in records]) * 1000
    near = np.zeros(t.shape, bool)
    for v, s in first_seen.items():
        if v != min(first_seen):
            near |= (t >= s - window) & (t <= s + window)
    return lat[~near], lat[near]


def _pct(a, q):
    return float(np.percentile(a, q)) if a.size else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000, help="training steps of the live run")
    p.add_argument("--every-s", type=float, default=5.0, help="its publish.every_s")
    p.add_argument("--poll-s", type=float, default=2.0, help="serve --poll-seconds")
    p.add_argument("--rate", type=float, default=200.0, help="requests a second")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--window", type=float, default=1.0)
    p.add_argument("--deltas", type=int, default=8, help="deltas applied in part (b)")
    p.add_argument("--gap-s", type=float, default=3.0, help="seconds between them")
    p.add_argument("--train-args", nargs="*", default=[], help="more `key=value` overrides")
    p.add_argument("--out", help="write the results here (JSON)")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="sparsejax_fresh_")
    log = open(os.path.join(tmp, "log.txt"), "w")
    results = {}
    try:
        # (a) live: training publishes while the server follows
        train, pub = _train(tmp, "live", args.steps, args.every_s, args.train_args, log)
        try:
            _wait_for(os.path.join(pub, "1", "model.json"), train, 600)
            end = [None]

            def until():  # training done, then one more publish and poll
                if train.poll() is None:
                    return False
                end[0] = end[0] or time.time()
                return time.time() - end[0] > args.poll_s + 3

            records, seen = _serve_and_load(pub, args, log, until)
        finally:
            if train.poll() is None:
                train.terminate()
        versions = _versions(pub)
        print(f"\n(a) live: {args.steps} training steps publishing every {args.every_s:g} s, "
              f"serve --poll-seconds {args.poll_s:g}, {args.rate:g} requests/s open loop; "
              f"{_table_rows(pub, max(versions)):,} table rows at the end\n")  # fmt: skip
        print("| version | kind | table rows carried | MiB | freshness s |\n|---|---|---|---|---|")
        live = []
        for v, info in sorted(versions.items()):
            at = next((seen[u] for u in sorted(seen) if u >= v), None)
            fresh = None if at is None else at - info["created"]
            live.append({"version": v, **info, "freshness_s": fresh})
            rows = _table_rows(pub, v)
            carried = (
                ""
                if info["kind"] == "full"
                else (f"{info['rows']:,} ({100 * info['rows'] / rows:.1f}%)")
            )
            mib = "" if info["kind"] == "full" else f"{info['bytes'] / 2**20:.1f}"
            shown = "not seen" if fresh is None else f"{fresh:.2f}"
            print(f"| {v} | {info['kind']} | {carried} | {mib} | {shown} |")
        steady, applying = _latency(records, seen, args.window)
        print(
            f"\nlatency with training on the same cores: p99 {_pct(steady, 99):.1f} ms "
            f"steady, {_pct(applying, 99):.1f} ms within {args.window:g} s of a new version"
        )
        deltas = [r for r in live if r["kind"] == "delta"]
        worst = max((r["freshness_s"] or float("inf") for r in deltas), default=float("nan"))
        results["live"] = {"versions": live, "worst_freshness_s": worst}
        # (b) controlled: one-step deltas applied every --gap-s, no training beside
        train, pub_b = _train(tmp, "steps", args.deltas + 1, 1e-9, args.train_args, log)
        if train.wait() != 0:
            raise SystemExit("the run for part (b) failed; see " + log.name)
        stage = os.path.join(tmp, "stage")
        os.makedirs(stage)
        base = _fulls(pub_b)[-1]  # dynamic tables: new keys may have needed full versions
        shutil.copytree(os.path.join(pub_b, str(base)), os.path.join(stage, str(base)))
        moved: dict[int, float] = {}

        def feed():
            time.sleep(2 * args.gap_s)
            for v in range(base + 1, args.deltas + 2):
                shutil.copytree(os.path.join(pub_b, f"{v}.delta"), os.path.join(stage, "tmp"))
                os.rename(os.path.join(stage, "tmp"), os.path.join(stage, f"{v}.delta"))
                moved[v] = time.time()
                time.sleep(args.gap_s)

        t_end = time.time() + (args.deltas + 3) * args.gap_s
        records, seen = _serve_and_load(stage, args, log, lambda: time.time() > t_end, feed)
        versions = _versions(pub_b)
        steady, applying = _latency(records, seen, args.window)
        sizes = [100 * versions[v]["rows"] / _table_rows(pub_b, v) for v in moved]
        lags = [seen[v] - moved[v] for v in moved if v in seen]
        ratio = _pct(applying, 99) / _pct(steady, 99)
        print(f"\n(b) {len(moved)} one-step deltas ({min(sizes):.1f}-{max(sizes):.1f}% of the "
              f"table rows, {np.mean([versions[v]['bytes'] for v in moved]) / 2**20:.1f} MiB "
              f"each) put into the served folder every {args.gap_s:g} s, no training beside; "
              f"served {min(lags):.2f}-{max(lags):.2f} s after they appeared\n")  # fmt: skip
        print("| requests | p50 ms | p99 ms |\n|---|---|---|")
        print(f"| steady ({steady.size:,}) | {_pct(steady, 50):.2f} | {_pct(steady, 99):.2f} |")
        print(f"| within {args.window:g} s of a delta swapped in ({applying.size:,}) | "
              f"{_pct(applying, 50):.2f} | {_pct(applying, 99):.2f} |")  # fmt: skip
        results["applying"] = {"delta_rows_pct": sizes, "served_after_s": lags,
                               "steady_p99_ms": _pct(steady, 99),
                               "applying_p99_ms": _pct(applying, 99)}  # fmt: skip
        fresh_ok, p99_ok = "ok" if worst <= 10 else "FAIL", "ok" if ratio <= 2 else "FAIL"
        print(f"\nchecks: every delta of the live run served within 10 s of its publish: "
              f"worst {worst:.2f} s -> {fresh_ok}; p99 while a delta is applied / steady "
              f"p99 = {ratio:.2f} -> {p99_ok}")  # fmt: skip
    finally:
        log.close()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
