#!/usr/bin/env python3
"""Serving on more cores (issue 27): `sparsejax serve --workers 1` against `--workers 2`
on one model, under `wrk` (a native load tool, so the client's CPU stays small; the
Debian package `wrk`), closed loop with C connections each sending single-example POST
/v1/predict requests back to back for --seconds.

All the servers run at once; the cells go rep by rep, interleaved (--reps, default 3),
and the table gives the median repetition. Per worker count and concurrency:
requests/s (good answers), p50/p99 latency (wrk's), the CPU seconds wrk used, the cores
the server's processes used (CPU seconds per second), and the memory of the server's
processes together (the physical pages they hold, a page shared by the workers once; the
shared-memory folder of the tables counted whole, also its pages no worker has touched;
`_memory_kib`), against the model's table bytes. wrk and the process tree's CPU are
`_load_tools`', as in bench_serving.py.

--unpinned adds, per worker count > 1, a server of that many workers whose models run
on every core (`serve --no-pin-cores`), against the default of a share each.

Checks (the issue's Must reach): 2 workers >= 1.5x one worker's requests/s at the best
concurrency; their memory <= one worker's + 20% of the table bytes.

    python experiments/bench_serving_workers.py MODEL_DIR --concurrency 16 64 --seconds 10
    python experiments/bench_serving_workers.py MODEL_DIR --concurrency 64 128 --unpinned
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # however it is loaded
import _load_tools as lt  # noqa: E402
from bench_serving import ServerProcess  # noqa: E402


def _memory_kib(pid: int) -> tuple[int | None, int]:
    """The memory of `pid` and its children (KiB), counted two ways: the physical pages
    they have resident, each page once however many of them map it (from
    /proc/PID/pagemap; None where the page frames cannot be read: it needs root), and
    the sum of their PSS. Either way the tables' shared-memory folder of a `--workers`
    supervisor is counted whole (also the pages no worker has touched yet) and its
    mappings not again.

    PSS splits a page among all the processes that map it, also those of another server
    running beside this one (a library's pages): the servers' sums then shift with how
    many processes each has. The union of page frames is what this server holds."""
    folders = [os.path.join("/dev/shm", n) for n in
               (os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else ())
               if n.startswith(f"sparsejax-serve-{pid}-")]  # fmt: skip
    total = sum(os.stat(os.path.join(d, f)).st_blocks * 512 // 1024
                for d in folders for f in os.listdir(d))  # fmt: skip
    frames: set[int] = set()
    pss = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for p in lt.process_tree(pid):
        try:
            with open(f"/proc/{p}/maps") as maps, open(f"/proc/{p}/pagemap", "rb") as pagemap:
                for line in maps:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and any(d in fields[5] for d in folders):
                        continue  # the tables: counted whole above
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    pagemap.seek(lo // page * 8)
                    data = pagemap.read((hi - lo) // page * 8)
                    for (entry,) in struct.iter_unpack("Q", data):
                        if entry >> 63:  # present: bits 0-54 are the page frame
                            frames.add(entry & ((1 << 55) - 1))
            for line in open(f"/proc/{p}/smaps_rollup"):
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
                elif line.startswith("Pss_Shmem:"):
                    pss -= int(line.split()[1])
        except OSError:
            pass
    readable = frames and 0 not in frames  # without root, every frame reads as 0
    return (total + len(frames) * page // 1024 if readable else None), total + pss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    p.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--reps", type=int, default=3, help="repetitions, interleaved; median")
    p.add_argument(
        "--unpinned",
        action="store_true",
        help="also each worker count > 1 with --no-pin-cores (every worker's model on every core)",
    )
    args = p.parse_args(argv)
    lt.need("wrk")
    model = args.model
    first = (
        model
        if os.path.exists(os.path.join(model, "model.json"))
        else os.path.join(model, min((n for n in os.listdir(model) if n.isdigit()), key=int))
    )
    manifest = json.load(open(os.path.join(first, "model.json")))
    table_bytes = manifest["memory"]["tables_bytes"]
    example = json.load(open(os.path.join(first, "example_request.json")))["examples"][0]
    body = lt.v1_body(example)

    def wrk(server: ServerProcess, connections: int, seconds: float) -> dict:
        url = f"{server.url}/v1/predict"
        return lt.wrk(url, body, connections=connections, seconds=seconds)

    # every server up at once (an idle one takes next to no CPU), then the cells
    # interleaved rep by rep: this VM's speed drifts within minutes
    kinds = {str(w): (w, []) for w in args.workers}  # label: (workers, more flags)
    if args.unpinned:
        kinds.update({f"{w} (every core)": (w, ["--no-pin-cores"]) for w in args.workers if w > 1})
    servers: dict[str, ServerProcess] = {}
    with contextlib.ExitStack() as stack:  # each server stopped (SIGTERM) on the way out
        for w, (n, flags) in kinds.items():
            servers[w] = stack.enter_context(
                ServerProcess(model, ["--workers", str(n), *flags], workers=n)
            )
            wrk(servers[w], 4, 2)  # warm-up
        cells: dict[tuple, list] = {}
        for rep in range(args.reps):
            order = list(kinds) if rep % 2 == 0 else list(kinds)[::-1]
            for w in order:
                for c in args.concurrency:
                    cpu = lt.TreeCpu(servers[w].proc.pid)
                    cpu.start()
                    run = wrk(servers[w], c, args.seconds)
                    spent = cpu.stop()  # None: a worker was restarted meanwhile
                    run["cores"] = float("nan") if spent is None else spent / run["seconds"]
                    cells.setdefault((w, c), []).append(run)
        rows = {}
        for (w, c), runs in cells.items():
            runs.sort(key=lambda r: r["throughput"])
            mid = runs[len(runs) // 2]  # the median repetition's figures
            pages, pss = _memory_kib(servers[w].proc.pid)
            rows[(w, c)] = {**mid, "rps_all": [r["throughput"] for r in runs],
                            "memory_mib": (pss if pages is None else pages) / 1024,
                            "pss_mib": pss / 1024}  # fmt: skip
    print(f"\n{model}: tables {table_bytes / 2**20:.1f} MiB; wrk -t1, {args.seconds:g} s a "
          f"cell, single-example requests, {os.cpu_count()} cores\n")  # fmt: skip
    print(
        "| workers | connections | requests/s (median) | all reps | vs 1 worker | p50 ms | "
        "p99 ms | errors | wrk CPU s | server cores | server memory MiB | its PSS sum MiB |\n"
        + "|---" * 12
        + "|"
    )
    for (w, c), r in rows.items():
        base = rows.get(("1", c), r)["throughput"]
        reps = ", ".join(f"{x:,.0f}" for x in r["rps_all"])
        print(f"| {w} | {c} | {r['throughput']:,.0f} | {reps} | {r['throughput'] / base:.2f}x | "
              f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} | {r['tool_cpu_s']:.1f} | "
              f"{r['cores']:.2f} | "
              f"{r['memory_mib']:.0f} | {r['pss_mib']:.0f} |")  # fmt: skip
    if 1 in args.workers and 2 in args.workers:
        best1 = max(rows[("1", c)]["throughput"] for c in args.concurrency)
        best2 = max(rows[("2", c)]["throughput"] for c in args.concurrency)
        mem1 = max(rows[("1", c)]["memory_mib"] for c in args.concurrency)
        mem2 = max(rows[("2", c)]["memory_mib"] for c in args.concurrency)
        limit = mem1 + 0.2 * table_bytes / 2**20
        print(f"\nchecks: 2 workers / 1 worker at the best concurrency = {best2 / best1:.2f}x "
              f"({'ok' if best2 >= 1.5 * best1 else 'FAIL'}: >= 1.5x); memory {mem2:.0f} MiB "
              f"vs 1 worker + 20% of the tables = {limit:.0f} MiB "
              f"({'ok' if mem2 <= limit else 'FAIL'})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
