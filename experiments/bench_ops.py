#!/usr/bin/env python3
r"""Benchmark of the core ops against baselines measured in the same run.

(a) embedding_bag forward, V=1e6, N=2048x26 lookups, D=64, sum: GB/s gathered for each
    implementation, vs PyTorch nn.EmbeddingBag and vs a memory copy.
(b) DLRM-like train step (B=2048, 26 lookups per example, D=64, MLP 64-256-128-1, BCE,
    backward, row-wise Adagrad on touched rows, dense Adagrad on the MLP), one table of V
    rows with 26 ids per example ("pool26") and 26 tables of V/26 rows with one id each
    ("pool1"), vs naive Flax nn.Embed + optax, vs PyTorch EmbeddingBag(sparse=True) +
    Adagrad and FBGEMM's fused TBE (EXACT_ROWWISE_ADAGRAD), the latter two through the
    peer step script (--peer-step-script) run by the peer venv's python.
(c) the forward of (a) in ONE process with PyTorch (needs torch in this venv: the
    `[bench]` extra): sparsejax's cpu_ffi embedding_bag and torch's nn.EmbeddingBag on
    the same table and ids, each alone, alternating call by call (torch's OpenMP team is
    then active around every sparsejax call), and each alone next to a busy thread (a
    numpy loop, like a data loader). Ratios are taken within each process.

Every (method, config, V) runs in a fresh subprocess (so tables never share a process),
the methods interleaved, repeated --reps times; each cell is the median over processes
of the per-process median step time.

Peers (optional; their columns read n/a without them):
  --peer-python       python of a venv with torch==2.13.0 + fbgemm-gpu-cpu, for the torch
                      column of (a) and the torch/FBGEMM columns of (b);
                      default $PEER_PYTHON
  --peer-step-script  the PyTorch step benchmark for (b) (torch_step_bench.py, kept with
                      the peer venv, not in this repository);
                      default $PEER_STEP_SCRIPT

    PYTHONPATH=. python experiments/bench_ops.py --peer-python PEER_VENV/bin/python \
        --peer-step-script PEERS/torch_step_bench.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

B, D, F = 2048, 64, 26
N = B * F
LR, EPS = 0.01, 1e-8
NBATCH, WARMUP, STEPS = 8, 2, 10
HERE = os.path.dirname(os.path.abspath(__file__))

TORCH_FORWARD = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(2)
V, D, N, F = {V}, {D}, {N}, {F}
eb = torch.nn.EmbeddingBag(V, D, mode="sum")
with torch.no_grad():
    eb.weight.uniform_(-0.01, 0.01)
g = torch.Generator().manual_seed(1234)
ids = [torch.randint(0, V, (N,), generator=g) for _ in range(8)]
off = torch.arange(0, N, F)
ts = []
with torch.no_grad():
    for k in range(5 + {reps}):
        t = time.perf_counter(); eb(ids[k % 8], off); dt = time.perf_counter() - t
        if k >= 5: ts.append(dt * 1e3)
print(json.dumps(dict(median_ms=statistics.median(ts))))
"""


# ---------------------------------------------------------------- in-process runners
def _time_steps(fn, nbatch=NBATCH, warmup=WARMUP, steps=STEPS):
    import jax

    times = []
    for s in range(warmup + steps):
        t = time.perf_counter()
        jax.block_until_ready(fn(s % nbatch))
        if s >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
    return times


def run_forward(impl: str, V: int, reps: int) -> dict:
    import jax
    import numpy as np

    if impl == "memcopy":  # streaming bandwidth of this machine, read + write bytes
        src = np.ones(1 << 27, np.float32)  # 512 MiB
        dst = np.empty_like(src)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            np.copyto(dst, src)
            ts.append(time.perf_counter() - t)
        return dict(gbps=2 * src.nbytes / statistics.median(ts) / 1e9)
    _, _, call = _forward_setup(impl, V)
    _warm_up(lambda k: jax.block_until_ready(call(k)))
    times = _time_steps(call, warmup=0, steps=reps)
    ms = statistics.median(times)
    return dict(median_ms=ms, gbps=_gbps(ms))


def _gbps(ms):
    """Bytes of the rows gathered per second by one forward of N lookups."""
    return N * D * 4 / (ms * 1e-3) / 1e9


