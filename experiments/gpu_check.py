#!/usr/bin/env python3
"""GPU check of the Pallas-Triton kernels (each op's `pallas_triton.py` under
`sparsejax.ops`): correctness at realistic sizes against the library's own
`implementation="xla"`, and timing against it and against a device-to-device copy, in
one table.

    python experiments/gpu_check.py                       # on a GPU (a few minutes)
    python experiments/gpu_check.py --interpret --small   # CPU smoke test, tiny sizes

Columns: ms is the median of >= 10 timed samples (each sample runs the call `--reps`
times back to back, then blocks); GB/s counts the bytes a kernel must move (the byte
model is printed under the table); "% copy" compares that with `x + c` over ~2 GB
(read + write bytes); "vs XLA" is XLA's time divided by the kernel's (> 1: faster);
"check" is the largest error against the XLA result on the same inputs (argmax
positions and untouched rows must match exactly).

What this covers that CPU tests cannot: races between programs (hot ids whose atomics
collide, many programs storing rows), negative / out-of-range ids on real memory
(masked loads must never fault), Triton compilation itself, and real bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax.ops import optimizers as opt_lib
from sparsejax.ops._embedding_bag import pallas_triton as bag_kernels
from sparsejax.ops._embedding_bag import segment_max_p
from sparsejax.ops._quantized_bag import pallas_triton as quantized_kernels
from sparsejax.ops._quantized_bag.api import quantized_bag_p
from sparsejax.ops._quantized_bag.base import code_width, dequantize
from sparsejax.ops._segment_spmm import pallas_triton as spmm_kernels
from sparsejax.ops._segment_spmm import segment_spmm_p
from sparsejax.ops._sparse_apply import pallas_triton as apply_kernels
from sparsejax.ops._sparse_apply import sparse_apply_p, update_touched_rows

ROWS: list[dict] = []
COPY_GBPS = [float("nan")]
FAILED: list[str] = []
BYTE_MODELS = {
    "copy": "2 x array bytes (read + write)",
    "forward": "N*(D*itemsize + 8 id/coef) + S*D*itemsize out (+ S*D*4 argk for max)",
    "spmm": "N*(D*itemsize + 12 id/seg/coef) + S*D*itemsize out",
    "quantized": "N*(W code bytes + 3 scale/zero point + 8 id/coef) + S*D*4 out",
    "sparse_apply": "N*(12 + D*4 grad row) + U*2*D*4 (G write + read) "
    "+ U*2*(row + slot bytes) (touched state read + write)",
    "apply_rows": "U*(D*4 grad + 4 id) + U*2*(row + slot bytes)",
}


# ------------------------------------------------------------------ timing helpers
def timeit(fn, *args, samples, reps):
    """Median ms per call of fn(*args) (already compiled by a warm-up call)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / reps)
    return statistics.median(times) * 1e3


def timeit_stateful(fn, state, *args, samples, reps):
    """Like `timeit` for fn(state, *args) -> state with the state donated."""
    state = fn(state, *args)
    jax.block_until_ready(state)
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        for _ in range(reps):
            state = fn(state, *args)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t) / reps)
    return statistics.median(times) * 1e3, state


def record(kernel, shape, ms, nbytes, xla_ms=None, check=""):
    gbps = nbytes / (ms * 1e-3) / 1e9
    ROWS.append(
        dict(
            kernel=kernel,
            shape=shape,
            ms=ms,
            gbps=gbps,
            pct=100.0 * gbps / COPY_GBPS[0],
            speedup=(xla_ms / ms) if xla_ms else None,
            check=check,
        )
    )
    print(
        f"  {kernel:<34} {shape:<46} {ms:9.4f} ms  {gbps:8.1f} GB/s"
        + (f"  x{xla_ms / ms:5.2f} vs XLA" if xla_ms else "")
        + f"  {check}",
        flush=True,
    )


