#!/usr/bin/env python3
"""Streaming a file larger than memory trains with flat RSS (issue 9, Must-reach: RSS
within 10% between 10% and 100% of a file of at least 4 GB).

Generates a Criteo TSV file of --gb GB in --dir (`_input_files.py`: Criteo-shaped rows,
~250 bytes each), then streams it once through `Loader(FileSource(path, format="criteo",
transform=hash ids into the tables), shuffle_buffer=65536, device_put=True, prefetch=4)`
and, with --train (the default), trains the `sparsejax train` default DLRM (batch 1024,
embedding dim 16, tables capped at 100k rows) on every batch. The process's RSS
(/proc/self/status VmRSS, and the peak VmHWM) is recorded each time another 10% of the
file's lines has been parsed. The file is deleted at the end (--keep keeps it).

    PYTHONPATH=. python experiments/stream_rss.py --gb 4.2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _input_files import CriteoRows, write_criteo  # noqa: E402


def rss_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                vals[k] = int(v.split()[0]) / 1024
    return vals["VmRSS"], vals["VmHWM"]


def log(msg: str) -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"[{time.strftime('%H:%M:%S')} load {load}] {msg}", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.2, help="file size to generate (GB)")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--train", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--keep", action="store_true", help="keep the generated file")
    args = ap.parse_args()
    path = os.path.join(args.dir, "sparsejax_stream_rss.tsv")
    rows_per_gb = 1e9 / 253  # measured bytes per generated row
    n = int(args.gb * rows_per_gb)
    try:
        if not (os.path.exists(path) and os.path.getsize(path) >= args.gb * 1e9 * 0.98):
            log(f"generating {n:,} rows (~{args.gb} GB) into {path}")
            t = time.perf_counter()
            write_criteo(path, CriteoRows(seed=0), n, block=250_000)
            log(
                f"generated {os.path.getsize(path) / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s"
            )
        size = os.path.getsize(path)
        with open(path, "rb") as f:  # lines, for the progress marks (a fast count)
            total = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(64 << 20), b""))
        run(path, size, total, args.train)
    finally:
        if not args.keep and os.path.exists(path):
            os.remove(path)
            log(f"deleted {path}")


def run(path: str, size: int, total: int, train: bool) -> None:
    import jax

    from sparsejax import runner
    from sparsejax.data import FileSource, HashMapping, Loader

    cfg = runner.load_config([], ["progress=false"])
    data = runner.build_data(cfg)
    vocab = {t.name: t.vocab_size for t in data.tables}
    maps = {f.name: HashMapping(buckets=vocab[f.table]) for f in data.features}
    src = FileSource(path, format="criteo", transform=lambda ex: ex.map_ids(maps))
    loader = Loader(
        src,
        data.packer,
        seed=0,
        epochs=1,
        shuffle_buffer=1 << 16,
        device_put=True,
        prefetch=4,
    )
    trainer = state = None
    if train:
        model = runner.build_model(cfg, data.tables, data.features)
        trainer = runner.Trainer(model, runner.dense_optimizer(cfg.optimizer))
    base = rss_mb()
    log(f"RSS before streaming {base[0]:,.0f} MB; {size / 1e9:.2f} GB, {total:,} lines")
    marks = []  # (percent, lines parsed, batches, RSS, peak)
    nxt, batches, t0 = 10, 0, time.perf_counter()
    last = None
    with loader:
        for batch in loader:
            if train:
                if state is None:
                    state = trainer.init(jax.random.key(0), batch)
                state, m = trainer.train_step(state, batch)
                last = m["loss"]
            batches += 1
            parsed = src.report.lines_read
            while nxt <= 100 and parsed >= total * nxt / 100:
                if last is not None:
                    jax.block_until_ready(last)
                rss, hwm = rss_mb()
                marks.append((nxt, parsed, batches, rss, hwm))
                log(f"{nxt}% parsed: batch {batches:,}, RSS {rss:,.0f} MB (peak {hwm:,.0f})")
                nxt += 10
    elapsed = time.perf_counter() - t0
    if last is not None:
        jax.block_until_ready(last)
    rss_end, hwm_end = rss_mb()
    rows = [rss for _, _, _, rss, _ in marks]
    spread = (max(rows) - min(rows)) / min(rows)
    what = "trained (default DLRM, batch 1024)" if train else "packed and put (no training)"
    print(f"# stream_rss: {size / 1e9:.2f} GB Criteo TSV, {total:,} lines, {batches:,} batches")
    print(f"# {what} in {elapsed:.0f} s ({total / elapsed:,.0f} rows/s)")
    print(f"# RSS before streaming: {base[0]:,.0f} MB\n")
    print("| file parsed | batches | RSS MB | peak RSS MB |")
    print("|---|---|---|---|")
    for pct, _, b, rss, hwm in marks:
        print(f"| {pct}% | {b:,} | {rss:,.0f} | {hwm:,.0f} |")
    print(f"\nRSS spread 10%..100%: {spread:.1%} (max {max(rows):,.0f}, min {min(rows):,.0f} MB);")
    print(f"after the loop: RSS {rss_end:,.0f} MB, peak {hwm_end:,.0f} MB")
    print("Must-reach (within 10%):", "PASS" if spread <= 0.10 else "FAIL")


if __name__ == "__main__":
    main()
