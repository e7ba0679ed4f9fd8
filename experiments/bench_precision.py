#!/usr/bin/env python3
"""Step time of precision variants of one config (issue 13): fp32 tables and dense
layers (the baseline), bf16 table storage (`model.table_dtype=bfloat16`), bf16 dense
layers (`model.dtype=bfloat16`, mixed precision), both. Each variant runs in its own
process (`sparsejax profile ... --steps N`, whose untraced median step time and parts
it reads), variants interleaved rep by rep so a drift of the machine hits them alike;
prints the median over reps and the ratio to fp32.

    PYTHONPATH=. python experiments/bench_precision.py configs/dlrm_synthetic_1m.yaml --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

VARIANTS = {
    "fp32": [],
    "bf16 tables": ["model.table_dtype=bfloat16"],
    "bf16 dense (AMP)": ["model.dtype=bfloat16"],
    "bf16 both": ["model.table_dtype=bfloat16", "model.dtype=bfloat16"],
}


def one(config: str, overrides: list[str], steps: int, out: str) -> dict:
    cmd = [sys.executable, "-m", "sparsejax", "profile", config, f"out_dir={out}", "name=b"]
    cmd += ["progress=false", *overrides, "--steps", str(steps), "--warmup", "5"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "b", "profile", "summary.json")) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    got: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for name, overrides in VARIANTS.items():
            with tempfile.TemporaryDirectory() as out:
                got[name].append(one(args.config, overrides, args.steps, out))
            print(f"rep {rep} {name}: {got[name][-1]['step_ms']:.2f} ms", flush=True)
    base = statistics.median(r["step_ms"] for r in got["fp32"])
    print(f"\n{args.config}, {args.reps} processes per variant, median step (untraced)")
    print("| variant | step ms | vs fp32 | embedding lookup ms | dense ms | sparse update ms |")
    print("|---|---|---|---|---|---|")
    for name, runs in got.items():
        ms = statistics.median(r["step_ms"] for r in runs)
        part = {p: statistics.median(r["parts"][p] for r in runs) for p in runs[0]["parts"]}
        print(
            f"| {name} | {ms:.2f} | {base / ms:.2f}x | {part['embedding_lookup']:.2f} | "
            f"{part['dense']:.2f} | {part['sparse_update']:.2f} |"
        )


if __name__ == "__main__":
    main()