def print_table(args):
    dev = jax.devices()[0]
    print()
    print(
        f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
        f"interpret={args.interpret}, small={args.small}, copy bw {COPY_GBPS[0]:.1f} GB/s"
    )
    head = (
        f"| {'kernel':<34} | {'shape':<46} | {'ms':>9} | {'GB/s':>8} | {'% copy':>6} "
        f"| {'vs XLA':>6} | check"
    )
    print(head)
    print("|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:]))
    for r in ROWS:
        sp = f"{r['speedup']:6.2f}" if r["speedup"] else "     -"
        print(
            f"| {r['kernel']:<34} | {r['shape']:<46} | {r['ms']:9.4f} | {r['gbps']:8.1f} "
            f"| {r['pct']:6.1f} | {sp} | {r['check']}"
        )
    print("\nbyte models (what GB/s counts; xla rows use their kernel's model):")
    for k, v in BYTE_MODELS.items():
        print(f"  {k}: {v}")


# ------------------------------------------------------------------ XLA implementations
# The library's own implementation="xla" of each primitive, with the kernels' operands.
def xla_bag_sum(table, ids, seg, coef, num_segments):
    return segment_spmm_p.bind(
        coef,
        ids,
        seg,
        table,
        num_segments=num_segments,
        implementation="xla",
        sorted_segments=True,
        unit_values=False,
    )


def xla_bag_max(table, ids, seg, coef, num_segments):
    return tuple(
        segment_max_p.bind(coef, ids, seg, table, num_segments=num_segments, implementation="xla")
    )


def xla_sparse_apply(table, slots, ids, seg, coef, grad, hp, step, *, optimizer):
    outs = sparse_apply_p.bind(
        table, *slots, ids, seg, coef, grad, hp, step, optimizer=optimizer, implementation="xla"
    )
    return outs[0], tuple(outs[1:])


def pallas_sparse_apply(table, slots, *args, optimizer, interpret):
    outs = apply_kernels.sparse_apply(
        table, *slots, *args, optimizer=optimizer, interpret=interpret
    )
    return outs[0], tuple(outs[1:])


def xla_apply_rows(table, slots, uids, grads, hp, step, *, optimizer):
    vocab = table.shape[0]
    uids = jnp.where((uids >= 0) & (uids < vocab), uids, vocab)
    table, slots = update_touched_rows(optimizer, table, slots, uids, grads, hp, step)
    return table, tuple(slots)


# ------------------------------------------------------------------ inputs
def make_bags(rng, num_bags, mean_len, vocab, *, power_law=False, pad_frac=0.02, hot_frac=0.0):
    """Sorted segment ids; ids uniform over the table (so the table is not L2-resident),
    a fraction of padding ids (-1 and >= vocab) anywhere, optional hot id 7."""
    if power_law:
        lengths = np.minimum(rng.zipf(1.6, num_bags), 50 * mean_len)
        lengths = (lengths * (mean_len * num_bags / lengths.sum())).astype(np.int64)
    else:
        lengths = rng.integers(mean_len // 2, mean_len + mean_len // 2 + 1, num_bags)
    lengths[:3] = [0, 1, 0]  # empty bags and L=1 even at small sizes
    seg = np.repeat(np.arange(num_bags, dtype=np.int32), lengths)
    n = seg.shape[0]
    ids = rng.integers(0, vocab, n, dtype=np.int64).astype(np.int32)
    bad = rng.random(n) < pad_frac
    ids[bad] = np.where(rng.random(bad.sum()) < 0.5, -1, vocab + 3)
    if hot_frac:
        ids[rng.random(n) < hot_frac] = 7
    coef = rng.uniform(0.5, 1.5, n).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(coef)


def max_err(a, b):
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b) / (1.0 + jnp.abs(b))))


# ------------------------------------------------------------------ sections
def guarded(label, fn, *a, **k):
    """Run one check; a failure is reported and recorded, never fatal to the others."""
    try:
        return fn(*a, **k)
    except Exception:  # noqa: BLE001
        print(f"  {label} FAILED:")
        traceback.print_exc()
        FAILED.append(label)
        return None


