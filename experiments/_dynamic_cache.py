"""`bench_dynamic.py --part cache`: DLRM training with tables in a device cache of 10% of
their rows vs the same tables fully on the device, per Zipf exponent.

Workload: B=4096, 13 dense + --tables sparse features with one id each, each its own
table of --vocab rows; --model small (D=16, DLRM bottom 13->64->16, top ->64->1) or dlrm
(D=64, bottom 13->512->256->64, top ->512->256->1, as configs/dlrm_synthetic_1m.yaml);
row-wise Adagrad on the tables, Adam on the MLPs. Ids are Zipf(s) ranks over the
vocabulary (scrambled, so hot rows are spread over the table), pre-generated: --nbatch
batches rotated.

Rows per exponent s (each in its own process, the on-device one first, then the cached
and dynamic ones; every process runs --reps repetitions of --steps steps after a warm-up
and reports the median):
  on device   `TableSpec(vocab_size=V)`: the whole table in the jitted state
  cached      `TableSpec(vocab_size=V, cache=HostCache(rows=V/10))`: rows on the host,
              10% in the device cache, exchanged between steps
  dynamic     `TableSpec(dynamic=DynamicVocab(), cache=HostCache(rows=V/10))`: the same
              ids as raw int64 keys (rows created at first sight)
Each row: ms/step, samples/s, throughput relative to on device (same run), the cache
hit rate over distinct rows, rows moved per step and table, and the host planning
time per step (`HostTables.prepare_train`, most of it overlapped with the device step).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

B, DENSE = 4096, 13
MODELS = {
    "small": (16, (64, 16), (64, 1)),
    "dlrm": (64, (512, 256, 64), (512, 256, 1)),
}
"""--model: (embedding dim, bottom MLP, top MLP). "small" is the worst case for the cache
(a ~2-10 ms step: the host's share is largest); "dlrm" has the layer sizes of
configs/dlrm_synthetic_1m.yaml (the throughput configuration)."""


def _ids(s: float, vocab: int, tables: int, nbatch: int, seed: int = 0) -> np.ndarray:
    """int64[nbatch, tables, B]: Zipf(s) ranks over `vocab`, through a fixed permutation."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** s
    cdf = np.cumsum(p / p.sum())
    perm = rng.permutation(vocab)
    ranks = np.searchsorted(cdf, rng.random((nbatch, tables, B)))
    return perm[np.minimum(ranks, vocab - 1)].astype(np.int64)


def _worker(
    kind: str,
    s: float,
    vocab: int,
    tables: int,
    nbatch: int,
    steps: int,
    reps: int,
    warmup: int,
    model_name: str,
):
    import jax
    import optax

    from sparsejax.data import PaddedIds, SparseBatch
    from sparsejax.embedding import DynamicVocab, FeatureSpec, HostCache, TableSpec
    from sparsejax.nn import DLRM
    from sparsejax.ops.optimizers import RowWiseAdagrad
    from sparsejax.train import Trainer

    opt = RowWiseAdagrad(learning_rate=0.01)
    dim, bottom, top = MODELS[model_name]
    extra = {
        "device": {"vocab_size": vocab},
        "cached": {"vocab_size": vocab, "cache": HostCache(rows=vocab // 10)},
        "dynamic": {"dynamic": DynamicVocab(), "cache": HostCache(rows=vocab // 10)},
    }[kind]
    specs = [TableSpec(name=f"t{i}", dim=dim, optimizer=opt, **extra) for i in range(tables)]
    feats = [FeatureSpec(name=f"f{i}", table=f"t{i}") for i in range(tables)]
    ids = _ids(s, vocab, tables, nbatch)
    if kind == "dynamic":  # raw keys: the ids scrambled over the int64 range
        ids = (ids * np.int64(0x9E3779B1) + 12345) & np.int64(2**62 - 1)
    dtype = np.int32 if kind == "device" else np.int64
    rng = np.random.default_rng(1)
    seg = np.arange(B, dtype=np.int32)
    batches = [
        SparseBatch(
            features={f"f{i}": PaddedIds(ids[k, i].astype(dtype), seg) for i in range(tables)},
            dense=rng.normal(size=(B, DENSE)).astype(np.float32),
            labels=rng.integers(0, 2, B).astype(np.float32),
            mask=np.ones(B, np.float32),
        )
        for k in range(nbatch)
    ]
    if kind == "device":  # the device side gets its batches on the device, as a loader would
        batches = [jax.device_put(b) for b in batches]
    model = DLRM(tables=tuple(specs), features=tuple(feats), bottom=bottom, top=top)
    trainer = Trainer(model, optax.adam(1e-3))
    state = trainer.init(jax.random.key(0), batches[0])
    plan = [0.0]
    if trainer.host.saves_rows:
        host = trainer.host
        prepare = host.prepare

        def timed(tables_, batch, *, train):
            t = time.perf_counter()
            out = prepare(tables_, batch, train=train)
            plan[0] += time.perf_counter() - t
            return out

        host.prepare = timed
    k = 0
    for _ in range(max(nbatch, warmup)):  # warm-up: compile, fill the cache, first touches
        state, m = trainer.train_step(state, batches[k % nbatch])
        k += 1
    jax.block_until_ready(m["loss"])
    if trainer.host.saves_rows:  # stats of the measured steps only
        full = all(ht.n_free_slots == 0 for ht in trainer.host.tables.values())
        print(f"cache full after warm-up: {full}", file=sys.stderr)
        for ht in trainer.host.tables.values():
            ht.stats = type(ht.stats)()
    times, plans = [], []
    for _ in range(reps):
        plan[0] = 0.0
        t = time.perf_counter()
        for _ in range(steps):
            state, m = trainer.train_step(state, batches[k % nbatch])
            k += 1
        jax.block_until_ready(m["loss"])
        times.append((time.perf_counter() - t) / steps)
        plans.append(plan[0] / steps)
    out = {"ms": 1e3 * statistics.median(times), "plan_ms": 1e3 * statistics.median(plans)}
    if trainer.host.saves_rows:
        st = trainer.host.stats()
        out["hit_rate"] = statistics.mean(v["cache_hit_rate"] for v in st.values())
        out["moved"] = statistics.mean(v["rows_moved_per_step"] for v in st.values())
    print(json.dumps(out))


def run(args) -> list[str]:
    """Runs every (exponent, kind) in its own process; returns the table's lines."""
    lines = [
        f"model {args.model} (D={MODELS[args.model][0]}, bottom {MODELS[args.model][1]}, top "
        f"{MODELS[args.model][2]}), B={B}, {args.tables} tables x {args.vocab} rows, "
        f"cache = 10% of the rows; "
        f"{args.reps} reps x {args.steps} steps, median",
        "",
        "| Zipf s | tables | ms/step | samples/s | vs on device | hit rate | rows moved/step/table"
        " | host plan ms/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in args.zipf:
        base = None
        for kind in ("device", "cached", "dynamic"):
            cmd = [
                sys.executable,
                __file__,
                kind,
                str(s),
                str(args.vocab),
                str(args.tables),
                str(args.nbatch),
                str(args.steps),
                str(args.reps),
                str(args.warmup),
                args.model,
            ]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode:
                raise RuntimeError(f"{kind} s={s} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            base = r["ms"] if base is None else base
            hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "-"
            moved = f"{r['moved']:.0f}" if "moved" in r else "-"
            plan = f"{r['plan_ms']:.1f}" if kind != "device" else "-"
            line = (
                f"| {s} | {kind} | {r['ms']:.1f} | {B / r['ms'] * 1e3:,.0f} | "
                f"{base / r['ms']:.2f}x | {hit} | {moved} | {plan} |"
            )
            print(line, flush=True)
            lines.append(line)
    return lines


if __name__ == "__main__":
    kind, s, vocab, tables, nbatch, steps, reps, warmup, model = sys.argv[1:]
    _worker(kind, float(s), *map(int, (vocab, tables, nbatch, steps, reps, warmup)), model)
