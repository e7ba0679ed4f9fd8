#!/usr/bin/env python3
"""Input pipeline throughput: rows/s parsed per format, and the loader overlapped with
training the default DLRM (issue 9).

Files (generated once into --dir, larger than the CPU cache; kept for reruns, removed
with --clean): --rows Criteo-shaped rows (label, 13 dense integers, 26 8-hex-digit ids
with power-law frequencies, 20% of dense and 5% of ids empty; `_input_files.py`) as

  criteo    Criteo TSV                          FileSource(format="criteo")
  gz        the same, gzip-compressed           FileSource(format="criteo")
  zst       the same, zstd-compressed           FileSource(format="criteo")
  csv       comma-separated with a header; ids  FileSource(format="delimited"), the
            are strings, hashed (stable_hash)   ids hashed with blake2b once per string
  libsvm    libFM `label field:idx:val ...`     FileSource(format="libsvm", field_map=
            (empty fields omitted: variable      26 fields + dense), field-aware
            width)
  parquet   label, I1..I13 float, C1..C26 int64  FileSource(format="parquet", int_ids)
            (row groups of 64k rows)

(a) Parse rate: each format read start to end (chunks of parsed `Examples`, nothing
    else), --reps repetitions, median (min-max) rows/s.
(b) Loader vs training, the `sparsejax train` default (synthetic-shaped data: DLRM,
    batch 1024, embedding dim 16, tables of the Criteo cardinalities capped at 100k
    rows): the Criteo file is streamed by `Loader(FileSource(..., transform=hash ids
    into the tables), shuffle_buffer=65536, device_put=True, prefetch=4)`.
      train step alone   the jitted train step on 16 pre-packed device batches, rotated
      loader alone       the loader's batches/s (parse + map + shuffle + pack + put)
      synthetic          for comparison, the same with the loader of `sparsejax train`'s
                         default data (`SyntheticCriteo`: generate + pack + put)
      overlapped         the train step fed by the loader (what a run does); on 2
                         cores the loader's threads and XLA's share the CPUs, so it is
                         slower than the step alone even when the loader keeps ahead
    The Must-reach: the loader alone is faster than the train step alone (the loader
    keeps ahead), so overlapped training runs at the train step's rate.

    PYTHONPATH=. python experiments/bench_input.py --rows 1000000 --reps 3
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _input_files import NUM_CAT, NUM_DENSE, CriteoRows, _rendered, assemble  # noqa: E402

DENSE = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
CATS = [f"C{i}" for i in range(1, NUM_CAT + 1)]
BLOCK = 200_000


def log(msg: str) -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"[{time.strftime('%H:%M:%S')} load {load}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Files


def make_files(d: str, n: int) -> dict[str, str]:
    os.makedirs(d, exist_ok=True)
    paths = {
        "criteo": os.path.join(d, "train.tsv"),
        "gz": os.path.join(d, "train.tsv.gz"),
        "zst": os.path.join(d, "train.tsv.zst"),
        "csv": os.path.join(d, "train.csv"),
        "libsvm": os.path.join(d, "train.libfm"),
        "parquet": os.path.join(d, "train.parquet"),
    }
    meta = os.path.join(d, "meta.json")
    if os.path.exists(meta) and json.load(open(meta)).get("rows") == n:
        return paths
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rows = CriteoRows(seed=0)
    cols = rows.columns()
    # libFM: field k holds `k:idx:val` (dense: idx 0, val = the integer; ids: idx = choice).
    fm_cols = [rows.labels]
    for k in range(NUM_DENSE):
        fm_cols.append(_rendered([b""] + [b"%d:0:%d" % (k, x) for x in range(2000)]))
    for k in range(NUM_CAT):
        fm_cols.append(
            _rendered([b""] + [b"%d:%d:1" % (NUM_DENSE + k, v) for v in range(1, rows.vocab + 1)])
        )
    cat_raw = [
        np.array([-1] + [int(v, 16) for v in _strings(mat, lens)[1:]], np.int64)
        for mat, lens in rows.cats
    ]
    header = (",".join(["label", *DENSE, *CATS]) + "\n").encode()
    zc = zstandard.ZstdCompressor(level=3)
    schema = pa.schema(
        [("label", pa.int8())]
        + [(c, pa.float32()) for c in DENSE]
        + [(c, pa.int64()) for c in CATS]
    )
    t0 = time.perf_counter()
    with (
        open(paths["criteo"], "wb") as f_tsv,
        gzip.open(paths["gz"], "wb", compresslevel=6) as f_gz,
        open(paths["zst"], "wb") as f_zst_raw,
        open(paths["csv"], "wb") as f_csv,
        open(paths["libsvm"], "wb") as f_fm,
        pq.ParquetWriter(paths["parquet"], schema) as f_pq,
    ):
        f_zst = zc.stream_writer(f_zst_raw)
        f_csv.write(header)
        for start in range(0, n, BLOCK):
            k = min(BLOCK, n - start)
            ch = rows.choices(start, k)
            tsv = assemble(cols, ch, b"\t")
            f_tsv.write(tsv)
            f_gz.write(tsv)
            f_zst.write(tsv)
            f_csv.write(assemble(cols, ch, b","))
            f_fm.write(assemble(fm_cols, ch, b" "))
            dense = np.where(ch[:, 1 : 1 + NUM_DENSE] > 0, ch[:, 1 : 1 + NUM_DENSE] - 1, 0)
            arrays = [pa.array(ch[:, 0].astype(np.int8))]
            arrays += [pa.array(dense[:, j].astype(np.float32)) for j in range(NUM_DENSE)]
            for j in range(NUM_CAT):
                raw = cat_raw[j][ch[:, 1 + NUM_DENSE + j]]
                arrays.append(pa.array(raw, mask=raw < 0))
            f_pq.write_batch(pa.record_batch(arrays, schema=schema), row_group_size=1 << 16)
        f_zst.flush(zstandard.FLUSH_FRAME)
    log(f"generated {n:,} rows in {time.perf_counter() - t0:.0f} s")
    json.dump({"rows": n}, open(meta, "w"))
    return paths


def _strings(mat, lens):
    return [bytes(mat[i, : lens[i]]).decode() for i in range(mat.shape[0])]


def sources(paths):
    from sparsejax.data import FileSource

    fmap = {k: f"f{k}" for k in range(NUM_DENSE + NUM_CAT)}
    csv_schema = {"label": "label", "dense": DENSE, "categorical": CATS}
    pq_schema = {"label": "label", "dense": DENSE, "categorical": CATS, "int_ids": True}
    return {
        "criteo": lambda: FileSource(paths["criteo"], format="criteo"),
        "gz": lambda: FileSource(paths["gz"], format="criteo"),
        "zst": lambda: FileSource(paths["zst"], format="criteo"),
        "csv": lambda: FileSource(paths["csv"], format="delimited", schema=csv_schema),
        "libsvm": lambda: FileSource(paths["libsvm"], format="libsvm", field_map=fmap),
        "parquet": lambda: FileSource(paths["parquet"], format="parquet", schema=pq_schema),
    }


# ---------------------------------------------------------------------------------------
# (a) parse rates


def parse_rates(paths, reps: int):
    out = {}
    for name, make in sources(paths).items():
        rates = []
        for _ in range(reps):
            src = make()
            t = time.perf_counter()
            n = sum(len(c.examples) for c in src.chunks())
            rates.append(n / (time.perf_counter() - t))
        out[name] = (rates, n, os.path.getsize(paths[name]))
        log(f"{name}: {statistics.median(rates):,.0f} rows/s")
    return out


# ---------------------------------------------------------------------------------------
# (b) loader vs training


def loader_vs_training(path: str, reps: int, steps: int):
    import jax

    from sparsejax import runner
    from sparsejax.data import FileSource, HashMapping, Loader, measure_throughput

    cfg = runner.load_config([], ["progress=false"])
    assert (cfg.model.name, cfg.data.kind, cfg.data.batch_size) == ("dlrm", "synthetic", 1024)
    data = runner.build_data(cfg)
    model = runner.build_model(cfg, data.tables, data.features)
    trainer = runner.Trainer(model, runner.dense_optimizer(cfg.optimizer))
    vocab = {t.name: t.vocab_size for t in data.tables}
    maps = {f.name: HashMapping(buckets=vocab[f.table]) for f in data.features}

    def source():
        return FileSource(path, format="criteo", transform=lambda ex: ex.map_ids(maps))

    def loader():
        return Loader(
            source(),
            data.packer,
            seed=0,
            epochs=None,
            shuffle_buffer=1 << 16,
            device_put=True,
            prefetch=4,
        )

    b = data.packer.batch_size
    with loader() as ld:
        batches = [next(ld) for _ in range(16)]
    state = trainer.init(jax.random.key(0), batches[0])
    k = [0]

    def step(batch):
        nonlocal state
        state, m = trainer.train_step(state, batch)
        return m["loss"]

    for i in range(5):
        jax.block_until_ready(step(batches[i % 16]))

    def overlapped(ld):
        it = iter(ld)
        for _ in range(3):
            jax.block_until_ready(step(next(it)))
        t = time.perf_counter()
        for _ in range(steps):
            last = step(next(it))
        jax.block_until_ready(last)
        return steps * b / (time.perf_counter() - t)

    def synthetic():
        return Loader(data.train_source, data.packer, device_put=True, prefetch=4, epochs=None)

    train, load, over, syn_load, syn_over = [], [], [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(steps):
            last = step(batches[(k[0] + i) % 16])
        jax.block_until_ready(last)
        train.append(steps * b / (time.perf_counter() - t))
        with loader() as ld:
            load.append(measure_throughput(ld, num_batches=steps, warmup=2) * b)
        with loader() as ld:
            over.append(overlapped(ld))
        with synthetic() as ld:
            syn_load.append(measure_throughput(ld, num_batches=steps, warmup=2) * b)
        with synthetic() as ld:
            syn_over.append(overlapped(ld))
        log(f"train {train[-1]:,.0f}/s, loader {load[-1]:,.0f}/s, overlapped {over[-1]:,.0f}/s")
    return train, load, over, syn_load, syn_over


def fmt(rates):
    return f"{statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200, help="train steps per repetition (b)")
    ap.add_argument("--dir", default="/tmp/sparsejax_bench_input")
    ap.add_argument("--skip-parse", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--clean", action="store_true", help="delete --dir at the end")
    args = ap.parse_args()
    paths = make_files(args.dir, args.rows)
    print(f"# bench_input: {args.rows:,} rows per file, {args.reps} repetitions, median (min-max)")
    print(f"# machine: {os.cpu_count()} CPUs, load at start {os.getloadavg()[0]:.2f}\n")
    if not args.skip_parse:
        rates = parse_rates(paths, args.reps)
        print("| format | file MB | rows/s parsed | MB/s |")
        print("|---|---|---|---|")
        for name, (r, n, size) in rates.items():
            mbs = statistics.median(r) * size / n / 1e6
            print(f"| {name} | {size / 1e6:,.0f} | {fmt(r)} | {mbs:,.0f} |")
        print()
    if not args.skip_train:
        train, load, over, syn_load, syn_over = loader_vs_training(
            paths["criteo"], args.reps, args.steps
        )
        print("| default DLRM, batch 1024 | samples/s |")
        print("|---|---|")
        print(f"| train step alone (pre-packed device batches) | {fmt(train)} |")
        print(f"| loader alone (Criteo file: parse, hash, shuffle, pack, put) | {fmt(load)} |")
        print(f"| training fed by the loader | {fmt(over)} |")
        print(f"| for comparison: the synthetic generator's loader alone | {fmt(syn_load)} |")
        print(f"| for comparison: training fed by the synthetic loader | {fmt(syn_over)} |")
        print(f"\nloader / train step: {statistics.median(load) / statistics.median(train):.2f}x")
    if args.clean:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