def sizes(args):
    """(vocab, num_bags, mean bag length): a table far larger than L2 and >= 100 MB
    gathered per call on the GPU; tiny with --small."""
    return (20_000, 64, 8) if args.small else (4_000_000, 16384, 32)


def section_copy(args):
    n = (8 << 20 if args.small else 2 << 30) // 4
    x = jnp.ones((n,), jnp.float32)
    c = jnp.float32(0.0)  # a runtime operand, so XLA cannot fold the add away
    ms = timeit(jax.jit(lambda x, c: x + c), x, c, samples=args.samples, reps=args.reps)
    COPY_GBPS[0] = 2 * n * 4 / (ms * 1e-3) / 1e9
    record("copy x+c", f"f32[{n}]", ms, 2 * n * 4)


def forward_case(args, table, ids, seg, coef, num_bags, label, *, with_max, sweep):
    ip, t = args.interpret, dict(samples=args.samples, reps=args.reps)
    n, dim = ids.shape[0], table.shape[1]
    isz = table.dtype.itemsize
    nbytes = n * (dim * isz + 8) + num_bags * dim * isz
    shape = f"{label} N={n} S={num_bags}"
    ref_fn = jax.jit(functools.partial(xla_bag_sum, num_segments=num_bags))
    ref = ref_fn(table, ids, seg, coef)
    xla_ms = timeit(ref_fn, table, ids, seg, coef, **t)
    record("xla take+segment_sum", shape, xla_ms, nbytes)

    def fwd():
        f = jax.jit(lambda t, i, s, c: bag_kernels.bag_forward(c, i, s, t, num_bags, interpret=ip))
        err = max_err(f(table, ids, seg, coef), ref)
        record(
            "embedding_bag_fwd sum",
            shape,
            timeit(f, table, ids, seg, coef, **t),
            nbytes,
            xla_ms,
            f"err {err:.1e}",
        )

    def spmm():
        f = jax.jit(lambda c, i, s, tb: spmm_kernels.spmm(c, i, s, tb, num_bags, interpret=ip))
        err = max_err(f(coef, ids, seg, table), ref)
        record(
            "spmm (as fwd)",
            shape,
            timeit(f, coef, ids, seg, table, **t),
            nbytes + 4 * n,
            xla_ms,
            f"err {err:.1e}",
        )

    def fmax():
        ref_fn = jax.jit(functools.partial(xla_bag_max, num_segments=num_bags))
        r_out, r_arg = ref_fn(table, ids, seg, coef)
        x_ms = timeit(ref_fn, table, ids, seg, coef, **t)
        f = jax.jit(
            lambda t, i, s, c: bag_kernels.bag_forward(
                c, i, s, t, num_bags, combiner="max", interpret=ip
            )
        )
        out, arg = f(table, ids, seg, coef)
        check = f"err {max_err(out, r_out):.1e} argk diff {int(jnp.sum(arg != r_arg))}"
        record(
            "embedding_bag_fwd max",
            shape,
            timeit(f, table, ids, seg, coef, **t),
            nbytes + num_bags * dim * 4,
            x_ms,
            check,
        )

    guarded(f"fwd sum {shape}", fwd)
    guarded(f"spmm {shape}", spmm)
    if with_max:
        guarded(f"fwd max {shape}", fmax)
    if sweep:
        for r in (8, 16, 32):
            for w in (1, 2, 4):
                for bags in (1, 2):

                    def one(r=r, w=w, bags=bags):
                        f = jax.jit(
                            lambda t, i, s, c, r=r, w=w, bags=bags: bag_kernels.bag_forward(
                                c,
                                i,
                                s,
                                t,
                                num_bags,
                                rows_per_step=r,
                                bags_per_program=bags,
                                num_warps=w,
                                interpret=ip,
                            )
                        )
                        err = max_err(f(table, ids, seg, coef), ref)
                        record(
                            f"fwd sweep R={r} warps={w} bags={bags}",
                            shape,
                            timeit(f, table, ids, seg, coef, **t),
                            nbytes,
                            xla_ms,
                            f"err {err:.1e}",
                        )

                    guarded(f"fwd sweep R={r} warps={w} bags={bags}", one)


