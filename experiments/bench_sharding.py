#!/usr/bin/env python3
"""Sharded tables (issue 11): bytes communicated per step and step time per placement.

On an 8-device CPU mesh (2 x 4: data=2, model=4; `--xla_force_host_platform_device_count`
is set before jax is imported), one full training step of the embeddings of a DLRM-like
workload: --tables tables of V rows x --dim columns, one feature per table, 1-3 ids per
bag (uniform), --batch examples over all devices; the step is the store's lookup, the
loss 0.5 * sum(pooled^2) / B, its gradient, and the store's `apply_gradients` (row-wise
Adagrad; Adagrad for column_wise, which cannot split a per-row slot), jitted with the
state donated. --batches pre-generated batches (fixed seed) are rotated step by step.

For each placement and each vocabulary size (--vocabs, default 1e4 and 1e6 rows per
table, 100x apart):

(a) formula: bytes per step per device from shapes, `comm_bytes` of the planner
    (sparsejax/sharding/_planner.py) for the id slots and bags local to one device, an
    id as the store sends it: 8 bytes (row, bag), 12 when its stack needs a pooling
    coefficient (weighted, mean or sqrtn features; none here);
(b) HLO: bytes per step per device from the compiled program
    (`jit(step).lower(...).compile().as_text()`, the per-device SPMD module): every
    all-to-all, all-gather, all-reduce, reduce-scatter and collective-permute, counted
    once each, by the size of its larger side (the full buffer: the result of an
    all-gather, the operand of a reduce-scatter; operand = result for the others; all
    operands of a tuple collective). The bytes a device sends to itself are included,
    as in the formula. Collectives inside loops would be counted once; the script fails
    if any is found outside the entry computation;
(c) ms per step: median of --reps timed runs of --steps steps each, after --warmup
    steps; with --rounds R, every cell runs R times (round after round, each in its own
    process) and the median over the rounds is shown, (min-max) beside it;
(d) ratios of HLO bytes and of ms vs "replicated" at the same vocabulary;
(e) exchange (issue 24): the lookup's all-to-all bytes a device sends to other devices
    per step (ids, bags and the partial bags back), against the bytes that must move
    (the ids whose owner is another device, and the same partial bags), as the
    `Trainer` counts them (`exchange_stats`); "ids" the same for the ids alone.
    `--exchange sized` (default) sizes the send buffers as the `Trainer` does (the
    largest per-owner count over the batches, x --headroom (1.05), rounded up to 1/16 of a power of
    two); `--exchange full` gives the buffers of before (room for every id a device
    holds: S x the ids), whose HLO bytes are the planner's formula.

Baselines: plain `jax.jit` of `jnp.take` on the same tables stacked into one
[T x V, D] array, rows sharded over "model" (`P("model", None)`) and over every device
(`P(("data", "model"), None)`), the same ids as a dense [B, T, 3] array with a mask,
the same loss, the dense autodiff gradient and an SGD update: XLA's own partitioning.

Check (the issue's Must reach): for row_wise and table_wise the HLO bytes are equal at
every vocabulary size; exit status 1 otherwise.

Each cell runs in a fresh process (memory freed by one cell is not always returned to
the system, and no cell inherits another's caches); `--in-process` runs them all here.
Cells whose compiled step would not fit in the free memory (XLA's own memory analysis
plus twice the collective buffers, times 8 devices, against MemAvailable less
--mem-reserve GiB) are compiled and counted but not timed ("not timed", with the need).

    PYTHONPATH=. python experiments/bench_sharding.py
    PYTHONPATH=. python experiments/bench_sharding.py --quick      # smoke run, < 1 min
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # however it is loaded
from _machine import load_average, mem_available  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from sparsejax import ops  # noqa: E402
from sparsejax.data import PaddedIds, SparseBatch  # noqa: E402
from sparsejax.embedding import FeatureSpec, TableSpec  # noqa: E402
from sparsejax.sharding import ShardedTableStore, exchange_bytes, make_mesh, shard_batch  # noqa: E402
from sparsejax.sharding._batch import capacity_per_device  # noqa: E402
from sparsejax.train._trainer import _bucket  # noqa: E402

PLACEMENTS = ("replicated", "table_wise", "column_wise", "table_row_wise", "row_wise")
BASELINES = {
    "jit take, rows over model": P("model", None),
    "jit take, rows over all": P(("data", "model"), None),
}
MUST_BE_EQUAL = ("row_wise", "table_wise")
MAX_IDS = 3
LR = 0.05
COLLECTIVES = (
    "all-to-all",
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "collective-permute",
)
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<result>.*?)\s+"
    r"(?P<op>(?:" + "|".join(COLLECTIVES) + r")(?:-start|-done)?)\((?P<operands>[^)]*)\)"
)


# ------------------------------------------------------------------ helpers


def vocab_text(v: int) -> str:
    e = len(str(v)) - 1
    return f"1e{e}" if v == 10**e else f"{v:,}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def _shapes_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        size = DTYPE_BYTES[dtype]
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size
    return total


def hlo_collectives(hlo: str) -> list[dict]:
    """Every collective of a compiled (per-device) HLO module: op, bytes (the larger of
    its operands and its result), computation. Async pairs count at their start."""
    out, comp = [], None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            comp = ("ENTRY " if head.group(1) else "") + head.group(2)
            continue
        m = _INSTR.match(line)
        if not m or m.group("op").endswith("-done"):
            continue
        op = m.group("op").removesuffix("-start")
        res, opnd = _shapes_bytes(m.group("result")), _shapes_bytes(m.group("operands"))
        if m.group("op").endswith("-start"):  # result = (operands..., outputs...)
            res -= opnd
        out.append(
            {"op": op, "bytes": max(res, opnd), "computation": comp, "name": m.group("name")}
        )
    return out


def summarize(colls: list[dict]) -> tuple[int, str]:
    """Total bytes and a per-op breakdown ("op xcount: bytes")."""
    by: dict[str, list[int]] = {}
    for c in colls:
        by.setdefault(c["op"], []).append(c["bytes"])
    parts = [f"{op} x{len(v)}: {fmt_bytes(sum(v))}" for op, v in sorted(by.items())]
    return sum(c["bytes"] for c in colls), "; ".join(parts) or "none"


def fits(compiled, devices: int, collective_bytes: int, reserve: float) -> tuple[bool, int]:
    """Whether the compiled step fits the free memory: XLA's per-device analysis, plus
    twice each device's collective bytes (the CPU collectives copy their buffers outside
    that analysis: the 1e6-row jit-take step over "model", analysed at 12.3 GB, reached
    19.8 GB), times the devices, under MemAvailable less `reserve` GiB."""
    m = compiled.memory_analysis()
    per = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    per += 2 * collective_bytes - m.alias_size_in_bytes
    need = per * devices
    return need < mem_available() - reserve * 2**30, need


# ------------------------------------------------------------------ workload


def make_specs(placement: str, tables: int, vocab: int, dim: int):
    opt = (
        ops.Adagrad(learning_rate=LR)
        if placement == "column_wise"
        else ops.RowWiseAdagrad(learning_rate=LR)
    )
    ts = [
        TableSpec(name=f"t{i}", vocab_size=vocab, dim=dim, optimizer=opt, placement=placement)
        for i in range(tables)
    ]
    fs = [FeatureSpec(name=f"f{i}", table=f"t{i}", max_ids=MAX_IDS) for i in range(tables)]
    return ts, fs


def make_batches(rng, n: int, batch: int, tables: int, vocab: int) -> list[dict]:
    """`n` batches: per feature (lengths [B] in 1..3, ids [sum lengths] uniform)."""
    out = []
    for _ in range(n):
        feats = {}
        for i in range(tables):
            lengths = rng.integers(1, MAX_IDS + 1, batch)
            feats[f"f{i}"] = (lengths, rng.integers(0, vocab, int(lengths.sum())))
        out.append(feats)
    return out


def padded(raw: dict, features, batch: int) -> SparseBatch:
    out = {}
    for f in features:
        lengths, ids = raw[f.name]
        cap = f.capacity_for(batch)
        pad = cap - ids.size
        segs = np.repeat(np.arange(batch), lengths)
        out[f.name] = PaddedIds(
            np.concatenate([ids, -np.ones(pad, np.int64)]).astype(np.int32),
            np.concatenate([segs, np.full(pad, batch - 1)]).astype(np.int32),
            None,
        )
    ones = np.ones(batch, np.float32)
    return SparseBatch(out, np.zeros((batch, 1), np.float32), ones, ones)


def dense_ids(raw: dict, tables: int, vocab: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The same ids as [B, T, 3] rows of the stacked [T x V, D] table, and a mask."""
    ids = np.zeros((batch, tables, MAX_IDS), np.int32)
    mask = np.zeros((batch, tables, MAX_IDS), np.float32)
    for i in range(tables):
        lengths, flat = raw[f"f{i}"]
        pos = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        ex = np.repeat(np.arange(batch), lengths)
        ids[ex, i, pos] = flat + i * vocab
        mask[ex, i, pos] = 1.0
    return ids, mask


