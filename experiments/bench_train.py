#!/usr/bin/env python3
"""End-to-end DLRM training throughput (samples/s) on synthetic Criteo-shaped data,
sparsejax vs TorchRec / FBGEMM and plain PyTorch, measured in one run.

Workload (configs/dlrm_synthetic_1m.yaml): B=4096, 13 dense + 26 sparse features with
one id each, D=64, tables of the Criteo Kaggle cardinalities capped at --max-vocab rows
(`SyntheticCriteo`, Zipf ids, exponent 1.1); DLRM bottom MLP 13->512->256->64 (ReLU
after each), dot interaction over the 27 vectors (351 pairs) concatenated with the bottom
output, top MLP 415->512->256->1, BCE; sparse: row-wise Adagrad lr 0.01 eps 1e-8 on
touched rows; dense: Adam lr 1e-3.

Rows:
  sparsejax compute only   the jitted `Trainer.train_step` (built as the runner builds it)
                           on --nbatch pre-packed device batches, rotated; measured before
                           and after the torch rows, the repetitions pooled
  sparsejax + Loader       the same step fed by `Loader(gen, packer, device_put=True,
                           prefetch=4, epochs=None)` (generate + pack in a background
                           thread); plus the loader alone (`measure_throughput`)
  TorchRec DLRM (fused)    torchrec.models.dlrm.DLRM over a FusedEmbeddingBagCollection
                           (FBGEMM TBE, EXACT_ROWWISE_ADAGRAD fused in backward)
  FBGEMM TBE (fused)       one SplitTableBatchedEmbeddingBagsCodegen over the 26 tables
                           (EXACT_ROWWISE_ADAGRAD fused in backward) + torch MLPs + Adam
  PyTorch EmbeddingBag     26 nn.EmbeddingBag(sparse=True, mode sum) +
                           torch.optim.Adagrad (element-wise) + Adam
The torch rows run in the peer venv (experiments/_torch_dlrm_step.py, one process per
method, torch.set_num_threads(2)) on the SAME batches: generated here with
SyntheticCriteo and handed over in a temporary .npz.

Every row: --reps repetitions of --steps steps after a warm-up (--warmup-s seconds, at
least 3 steps; the first touches of the ~1.4 GB tables are slow), median (min-max)
ms/step, samples/s, and sparsejax compute-only's speedup over it (row ms / sparsejax
ms; >1 means sparsejax is faster).

--profile adds a breakdown of the sparsejax step (lookup, sparse update, dense part
timed as separate jitted functions) and an XLA-vs-torch comparison of the dense part
and of the MLP matmuls at these shapes.

The torch rows need a python with torch, fbgemm-gpu-cpu and torchrec: `--peer-python`,
or the environment variable PEER_PYTHON; without either they are skipped.
`sparsejax._cpu_runtime.tune_allocator` (XLA:CPU's per-step temporary buffer reused
instead of mapped afresh) is applied before JAX starts; the header says whether it is
in effect (`SPARSEJAX_MALLOC_TUNING=0` turns it off, to compare).

    PYTHONPATH=. python experiments/bench_train.py --peer-python "$PEER_PYTHON" --profile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TORCH_SCRIPT = os.path.join(HERE, "_torch_dlrm_step.py")
CONFIG = os.path.join(ROOT, "configs", "dlrm_synthetic_1m.yaml")
TORCH_ROWS = (
    ("trec_dlrm", "TorchRec DLRM + FusedEBC (FBGEMM rw-Adagrad)"),
    ("tbe", "FBGEMM TBE fused rw-Adagrad + torch MLP"),
    ("torch_eb", "PyTorch 26x EmbeddingBag(sparse) + Adagrad"),
)


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {loadavg()}] {msg}", file=sys.stderr, flush=True)


def timed_reps(step, reps: int, steps: int, sync) -> list[float]:
    """ms/step of each of `reps` repetitions of `steps` calls of `step()`."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        last = None
        for _ in range(steps):
            last = step()
        sync(last)
        out.append((time.perf_counter() - t) * 1e3 / steps)
    return out


def warm(step, seconds: float, sync, min_steps: int = 3) -> int:
    t0, n = time.perf_counter(), 0
    while n < min_steps or time.perf_counter() - t0 < seconds:
        sync(step())
        n += 1
    return n


# ---------------------------------------------------------------------------------------
# sparsejax