def section_forward(args, rng):
    vocab, num_bags, mean_len = sizes(args)
    for dim, dtype in ((128, jnp.float32), (64, jnp.float32), (128, jnp.bfloat16)):
        table = jax.random.normal(jax.random.key(dim), (vocab, dim), jnp.float32).astype(dtype)
        label = f"V={vocab} D={dim} {jnp.dtype(dtype).name}"
        ids, seg, coef = make_bags(rng, num_bags, mean_len, vocab)
        main_case = dim == 128 and dtype == jnp.float32
        forward_case(
            args,
            table,
            ids,
            seg,
            coef,
            num_bags,
            label,
            with_max=main_case,
            sweep=main_case and not args.no_sweep,
        )
        if main_case:  # heavy-tailed bag lengths: one bag per program vs fixed chunks
            ids, seg, coef = make_bags(rng, num_bags, mean_len, vocab, power_law=True)
            forward_case(
                args,
                table,
                ids,
                seg,
                coef,
                num_bags,
                f"{label} power-law L",
                with_max=False,
                sweep=False,
            )
        del table


def optimizer_case(args, optimizer, table, ids, seg, coef, grad, touched, untouched):
    ip, t = args.interpret, dict(samples=args.samples, reps=args.reps)
    name = type(optimizer).__name__
    vocab, dim = table.shape
    n, num_u = ids.shape[0], touched.shape[0]
    slots = tuple(optimizer.init_slots(vocab, dim)[s.name] for s in optimizer.slots())
    hp, step = optimizer.hparams(), jnp.int32(3)
    slot_row_bytes = sum(4 if s.per_row else 4 * dim for s in optimizer.slots())
    state_bytes = 2 * num_u * (dim * 4 + slot_row_bytes)
    shape = f"V={vocab} D={dim} N={n} U={num_u}"
    # Correctness without donation (the inputs must survive for the comparison).
    ref_fn = jax.jit(functools.partial(xla_sparse_apply, optimizer=optimizer))
    pal_fn = jax.jit(functools.partial(pallas_sparse_apply, optimizer=optimizer, interpret=ip))
    r_table, r_slots = ref_fn(table, slots, ids, seg, coef, grad, hp, step)
    p_table, p_slots = pal_fn(table, slots, ids, seg, coef, grad, hp, step)
    rows, ut = jnp.asarray(touched), jnp.asarray(untouched)
    err = max(
        [max_err(p_table[rows], r_table[rows])]
        + [max_err(a[rows], b[rows]) for a, b in zip(p_slots, r_slots, strict=True)]
    )
    same = bool(jnp.array_equal(p_table[ut], table[ut])) and all(
        bool(jnp.array_equal(a[ut], b[ut])) for a, b in zip(p_slots, slots, strict=True)
    )
    check = f"err {err:.1e} untouched {'same' if same else 'CHANGED'}"
    del r_table, r_slots, p_table, p_slots
    # Timing with the state donated (in place), as in a training step.
    nbytes = n * (12 + dim * 4) + 2 * num_u * dim * 4 + state_bytes
    xs = jax.jit(lambda st, *a: xla_sparse_apply(*st, *a, optimizer=optimizer), donate_argnums=0)
    ps = jax.jit(
        lambda st, *a: pallas_sparse_apply(*st, *a, optimizer=optimizer, interpret=ip),
        donate_argnums=0,
    )
    state = (table, slots)
    del table, slots
    xla_ms, state = timeit_stateful(xs, state, ids, seg, coef, grad, hp, step, **t)
    record(f"xla sparse_apply {name}", shape, xla_ms, nbytes)
    before = state[0].unsafe_buffer_pointer()
    ms, state = timeit_stateful(ps, state, ids, seg, coef, grad, hp, step, **t)
    inplace = state[0].unsafe_buffer_pointer() == before
    record(
        f"sparse_apply {name}",
        shape,
        ms,
        nbytes,
        xla_ms,
        check + (" in-place" if inplace else " COPIED"),
    )
    # apply_rows alone, on the unique ids (padded with -1 to N).
    uids = jnp.asarray(np.concatenate([touched, -np.ones(n - num_u, np.int64)]), jnp.int32)
    g = jax.random.normal(jax.random.key(3), (n, dim), jnp.float32)
    xa = jax.jit(lambda st, *a: xla_apply_rows(*st, *a, optimizer=optimizer), donate_argnums=0)
    pa = jax.jit(
        lambda st, *a: apply_kernels.apply_rows(*st, *a, optimizer=optimizer, interpret=ip),
        donate_argnums=0,
    )
    xla_ms, state = timeit_stateful(xa, state, uids, g, hp, step, **t)
    ms, state = timeit_stateful(pa, state, uids, g, hp, step, **t)
    record(f"apply_rows {name}", shape, ms, num_u * (dim * 4 + 4) + state_bytes, xla_ms)


