#!/usr/bin/env python3
"""Host-executed tables (issue 13): step time of a config with some tables placed on
the host (`tables.<name>.placement=host`: lookup and sparse update on the host's CPU,
the dense step on the device) against all tables on the device, with the look-ahead
pipeline off and on, and the fraction of looked-ahead bags recomputed after the update.

Each variant trains in its own process (`--worker`) on the same rotating batches
(`--batches` of them, drawn once from the config's data); variants are interleaved rep
by rep, and each prints its median step time over `--steps` steps and a digest of its
losses, so the table also shows the variants trained the same numbers.

    PYTHONPATH=. python experiments/bench_host_exec.py configs/default.yaml --reps 3
    PYTHONPATH=. python experiments/bench_host_exec.py configs/default.yaml --host C3 C4 C12
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("device", "host", "host + look-ahead")


def worker(args) -> None:
    import jax
    import numpy as np

    from sparsejax.embedding.host import HostExecution
    from sparsejax.runner import load_config
    from sparsejax.runner._run import build_run, train_loader

    host = [] if args.worker == "device" else [f"tables.{t}.placement=host" for t in args.host]
    cfg = load_config(
        [args.config],
        [f"out_dir={args.out}", f"name={args.worker.split()[0]}", "progress=false", *host],
    )
    run = build_run(cfg, log=lambda _: None)
    trainer, state = run.trainer, run.state
    for part in trainer.host.parts:  # the host-executed tables' look-ahead, on or off
        if isinstance(part, HostExecution):
            part.looks_ahead = args.worker.endswith("look-ahead")
    loader = train_loader(run, epochs=None)
    batches = [next(loader) for _ in range(args.batches)]
    loader.close()
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        t = time.perf_counter()
        state, m = trainer.train_step(
            state, batches[i % len(batches)], batches[(i + 1) % len(batches)]
        )
        losses.append(m["loss"])
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    losses = np.asarray(jax.device_get(losses), np.float32)
    stats = trainer.host.stats().get(HostExecution.name, {})
    print(
        json.dumps(
            {
                "ms": 1e3 * statistics.median(times[args.warmup :]),
                "losses": hashlib.sha256(losses.tobytes()).hexdigest()[:12],
                "recomputed": stats.get("recomputed_fraction"),
                "host_rows": sum(t.vocab_size for t in run.model.tables if t.placement == "host"),
                "rows": sum(t.vocab_size for t in run.model.tables),
                "device": str(jax.devices()[0].device_kind),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--host", nargs="+", default=["*"], help="tables placed on the host")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batches", type=int, default=32, help="rotating batches")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    out = tempfile.mkdtemp(prefix="bench_host_exec.")
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.reps):
        for v in VARIANTS:
            cmd = [sys.executable, __file__, args.config, "--worker", v, "--out", out]
            cmd += ["--host", *args.host, "--steps", str(args.steps), "--warmup", str(args.warmup)]
            cmd += ["--batches", str(args.batches)]
            res = subprocess.run(cmd, check=True, capture_output=True, text=True)
            runs[v].append(json.loads(res.stdout.strip().splitlines()[-1]))
    first = runs["host"][0]
    print(
        f"{args.config}, tables on the host: {' '.join(args.host)} ({first['host_rows']:,} of "
        f"{first['rows']:,} rows); device: {first['device']}; median of {args.reps} processes "
        f"x {args.steps} steps"
    )
    base = statistics.median(r["ms"] for r in runs["device"])
    print(f"{'variant':<20} {'ms/step':>8} {'vs device':>10} {'recomputed':>11}  losses")
    for v in VARIANTS:
        ms = statistics.median(r["ms"] for r in runs[v])
        rec = runs[v][0]["recomputed"]
        rec = "" if rec is None or v != "host + look-ahead" else f"{100 * rec:.1f}%"
        digests = sorted({r["losses"] for r in runs[v]})
        print(f"{v:<20} {ms:8.2f} {base / ms:9.2f}x {rec:>11}  {','.join(digests)}")


if __name__ == "__main__":
    main()
