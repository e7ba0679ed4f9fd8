#!/usr/bin/env python3
"""The loader alone (read, pack, put on the device) at `dlrm_synthetic_1m` shapes: batch
4096, 26 one-id features over the Criteo cardinalities capped at 1e6 rows, 13 dense
(issue 26). Each loader runs in its own process; --reps repetitions of --batches batches
(after 5 warm-up batches), median (min-max) samples/s, and the ratio against the
synthetic generator's loader (what `sparsejax train configs/dlrm_synthetic_1m.yaml`
reads today), measured in the same run:

  synthetic           Loader(SyntheticCriteo): generate + pack + put
  ..., 2 workers      the same with Loader(workers=2): two threads make batches
  criteo tsv          Loader(FileSource(Criteo TSV, hash ids into the tables)), streamed
                      with a shuffle window of 65,536 rows: parse + map + pack + put
  prepared            Loader(PreparedData) of --rows generated rows (`sparsejax data`),
                      shuffled by windows of 65,536 rows: gather + put + device unpack
  prepared, in order  the same, unshuffled
  prepared criteo     Loader(PreparedData) of the Criteo TSV's rows, mapped as above

Files go to --dir (kept for reruns; several hundred MB, larger than the CPU cache).

    PYTHONPATH=. python experiments/bench_loader.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

CASES = (
    "synthetic",
    "synthetic, 2 workers",
    "criteo tsv",
    "prepared",
    "prepared, 2 workers",
    "prepared, in order",
    "prepared criteo",
)


def log(msg: str) -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"[{time.strftime('%H:%M:%S')} load {load}] {msg}", file=sys.stderr, flush=True)


def _data():
    from sparsejax import data as sd
    from sparsejax import runner

    cfg = runner.load_config([os.path.join(ROOT, "configs", "dlrm_synthetic_1m.yaml")], [])
    bundle = runner.build_data(cfg)
    maps = {
        f.name: sd.HashMapping(buckets=t.vocab_size)
        for f, t in zip(bundle.features, bundle.tables, strict=True)
    }
    return cfg, bundle, maps


def prepare(args) -> None:
    """The Criteo TSV and the two prepared directories, once."""
    from _input_files import CriteoRows, write_criteo

    from sparsejax import data as sd

    os.makedirs(args.dir, exist_ok=True)
    cfg, bundle, maps = _data()
    tsv = os.path.join(args.dir, "train.tsv")
    if not os.path.exists(tsv):
        t = time.perf_counter()
        write_criteo(tsv + ".tmp", CriteoRows(seed=0), args.tsv_rows)
        os.rename(tsv + ".tmp", tsv)
        log(f"wrote {tsv} ({args.tsv_rows:,} rows) in {time.perf_counter() - t:.0f} s")
    gen, b = bundle.train_source, 1 << 16
    places = {
        "synthetic": (
            sd.Examples(labels=lab, dense=den, sparse=sp)
            for sp, lab, den in (gen.batch(i, b) for i in range(-(-args.rows // b)))
        ),
        "criteo": (
            c.examples
            for c in sd.FileSource(
                tsv, format="criteo", transform=lambda ex: ex.map_ids(maps)
            ).chunks()
        ),
    }
    for name, chunks in places.items():
        path = os.path.join(args.dir, f"prepared_{name}")
        if not os.path.exists(path):
            t = time.perf_counter()
            p = sd.write_prepared(path, chunks, bundle.tables, bundle.features)
            log(f"prepared {path}: {len(p):,} rows in {time.perf_counter() - t:.0f} s")


def child(args) -> None:
    import jax

    from sparsejax import data as sd

    cfg, bundle, maps = _data()
    case, workers = args.child.removesuffix(", 2 workers"), 2 if "2 workers" in args.child else 1
    kw = dict(device_put=True, prefetch=4, epochs=None, shuffle_buffer=1 << 16, workers=workers)
    if case == "synthetic":
        source = bundle.train_source
    elif case == "criteo tsv":
        tsv = os.path.join(args.dir, "train.tsv")
        source = sd.FileSource(tsv, format="criteo", transform=lambda ex: ex.map_ids(maps))
    else:
        which = "criteo" if case == "prepared criteo" else "synthetic"
        source = sd.PreparedData(os.path.join(args.dir, f"prepared_{which}"))
        source.verify()  # the checksums once, before the clock (they are checked per
        # row group the first time a batch reads it: the first epoch pays 0.2 ms a batch)
        kw["shuffle"] = case != "prepared, in order"
    rates = []
    for rep in range(args.reps):
        with sd.Loader(source, bundle.packer, seed=rep, **kw) as loader:
            rates.append(sd.measure_throughput(loader, num_batches=args.batches, warmup=5))
    b = bundle.packer.batch_size
    json.dump({"rates": [r * b for r in rates], "device": str(jax.devices()[0])}, sys.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", type=int, default=200, help="timed batches a repetition")
    ap.add_argument("--rows", type=int, default=4_000_000, help="generated rows prepared")
    ap.add_argument("--tsv-rows", type=int, default=1_000_000)
    ap.add_argument("--dir", default="/tmp/sparsejax_bench_loader")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    prepare(args)
    results = {}
    for case in args.cases:
        cmd = [sys.executable, __file__, "--child", case, "--dir", args.dir]
        cmd += ["--reps", str(args.reps), "--batches", str(args.batches)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode:
            sys.exit(f"{case} failed:\n{out.stderr[-3000:]}")
        results[case] = json.loads(out.stdout)["rates"]
        log(f"{case}: {statistics.median(results[case]):,.0f} samples/s")
    base = statistics.median(results.get("synthetic", [float("nan")]))
    print(
        "| loader (B=4096, dlrm_synthetic_1m shapes) | samples/s, median (min-max) | vs synthetic |"
    )
    print("|---|---|---|")
    for case, rates in results.items():
        med = statistics.median(rates)
        print(f"| {case} | {med:,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