def section_optimizer(args, rng):
    vocab, num_bags, mean_len = sizes(args)
    dim = 128
    # 1% of lookups hit one hot id: its run spans hundreds of spmm chunks (atomics).
    ids, seg, coef = make_bags(rng, num_bags, mean_len, vocab, hot_frac=0.01)
    grad = jax.random.normal(jax.random.key(1), (num_bags, dim), jnp.float32)
    ids_np, seg_np = np.asarray(ids), np.asarray(seg)
    ok = (ids_np >= 0) & (ids_np < vocab) & (seg_np >= 0) & (seg_np < num_bags)
    touched = np.unique(ids_np[ok])
    untouched = np.setdiff1d(rng.integers(0, vocab, 4096), touched)
    for optimizer in (
        opt_lib.RowWiseAdagrad(learning_rate=0.01),
        opt_lib.LazyAdam(learning_rate=0.001),
        opt_lib.SGD(learning_rate=0.01),
    ):
        table = jax.random.normal(jax.random.key(2), (vocab, dim), jnp.float32)
        guarded(
            f"optimizer {type(optimizer).__name__}",
            optimizer_case,
            args,
            optimizer,
            table,
            ids,
            seg,
            coef,
            grad,
            touched,
            untouched,
        )
        del table


def xla_quantized_bag(
    data, scale, zero_point, ids, seg, coef, *, num_segments, bits, dim, combiner
):
    return quantized_bag_p.bind(
        coef,
        ids,
        seg,
        data,
        scale,
        zero_point,
        num_segments=num_segments,
        bits=bits,
        dim=dim,
        combiner=combiner,
        unit_values=False,
        implementation="xla",
    )