def _forward_setup(impl: str, V: int):
    """(table, ids, call): call(k) runs the jitted forward on batch k % NBATCH."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sparsejax import ops

    table = jax.random.uniform(jax.random.key(0), (V, D), jnp.float32, -0.01, 0.01)
    rng = np.random.default_rng(1234)
    ids = [jnp.asarray(rng.integers(0, V, N), jnp.int32) for _ in range(NBATCH)]
    seg = jnp.asarray(np.repeat(np.arange(B), F), jnp.int32)
    if impl == "jnp_take_segment_sum":
        f = jax.jit(
            lambda t, i: jax.ops.segment_sum(
                jnp.take(t, i, axis=0), seg, B, indices_are_sorted=True
            )
        )
    else:
        f = jax.jit(lambda t, i: ops.embedding_bag(t, i, seg, B, implementation=impl))
    jax.block_until_ready(table)
    return table, ids, lambda k: f(table, ids[k % NBATCH])


def _warm_up(fn, seconds=2.0):
    """Steady state: compilation, and the one-time move of a large table onto 2 MiB pages
    that the C++ kernels request in the background."""
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds or k < 3:
        fn(k)
        k += 1


SAME_PROCESS_CASES = ("alone", "alternating", "busy_thread")
GOMP_SPIN_S = 0.05
"""After a parallel region, torch's OpenMP (libgomp) workers spin 300000 `pause`s before
they sleep (~9 ms measured on a 2-core AMD EPYC VM; OMP_WAIT_POLICY / GOMP_SPINCOUNT change
it), so an op timed right after a torch call runs next to a spinning thread."""


def run_same_process(V: int, reps: int, rounds: int = 3) -> dict:
    """(c): sparsejax cpu_ffi and torch nn.EmbeddingBag forwards in this one process.

    Cases, interleaved `rounds` times, `reps` timed calls of each op per case and round:
    alone (each op in its own block, GOMP_SPIN_S after the other op), alternating
    (sparsejax, torch, sparsejax, ...: torch's OpenMP workers spin through every
    sparsejax call) and busy_thread (each op alone while a thread runs a numpy loop).
    Returns {case: {op: median ms}} and torch's thread count.
    """
    import threading

    import jax
    import numpy as np
    import torch

    table, ids, sj_call = _forward_setup("cpu_ffi", V)
    eb = torch.nn.EmbeddingBag(V, D, mode="sum")
    with torch.no_grad():
        eb.weight.copy_(torch.from_numpy(np.asarray(table)))
    tids = [torch.from_numpy(np.asarray(i).astype(np.int64)) for i in ids]
    offsets = torch.arange(0, N, F)

    def sj(k):
        t = time.perf_counter()
        jax.block_until_ready(sj_call(k))
        return time.perf_counter() - t

    def tc(k):
        t = time.perf_counter()
        with torch.no_grad():
            eb(tids[k % NBATCH], offsets)
        return time.perf_counter() - t

    np.testing.assert_allclose(
        np.asarray(sj_call(0)), eb(tids[0], offsets).detach().numpy(), rtol=1e-4, atol=1e-6
    )
    _warm_up(lambda k: (sj(k), tc(k)))
    stop = threading.Event()

    def busy():  # a data-loader-like thread: numpy work that releases the GIL
        a = np.ones(1 << 20, np.float32)
        b = np.empty_like(a)
        while not stop.is_set():
            np.multiply(a, 1.0001, out=b)

    times = {c: {"sparsejax": [], "torch": []} for c in SAME_PROCESS_CASES}
    for _ in range(rounds):
        for case in SAME_PROCESS_CASES:
            t = times[case]
            if case == "alternating":
                for k in range(reps):
                    t["sparsejax"].append(sj(k))
                    t["torch"].append(tc(k))
                continue
            thread = None
            if case == "busy_thread":
                stop.clear()
                thread = threading.Thread(target=busy, daemon=True)
                thread.start()
                time.sleep(0.05)
            for op, fn in (("sparsejax", sj), ("torch", tc)):
                time.sleep(GOMP_SPIN_S)  # alone: torch's OpenMP team has gone to sleep
                fn(0)  # not timed
                t[op].extend(fn(k) for k in range(reps))
            if thread is not None:
                stop.set()
                thread.join()
    return dict(
        torch_threads=torch.get_num_threads(),
        **{c: {op: 1e3 * statistics.median(v) for op, v in t.items()} for c, t in times.items()},
    )


def _mlp():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(256)(x))
            x = nn.relu(nn.Dense(128)(x))
            return nn.Dense(1)(x)

    return MLP()


def _batches(cfg: str, V: int):
    """Same shapes and id distribution as the peer script (uniform ids)."""
    import numpy as np

    rng = np.random.default_rng(1234)
    out = []
    rows = math.ceil(V / F) if cfg == "pool1" else V
    for _ in range(NBATCH):
        ids = rng.integers(0, rows, (B, F))
        if cfg == "pool1":  # 26 tables stacked into one: feature f's rows start at f*rows
            ids = ids + np.arange(F)[None, :] * rows
        y = rng.integers(0, 2, (B, 1)).astype(np.float32)
        out.append((ids.reshape(-1).astype(np.int32), y))
    return out, rows * (F if cfg == "pool1" else 1)


def run_step(method: str, cfg: str, V: int, warmup_s: float = 0.0) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from sparsejax import ops

    batches, total_rows = _batches(cfg, V)
    batches = [(jnp.asarray(i), jnp.asarray(y)) for i, y in batches]
    mlp = _mlp()
    tx = optax.adagrad(LR, initial_accumulator_value=0.0, eps=EPS)
    mlp_params = mlp.init(jax.random.key(1), jnp.zeros((1, D)))
    table = jax.random.uniform(jax.random.key(0), (total_rows, D), jnp.float32, -0.01, 0.01)
    jax.block_until_ready(table)

    def bce(logits, y):
        return optax.sigmoid_binary_cross_entropy(logits, y).mean()

    if method == "flax_naive":
        import flax.linen as nn

        class Naive(nn.Module):
            @nn.compact
            def __call__(self, ids):
                emb = nn.Embed(total_rows, D)(ids.reshape(B, F))
                return _mlp()(emb.sum(1))

        model = Naive()
        params = model.init(jax.random.key(1), batches[0][0])
        params["params"]["Embed_0"]["embedding"] = table
        opt_state = tx.init(params)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state, ids, y):
            loss, g = jax.value_and_grad(lambda p: bce(model.apply(p, ids), y))(params)
            upd, opt_state = tx.update(g, opt_state, params)
            return optax.apply_updates(params, upd), opt_state, loss

        state = [params, opt_state]

        def run(k):
            state[0], state[1], loss = step(state[0], state[1], *batches[k])
            return loss
    else:
        impl = method.removeprefix("sparsejax_")
        opt = ops.RowWiseAdagrad(learning_rate=LR, eps=EPS)
        num_segments = N if cfg == "pool1" else B
        seg = jnp.asarray(np.arange(N) // (1 if cfg == "pool1" else F), jnp.int32)

        @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
        def step(table, slots, params, opt_state, step_no, ids, y):
            pooled = ops.embedding_bag(table, ids, seg, num_segments, implementation=impl)

            def loss_fn(pooled, params):
                return bce(mlp.apply(params, pooled.reshape(B, -1, D).sum(1)), y)

            loss, (g_pooled, g_params) = jax.value_and_grad(loss_fn, (0, 1))(pooled, params)
            table, slots = ops.sparse_apply(
                table, slots, ids, seg, g_pooled, optimizer=opt, step=step_no, implementation=impl
            )
            upd, opt_state = tx.update(g_params, opt_state, params)
            return table, slots, optax.apply_updates(params, upd), opt_state, loss

        state = [table, opt.init_slots(total_rows, D), mlp_params, tx.init(mlp_params)]
        jax.block_until_ready(state)
        counter = [0]

        def run(k):
            counter[0] += 1
            *new, loss = step(*state, jnp.int32(counter[0]), *batches[k])
            state[:] = new
            return loss

    t = time.perf_counter()
    jax.block_until_ready(run(0))
    compile_s = time.perf_counter() - t
    while time.perf_counter() - t < warmup_s:  # optional steady-state warm-up
        jax.block_until_ready(run(0))
    times = _time_steps(run)
    return dict(median_ms=statistics.median(times), compile_s=compile_s)


# ---------------------------------------------------------------- orchestration
def _subprocess_json(cmd: list[str], timeout=900) -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", os.path.join(HERE, ".."))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(error=(proc.stderr or proc.stdout).strip().splitlines()[-1:])
    return json.loads(lines[-1])


def forward_cell(impl, V, reps, peer_python):
    if impl == "torch_embedding_bag":
        if not peer_python:
            return dict(error="no --peer-python")
        code = TORCH_FORWARD.format(V=V, D=D, N=N, F=F, reps=reps)
        res = _subprocess_json([peer_python, "-c", code])
        if "median_ms" in res:
            res["gbps"] = N * D * 4 / (res["median_ms"] * 1e-3) / 1e9
        return res
    return _subprocess_json([sys.executable, __file__, "--one-forward", impl, str(V), str(reps)])


def step_cell(method, cfg, V, peer_python, peer_script, warmup_s):
    if method in ("torch_eb", "tbe_rw"):
        if not (peer_python and peer_script):
            return dict(error="no --peer-python / --peer-step-script")
        return _subprocess_json(
            [peer_python, peer_script, "--method", method, "--cfg", cfg, "--V", str(V)]
        )
    return _subprocess_json(
        [sys.executable, __file__, "--one-step", method, cfg, str(V), str(warmup_s)]
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--peer-python",
        default=os.environ.get("PEER_PYTHON"),
        help="python of a venv with torch==2.13.0 + fbgemm-gpu-cpu (default $PEER_PYTHON)",
    )
    ap.add_argument(
        "--peer-step-script",
        default=os.environ.get("PEER_STEP_SCRIPT"),
        help="torch_step_bench.py for the (b) peer columns (default $PEER_STEP_SCRIPT)",
    )
    ap.add_argument("--reps", type=int, default=3, help="processes per cell (median of medians)")
    ap.add_argument("--fwd-reps", type=int, default=21, help="timed calls per forward process")
    ap.add_argument("--vocab", default="1e4,1e5,1e6,4e6")
    ap.add_argument("--impls", default="cpu_ffi,xla,pallas")
    ap.add_argument("--skip-forward", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument(
        "--skip-same-process",
        action="store_true",
        help="skip (c), the forward in one process with PyTorch",
    )
    ap.add_argument("--naive-max-vocab", type=float, default=4e6)
    ap.add_argument("--json", default=None, help="also write raw results here")
    ap.add_argument("--one-forward", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="extra warm-up seconds for the JAX steps (steady state: the C++ "
        "kernels move tables >= 64 MiB onto 2 MiB pages in the background "
        "during the first seconds); peers always get 2 warm-up steps",
    )
    ap.add_argument("--one-step", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--one-same-process", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one_forward:
        impl, V, reps = args.one_forward
        print(json.dumps(run_forward(impl, int(float(V)), int(reps))))
        return
    if args.one_same_process:
        V, reps = args.one_same_process
        print(json.dumps(run_same_process(int(float(V)), int(reps))))
        return
    if args.one_step:
        method, cfg, V, warmup_s = args.one_step
        print(json.dumps(run_step(method, cfg, int(float(V)), float(warmup_s))))
        return

    impls = [i for i in args.impls.split(",") if i]
    raw = {}
    if not args.skip_forward:
        V = 1_000_000
        cells = ["memcopy", "torch_embedding_bag", "jnp_take_segment_sum", *impls]
        runs = {c: [] for c in cells}
        for _ in range(args.reps):
            for c in cells:
                runs[c].append(forward_cell(c, V, args.fwd_reps, args.peer_python))
        raw["forward"] = runs
        torch_gbps = _median(runs["torch_embedding_bag"], "gbps")
        print(
            f"\n(a) embedding_bag forward, V=1e6, N={N}, D={D}, sum, f32 "
            f"({args.reps} processes x {args.fwd_reps} calls, median)"
        )
        print("| implementation | ms | GB/s gathered | vs torch EmbeddingBag | % of memcopy |")
        print("|---|---|---|---|---|")
        copy = _median(runs["memcopy"], "gbps")
        print(f"| memcopy (np.copyto 512 MiB, read+write) | | {copy:.1f} | | 100% |")
        for c in cells[1:]:
            ms, gb = _median(runs[c], "median_ms"), _median(runs[c], "gbps")
            print(
                f"| {c} | {_fmt(ms, 2)} | {_fmt(gb, 2)} | {_ratio(gb, torch_gbps)} "
                f"| {_ratio(gb, copy, pct=True)} |"
            )

    if not args.skip_same_process:
        raw["same_process"] = same_process_table(args.reps, args.fwd_reps)

    if not args.skip_step:
        vocabs = [int(float(v)) for v in args.vocab.split(",")]
        methods = [f"sparsejax_{i}" for i in impls if i != "pallas"] + [
            "flax_naive",
            "torch_eb",
            "tbe_rw",
        ]
        step_runs = {}
        for _ in range(args.reps):
            for cfg in ("pool26", "pool1"):
                for V in vocabs:
                    for m in methods:
                        if m == "flax_naive" and V > args.naive_max_vocab:
                            continue
                        step_runs.setdefault((m, cfg, V), []).append(
                            step_cell(
                                m, cfg, V, args.peer_python, args.peer_step_script, args.warmup_s
                            )
                        )
        raw["step"] = {"|".join(map(str, k)): v for k, v in step_runs.items()}
        print(
            f"\n(b) DLRM-like train step, B={B}, 26 lookups/example, D={D}, row-wise Adagrad "
            f"(median ms over {args.reps} processes of the median of {STEPS} steps; "
            f"JAX warm-up {WARMUP} steps + {args.warmup_s:g} s)"
        )
        best = methods[0]
        for cfg in ("pool26", "pool1"):
            print(
                f"\n{cfg}: "
                + ("one table, 26 ids per example" if cfg == "pool26" else "26 tables, one id each")
            )
            print(
                "| V | " + " | ".join(methods) + f" | {best} speed-up vs tbe_rw | vs torch_eb "
                "| vs flax_naive |"
            )
            print("|---" * (len(methods) + 4) + "|")
            for V in vocabs:
                med = {m: _median(step_runs.get((m, cfg, V), []), "median_ms") for m in methods}
                cells = " | ".join(_fmt(med[m], 1) for m in methods)
                print(
                    f"| {V:.0e} | {cells} | {_ratio(med['tbe_rw'], med[best])} | "
                    f"{_ratio(med['torch_eb'], med[best])} | "
                    f"{_ratio(med['flax_naive'], med[best])} |"
                )
            lo, hi = (
                _median(step_runs.get((best, cfg, v), []), "median_ms")
                for v in (min(vocabs), max(vocabs))
            )
            print(
                f"\n{best} step(V={max(vocabs):.0e}) / step(V={min(vocabs):.0e}) = {_ratio(hi, lo)}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1, default=str)


def same_process_table(reps: int, fwd_reps: int) -> list[dict]:
    """(c): runs run_same_process in `reps` fresh processes and prints the table."""
    import importlib.util

    V = 1_000_000
    print(
        f"\n(c) embedding_bag forward in ONE process with PyTorch, V=1e6, N={N}, D={D}, sum, "
        f"f32 ({reps} processes x 3 rounds x {fwd_reps} calls per op and case; ratios "
        "within each process, then the median)"
    )
    if importlib.util.find_spec("torch") is None:
        print("skipped: torch is not installed in this venv (pip install -e .[bench])")
        return []
    cmd = [sys.executable, __file__, "--one-same-process", str(V), str(fwd_reps)]
    runs = [_subprocess_json(cmd) for _ in range(reps)]
    ok = [r for r in runs if "alone" in r]
    for r in runs:
        if "error" in r:
            print(f"failed process: {r['error']}")
    if not ok:
        return runs
    print(f"torch threads: {ok[0]['torch_threads']}")
    print(
        "| case | sparsejax cpu_ffi GB/s | torch EmbeddingBag GB/s | sparsejax vs torch "
        "| sparsejax vs its alone | torch vs its alone |"
    )
    print("|---|---|---|---|---|---|")
    med = statistics.median
    for case in SAME_PROCESS_CASES:
        sj = [r[case]["sparsejax"] for r in ok]  # ms
        tc = [r[case]["torch"] for r in ok]
        vs_torch = med(t / s for s, t in zip(sj, tc, strict=True))
        sj_alone = med(r["alone"]["sparsejax"] / s for r, s in zip(ok, sj, strict=True))
        tc_alone = med(r["alone"]["torch"] / t for r, t in zip(ok, tc, strict=True))
        print(
            f"| {case} | {_gbps(med(sj)):.2f} | {_gbps(med(tc)):.2f} | {vs_torch:.2f}x "
            f"| {100 * sj_alone:.0f}% | {100 * tc_alone:.0f}% |"
        )
    return runs


def _median(results, key):
    vals = [r[key] for r in results if key in r]
    return statistics.median(vals) if vals else None


def _fmt(x, digits):
    return "n/a" if x is None else f"{x:.{digits}f}"


def _ratio(num, den, pct=False):
    if num is None or den is None or den == 0:
        return "n/a"
    return f"{100 * num / den:.0f}%" if pct else f"{num / den:.2f}x"


if __name__ == "__main__":
    main()