def build_sparsejax(args):
    from sparsejax import runner

    overrides = [
        f"data.batch_size={args.batch_size}",
        f"data.max_vocab={int(args.max_vocab)}",
        "progress=false",
        "model.embedding_dim=64",
    ]
    cfg = runner.load_config([CONFIG], overrides)
    o = cfg.optimizer
    assert (cfg.model.name, o.sparse, o.sparse_learning_rate, o.dense, o.dense_learning_rate) == (
        "dlrm",
        "rowwise_adagrad",
        0.01,
        "adam",
        1e-3,
    ), cfg
    assert runner.sparse_optimizer(o).eps == 1e-8
    assert cfg.data.zipf == 1.1
    data = runner.build_data(cfg)
    model = runner.build_model(cfg, data.tables, data.features)
    assert tuple(model.bottom) == (512, 256, 64) and tuple(model.top) == (512, 256, 1), model
    trainer = runner.Trainer(model, runner.dense_optimizer(cfg.optimizer))
    return cfg, data, model, trainer


def host_batches(gen, n: int, b: int):
    return [gen.batch(i, b) for i in range(n)]


def save_npz(gen, hb, path: str) -> None:
    ids = np.stack(
        [np.stack([s[name].values for name in gen.feature_names], axis=1) for s, _, _ in hb]
    ).astype(np.int64)
    np.savez(
        path,
        ids=ids,
        dense=np.stack([d for _, _, d in hb]).astype(np.float32),
        labels=np.stack([lab for _, lab, _ in hb]).astype(np.float32),
        vocab=np.asarray(gen.vocab_sizes, np.int64),
    )


def run_sparsejax_compute(trainer, state, batches, args, k0=0):
    import jax

    k = [k0]

    def step():
        nonlocal state
        state, m = trainer.train_step(state, batches[k[0] % len(batches)])
        k[0] += 1
        return m["loss"]

    sync = jax.block_until_ready
    first = float(step())
    n_warm = warm(step, args.warmup_s, sync) + 1
    reps = timed_reps(step, args.reps, args.steps, sync)
    last = float(step())
    return state, reps, n_warm, k[0], (first, last)


def run_sparsejax_loader(trainer, state, data, args):
    import jax

    from sparsejax.data import Loader

    loader = Loader(data.train_source, data.packer, device_put=True, prefetch=4, epochs=None)
    it = iter(loader)

    def step():
        nonlocal state
        state, m = trainer.train_step(state, next(it))
        return m["loss"]

    try:
        sync = jax.block_until_ready
        n_warm = warm(step, args.warmup_s, sync)
        reps = timed_reps(step, args.reps, args.steps, sync)
    finally:
        loader.close()
    return state, reps, n_warm


def loader_alone(data, args) -> list[float]:
    """Batches/s of the loader alone (generate + pack + device_put), per repetition."""
    from sparsejax.data import Loader, measure_throughput

    out = []
    for _ in range(max(3, args.reps // 2)):
        with Loader(
            data.train_source, data.packer, device_put=True, prefetch=4, epochs=None
        ) as loader:
            out.append(measure_throughput(loader, num_batches=max(3 * args.steps, 30), warmup=2))
    return out


# ---------------------------------------------------------------------------------------
# torch (peer venv)


def run_torch(args, method: str, npz: str) -> dict:
    if not args.peer_python:
        return {"error": "no --peer-python / PEER_PYTHON"}
    cmd = [
        args.peer_python,
        TORCH_SCRIPT,
        "--method",
        method,
        "--data",
        npz,
        "--reps",
        str(args.reps),
        "--steps",
        str(args.steps),
        "--warmup-s",
        str(args.warmup_s),
        "--threads",
        "2",
    ]
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.torch_env))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------
# profile: the parts of the sparsejax step, the dense part vs torch, matmuls vs torch


