"""Where a training step's time goes: step timing, trace attribution and the byte model.

`profile_training` trains `warmup` steps to compile, then `steps` more, one at a time and
timed in phases: waiting for the input pipeline, the host side of the step (tiered
tables' cache exchange, placing the batch on the mesh), host-executed tables' lookup and
update on the host's CPU, and the compiled step on the device. Those `steps` run twice,
untraced (the step time) and under `jax.profiler` (the split of the device phase): each
traced device event (an XLA thunk or kernel) is charged to the named scope of its HLO
instruction's `op_name` (`PROFILE_SCOPES`, put on by the library: `embedding_lookup` in
`EmbeddingBagCollection`, `dense`, `sparse_update` and `dense_optimizer` in `Trainer`),
collectives by opcode, the rest to `other_device`; time when several events run at once
is split between them, and time within the step's span when none runs is `device_idle`.
`dispatch` is timed on its own, after each traced step: a compiled program that takes
the step's arguments and does nothing, called and waited for. Nothing is a remainder:
`coverage` = the parts' sum over the wall time of the same traced steps (the untraced
step time is reported beside it: the tracer's cost). With several devices the device
parts are one device's, the mean over the devices.

Beside the times it reports the bytes the embedding parts move per step (byte model in
`embedding_bytes`) as GB/s against a device copy (`x + c`) and a gather of uniformly
random rows of the run's width (`gather_bandwidth`: what random row reads give; the
copy is what streaming gives), both measured in the same process, and the step's FLOPs
(XLA's cost analysis) per second of the dense part. It writes `out_dir`: `trace/`
(TensorBoard's profile plugin and `perfetto_trace.json.gz` for ui.perfetto.dev),
`summary.txt`, `summary.json` and `summary.png`, only once the whole profile is made.

`ProfileWindow` is the same attribution as a `fit` hook over a window of a training run.
The runner's `sparsejax profile` builds a run and calls `profile_training`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..data import Loader
from ..embedding import expand
from ..embedding.host import HostSides
from ..ops import embedding_bag
from ._loop import Hook
from ._trainer import Trainer, TrainState

PROFILE_SCOPES = ("embedding_lookup", "dense", "sparse_update", "dense_optimizer")
"""Named scopes the library puts on a training step's ops (innermost wins)."""
COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "reduce-scatter",
    "collective-permute",
)
PARTS = (
    "input",
    "host",
    "host_tables",
    "dispatch",
    *PROFILE_SCOPES,
    "collectives",
    "other_device",
    "device_idle",
)
"""The parts of a step, in the order reported."""
PART_TEXT = {
    "input": "input pipeline (waiting for the loader)",
    "host": "host: cache exchange, batch placement",
    "host_tables": "host tables: lookup + update (CPU)",
    "dispatch": "dispatch (the step's call, no work)",
    "embedding_lookup": "embedding lookup",
    "dense": "dense forward/backward (model, loss)",
    "sparse_update": "sparse update (touched rows)",
    "dense_optimizer": "dense optimizer",
    "collectives": "collectives",
    "other_device": "other device work",
    "device_idle": "device idle between kernels",
}


