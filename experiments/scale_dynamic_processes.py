#!/usr/bin/env python3
"""Dynamic tables across processes (issue 25): the 1e9-ID stream of
`configs/dlrm_synthetic_1b.yaml` (raw 64-bit keys, Bloom admission, TTL eviction, a RAM
budget with a disk tier) trained by 1, 2 and 4 local processes (`jax.distributed`, one
CPU device each, the same global batch), each owning the keys a fixed hash gives it.
Every run gets --minutes of wall time (the first step, compilation, untimed); every
--every steps each process records:

  samples/s     global batch x steps/s over the interval
  host ms       ms per step in its host side's `prepare` (its batch's distinct keys to
                their owners and the answers back, admission, eviction, cache placement,
                host row reads, dispatching the row exchange); it runs while the device
                computes the step before
  keys          distinct keys of its batch share per step (summed over tables), those
                sent to other processes, and the host bytes it sent them per step
  RSS           VmRSS (and the peak); rows live it owns; cache hit rate (all owners)

and the table (markdown) prints per process count: the last interval's figures per
process, samples/s against 1 process, and RSS against the 1-process run's at the same
point of the stream (rows live included). Each process count runs in its own processes.

    PYTHONPATH=. python experiments/scale_dynamic_processes.py --processes 1 2 4 --minutes 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def log(msg: str) -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"[{time.strftime('%H:%M:%S')} load {load}] {msg}", file=sys.stderr, flush=True)


def child(args) -> None:
    """One process of a run: train, sample, write its samples to --json."""
    from sparsejax.sharding import initialize_from_env

    initialize_from_env()
    import jax
    import numpy as np
    from scale_1b import proc_status, time_host_side

    from sparsejax.runner import load_config
    from sparsejax.runner._run import build_run, train_loader
    from sparsejax.train import Hook, fit

    rank, procs = jax.process_index(), jax.process_count()
    cfg = load_config(
        [args.config],
        [*args.overrides, f"out_dir={args.out_dir}", "progress=false", "resume=false"],
    )
    run = build_run(cfg, log=(lambda m: log(f"p{rank}: {m}")) if rank == 0 else (lambda m: None))
    trainer, host = run.trainer, run.trainer.host
    owned = next((p for p in host.parts if hasattr(p, "exchanged")), None)
    batch = cfg.data.batch_size

    class Sampler(Hook):
        def __init__(self):
            self.rows, self.host_s, self.t0 = [], 0.0, None
            time_host_side(host, self)

        def after_step(self, step, state, metrics):
            if self.t0 is None:  # the first step (compilation) is not timed
                jax.block_until_ready(metrics["loss"])
                self.t0 = self.t_last = time.perf_counter()
                self.last = (step, self.host_s, dict(owned.exchanged) if owned else None)
                return None
            if step % args.every:
                return None
            loss = float(metrics["loss"])
            stats = host.stats()  # a collective: every process samples the same steps
            now = time.perf_counter()
            n = step - self.last[0]
            ex = None
            if owned is not None:
                ex = {
                    k: (owned.exchanged[k] - self.last[2][k]) / n
                    for k in ("keys", "keys_away", "bytes")
                }
            hits = [s["cache_hit_rate"] for s in stats.values() if s["cache_hit_rate"] is not None]
            status = proc_status()
            row = {
                "step": step,
                "minutes": (now - self.t0) / 60,
                "samples_per_s": batch * n / (now - self.t_last),
                "host_ms": 1e3 * (self.host_s - self.last[1]) / n,
                "loss": loss,
                "rss": status["VmRSS"],
                "rss_peak": status["VmHWM"],
                "rows_live": sum(
                    s.get("rows_live_per_process", [s["rows_live"]])[rank] for s in stats.values()
                ),
                "rows_live_all": sum(s["rows_live"] for s in stats.values()),
                "hit_rate": float(np.mean(hits)) if hits else None,
                "exchange": ex,
            }
            self.rows.append(row)
            if rank == 0:
                log(
                    f"{procs} proc, step {step}: {row['samples_per_s']:,.0f} samples/s, host "
                    f"{row['host_ms']:.0f} ms/step, RSS {gib(row['rss'])} GiB, rows "
                    f"{row['rows_live']:,} of {row['rows_live_all']:,}"
                    + (f", keys/step {ex['keys']:,.0f} ({ex['keys_away']:,.0f} away)" if ex else "")
                )
            self.t_last, self.last = (
                now,
                (step, self.host_s, dict(owned.exchanged) if owned else None),
            )
            # every process stops at the same step: process 0's clock decides
            stop = np.array([now - self.t0 >= args.minutes * 60], np.int32)
            if procs > 1:
                from jax.experimental import multihost_utils

                stop = multihost_utils.broadcast_one_to_all(stop)
            return bool(stop[0])

    loader = train_loader(run, epochs=None)  # this process's share of each batch
    sampler = Sampler()
    try:
        fit(trainer, run.state, loader, steps=args.steps, eval_batches=None, hooks=[sampler])
    finally:
        loader.close()
    with open(args.json, "w") as f:
        json.dump({"rank": rank, "processes": procs, "rows": sampler.rows}, f)


def launch(n: int, args, out: str) -> list[dict]:
    """Run `n` processes of `child`; their samples by rank."""
    from sparsejax.sharding._launch import child_env, free_port

    port = free_port()
    procs = []
    for rank in range(n):
        env = child_env(rank, n, f"127.0.0.1:{port}", devices_per_process=1)
        env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")])
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--config",
            args.config,
            "--minutes",
            str(args.minutes),
            "--steps",
            str(args.steps),
            "--every",
            str(args.every),
            "--out-dir",
            os.path.join(out, f"p{n}"),
            "--json",
            os.path.join(out, f"p{n}_{rank}.json"),
            *args.overrides,
        ]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{n} processes: exit codes {codes}")
    return [json.load(open(os.path.join(out, f"p{n}_{r}.json"))) for r in range(n)]


def table(results: dict[int, list[dict]]) -> str:
    head = (
        "| processes | process | step | samples/s | vs 1 | host ms/step | keys/step | "
        "sent away | KiB sent/step | RSS GiB | peak GiB | RSS vs 1 | rows live (own) | hit |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    base = results.get(1, [None])[0]
    for n, ranks in sorted(results.items()):
        for r in ranks:
            last = r["rows"][-1]
            ref = None
            if base is not None:  # the 1-process sample at the same step (or the nearest)
                ref = min(base["rows"], key=lambda b: abs(b["step"] - last["step"]))
            ex = last["exchange"] or {"keys": 0, "keys_away": 0, "bytes": 0}
            lines.append(
                f"| {n} | {r['rank']} | {last['step']} | {last['samples_per_s']:,.0f} | "
                + (f"{last['samples_per_s'] / ref['samples_per_s']:.2f}x" if ref else "-")
                + f" | {last['host_ms']:.0f} | {ex['keys']:,.0f} | {ex['keys_away']:,.0f} | "
                f"{ex['bytes'] / 1024:,.0f} | {gib(last['rss'])} | {gib(last['rss_peak'])} | "
                + (f"{last['rss'] / ref['rss']:.2f}" if ref else "-")
                + f" (1 proc @ {ref['step'] if ref else '-'}) | {last['rows_live']:,} | "
                + (f"{last['hit_rate']:.3f}" if last["hit_rate"] is not None else "-")
                + " |"
            )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "dlrm_synthetic_1b.yaml"))
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--minutes", type=float, default=6.0, help="wall time of each run")
    ap.add_argument("--steps", type=int, default=1_000_000, help="at most this many steps")
    ap.add_argument("--every", type=int, default=100, help="steps between samples")
    ap.add_argument("--out-dir", default=None, help="runs directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="(--child) write the samples here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()
    if args.child:
        return child(args)
    out = args.out_dir or tempfile.mkdtemp(prefix="sparsejax_dyn_procs_")
    results = {}
    for n in args.processes:
        log(f"{n} process(es)")
        results[n] = launch(n, args, out)
    print(table(results))
    with open(os.path.join(out, "samples.json"), "w") as f:
        json.dump({str(k): v for k, v in results.items()}, f)
    log(f"samples: {os.path.join(out, 'samples.json')}")


if __name__ == "__main__":
    main()