def profile(trainer, model, data, state, batches, args, npz: str) -> list[tuple[str, list]]:
    import jax
    import jax.numpy as jnp
    import optax

    from sparsejax.embedding import EmbeddingCollection
    from sparsejax.nn import MLP, DotInteraction

    rows = []
    b = args.batch_size
    sync = jax.block_until_ready

    def bench(name, fn, *a, donate_first=False):
        cur = list(a)
        k = [0]

        def step():
            if donate_first:
                cur[0], out = fn(*cur[:1], batches[k[0] % len(batches)], *cur[1:])
            else:
                out = fn(*cur[:1], batches[k[0] % len(batches)], *cur[1:])
            k[0] += 1
            return out

        warm(step, min(args.warmup_s, 2.0), sync)
        reps = timed_reps(step, args.reps, args.steps, sync)
        rows.append((name, reps))
        log(f"profile {name}: {statistics.median(reps):.2f} ms")
        return cur[0] if donate_first else None

    ec = EmbeddingCollection(data.tables, data.features, implementation=model.implementation)
    (layer,) = state.tables.keys()
    tables = state.tables[layer]
    log(f"stacks: {[(n, tuple(v['weights'].shape)) for n, v in tables.items()]}")

    lookup = jax.jit(lambda t, batch: ec.lookup(t, batch.features, b)[0])
    bench("lookup (embedding_bag fwd, all groups)", lookup, tables)

    def _update(t, batch, g):
        _, lookups = ec.lookup(t, batch.features, b)
        return ec.apply_gradients(t, lookups, g, step=1), None

    upd = jax.jit(lambda t, batch, g: _update(t, batch, g)[0], donate_argnums=0)
    out_shapes = jax.eval_shape(lookup, tables, batches[0])
    grads = jax.tree.map(lambda s: jnp.full(s.shape, 1e-3, s.dtype), out_shapes)

    def upd_step(t, batch, g):
        new = upd(t, batch, g)
        return new, new[next(iter(new))]["weights"][:1]

    tables = bench(
        "sparse update (sparse_apply, all groups)", upd_step, tables, grads, donate_first=True
    )
    state = state.replace(tables={layer: tables})

    # The dense part of the step (pooled rows given): fwd + bwd + Adam, as in the trainer.
    bottom = MLP(model.bottom, final_activation=True)
    top = MLP(model.top)
    tx = trainer.tx

    def dense_loss(params, pooled, batch):
        x = bottom.apply({"params": params["bottom"]}, batch.dense)
        vecs = jnp.concatenate([x[:, None, :], pooled], axis=1)
        z = top.apply(
            {"params": params["top"]},
            jnp.concatenate([x, DotInteraction().apply({}, vecs)], axis=1),
        )[:, 0]
        return optax.sigmoid_binary_cross_entropy(z, batch.labels).mean()

    def dense_step(carry, batch, pooled):
        params, opt = carry
        loss, (gp, gx) = jax.value_and_grad(dense_loss, argnums=(0, 1))(params, pooled, batch)
        upd_, opt = tx.update(gp, opt, params)
        return (optax.apply_updates(params, upd_), opt), (loss, gx)

    params = jax.tree.map(jnp.copy, state.params)
    carry = (params, tx.init(params))
    pooled = jax.random.uniform(
        jax.random.key(1), (b, len(data.features), 64), jnp.float32, -0.01, 0.01
    )
    dstep = jax.jit(dense_step, donate_argnums=0)
    bench(
        "dense part (MLPs + interaction, fwd+bwd+Adam) [XLA]",
        lambda c, batch, p: dstep(c, batch, p),
        carry,
        pooled,
        donate_first=True,
    )

    tdense = run_torch(args, "dense_only", npz)
    if "rep_ms" in tdense:
        rows.append(("dense part (same) [torch, 2 threads]", tdense["rep_ms"]))
    else:
        rows.append((f"dense part [torch]: {tdense.get('error')}", []))

    # Matmul micro-benchmark: forward x @ W (+ the two backward matmuls) per layer shape.
    shapes = [(b, 13, 512), (b, 512, 256), (b, 256, 64), (b, 415, 512), (b, 512, 256), (b, 256, 1)]
    mm = []
    for m, kk, n in shapes:
        x = jax.random.normal(jax.random.key(2), (m, kk), jnp.float32)
        w = jax.random.normal(jax.random.key(3), (kk, n), jnp.float32)
        gy = jax.random.normal(jax.random.key(4), (m, n), jnp.float32)
        f = jax.jit(lambda x, w, gy: (x @ w, x.T @ gy, gy @ w.T))
        sync(f(x, w, gy))
        ts = []
        for _ in range(max(args.reps, 5)):
            t = time.perf_counter()
            for _ in range(args.steps):
                r = f(x, w, gy)
            sync(r)
            ts.append((time.perf_counter() - t) * 1e3 / args.steps)
        mm.append(((m, kk, n), ts))
    bx = jax.random.normal(jax.random.key(5), (b, 27, 64), jnp.float32)
    fb = jax.jit(lambda v: jnp.einsum("bfd,bgd->bfg", v, v))
    sync(fb(bx))
    ts = []
    for _ in range(max(args.reps, 5)):
        t = time.perf_counter()
        for _ in range(args.steps):
            r = fb(bx)
        sync(r)
        ts.append((time.perf_counter() - t) * 1e3 / args.steps)
    mm.append((("bmm", 27, 64), ts))
    torch_mm = _torch_matmuls(args, shapes, b)
    return rows, mm, torch_mm