@dataclasses.dataclass
class StepProfile:
    """What `profile_training` measured (times in ms per step, medians)."""

    steps: int
    step_ms: float
    """Wall time of a step, untraced: input + host + device, one after another (median)."""
    traced_step_ms: float
    """The same under the tracer (mean over the traced steps, which the parts split)."""
    device_ms: float
    """Wall time of the device phase alone, untraced."""
    parts: dict[str, float]
    bytes: dict[str, int]
    """Bytes moved per step by the embedding parts (`embedding_bytes`)."""
    copy_gbps: float
    """Read + write bandwidth of `x + c` over a large array on the same device."""
    gather_gbps: float | None
    """GB/s (the lookup's byte model) of `embedding_bag` over uniformly random rows of
    the run's row width in a table larger than the caches, same device: what random
    row reads give here (`gather_bandwidth`); None when not measured."""
    flops: float | None
    """The step's floating-point operations (XLA cost analysis), if known."""
    device: str
    unattributed_events: int = 0
    trace_dir: str = ""
    exchange: dict | None = None
    """Placed tables' lookup exchange over the profiled steps (`Trainer.exchange_stats`):
    bytes this process's devices sent per step to other devices in the lookup's
    all-to-alls (`sent_bytes`) against the bytes that had to move (`needed_bytes`),
    the send-buffer capacity per group and its grows; None without placed tables."""

    @property
    def coverage(self) -> float:
        """The parts' sum over the wall time of the same (traced) steps."""
        return sum(self.parts.values()) / self.traced_step_ms

    def gbps(self, part: str) -> float | None:
        ms = self.parts.get(part, 0.0)
        return self.bytes[part] / (ms * 1e-3) / 1e9 if part in self.bytes and ms > 0 else None

    @property
    def dense_gflops(self) -> float | None:
        ms = self.parts["dense"] + self.parts["dense_optimizer"]
        return None if not self.flops or ms <= 0 else self.flops / (ms * 1e-3) / 1e9

    def table(self) -> str:
        lines = [
            f"step {self.step_ms:.2f} ms ({self.steps} steps, median; {self.device}), device "
            f"phase {self.device_ms:.2f} ms; traced {self.traced_step_ms:.2f} ms (mean), "
            f"of which the parts cover {100 * self.coverage:.1f}%",
            f"{'part':<40} {'ms/step':>9} {'share':>7}  throughput",
        ]
        for p in PARTS:
            ms = self.parts[p]
            rate = ""
            gbps = self.gbps(p)
            if gbps is not None:
                rate = (
                    f"{self.bytes[p] / 1e6:.1f} MB, {gbps:.1f} GB/s "
                    f"({100 * gbps / self.copy_gbps:.0f}% of copy"
                    + (
                        f", {100 * gbps / self.gather_gbps:.0f}% of gather)"
                        if self.gather_gbps
                        else ")"
                    )
                )
            elif p == "dense" and self.dense_gflops is not None:
                rate = f"{self.dense_gflops:.1f} GFLOP/s (the step's FLOPs over dense + optimizer)"
            share = 100 * ms / self.traced_step_ms
            lines.append(f"{PART_TEXT[p]:<40} {ms:9.3f} {share:6.1f}%  {rate}")
        lines.append(
            f"{'sum of the parts':<40} {sum(self.parts.values()):9.3f} "
            f"{100 * self.coverage:6.1f}%  (the rest: unaccounted)"
        )
        lines.append(f"device copy (x + c): {self.copy_gbps:.1f} GB/s read + write")
        if self.gather_gbps:
            lines.append(
                f"random row gather (embedding_bag, uniform ids, the run's row width): "
                f"{self.gather_gbps:.1f} GB/s"
            )
        ex = self.exchange
        if ex and ex.get("steps"):
            ratio = ex["sent_bytes"] / ex["needed_bytes"] if ex["needed_bytes"] else float("nan")
            lines.append(
                f"exchange (lookup all-to-alls, this process's devices to others): "
                f"{ex['sent_bytes'] / 1e6:.3f} MB/step sent, {ex['needed_bytes'] / 1e6:.3f} MB "
                f"needed ({ratio:.2f}x; ids {ex['sent_id_bytes'] / 1e6:.3f} MB of "
                f"{ex['needed_id_bytes'] / 1e6:.3f} MB), capacity {ex['capacity']}, "
                f"{ex['grows']} grows"
            )
        if self.trace_dir:
            lines.append(f"trace: {self.trace_dir} (TensorBoard profile, perfetto_trace.json.gz)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["coverage"] = self.coverage
        out["gbps"] = {p: self.gbps(p) for p in self.bytes}
        out["dense_gflops"] = self.dense_gflops
        return out


# ----------------------------------------------------------------------- HLO scopes
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _scope_of(op_name: str, scopes: Sequence[str]) -> str | None:
    """The innermost of `scopes` in an op_name path ("jit(f)/dense/jvp(x)/dot"), also
    inside jvp(..) / transpose(..)."""
    best, pos = None, -1
    for path in op_name.split(";"):
        for s in scopes:
            for m in re.finditer(r"(?:^|[/(])" + re.escape(s) + r"(?=$|[/)])", path):
                if m.start() > pos:
                    best, pos = s, m.start()
    return best


def hlo_parts(hlo: str, scopes: Sequence[str] = PROFILE_SCOPES) -> dict[str, str]:
    """`{HLO instruction: part}` of a compiled module's text: collectives by opcode,
    else the innermost scope of its `op_name` metadata. An instruction without metadata
    (e.g. a dot the simplifier made) takes its operands' part when they agree; a fusion
    whose root is outside every scope takes the most common part of the instructions
    fused into it (a matmul fused with a reduction outside the scope stays "dense")."""
    info, inside, computation = {}, defaultdict(list), None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if head:
            computation = head.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, rest = m.groups()
        body = rest.split("metadata=")[0]
        if any(name.startswith(c) or f" {c}(" in body for c in COLLECTIVE_OPS):
            info[name] = ("collectives", True, [], None)
            continue
        meta = _OP_NAME.search(rest)
        part = _scope_of(meta.group(1), scopes) if meta else None
        calls = re.search(r"calls=%([\w.\-]+)", rest)
        info[name] = (part, bool(meta), re.findall(r"%([\w.\-]+)", body), calls and calls[1])
        if part is not None and computation is not None:
            inside[computation].append(part)
    out = {}
    for name, (part, has_meta, operands, called) in info.items():
        if part is None and called in inside:
            part = max(set(inside[called]), key=inside[called].count)
        if part is None and not has_meta:
            found = {info[o][0] for o in operands if o in info and info[o][0]}
            part = found.pop() if len(found) == 1 else None
        out[name] = part or "other_device"
    return out


def _union(intervals) -> float:
    total, start, end = 0.0, None, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (end - start if end is not None else 0.0)


def split_overlaps(events: Sequence[tuple[float, float, str]]) -> dict[str, float]:
    """Time per part of `(start, end, part)` events: each instant of busy time is split
    equally among the parts running then (so the parts sum to the busy time)."""
    points = sorted({t for s, e, _ in events for t in (s, e)})
    out: dict[str, float] = defaultdict(float)
    starts = sorted(events)
    active: list[tuple[float, float, str]] = []
    i = 0
    for a, b in zip(points, points[1:], strict=False):
        while i < len(starts) and starts[i][0] <= a:
            active.append(starts[i])
            i += 1
        active = [ev for ev in active if ev[1] > a]
        now = [k for s, e, k in active if s <= a and e >= b]
        for k in now:
            out[k] += (b - a) / len(now)
    return out


def device_events(xplane: str, module: str) -> dict[tuple, list[tuple[float, float, str]]]:
    """`{(device, run id): [(start ns, end ns, HLO instruction)]}` of `module` in a
    trace, one entry per execution of it on a device: the GPU planes' kernels where
    there are GPU planes, else the CPU's thunks."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane)
    planes = list(data.planes)
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    runs: dict[tuple, list] = defaultdict(list)
    for plane in gpu or [p for p in planes if p.name.startswith("/host:CPU")]:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                op = stats.get("hlo_op")
                if op is None or stats.get("hlo_module") != module:
                    continue
                device = stats.get("device_ordinal", plane.name)
                key = (str(device), int(stats.get("run_id", -1)))  # GPU kernels: no run id
                runs[key].append((ev.start_ns, ev.start_ns + ev.duration_ns, str(op)))
    return runs


def split_executions(events: Sequence[tuple], count: int) -> list[list]:
    """`events` of `count` executions without run ids (GPU kernels), cut at the
    `count - 1` widest gaps: between two steps the device waits for the host's input,
    host and dispatch phases, longer than any gap between one step's kernels."""
    events = sorted(events)
    if count <= 1 or len(events) <= count:
        return [events]
    ends = np.maximum.accumulate(np.array([e for _, e, _ in events], dtype=np.float64))
    gaps = np.array([s for s, _, _ in events[1:]], dtype=np.float64) - ends[:-1]
    cuts = sorted(np.argsort(gaps)[-(count - 1) :] + 1)
    return [events[a:b] for a, b in zip([0, *cuts], [*cuts, len(events)], strict=True)]


DEVICE_PARTS = PARTS[PARTS.index("dispatch") + 1 :]
"""The parts the trace's device events give."""


def device_parts(trace_dir: str, hlo: str, steps: int) -> tuple[dict[str, float], int]:
    """ms per step of each of `DEVICE_PARTS` in a trace of `steps` executions of the
    compiled step whose HLO text is `hlo`: per device the mean over its executions, then
    the mean over the devices; and the count of events whose op is not in the HLO."""
    (xplane,) = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.xplane.pb"))
    module = re.search(r"HloModule\s+([\w.\-]+)", hlo).group(1)
    runs = device_events(xplane, module)
    if not runs:
        raise RuntimeError(
            f"profile: the trace has no device events of the step ({module}); nothing to attribute"
        )
    part_of = hlo_parts(hlo)
    per_device: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    unknown = 0
    for (device, run_id), events in runs.items():
        groups = split_executions(events, steps) if run_id == -1 else [events]
        for group in groups:
            charged = []
            for s, e, op in group:
                unknown += op not in part_of
                charged.append((s, e, part_of.get(op, "other_device")))
            split = split_overlaps(charged)
            # within the step's span, time when no kernel (thunk) ran: waits between them
            span = max(e for _, e, _ in charged) - min(s for s, _, _ in charged)
            split["device_idle"] = span - _union([(s, e) for s, e, _ in charged])
            for p in DEVICE_PARTS:
                per_device[device][p].append(split.get(p, 0.0) / 1e6)
    parts = {
        p: statistics.mean(statistics.mean(d[p]) for d in per_device.values()) for p in DEVICE_PARTS
    }
    return parts, unknown


# ----------------------------------------------------------------------- bytes
def embedding_bytes(tables, features, host_features: Mapping, batch_size: int) -> dict[str, int]:
    """Bytes per step of the embedding parts, from one batch's ids (after any cache
    remap): the lookup reads each valid id's row and its id and weight (8 bytes) and
    writes one f32 row per bag; the sparse update reads each id's gradient row (f32)
    and id, segment and weight (12 bytes), and reads and writes each touched row and
    its optimizer slots once."""
    ex = expand(tables, features)
    split = ex.split_features(host_features)
    by_name = {t.name: t for t in ex.tables}
    lookup = update = 0
    touched: dict[str, list] = defaultdict(list)
    for f in ex.features:
        if f.name not in split:
            continue
        t = by_name[f.table].device_view()
        ids = np.asarray(split[f.name].ids)
        ok = ids[(ids >= 0) & (ids < t.vocab_size)]
        row = t.dim * jnp.dtype(t.dtype).itemsize
        bags = batch_size * f.bags_per_example()
        lookup += ok.size * (row + 8) + bags * t.dim * 4
        update += ok.size * (12 + t.dim * 4)
        touched[t.name].append(ok)
    for name, ids in touched.items():
        t = by_name[name].device_view()
        row = t.dim * jnp.dtype(t.dtype).itemsize
        slot = sum(4 * (1 if s.per_row else t.dim) for s in t.optimizer.slots())
        update += np.unique(np.concatenate(ids)).size * 2 * (row + slot)
    return {"embedding_lookup": int(lookup), "sparse_update": int(update)}


def step_bytes(
    tables, features, host_placed: Collection[str], host_features: Mapping, batch_size: int
) -> dict[str, int]:
    """`embedding_bytes` of the device tables, and of the host-executed tables (names in
    `host_placed`) as `"host_tables"` (their lookup and update run on the host)."""

    def of(host: bool) -> dict[str, int]:
        ts = [t for t in tables if (t.name in host_placed) == host]
        fs = [f for f in features if (f.table in host_placed) == host]
        return embedding_bytes(ts, fs, host_features, batch_size)

    out = of(False)
    if host_placed:
        out["host_tables"] = sum(of(True).values())
    return out


def copy_bandwidth(samples: int = 10, nbytes: int | None = None) -> float:
    """Read + write GB/s of `x + c` over `nbytes` on the default device (median); by
    default 256 MiB on a CPU, 2 GiB on an accelerator (a smaller copy there is bound by
    the launch, not by memory)."""
    if nbytes is None:
        nbytes = (256 << 20) if jax.default_backend() == "cpu" else (2 << 30)
    x = jnp.ones((nbytes // 4,), jnp.float32)
    c = jnp.float32(0.0)  # a runtime operand, so XLA cannot fold the add away
    f = jax.jit(lambda x, c: x + c)
    return 2 * nbytes / _median_seconds(lambda _: f(x, c), samples) / 1e9


def _median_seconds(call: Callable[[int], Any], samples: int) -> float:
    """Median wall time of `call(k)` for k in range(samples), waited for, after one
    untimed `call(0)` (compilation)."""
    jax.block_until_ready(call(0))
    times = []
    for k in range(samples):
        t = time.perf_counter()
        jax.block_until_ready(call(k))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gather_bandwidth(dim: int, dtype="float32", samples: int = 10) -> float:
    """GB/s of `sparsejax.ops.embedding_bag` (one id per bag) over uniformly random rows
    of `dim` columns in a table of 256 MiB (CPU) or 2 GiB (accelerator), counted as
    `embedding_bytes` counts a lookup: the ceiling that random row reads set for the
    embedding parts, beside the copy's streaming one (median of `samples`, rotating
    ids)."""
    cpu = jax.default_backend() == "cpu"
    row = dim * jnp.dtype(dtype).itemsize
    rows = ((256 << 20) if cpu else (2 << 30)) // row
    n = min(rows // 4, (1 << 17) if cpu else (1 << 21))
    table = jax.device_put(np.ones((rows, dim), jnp.dtype(dtype)))  # as tables are placed
    segs = jnp.arange(n, dtype=jnp.int32)
    rng = np.random.default_rng(0)
    ids = [jnp.asarray(rng.integers(0, rows, n, dtype=np.int32)) for _ in range(4)]
    f = jax.jit(lambda t, i: embedding_bag(t, i, segs, n, combiner="sum"))
    nbytes = n * (row + 8) + n * dim * 4
    return nbytes / _median_seconds(lambda k: f(table, ids[k % len(ids)]), samples) / 1e9


# ----------------------------------------------------------------------- the profile
def profile_training(
    trainer: Trainer,
    state: TrainState,
    loader: Loader,
    *,
    tables: Sequence,
    features: Sequence,
    out_dir: str,
    host_placed: Collection[str] = (),
    steps: int = 20,
    warmup: int = 5,
    log: Callable[[str], None] = print,
) -> tuple[StepProfile, TrainState]:
    """Profile `steps` training steps of `trainer` from `state` on `loader`'s batches
    (module docstring); `loader` is closed when done.

    Args:
      tables, features: the model's table and feature specs (the byte model).
      out_dir: where the trace and summaries go, once all is measured (replacing what
        is there; nothing is written when profiling fails).
      host_placed: names of host-executed tables (their bytes are `"host_tables"`).

    Returns:
      The profile, and the state after the profiled steps.
    """
    if steps < 1 or warmup < 1:
        raise ValueError(f"profile: steps and warmup must be >= 1, got {steps} and {warmup}")
    batches = iter(loader)

    step_args = None  # the jitted step's argument shapes (host tables' rows in place)
    spent: dict[tuple[str, str], float] = defaultdict(float)  # (phase, profile part) -> s

    def phases(state, step_fn):
        """One step in timed phases: (state, (input, host, host tables, device) s,
        batch). Each host side's `prepare` and `finish` time goes to its
        `profile_part` ("host_tables": host-executed tables' lookup and update);
        host: the rest of `prepare_train` (e.g. placing the batch)."""
        nonlocal step_args
        t0 = time.perf_counter()
        batch = next(batches)
        t1 = time.perf_counter()
        spent.clear()
        state, batch = jax.block_until_ready(trainer.prepare_train(state, batch))
        step_args = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            (state, batch),
        )
        t3 = time.perf_counter()
        state, metrics = step_fn(state, batch)
        jax.block_until_ready((state, metrics))
        t4 = time.perf_counter()
        state = jax.block_until_ready(trainer.finish_train(state))
        before = spent["prepare", "host_tables"]
        host_tables = before + spent["finish", "host_tables"]
        host = t3 - t1 - before + spent["finish", "host"]
        times = (t1 - t0, host, host_tables, t4 - t3)
        return state, times, batch

    untimed = trainer.host
    trainer.host = _TimedHostSides(untimed.parts, spent)

    tmp = None
    try:
        log(f"profile: {warmup} warm-up steps (compiling), then {steps} steps twice")
        batch = None

        def jitted(state, batch):  # the step as train_step runs it, host work done
            return trainer._jitted("train", batch)(state, batch)

        for _ in range(warmup):
            state, _, batch = phases(state, jitted)
        compiled = trainer._jitted("train", batch).lower(*step_args).compile()
        hlo = compiled.as_text()
        flops = _flops(compiled)
        nbytes = step_bytes(
            tables, features, host_placed, jax.device_get(batch.features), batch.batch_size
        )
        noop = _noop_step(trainer, state, batch)
        walls, device_walls = [], []
        for _ in range(steps):
            state, times, _ = phases(state, compiled)
            walls.append(sum(times))
            device_walls.append(times[-1])
        tmp = tempfile.mkdtemp(prefix="profile.", dir=os.path.dirname(os.path.abspath(out_dir)))
        trace_dir = os.path.join(tmp, "trace")
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        options.host_tracer_level = 1
        traced, dispatch = [], []
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
            for _ in range(steps):
                state, times, batch = phases(state, compiled)
                traced.append(times)
                t = time.perf_counter()  # the call's own cost, under the tracer too
                jax.block_until_ready(noop(state, batch))
                dispatch.append(time.perf_counter() - t)
        loader.close()
        exchange = trainer.exchange_stats() if trainer.shards_batch else None
        device, unknown = device_parts(trace_dir, hlo, steps)
        parts = {
            "input": 1e3 * statistics.mean(t[0] for t in traced),
            "host": 1e3 * statistics.mean(t[1] for t in traced),
            "host_tables": 1e3 * statistics.mean(t[2] for t in traced),
            "dispatch": 1e3 * statistics.mean(dispatch),
            **device,
        }
        dev = jax.devices()[0]
        result = StepProfile(
            steps=steps,
            step_ms=1e3 * statistics.median(walls),
            traced_step_ms=1e3 * statistics.mean(sum(t) for t in traced),
            device_ms=1e3 * statistics.median(device_walls),
            parts=parts,
            bytes=nbytes,
            copy_gbps=copy_bandwidth(),
            gather_gbps=gather_bandwidth(max(t.dim for t in tables)),
            flops=flops,
            device=_device_text(dev),
            unattributed_events=unknown,
            trace_dir=os.path.join(out_dir, "trace"),
            exchange=exchange,
        )
        with open(os.path.join(tmp, "summary.txt"), "w") as f:
            f.write(result.table() + "\n")
        with open(os.path.join(tmp, "summary.json"), "w") as f:
            json.dump(result.to_json(), f, indent=1)
        plot_profile(result, os.path.join(tmp, "summary.png"))
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)  # the whole profile, or none of it
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        trainer.host = untimed
        loader.close()
    return result, state


def _noop_step(trainer, state, batch):
    """A compiled program that takes the step's arguments (same leaves, same shardings)
    and does nothing: calling it and waiting is what a step's call costs beside its
    kernels (`dispatch`)."""
    fn = jax.jit(
        lambda s, b: s.step + 1,
        in_shardings=(
            _without_host(trainer, trainer.state_sharding()),
            trainer._batch_prefix(batch),
        ),
    )
    call = lambda state, batch: fn(_without_host(trainer, state), batch)  # noqa: E731
    jax.block_until_ready(call(state, batch))
    return call


def _without_host(trainer, state):
    """`state` as a jitted step takes it without the host (`HostSide.device_tables`)."""
    return state.replace(tables=trainer.host.device_tables(state.tables))


class _TimedHostSides(HostSides):
    """The trainer's host sides, each part's `prepare` and `finish` waited for and its
    seconds added to `spent[phase, part.profile_part]`."""

    def __init__(self, parts, spent: dict):
        super().__init__(parts)
        self.spent = spent

    def prepare(self, tables, batch, *, train):
        for p in self.parts:
            t = time.perf_counter()
            tables, batch = jax.block_until_ready(p.prepare(tables, batch, train=train))
            self.spent["prepare", p.profile_part] += time.perf_counter() - t
        return tables, batch

    def finish(self, tables, step, next_batch=None):
        for p in self.parts:
            t = time.perf_counter()
            tables = jax.block_until_ready(p.finish(tables, step, next_batch))
            self.spent["finish", p.profile_part] += time.perf_counter() - t
        return tables


def _device_text(dev) -> str:
    """E.g. "cpu x8" or "gpu NVIDIA H200 x1"."""
    kind = "" if dev.device_kind.lower() == dev.platform else f" {dev.device_kind}"
    return f"{dev.platform}{kind} x{jax.device_count()}"


def _flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend has it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    value = None if not cost else cost.get("flops")
    return float(value) if value and value > 0 else None


def plot_profile(p: StepProfile, path: str) -> None:
    """One page: the step's parts (ms and share) and the embedding parts' GB/s vs copy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2.2, 1]}, layout="constrained"
    )
    names = [PART_TEXT[k] for k in PARTS][::-1]
    values = [p.parts[k] for k in PARTS][::-1]
    ax.barh(names, values, color="#4878a8")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f} ms ({100 * v / p.traced_step_ms:.0f}%)", va="center", fontsize=8)
    ax.set_xlabel("ms per step")
    ax.set_title(
        f"step {p.traced_step_ms:.2f} ms traced ({p.step_ms:.2f} untraced) on {p.device}; "
        f"parts cover {100 * p.coverage:.0f}%",
        fontsize=9,
    )
    ax.set_xlim(0, max(values) * 1.45 if max(values) > 0 else 1)
    rates = {k: p.gbps(k) for k in ("embedding_lookup", "sparse_update")}
    labels = ["copy", "random\ngather", "lookup", "sparse\nupdate"]
    gbps = [p.copy_gbps, p.gather_gbps or 0.0, *[v or 0.0 for v in rates.values()]]
    bx.bar(labels, gbps, color=["#999999", "#bbbbbb", "#4878a8", "#d1854a"])
    for x, v in enumerate(gbps):
        bx.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    bx.set_ylabel("GB/s")
    bx.set_title("bytes moved per second", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


class ProfileWindow(Hook):
    """A `fit` hook (`profile_steps: [first, count]`): traces steps first..first+count-1
    of a training run, each waited for, and writes `out_dir` (the trace, and
    summary.txt/summary.json: the wall time of those steps and the device time per part
    of `DEVICE_PARTS`). Training goes on whatever the profile does; a profile that
    fails is logged as a warning and leaves nothing."""

    def __init__(self, trainer, first: int, count: int, out_dir: str, *, log=print):
        self.trainer, self.first, self.count = trainer, first, count
        self.last = first + count - 1
        self.out_dir, self.log = out_dir, log
        self.tmp = self.batch = None
        self.walls: list[float] = []
        self.t = 0.0

    def before_step(self, step: int, batch) -> None:
        if step == self.first:
            self.tmp = tempfile.mkdtemp(prefix="profile.", dir=os.path.dirname(self.out_dir))
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            options.host_tracer_level = 1
            jax.profiler.start_trace(
                os.path.join(self.tmp, "trace"),
                create_perfetto_trace=True,
                profiler_options=options,
            )
            self.batch = batch
        if self.first <= step <= self.last:
            self.t = time.perf_counter()

    def after_step(self, step: int, state, metrics) -> None:
        if step == self.first - 1:
            jax.block_until_ready(state)  # the window starts on an idle device
        if not self.first <= step <= self.last or self.tmp is None:
            return
        jax.block_until_ready((state, metrics))
        self.walls.append(time.perf_counter() - self.t)
        if step == self.last:
            jax.profiler.stop_trace()
            try:
                self._write(state)
            except Exception as e:  # noqa: BLE001 - a profile never stops training
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.tmp = None
                self.log(f"warning: profile of steps {self.first}..{self.last} failed: {e}")

    def on_end(self, step: int, state) -> None:
        if self.tmp is not None:  # training ended inside the window
            self.log(f"warning: training ended at step {step}, inside profile_steps; no profile")
        self.close()

    def close(self) -> None:
        """Stop an unfinished trace and remove it (training ended or failed inside)."""
        if self.tmp is None:
            return
        try:
            jax.profiler.stop_trace()
        except RuntimeError:  # not started, or already stopped
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp = None

    def _write(self, state) -> None:
        batch = self.batch
        hlo = self.trainer._jitted("train", batch).lower(state, batch).compile().as_text()
        parts, unknown = device_parts(os.path.join(self.tmp, "trace"), hlo, self.count)
        wall = 1e3 * statistics.mean(self.walls)
        lines = [
            f"steps {self.first}..{self.last}: {wall:.2f} ms per step (mean, each waited "
            f"for); device parts cover {100 * sum(parts.values()) / wall:.1f}%",
            *(f"{PART_TEXT[p]:<40} {ms:9.3f} {100 * ms / wall:6.1f}%" for p, ms in parts.items()),
        ]
        with open(os.path.join(self.tmp, "summary.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(self.tmp, "summary.json"), "w") as f:
            json.dump({"steps": [self.first, self.last], "step_ms": wall, "parts": parts,
                       "unattributed_events": unknown}, f, indent=1)  # fmt: skip
        if os.path.exists(self.out_dir):
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp, self.out_dir)
        self.tmp = None
        self.log(f"profile of steps {self.first}..{self.last}: {self.out_dir}/summary.txt")
