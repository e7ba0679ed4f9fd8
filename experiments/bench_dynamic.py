#!/usr/bin/env python3
"""Dynamic IDs (issue 10): throughput of the ID map, and (part "cache") the device cache.

--part map: IDs/s of `IdMap` (sparsejax/embedding/_id_map.py), both backends ("cpp":
    csrc/id_map.cc, "numpy": the vectorized fallback), at --sizes live keys (1e6, 1e7,
    1e8; 1e8 only when MemAvailable covers it, else skipped with the reason printed),
    against a Python dict and against `np.searchsorted` on a sorted key array.
    Keys are distinct random-looking int64 (a bijective mix of 0..N-1, so negatives and
    values near the int64 limits occur). Each rep uses a fresh batch of --batch keys:
      lookup   uniform random present keys (the worst case: every probe a cache miss)
      insert   --batch new keys into the map holding N keys (timed), then erased (the
               erase timed too), so every rep starts at N live keys
      build    N keys inserted from an empty map (capacity 1024) in --batch chunks,
               growth included (one rep); on this VM memory never touched before
               costs ~1 s per GiB at first touch, a good part of this figure
      unique   `unique_keys` of the lookup batch (searchsorted column: np.unique with
               inverse and counts, in sorted order; no dict figure)
    Python dict: lookup `list(map(d.__getitem__, q.tolist()))` -> int32 array, insert
    `d.update(zip(keys.tolist(), values.tolist()))`, erase `d.pop` per key: the array
    conversions are included, as the map's callers hold arrays. Above --dict-max live
    keys the dict is not built (memory, time): its rate at --dict-max is reported,
    marked "*" (extrapolated; a bigger dict would be slower, not faster).
    searchsorted: lookup = searchsorted + compare + gather; insert = sort the batch,
    searchsorted, np.insert into keys and values (O(N) per batch); erase = np.delete.
    Median of --reps reps (lookup, insert, erase); one thread (the map's loops are
    single-threaded, numpy's too).

    PYTHONPATH=. python experiments/bench_dynamic.py --part map

--part cache: DLRM training with each table's rows in a device cache of 10% of them
    (static ids, and the same ids as raw keys of dynamic tables) vs the tables fully on
    the device, per Zipf exponent; see experiments/_dynamic_cache.py.

    PYTHONPATH=. python experiments/bench_dynamic.py --part cache
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np
from _machine import cpu_name, mem_available  # experiments/: the script's directory

from sparsejax.embedding.host import _id_map
from sparsejax.embedding.host._id_map import EMPTY_KEY, IdMap, unique_keys

# ------------------------------------------------------------------ shared helpers


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    """(seconds, result) of fn(*args, **kwargs)."""
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t, out


def median_rate(n: int, seconds: list[float]) -> float:
    return n / statistics.median(seconds)


# ------------------------------------------------------------------ part "map"

_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xBF58476D1CE4E5B9)


def distinct_keys(start: int, n: int) -> np.ndarray:
    """Keys number start..start+n-1 of a fixed bijection of uint64 (distinct for
    distinct numbers), as int64; never EMPTY_KEY (key number 2**64-1 is not drawn)."""
    x = np.arange(start, start + n, dtype=np.uint64)
    x *= _K1
    x ^= x >> np.uint64(31)
    x *= _K2
    x ^= x >> np.uint64(29)
    k = x.view(np.int64)
    bad = k == EMPTY_KEY
    if bad.any():  # one key number in 2**64; redraw it from far away
        k[bad] = distinct_keys(1 << 62, 1)[0]
    return k


def map_bytes_needed(n: int, backends: list[str]) -> int:
    """Peak bytes of the map part at n live keys (one backend at a time)."""
    slots = 16
    while slots // 2 < n:
        slots *= 2
    peak = {"cpp": 16 * slots * 3 // 2, "numpy": 12 * slots * 3 // 2 + 40 * n}
    keys = 12 * n  # keys + values arrays
    searchsorted = 12 * n * 2 + 8 * n
    return keys + max([searchsorted] + [peak[b] for b in backends])


def bench_idmap(backend, keys, vals, batch, reps, rng, next_key):
    n = keys.size
    m = IdMap(1024, backend=backend)
    t = time.perf_counter()
    for c in range(0, n, batch):
        m.insert(keys[c : c + batch], vals[c : c + batch])
    build = n / (time.perf_counter() - t)
    assert len(m) == n
    look, ins, era, uni = [], [], [], []
    for r in range(reps):
        q = keys[rng.integers(0, n, size=batch)]
        dt, out = timed(m.lookup, q)
        look.append(dt)
        assert (out >= 0).all()
        uni.append(timed(unique_keys, q, backend=backend)[0])
        new = distinct_keys(next_key + r * batch, batch)
        nv = np.arange(n, n + batch, dtype=np.int32)
        ins.append(timed(m.insert, new, nv)[0])
        dt, old = timed(m.erase, new)
        era.append(dt)
        assert len(m) == n and (old == nv).all()
    res = {
        "lookup": median_rate(batch, look),
        "insert": median_rate(batch, ins),
        "erase": median_rate(batch, era),
        "build": build,
        "unique": median_rate(batch, uni),
        "bytes/key": m.nbytes / n,
    }
    del m
    gc.collect()
    return res


def dict_lookup(d, q):
    return np.array(list(map(d.__getitem__, q.tolist())), np.int32)


def dict_insert(d, keys, values):
    d.update(zip(keys.tolist(), values.tolist(), strict=True))


def dict_erase(d, keys):
    return np.array([d.pop(k, -1) for k in keys.tolist()], np.int32)


def bench_dict(keys, vals, batch, reps, rng, next_key):
    n = keys.size
    t = time.perf_counter()
    d = dict(zip(keys.tolist(), vals.tolist(), strict=True))
    build = n / (time.perf_counter() - t)
    look, ins, era = [], [], []
    for r in range(reps):
        q = keys[rng.integers(0, n, size=batch)]
        look.append(timed(dict_lookup, d, q)[0])
        new = distinct_keys(next_key + r * batch, batch)
        nv = np.arange(n, n + batch, dtype=np.int32)
        ins.append(timed(dict_insert, d, new, nv)[0])
        era.append(timed(dict_erase, d, new)[0])
    res = {
        "lookup": median_rate(batch, look),
        "insert": median_rate(batch, ins),
        "erase": median_rate(batch, era),
        "build": build,
    }
    del d
    gc.collect()
    return res


def sorted_lookup(sk, sv, q):
    i = np.searchsorted(sk, q)
    np.minimum(i, sk.size - 1, out=i)
    return np.where(sk[i] == q, sv[i], np.int32(-1))


def sorted_insert(sk, sv, keys, values):
    o = np.argsort(keys)
    bk, bv = keys[o], values[o]
    pos = np.searchsorted(sk, bk)
    return np.insert(sk, pos, bk), np.insert(sv, pos, bv)


def sorted_erase(sk, sv, keys):
    i = np.searchsorted(sk, keys)
    old = sv[i]
    return np.delete(sk, i), np.delete(sv, i), old


def bench_searchsorted(keys, vals, batch, reps, rng, next_key):
    n = keys.size
    t = time.perf_counter()
    order = np.argsort(keys)
    sk, sv = keys[order], vals[order]
    del order
    build = n / (time.perf_counter() - t)
    look, ins, era, uni = [], [], [], []
    for r in range(reps):
        q = keys[rng.integers(0, n, size=batch)]
        look.append(timed(sorted_lookup, sk, sv, q)[0])
        uni.append(timed(np.unique, q, return_inverse=True, return_counts=True)[0])
        new = distinct_keys(next_key + r * batch, batch)
        nv = np.arange(n, n + batch, dtype=np.int32)
        dt, (gk, gv) = timed(sorted_insert, sk, sv, new, nv)
        ins.append(dt)
        dt, (ek, _, old) = timed(sorted_erase, gk, gv, new)
        era.append(dt)
        assert ek.size == n and (old == nv).all()
        del gk, gv, ek
    return {
        "lookup": median_rate(batch, look),
        "insert": median_rate(batch, ins),
        "erase": median_rate(batch, era),
        "build": build,
        "unique": median_rate(batch, uni),
    }


def fmt_rate(r: float | None, star: bool = False) -> str:
    if r is None:
        return "-"
    return f"{r / 1e6:.2f}{'*' if star else ''}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    return f"{a / b:.1f}x"


def part_map(args) -> None:
    backends = [b for b in args.backends.split(",") if b]
    if "cpp" in backends and not _id_map.cpp_available():
        print(f"cpp backend skipped: {_id_map._CPP_MISSING}")
        backends.remove("cpp")
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    rng = np.random.default_rng(args.seed)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; batch {args.batch}, reps {args.reps}")
    results = {}
    dict_measured = None  # (live keys, rates) of the largest dict measured
    for n in sizes:
        need = map_bytes_needed(n, backends)
        avail = mem_available()
        if need > avail * 0.8:
            print(
                f"N={n:.0e}: skipped, needs ~{need / 2**30:.1f} GiB and "
                f"{avail / 2**30:.1f} GiB are available (MemAvailable; 80% used at most)"
            )
            continue
        keys = distinct_keys(0, n)
        vals = np.arange(n, dtype=np.int32)
        row = {}
        for b in backends:
            t = time.perf_counter()
            row[b] = bench_idmap(b, keys, vals, args.batch, args.reps, rng, n)
            print(f"N={n:.0e} {b}: {fmt(row[b])}  ({time.perf_counter() - t:.0f} s)", flush=True)
        if n <= args.dict_max:
            row["dict"] = bench_dict(keys, vals, args.batch, args.reps, rng, n)
            dict_measured = (n, row["dict"])
            print(f"N={n:.0e} dict: {fmt(row['dict'])}", flush=True)
        else:
            if dict_measured is None or dict_measured[0] != args.dict_max:
                nd = args.dict_max
                dk, dv = distinct_keys(0, nd), np.arange(nd, dtype=np.int32)
                dict_measured = (nd, bench_dict(dk, dv, args.batch, args.reps, rng, nd))
                del dk, dv
            row["dict"] = dict(dict_measured[1], extrapolated=True)
            print(f"N={n:.0e} dict: {fmt(row['dict'])} (measured at {args.dict_max:.0e} live)")
        row["searchsorted"] = bench_searchsorted(keys, vals, args.batch, args.reps, rng, n)
        print(f"N={n:.0e} searchsorted: {fmt(row['searchsorted'])}", flush=True)
        results[n] = row
        del keys, vals
        gc.collect()
    print_map_table(results, args)


def fmt(r: dict) -> str:
    parts = [f"{k} {v / 1e6:.2f}M/s" for k, v in r.items() if k in ("lookup", "insert", "erase")]
    parts.append(f"build {r['build'] / 1e6:.2f}M/s")
    if "unique" in r:
        parts.append(f"unique {r['unique'] / 1e6:.2f}M/s")
    if "bytes/key" in r:
        parts.append(f"{r['bytes/key']:.0f} B/key")
    return ", ".join(parts)


def print_map_table(results: dict, args) -> None:
    print()
    print("M IDs/s (median of reps); * = dict measured at fewer live keys (extrapolated)")
    print()
    head = (
        "| live keys | op | cpp | numpy | dict | searchsorted "
        "| cpp/dict | cpp/searchsorted | cpp/numpy | numpy/searchsorted |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for n, row in results.items():
        for op in ("lookup", "insert", "erase", "build", "unique"):
            c, p = row.get("cpp", {}).get(op), row.get("numpy", {}).get(op)
            d, s = row["dict"].get(op), row["searchsorted"][op]
            star = row["dict"].get("extrapolated", False)
            print(
                f"| {n:.0e} | {op} | {fmt_rate(c)} | {fmt_rate(p)} | {fmt_rate(d, star)} "
                f"| {fmt_rate(s)} | {fmt_ratio(c, d)} | {fmt_ratio(c, s)} | {fmt_ratio(c, p)} "
                f"| {fmt_ratio(p, s)} |"
            )
    print()
    for n, row in results.items():
        mem = ", ".join(f"{b} {row[b]['bytes/key']:.0f}" for b in ("cpp", "numpy") if b in row)
        print(f"bytes of slot arrays per live key at {n:.0e}: {mem}")


# ------------------------------------------------------------------ entry point


def part_cache(args) -> None:
    """Training with a 10% device cache vs the table on the device (_dynamic_cache.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _dynamic_cache

    print(f"machine: {cpu_name()}, {os.cpu_count()} cores")
    _dynamic_cache.run(args)


PARTS = {"map": part_map, "cache": part_cache}
"""--part name -> function(args)."""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--part", choices=sorted(PARTS), required=True, help="what to measure")
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("--part map")
    g.add_argument("--sizes", default="1e6,1e7,1e8", help="live keys, comma-separated")
    g.add_argument("--batch", type=int, default=1 << 20, help="keys per call")
    g.add_argument("--reps", type=int, default=5)
    g.add_argument("--backends", default="cpp,numpy", help="IdMap backends, comma-separated")
    g.add_argument(
        "--dict-max", type=float, default=1e7, help="largest dict built (larger: extrapolated)"
    )
    g = ap.add_argument_group("--part cache")
    g.add_argument("--zipf", default="0.8,1.05,1.2", help="Zipf exponents, comma-separated")
    g.add_argument("--vocab", type=float, default=1e6, help="rows of each table")
    g.add_argument("--tables", type=int, default=8, help="tables (one feature each)")
    g.add_argument("--model", choices=("small", "dlrm"), default="small", help="layer sizes")
    g.add_argument("--nbatch", type=int, default=150, help="distinct batches, rotated")
    g.add_argument("--steps", type=int, default=30, help="steps per rep")
    g.add_argument("--warmup", type=int, default=400, help="steps before timing (cache full)")
    args = ap.parse_args()
    args.zipf = [float(z) for z in str(args.zipf).split(",")]
    args.vocab = int(args.vocab)
    args.dict_max = int(args.dict_max)
    PARTS[args.part](args)


if __name__ == "__main__":
    main()