_TORCH_MM = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(2)
shapes, b, reps, steps = json.loads(sys.argv[1])
res = []
for m, k, n in shapes:
    x, w, gy = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
    f = lambda: (x @ w, x.T @ gy, gy @ w.T)
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(steps): f()
        ts.append((time.perf_counter() - t) * 1e3 / steps)
    res.append(ts)
v = torch.randn(b, 27, 64)
torch.bmm(v, v.transpose(1, 2))
ts = []
for _ in range(reps):
    t = time.perf_counter()
    for _ in range(steps): torch.bmm(v, v.transpose(1, 2))
    ts.append((time.perf_counter() - t) * 1e3 / steps)
res.append(ts)
print(json.dumps(res))
"""


def _torch_matmuls(args, shapes, b):
    if not args.peer_python:
        return None
    p = subprocess.run(
        [args.peer_python, "-c", _TORCH_MM, json.dumps([shapes, b, max(args.reps, 5), args.steps])],
        capture_output=True,
        text=True,
    )
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------------------------------


def fmt_row(name, reps, b, ref_ms, note=""):
    if not reps:
        return f"| {name} | n/a | | | {note} |"
    med = statistics.median(reps)
    ratio = f"{med / ref_ms:.2f}x" if ref_ms else ""
    return (
        f"| {name} | {med:.1f} ({min(reps):.1f}-{max(reps):.1f}) | {b * 1e3 / med:,.0f} | "
        f"{ratio} | {note} |"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--peer-python",
        default=os.environ.get("PEER_PYTHON", ""),
        help="python of a venv with torch, fbgemm-gpu-cpu and torchrec "
        "(default: $PEER_PYTHON; none skips the torch rows)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-vocab", type=float, default=1e6)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--nbatch", type=int, default=8, help="pre-packed batches rotated")
    ap.add_argument("--torch-methods", default=",".join(m for m, _ in TORCH_ROWS))
    ap.add_argument(
        "--torch-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the torch processes (e.g. OMP_WAIT_POLICY=PASSIVE)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also time the parts of the sparsejax step and the dense part / matmuls vs torch",
    )
    args = ap.parse_args()
    if args.reps < 1 or args.steps < 1:
        ap.error("--reps and --steps must be >= 1")

    from sparsejax._cpu_runtime import tune_allocator

    malloc_tuned = tune_allocator()  # before JAX starts its CPU threads

    import jax

    from sparsejax.ops import default_implementation

    b = args.batch_size
    loads = [loadavg()]
    log(f"building (B={b}, max_vocab={int(args.max_vocab):,})")
    cfg, data, model, trainer = build_sparsejax(args)
    gen = data.train_source
    rows_total = sum(t.vocab_size for t in data.tables)
    hb = host_batches(gen, args.nbatch, b)
    batches = [jax.device_put(data.packer.pack(s, labels=lab, dense=d)) for s, lab, d in hb]
    tmp = tempfile.mkdtemp(prefix="sjx_bench_train_")
    npz = os.path.join(tmp, "batches.npz")
    save_npz(gen, hb, npz)
    del hb

    t0 = time.perf_counter()
    state = trainer.init(jax.random.key(cfg.seed), batches[0])
    jax.block_until_ready(state)
    log(f"init {time.perf_counter() - t0:.1f} s; {rows_total:,} table rows; compiling + warm-up")
    state, reps_a, n_warm, k, loss_a = run_sparsejax_compute(trainer, state, batches, args)
    log(f"sparsejax compute (first): {statistics.median(reps_a):.1f} ms ({n_warm} warm-up steps)")
    loads.append(loadavg())

    lo = loader_alone(data, args)
    loads.append(loadavg())
    log(f"loader alone: {statistics.median(lo) * b:,.0f} samples/s")
    state, reps_l, _ = run_sparsejax_loader(trainer, state, data, args)
    loads.append(loadavg())
    log(f"sparsejax + loader: {statistics.median(reps_l):.1f} ms")

    torch_res = {}
    methods = [m for m in args.torch_methods.split(",") if m] if args.peer_python else []
    for m in methods:
        log(f"torch {m} ...")
        torch_res[m] = run_torch(args, m, npz)
        loads.append(loadavg())
        log(f"torch {m}: {torch_res[m].get('median_ms', torch_res[m].get('error'))}")

    state, reps_b, _, k, loss_b = run_sparsejax_compute(trainer, state, batches, args, k)
    loads.append(loadavg())
    log(f"sparsejax compute (again): {statistics.median(reps_b):.1f} ms")

    prof = None
    if args.profile:
        prof = profile(trainer, model, data, state, batches, args, npz)
        loads.append(loadavg())
    del state

    sjx = reps_a + reps_b
    ref = statistics.median(sjx)
    impl = default_implementation()
    so = [f for f in os.listdir(os.path.join(ROOT, "sparsejax")) if f.startswith("_cpu_ext")]
    so_time = (
        time.strftime(
            "%Y-%m-%d %H:%M",
            time.localtime(os.path.getmtime(os.path.join(ROOT, "sparsejax", so[0]))),
        )
        if so
        else "none"
    )

    print(
        f"\nDLRM train step, B={b}, 26 sparse (1 id each) + 13 dense, D=64, "
        f"{rows_total:,} table rows (Criteo Kaggle cardinalities capped at "
        f"{int(args.max_vocab):,}), Zipf 1.1; {args.reps} reps x {args.steps} steps after "
        f"{args.warmup_s:g} s warm-up; jax {jax.__version__} on {jax.default_backend()}, "
        f"sparse kernels: {impl} (_cpu_ext built {so_time}); malloc tuning: "
        f"{'on' if malloc_tuned else 'off'}; torch env: "
        f"{' '.join(args.torch_env) or 'default'}; load average at the stages: "
        f"{' | '.join(loads)}\n"
    )
    print("| row | ms/step median (min-max) | samples/s | row ms / sparsejax ms | notes |")
    print("|---|---|---|---|---|")
    print(
        fmt_row(
            "**sparsejax compute only** (jit Trainer.train_step, 8 device batches)",
            sjx,
            b,
            ref,
            f"before torch rows {statistics.median(reps_a):.1f} ms, after "
            f"{statistics.median(reps_b):.1f} ms; loss {loss_a[0]:.3f} -> "
            f"{loss_b[1]:.3f}",
        )
    )
    print(
        fmt_row(
            "sparsejax + Loader (device_put, prefetch 4)",
            reps_l,
            b,
            ref,
            f"loader alone: {statistics.median(lo) * b:,.0f} samples/s "
            f"({min(lo) * b:,.0f}-{max(lo) * b:,.0f})",
        )
    )
    names = dict(TORCH_ROWS)
    for m in methods:
        r = torch_res[m]
        if "rep_ms" in r:
            note = f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}"
            print(fmt_row(names.get(m, m), r["rep_ms"], b, ref, note))
        else:
            print(f"| {names.get(m, m)} | failed | | | {r.get('error')} |")

    if prof:
        parts, mm, tmm = prof
        print(
            "\nProfile of the sparsejax step (each part a separate jitted function, "
            "same batches):\n"
        )
        print("| part | ms median (min-max) | share of the full step |")
        print("|---|---|---|")
        for name, reps in parts:
            if reps:
                med = statistics.median(reps)
                print(f"| {name} | {med:.2f} ({min(reps):.2f}-{max(reps):.2f}) | {med / ref:.0%} |")
            else:
                print(f"| {name} | n/a | |")
        print(f"| full train step (row 1) | {ref:.2f} | 100% |")
        print(
            "\nMatmuls of the MLP layers (fwd x@W + the two backward matmuls) and the "
            "interaction bmm, XLA vs torch (2 threads):\n"
        )
        print(
            "| shape (M, K, N) | XLA ms | torch ms | XLA GFLOP/s | torch GFLOP/s | "
            "XLA / torch time |"
        )
        print("|---|---|---|---|---|---|")
        for i, (shape, ts) in enumerate(mm):
            x = statistics.median(ts)
            t = statistics.median(tmm[i]) if tmm else float("nan")
            if shape[0] == "bmm":
                fl = 2 * b * 27 * 27 * 64
                label = f"bmm [{b},27,64]x[{b},64,27] (fwd only)"
            else:
                fl = 3 * 2 * shape[0] * shape[1] * shape[2]
                label = str(shape)
            print(
                f"| {label} | {x:.3f} | {t:.3f} | {fl / x / 1e6:.1f} | {fl / t / 1e6:.1f} | "
                f"{x / t:.2f}x |"
            )
    os.remove(npz)
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