def quantized_case(args, rng, bits, dim, combiner, *, sweep=False, power_law=False):
    """The quantized bag (inference tables) vs its XLA path and vs the f32 bag over the
    dequantized table (what the codes save in bytes should show in time)."""
    ip, t = args.interpret, dict(samples=args.samples, reps=args.reps)
    vocab, num_bags, mean_len = sizes(args)
    width = code_width(bits, dim)
    k = jax.random.split(jax.random.key(bits * 1000 + dim), 3)
    data = jax.random.randint(k[0], (vocab, width), 0, 256, jnp.int32).astype(jnp.uint8)
    scale = jax.random.uniform(k[1], (vocab,), jnp.float32, 1e-3, 1e-2).astype(jnp.float16)
    zero_point = jax.random.randint(k[2], (vocab,), 0, 1 << bits, jnp.int32).astype(jnp.uint8)
    ids, seg, coef = make_bags(rng, num_bags, mean_len, vocab, power_law=power_law)
    n = ids.shape[0]
    shape = f"int{bits} V={vocab} D={dim} N={n} S={num_bags} {combiner}"
    shape += " power-law L" if power_law else ""
    opts = dict(num_segments=num_bags, bits=bits, dim=dim, combiner=combiner)
    ref_fn = jax.jit(functools.partial(xla_quantized_bag, **opts))
    ref = ref_fn(data, scale, zero_point, ids, seg, coef)
    xla_ms = timeit(ref_fn, data, scale, zero_point, ids, seg, coef, **t)
    nbytes = n * (width + 3 + 8) + num_bags * dim * 4
    record("xla quantized bag", shape, xla_ms, nbytes)

    def kernel(config):
        return jax.jit(
            lambda d, s_, z, i, g, c: quantized_kernels.quantized_bag_forward(
                c, i, g, d, s_, z, num_bags, bits=bits, dim=dim, combiner=combiner,
                interpret=ip, **dataclasses.asdict(config),
            )
        )  # fmt: skip

    f = kernel(quantized_kernels.get_heuristic_config(dim, bits))
    err = max_err(f(data, scale, zero_point, ids, seg, coef), ref)
    ms = timeit(f, data, scale, zero_point, ids, seg, coef, **t)
    record(f"quantized_bag {combiner}", shape, ms, nbytes, xla_ms, f"err {err:.1e}")
    if sweep:
        for r in (16, 32, 64):
            for w in (1, 2, 4, 8):

                def one(r=r, w=w):
                    g = kernel(quantized_kernels.Config(rows_per_step=r, num_warps=w))
                    err = max_err(g(data, scale, zero_point, ids, seg, coef), ref)
                    ms = timeit(g, data, scale, zero_point, ids, seg, coef, **t)
                    record(
                        f"quantized sweep R={r} warps={w}",
                        shape,
                        ms,
                        nbytes,
                        xla_ms,
                        f"err {err:.1e}",
                    )

                guarded(f"quantized sweep R={r} warps={w} {shape}", one)
    if combiner == "sum":  # the f32 bag on the same rows, dequantized
        table = dequantize(data, scale, zero_point, bits=bits, dim=dim)
        g = jax.jit(
            lambda tb, i, s_, c: bag_kernels.bag_forward(c, i, s_, tb, num_bags, interpret=ip)
        )
        err = max_err(g(table, ids, seg, coef), ref)
        f32_ms = timeit(g, table, ids, seg, coef, **t)
        record(
            "f32 bag, same rows",
            f"f32 V={vocab} D={dim} N={n} S={num_bags}",
            f32_ms,
            n * (dim * 4 + 8) + num_bags * dim * 4,
            None,
            f"err {err:.1e}; int{bits} x{f32_ms / ms:.2f} faster",
        )


def section_quantized(args, rng):
    cases = ((8, 128, "sum"), (4, 128, "sum"), (8, 64, "sum"), (8, 128, "max"))
    for bits, dim, combiner in cases:
        guarded(
            f"quantized int{bits} D={dim} {combiner}",
            quantized_case,
            args,
            rng,
            bits,
            dim,
            combiner,
            sweep=combiner == "sum" and not args.no_sweep,
        )
    guarded("quantized power-law L", quantized_case, args, rng, 8, 128, "sum", power_law=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
    p.add_argument("--samples", type=int, default=10, help="timed samples (median)")
    p.add_argument(
        "--reps", type=int, default=None, help="calls per sample (default 5; 1 with --interpret)"
    )
    p.add_argument("--no-sweep", action="store_true", help="skip the forward config sweep")
    p.add_argument("--sections", default="copy,forward,quantized,optimizer")
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 1 if args.interpret else 5
    if not args.interpret and jax.default_backend() != "gpu":
        print("no GPU: run with --interpret --small on a CPU", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    sections = {
        "copy": lambda: section_copy(args),
        "forward": lambda: section_forward(args, rng),
        "quantized": lambda: section_quantized(args, rng),
        "optimizer": lambda: section_optimizer(args, rng),
    }
    for name in args.sections.split(","):
        print(f"[{name}]", flush=True)
        guarded(f"section {name}", sections[name])
    print_table(args)
    if FAILED:
        print(f"\nFAILED: {FAILED}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
