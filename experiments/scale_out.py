#!/usr/bin/env python3
"""Tables larger than one host, on one machine (issue 24, "Shown at scale"): N local
processes (one CPU device each, joined by `jax.distributed`) train a DLRM whose tables
are placed row-wise over all of them, save a checkpoint, restore it on another process
count and export it. Each phase runs in its own set of processes; every process records
its peak RSS (`VmHWM`, reset between phases through `/proc/self/clear_refs`) beside the
bytes of the shards it holds (weights + optimizer slots of its rows), and may run under
a cap on its address space (`--cap-gib`, `ulimit -v`).

Phases (`--phases`, in order):
  train   N processes: init (each creates its own rows), `--steps` train steps, a save;
  restore processes from `--restore-on` (e.g. 2,4): restore the saved step, 2 steps;
  export  N processes: `sparsejax.runner.export_run` of the run;
  straight N processes, another run dir: `--steps` + 2 steps without stopping, whose
          last two losses the restores' losses are compared with.

    PYTHONPATH=. python experiments/scale_out.py                 # the >= 8 GiB DLRM
    PYTHONPATH=. python experiments/scale_out.py --preset wide   # 3e9-row dim-1 table

Prints one markdown table: phase, processes, process, shard GiB, peak RSS GiB, peak -
shard, seconds of the phase, and the losses of each training phase.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PRESETS = {
    # one table of 1e8 rows (6.3 GiB with its row-wise Adagrad slot), three of 1e7 and 22
    # Criteo-sized small ones: 8.3 GiB of table state, the largest table 2x what one of 4
    # processes holds (its shard + 1 GiB)
    "dlrm": [
        "model.name=dlrm",
        "model.embedding_dim=16",
        "model.options={bottom: [64, 16], top: [64, 1]}",
        "optimizer.sparse=rowwise_adagrad",
        "optimizer.sparse_learning_rate=0.05",
        "data.synthetic_options={vocab_sizes: [100000000, 10000000, 10000000, 10000000,"
        " 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000,"
        " 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000]}",
    ],
    # a wide (first-order) table of 3e9 rows: dim 1, bf16, SGD; the generator's Zipf
    # ranks are spread over all its rows, so every batch has ids above 2**31
    "wide": [
        "model.name=wide_deep",
        "model.embedding_dim=1",
        "model.table_dtype=bfloat16",
        "optimizer.sparse=sgd",
        "optimizer.sparse_learning_rate=0.05",
        "data.synthetic_options={vocab_sizes: [3000000000, 1000, 1000]}",
    ],
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the worker: one process of one phase ------------------------------------------------
def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "VmPeak"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def _shard_bytes(tables) -> int:
    """Bytes of the table state this process holds (one copy of each shard)."""
    import jax

    return sum(
        s.data.nbytes
        for a in jax.tree.leaves(tables)
        for s in a.addressable_shards
        if s.replica_id == 0
    )


def worker(args) -> None:
    import jax

    from sparsejax.runner import load_config
    from sparsejax.runner._run import _data_position, build_run
    from sparsejax.runner._run_dir import _record_start, resolved_config
    from sparsejax.sharding import initialize_from_env
    from sparsejax.train import Hook, fit

    initialize_from_env()
    rec: dict = {
        "worker": args.worker,
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "phases": [],
    }

    def mark(phase: str, t0: float, **extra) -> None:
        st = _status()
        rec["phases"].append(
            {
                "phase": phase,
                "peak": st["VmHWM"],
                "vmpeak": st["VmPeak"],
                "seconds": time.perf_counter() - t0,
                **extra,
            }
        )
        _reset_peak()

    config, *overrides = json.loads(args.overrides)
    if args.worker == "straight":
        overrides = [*overrides, "name=scale_out_straight"]
    cfg = resolved_config(load_config([config], overrides))
    if args.worker == "train" and jax.process_index() == 0:  # config.yaml, as `train` does
        os.makedirs(cfg.run_dir, exist_ok=True)
        _record_start(cfg, {"event": "start"})
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("scale_out: run dir ready")
    _reset_peak()
    if args.worker == "export":
        from sparsejax.runner import export_run

        t = time.perf_counter()
        export_run(cfg.run_dir, args.export_dir, overwrite=True, log=lambda m: None)
        mark("export", t)
    else:
        t = time.perf_counter()
        run = build_run(cfg, log=lambda m: None)
        rec["shard_bytes"] = _shard_bytes(run.state.tables)
        mark("restore" if args.worker == "restore" else "init", t)
        from sparsejax.runner._run import train_loader

        loader = train_loader(run, epochs=None, position=run.position)
        t = time.perf_counter()
        losses = []

        class Losses(Hook):
            def after_step(self, step, state, metrics):
                losses.append(float(metrics["loss"]))

        try:
            result = fit(
                run.trainer,
                run.state,
                loader,
                steps=int(run.state.step) + args.steps,
                hooks=[Losses()],
            )
            mark("train", t, losses=losses)
            if args.worker == "train":
                t = time.perf_counter()
                position = _data_position(loader)()  # where the restores go on
                run.checkpointer.save(result.state, data_position=position)
                mark("save", t)
        finally:
            loader.close()
    with open(
        os.path.join(
            args.record_dir, f"{args.worker}_{jax.process_count()}_p{jax.process_index()}.json"
        ),
        "w",
    ) as f:
        json.dump(rec, f)


# ---- the driver -------------------------------------------------------------------------
def launch_phase(phase: str, n: int, args, overrides: list[str], record_dir: str) -> None:
    from sparsejax.sharding._launch import child_env, free_port

    coord = f"127.0.0.1:{free_port()}"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        phase,
        "--steps",
        str({"train": args.steps, "straight": args.steps + 2}.get(phase, 2)),
        "--record-dir",
        record_dir,
        "--export-dir",
        os.path.join(record_dir, "model"),
        "--overrides",
        json.dumps(overrides),
    ]
    if args.cap_gib:
        cmd = ["bash", "-c", f'ulimit -v {int(args.cap_gib * 2**20)} && exec "$@"', "-", *cmd]
    log(f"{phase} on {n} processes")
    procs = [
        subprocess.Popen(cmd, env=child_env(i, n, coord, devices_per_process=1), cwd=ROOT)
        for i in range(n)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{phase} on {n} processes failed: exit codes {codes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="dlrm")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--restore-on", default="2,4", help="process counts of the restores")
    ap.add_argument("--phases", default="train,restore,export,straight")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--cap-gib", type=float, default=None, help="ulimit -v of each process")
    ap.add_argument("--out-dir", default=None, help="default: a temp dir, deleted after")
    ap.add_argument("--json", default=None, help="write every process's record here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--record-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--export-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default=None, help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="more config overrides, key=value")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    out = args.out_dir or tempfile.mkdtemp(prefix="sparsejax_scale_out_")
    record_dir = os.path.join(out, "records")
    os.makedirs(record_dir, exist_ok=True)
    overrides = [
        os.path.join(ROOT, "configs", "base.yaml"),
        f"out_dir={out}",
        "name=scale_out",
        "progress=false",
        "eval_every=null",
        "data.kind=synthetic",
        f"data.batch_size={args.batch_size}",
        "data.eval_batches=1",
        "tables={'*': {placement: row_wise}}",
        *PRESETS[args.preset],
        *args.extra,
    ]
    try:
        for phase in args.phases.split(","):
            counts = (
                [int(c) for c in args.restore_on.split(",")]
                if phase == "restore"
                else [args.processes]
            )
            for n in counts:
                launch_phase(phase, n, args, overrides, record_dir)
        report(record_dir, args)
    finally:
        if args.out_dir is None:
            shutil.rmtree(out, ignore_errors=True)


def report(record_dir: str, args) -> None:
    recs = []
    for name in sorted(os.listdir(record_dir)):
        if name.endswith(".json"):
            with open(os.path.join(record_dir, name)) as f:
                recs.append(json.load(f))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1)
    gib = 2**30
    order = ["train", "restore", "export", "straight"]
    print("| run | phase | processes | process | shard GiB | peak RSS GiB | peak - shard GiB | s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(recs, key=lambda r: (order.index(r["worker"]), r["processes"], r["process"])):
        shard = r.get("shard_bytes")
        for p in r["phases"]:
            print(
                f"| {r['worker']} | {p['phase']} | {r['processes']} | {r['process']} | "
                + ("-" if shard is None else f"{shard / gib:.3f}")
                + f" | {p['peak'] / gib:.2f} | "
                + ("-" if shard is None else f"{(p['peak'] - shard) / gib:+.2f}")
                + f" | {p['seconds']:.1f} |"
            )
    curves = {}
    for r in recs:
        kind = r["worker"]
        for p in r["phases"]:
            if p.get("losses") and r["process"] == 0:
                curves[(kind, r["processes"])] = p["losses"]
                losses = " ".join(f"{x:.6f}" for x in p["losses"])
                print(f"losses ({kind}, then trained on {r['processes']}): {losses}")
    straight = [v for (k, _), v in curves.items() if k == "straight"]
    for (kind, n), v in sorted(curves.items()):
        if kind == "restore" and straight:
            d = max(abs(a - b) for a, b in zip(v, straight[0][args.steps :], strict=False))
            print(f"restored on {n}: max |loss - never-stopped loss| = {d:.2e}")


if __name__ == "__main__":
    main()
