#!/usr/bin/env python3
"""Dynamic IDs at scale (issue 10, "Scale, shown"): `configs/dlrm_synthetic_1b.yaml`
trains DLRM on an endless stream of raw IDs drawn (Zipf) from a 1e9-ID space per
feature, every table dynamic with a bounded device cache, Bloom admission, TTL eviction
and a RAM budget with a disk tier. This runs it through the runner API (`build_run`,
then `sparsejax.train.fit` on the run's loader, as `sparsejax train` does, without
checkpoints) for --minutes of wall time (or --steps), and every --every steps records:

  steps/s      over the last interval (the host's id mapping and row exchange included)
  host ms      of those, ms per step in `HostTables.prepare_train` (ids -> cache slots,
               admission, eviction, host row reads/writes, dispatching the exchange)
  RSS, peak    /proc/self/status VmRSS and VmHWM; anon/file: RssAnon and RssFile (the
               disk tier's mapped pages count as file)
  rows live    over all tables (`HostTables.stats()`), admitted and evicted since start
  host RAM, disk  bytes of the host rows in RAM and in the disk tier's files
  device       bytes of the jitted state's tables (the caches: constant by construction)
  hit          mean device-cache hit rate of the tables, since the start

and prints the table (markdown) at the end, with the final eval (AUC, logloss on
held-out batches) and where a step's host time goes (cProfile of --profile steps).

    PYTHONPATH=. python experiments/scale_1b.py --minutes 12
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from sparsejax.data import Loader
from sparsejax.runner import load_config
from sparsejax.runner._run import build_run
from sparsejax.runner._run_dir import resolved_config
from sparsejax.train import Hook, fit

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def proc_status() -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def log(msg: str) -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"[{time.strftime('%H:%M:%S')} load {load}] {msg}", file=sys.stderr, flush=True)


def time_host_side(host, sampler) -> None:
    """Adds the seconds of each of `host.prepare`'s calls (the host's share of each
    step) to `sampler.host_s`."""
    prepare = host.prepare

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return prepare(*a, **k)
        finally:
            sampler.host_s += time.perf_counter() - t

    host.prepare = timed


class Sampler(Hook):
    """Records a row every `every` steps; stops training after `seconds` of wall time."""

    def __init__(self, trainer, every: int, seconds: float, device_bytes: int):
        self.trainer, self.every, self.seconds = trainer, every, seconds
        self.device_bytes = device_bytes
        self.rows: list[dict] = []
        self.host_s = 0.0
        self.t0 = self.t_last = None
        self.step_last = 0
        self.host_last = 0.0
        self.loss: list[float] = []
        time_host_side(trainer.host, self)

    def after_step(self, step, state, metrics):
        if self.t0 is None:  # the first step (compilation) is not timed
            jax.block_until_ready(metrics["loss"])
            self.t0 = self.t_last = time.perf_counter()
            self.step_last, self.host_last = step, self.host_s
            return None
        if step % self.every:
            return None
        loss = float(metrics["loss"])  # waits for the step
        now = time.perf_counter()
        st = self.trainer.host.stats().values()
        hits = [s["cache_hit_rate"] for s in st if s["cache_hit_rate"] is not None]
        status = proc_status()
        n = step - self.step_last
        row = {
            "step": step,
            "minutes": (now - self.t0) / 60,
            "steps_per_s": n / (now - self.t_last),
            "host_ms_per_step": 1e3 * (self.host_s - self.host_last) / n,
            "loss": loss,
            "rss": status["VmRSS"],
            "rss_peak": status["VmHWM"],
            "rss_anon": status["RssAnon"],
            "rss_file": status["RssFile"],
            "rows_live": sum(s["rows_live"] for s in st),
            "admitted": sum(s["admitted"] for s in st),
            "evicted": sum(s["evicted"] for s in st),
            "host_ram_bytes": sum(s["host_ram_bytes"] for s in st),
            "host_disk_bytes": sum(s["host_disk_bytes"] for s in st),
            "device_table_bytes": self.device_bytes,
            "hit_rate": float(np.mean(hits)) if hits else None,
            "rows_moved_per_step": sum(s["rows_moved_per_step"] for s in st),
        }
        self.rows.append(row)
        log(
            f"step {step}: {row['steps_per_s']:.2f} steps/s (host {row['host_ms_per_step']:.0f}"
            f" ms/step), loss {loss:.4f}, RSS {gib(row['rss'])} GiB (peak "
            f"{gib(row['rss_peak'])}), rows live {row['rows_live']:,}, host RAM "
            f"{gib(row['host_ram_bytes'])} GiB, disk {gib(row['host_disk_bytes'])} GiB"
        )
        self.t_last, self.step_last, self.host_last = now, step, self.host_s
        return now - self.t0 >= self.seconds


def table(rows: list[dict]) -> str:
    head = (
        "| step | min | steps/s | host ms/step | loss | RSS GiB | peak GiB | anon/file GiB "
        "| rows live | admitted | evicted | host RAM GiB | disk GiB | device MiB | hit |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['minutes']:.1f} | {r['steps_per_s']:.2f} | "
            f"{r['host_ms_per_step']:.0f} | {r['loss']:.4f} | {gib(r['rss'])} | "
            f"{gib(r['rss_peak'])} | {gib(r['rss_anon'])}/{gib(r['rss_file'])} | "
            f"{r['rows_live']:,} | {r['admitted']:,} | {r['evicted']:,} | "
            f"{gib(r['host_ram_bytes'])} | {gib(r['host_disk_bytes'])} | "
            f"{r['device_table_bytes'] / 2**20:.0f} | "
            + (f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else "-")
            + " |"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "dlrm_synthetic_1b.yaml"))
    ap.add_argument("--minutes", type=float, default=12.0, help="wall time of training")
    ap.add_argument("--steps", type=int, default=1_000_000, help="at most this many steps")
    ap.add_argument("--every", type=int, default=250, help="steps between samples")
    ap.add_argument("--profile", type=int, default=50, help="steps profiled at the end")
    ap.add_argument(
        "--out-dir", default=None, help="runs directory (default: a temp dir, deleted after)"
    )
    ap.add_argument("--json", default=None, help="write the samples here")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()

    out_dir = args.out_dir or tempfile.mkdtemp(prefix="sparsejax_scale_1b_")
    cfg = load_config(
        [args.config],
        [*args.overrides, f"out_dir={out_dir}", "progress=false", "resume=false"],
    )
    cfg = resolved_config(cfg)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    df = shutil.disk_usage(out_dir)
    log(f"run dir {cfg.run_dir}: {gib(df.free)} GiB free on its disk")
    try:
        t = time.perf_counter()
        run = build_run(cfg, log=log)
        log(f"built in {time.perf_counter() - t:.1f} s")
        trainer, host = run.trainer, run.trainer.host
        device_bytes = sum(x.nbytes for x in jax.tree.leaves(run.state.tables))
        loader = Loader(
            run.data.train_source,
            run.data.packer,
            shuffle=False,
            seed=cfg.seed,
            epochs=None,
            prefetch=cfg.data.prefetch,
            device_put=False,  # the host maps the raw ids first
        )
        sampler = Sampler(trainer, args.every, args.minutes * 60, device_bytes)
        try:
            result = fit(
                trainer,
                run.state,
                loader,
                steps=args.steps,
                eval_batches=run.data.eval_batches,
                hooks=[sampler],
            )
            state = result.state
            prof = None
            if args.profile:  # where a step's time goes, after the run
                it = iter(loader)
                pr = cProfile.Profile()
                t = time.perf_counter()
                pr.enable()
                for _ in range(args.profile):
                    state, m = trainer.train_step(state, next(it))
                jax.block_until_ready(m["loss"])
                pr.disable()
                dt = (time.perf_counter() - t) / args.profile
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
                prof = f"{args.profile} steps, {1e3 * dt:.0f} ms/step (profiled)\n" + s.getvalue()
        finally:
            loader.close()
        stats = host.stats()
        final = {
            "eval": {k: float(v) for k, v in result.eval.items()},
            "samples_per_s": result.samples_per_s,
            "tables": len(stats),
            "cache_rows_per_table": next(iter(stats.values()))["cache_rows"],
            "device_table_bytes": device_bytes,
            "device_table_bytes_end": sum(x.nbytes for x in jax.tree.leaves(state.tables)),
            "disk_free_end": shutil.disk_usage(out_dir).free,
        }
        print(table(sampler.rows))
        print()
        print(json.dumps(final, indent=1))
        if prof:
            print(prof)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": sampler.rows, "final": final}, f, indent=1)
        head = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        print(f"commit {head.stdout.strip()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    finally:
        if args.out_dir is None:
            shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