def formula_bytes(store: ShardedTableStore, batch: int) -> int | None:
    """The planner's `comm_bytes` for the ids and bags local to one device, summed over
    the tables, at the bytes an id really travels as (8: row and bag; 12 when a feature
    of the stack needs a pooling coefficient); None without the planner."""
    try:
        from sparsejax.sharding._planner import comm_bytes
    except ImportError:
        return None
    with_id_bytes = "id_bytes" in inspect.signature(comm_bytes).parameters  # else 12 B/id
    n = store.num_devices
    coef = {
        e.piece.source for g in store.groups.values() if g.needs_coefficients for e in g.entries
    }
    total = 0
    for t in store.tables.values():
        feats = [f for f in store.features.values() if f.table == t.name]
        c = comm_bytes(
            t.placement,
            ids=sum(capacity_per_device(f, batch, n) for f in feats),
            bags=sum(batch // n * f.bags_per_example() for f in feats),
            dim=t.dim,
            mesh_shape=dict(store.mesh.shape),
            **({"id_bytes": 12 if t.name in coef else 8} if with_id_bytes else {}),
        )
        total += c["forward"] + c["backward"]
    return total


def time_steps(step, state, inputs, steps: int, reps: int, warmup: int):
    """Median ms per step over `reps` runs of `steps` steps (inputs rotated)."""
    k = 0
    for _ in range(warmup):
        state, loss = step(state, *inputs[k % len(inputs)], jnp.int32(k + 1))
        k += 1
    jax.block_until_ready(state)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(steps):
            state, loss = step(state, *inputs[k % len(inputs)], jnp.int32(k + 1))
            k += 1
        jax.block_until_ready((state, loss))
        times.append((time.perf_counter() - t) / steps * 1e3)
    if not np.isfinite(float(loss)):
        raise FloatingPointError("the loss is not finite")
    del state
    return statistics.median(times)


def fill_state(abstract):
    """Weights (a cheap deterministic pattern, |w| < 0.01) and slots, placed as the store
    places them, built on the devices."""

    def build():
        def one(path, s):
            if getattr(path[-1], "key", None) == "weights":
                r = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
                c = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
                return (((r * 7 + c * 13) % 199).astype(jnp.float32) * 1e-4 - 0.01).astype(s.dtype)
            return jnp.full(s.shape, 0.1, s.dtype)

        return jax.tree_util.tree_map_with_path(one, abstract)

    return jax.jit(build, out_shardings=jax.tree.map(lambda s: s.sharding, abstract))()


# ------------------------------------------------------------------ cells


def store_cell(args, mesh, placement: str, vocab: int, raws: list[dict]) -> dict:
    tables, features = make_specs(placement, args.tables, vocab, args.dim)
    store = ShardedTableStore(tables, features, mesh=mesh, implementation=args.implementation)
    b = args.batch
    feat_sharding = NamedSharding(mesh, P(("data", "model")))

    def loss_fn(outputs):
        split = store.split(outputs, b)
        return sum(0.5 * jnp.sum(v * v) for v in split.values()) / b

    def step(state, feats, k):
        outputs, res = store.lookup(state, feats, b)
        loss, g = jax.value_and_grad(loss_fn)(outputs)
        return store.apply_gradients(state, res, g, step=k), loss

    counts = [{} for _ in raws]
    split = [
        shard_batch(padded(r, features, b), store.features, 8, stores=[store], counts=c)
        for r, c in zip(raws, counts, strict=True)
    ]
    sized = args.exchange == "sized"
    groups = sorted(counts[0])
    n_per = {  # every id a device holds, per group (the buffers of before)
        g: sum(capacity_per_device(e.feature, b, 8) for e in store.groups[g].entries)
        for g in groups
    }
    caps = {
        g: _bucket(int(np.ceil(max(int(c[g].max()) for c in counts) * args.headroom)))
        if sized
        else n_per[g]
        for g in groups
    }
    if sized:
        split = [
            dataclasses.replace(
                sb,
                features={
                    k: dataclasses.replace(v, exchange=tuple(sorted(caps.items())))
                    for k, v in sb.features.items()
                },
            )
            for sb in split
        ]
    moved = (
        np.mean(
            [exchange_bytes([store], c, caps, sb, 0) for c, sb in zip(counts, split, strict=True)],
            axis=0,
        )
        / 8
    )  # per device
    inputs = [(jax.device_put(sb.features, feat_sharding),) for sb in split]
    abstract = store.abstract_state()
    jstep = jax.jit(step, donate_argnums=0)
    compiled = jstep.lower(abstract, *inputs[0], jnp.int32(1)).compile()
    r = finish(args, compiled, lambda: fill_state(abstract), inputs, formula_bytes(store, b))
    keys = ("sent", "needed", "sent_ids", "needed_ids")
    r["exchange"] = dict(zip(keys, moved.tolist(), strict=True))
    r["capacity"] = {g: (caps[g], n_per[g]) for g in groups}
    return r


def baseline_cell(args, mesh, spec: P, vocab: int, raws: list[dict]) -> dict:
    b, t, d = args.batch, args.tables, args.dim
    table_sharding = NamedSharding(mesh, spec)
    batch_sharding = NamedSharding(mesh, P(("data", "model")))

    def step(table, ids, mask, k):
        def loss_fn(table):
            pooled = (jnp.take(table, ids, axis=0) * mask[..., None]).sum(2)
            return 0.5 * jnp.sum(pooled * pooled) / b

        loss, g = jax.value_and_grad(loss_fn)(table)
        return table - LR * g, loss

    inputs = [
        tuple(jax.device_put(a, batch_sharding) for a in dense_ids(r, t, vocab, b)) for r in raws
    ]
    abstract = jax.ShapeDtypeStruct((t * vocab, d), jnp.float32, sharding=table_sharding)
    jstep = jax.jit(step, donate_argnums=0, out_shardings=(table_sharding, None))
    compiled = jstep.lower(abstract, *inputs[0], jnp.int32(1)).compile()

    def init():
        return fill_state({"weights": abstract})["weights"]

    return finish(args, compiled, init, inputs, None)


def finish(args, compiled, init, inputs, formula) -> dict:
    colls = hlo_collectives(compiled.as_text())
    outside = [c for c in colls if not (c["computation"] or "").startswith("ENTRY")]
    if outside:
        raise RuntimeError(
            f"collectives outside the entry computation (counted once, may run more): "
            f"{[(c['name'], c['computation']) for c in outside]}"
        )
    hlo, breakdown = summarize(colls)
    ok, need = fits(compiled, 8, hlo, args.mem_reserve)
    ms, note = None, ""
    if args.no_time:
        note = f"not timed (needs {fmt_bytes(need)})"
    elif ok:
        ms = time_steps(compiled, init(), inputs, args.steps, args.reps, args.warmup)
    else:
        note = f"not timed: needs {fmt_bytes(need)} of {fmt_bytes(mem_available())} free"
    gc.collect()
    return {"formula": formula, "hlo": hlo, "breakdown": breakdown, "ms": ms, "note": note}


# ------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=4096, help="global batch (examples)")
    p.add_argument("--tables", type=int, default=8, help="tables (one feature each)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--vocabs", type=int, nargs="+", default=[10_000, 1_000_000])
    p.add_argument("--reps", type=int, default=5, help="timed runs per cell (median)")
    p.add_argument("--steps", type=int, default=5, help="steps per timed run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batches", type=int, default=4, help="distinct batches, rotated")
    p.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS)
    p.add_argument("--no-baseline", action="store_true", help="skip the jit-take baselines")
    p.add_argument("--implementation", default=None, help="sparse ops kernel (default: best)")
    p.add_argument("--mem-reserve", type=float, default=4.0, help="GiB left free when timing")
    p.add_argument("--no-time", action="store_true", help="bytes only (compile, no steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="runs of every cell (ms: median)")
    p.add_argument("--in-process", action="store_true", help="all cells in this process")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument(
        "--exchange", choices=("sized", "full"), default="sized", help="send buffers (see (e))"
    )
    p.add_argument("--headroom", type=float, default=1.05, help="sized buffers' headroom")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.tables, args.dim, args.vocabs = 64, 2, 8, [100, 10_000]
        args.reps, args.steps, args.warmup, args.batches = 1, 1, 1, 2
    return args


def run_cell(args: argparse.Namespace, name: str, vocab: int) -> dict:
    """One (placement or baseline, vocabulary) cell in this process."""
    if len(jax.devices()) < 8:
        raise SystemExit(f"needs 8 devices, jax sees {len(jax.devices())} (set XLA_FLAGS={_FLAG})")
    mesh = make_mesh(model=4, devices=jax.devices()[:8])
    raws = make_batches(
        np.random.default_rng(args.seed), args.batches, args.batch, args.tables, vocab
    )
    if name in BASELINES:
        r = baseline_cell(args, mesh, BASELINES[name], vocab, raws)
    else:
        r = store_cell(args, mesh, name, vocab, raws)
    r.update(placement=name, vocab=vocab)
    return r


def cell_subprocess(args: argparse.Namespace, name: str, vocab: int) -> dict:
    """`run_cell` in a fresh process: every cell starts with the memory and caches of a
    new process, whatever the cells before it allocated."""
    spec = json.dumps({"args": vars(args), "name": name, "vocab": vocab})
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--cell", spec],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.splitlines()[-1])


def measure(args: argparse.Namespace, log=print) -> list[dict]:
    """One row per (vocabulary, placement or baseline), in that order; each cell in its
    own process unless `--in-process`."""
    log(
        f"# mesh data=2 x model=4 (8 CPU devices), batch {args.batch}, {args.tables} tables x "
        f"dim {args.dim}, 1-{MAX_IDS} ids/bag, vocabs {args.vocabs}, implementation "
        f"{args.implementation}, jax {jax.__version__}, MemAvailable "
        f"{fmt_bytes(mem_available())}, load average {load_average()}"
    )
    names = list(args.placements) + ([] if args.no_baseline else list(BASELINES))
    runs: dict[tuple[str, int], list[dict]] = {}
    for k in range(args.rounds):
        for vocab in args.vocabs:
            for name in names:
                t = time.perf_counter()
                run = run_cell if args.in_process else cell_subprocess
                r = run(args, name, vocab)
                runs.setdefault((name, vocab), []).append(r)
                log(
                    f"# round {k + 1}: {name} V={vocab}: HLO {fmt_bytes(r['hlo'])} "
                    f"({r['breakdown']}), formula {fmt_bytes(r['formula'])}, {ms_text(r)} "
                    f"[{time.perf_counter() - t:.0f} s, load {load_average()}, "
                    f"MemAvailable {fmt_bytes(mem_available())}]"
                )
    rows = []
    for rs in runs.values():
        if len({r["hlo"] for r in rs}) != 1:
            raise RuntimeError(f"HLO bytes differ between rounds: {rs}")
        ms = [r["ms"] for r in rs if r["ms"] is not None]
        rows.append(
            {
                **rs[0],
                "ms": statistics.median(ms) if ms else None,
                "ms_range": (min(ms), max(ms)) if len(ms) > 1 else None,
            }
        )
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cell"]:  # a child of `cell_subprocess`
        spec = json.loads(argv[1])
        r = run_cell(argparse.Namespace(**spec["args"]), spec["name"], spec["vocab"])
        print(json.dumps(r))
        return 0
    rows = measure(parse_args(argv), log=lambda s: print(s, flush=True))
    print(table(rows))
    return check(rows)


def ms_text(r: dict) -> str:
    return f"{r['ms']:.1f} ms" if r["ms"] is not None else r["note"]


def table(rows: list[dict]) -> str:
    ref = {r["vocab"]: r for r in rows if r["placement"] == "replicated"}
    lines = [
        "| placement | vocab/table | bytes/step/device formula | bytes/step/device HLO "
        "| HLO - formula | ms/step | HLO bytes vs replicated | time vs replicated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = ref.get(r["vocab"])
        rb = f"{r['hlo'] / base['hlo']:.2f}x" if base and base["hlo"] else "-"
        rt = f"{r['ms'] / base['ms']:.2f}x" if base and base["ms"] and r["ms"] else "-"
        ms = f"{r['ms']:.1f}" if r["ms"] is not None else r["note"]
        if r.get("ms_range"):
            ms += " ({:.1f}-{:.1f})".format(*r["ms_range"])
        diff = "-" if r["formula"] is None else f"{r['hlo'] - r['formula']:+,} B"
        lines.append(
            f"| {r['placement']} | {vocab_text(r['vocab'])} | {fmt_bytes(r['formula'])} "
            f"| {fmt_bytes(r['hlo'])} | {diff} | {ms} | {rb} | {rt} |"
        )
    ex = [r for r in rows if r.get("exchange") and r["exchange"]["needed"]]
    if ex:
        lines += [
            "",
            "Lookup all-to-all bytes per step per device, sent to other devices vs needed:",
            "",
            "| placement | vocab/table | capacity / ids per device | sent | needed | ratio "
            "| ids sent | ids needed | ids ratio |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in ex:
            e = r["exchange"]
            cap = ", ".join(f"{c}/{n}" for c, n in r["capacity"].values())
            ids = e["sent_ids"] / e["needed_ids"] if e["needed_ids"] else float("nan")
            lines.append(
                f"| {r['placement']} | {vocab_text(r['vocab'])} | {cap} "
                f"| {fmt_bytes(e['sent'])} | {fmt_bytes(e['needed'])} "
                f"| {e['sent'] / e['needed']:.2f}x | {fmt_bytes(e['sent_ids'])} "
                f"| {fmt_bytes(e['needed_ids'])} | {ids:.2f}x |"
            )
    lines.append("")
    lines.append("HLO collectives per step (one device):")
    for r in rows:
        lines.append(f"- {r['placement']}, V={vocab_text(r['vocab'])}: {r['breakdown']}")
    return "\n".join(lines)


def check(rows: list[dict]) -> int:
    """Exit status: 1 if row_wise or table_wise moves different bytes at two vocabulary
    sizes (the other placements are reported, not failed)."""
    bad = []
    for pl in PLACEMENTS:
        got = {r["vocab"]: r["hlo"] for r in rows if r["placement"] == pl}
        if len(got) < 2:
            continue
        same = len(set(got.values())) == 1
        print(
            f"check: {pl} HLO bytes/step at V={' / '.join(map(vocab_text, got))}: "
            f"{' / '.join(f'{b:,}' for b in got.values())} -> {'equal' if same else 'DIFFERENT'}"
        )
        if not same and pl in MUST_BE_EQUAL:
            bad.append(pl)
    if bad:
        print(f"FAILED: {bad} move vocabulary-dependent bytes")
        return 1
    print(
        f"Must reach holds: {' and '.join(MUST_BE_EQUAL)} bytes/step do not depend on "
        f"the vocabulary"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
