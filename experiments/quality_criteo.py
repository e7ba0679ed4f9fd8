"""Quality check: sparsejax DLRM / DeepFM vs an independent PyTorch implementation of the
same architecture and hyperparameters (experiments/torch_reference.py), on the Criteo
Kaggle head-10k sample (first 8,000 rows train, last 2,000 eval), several seeds each.

The sparsejax side runs the shipped configs (configs/{dlrm,deepfm}_criteo.yaml) through
the same library functions as `sparsejax train`. The PyTorch side runs in a venv with
torch (`--peer-python`, default `$PEER_PYTHON`; see experiments/RESULTS.md for the
recipe). Both read the same file: `--data`, default
`$SPARSEJAX_DATA_DIR/criteo_kaggle_head10k/train_head10k.txt`. Prints eval AUC per seed
and the mean of each side.

    PYTHONPATH=. python experiments/quality_criteo.py --peer-python "$PEER_PYTHON"

`--configs A,B` instead compares sparsejax configs with each other (no PyTorch): each
config (a name under configs/ or a path) on the same split and seeds, through the same
runner functions; prints eval AUC per seed, each config's mean and std, and the
difference of each mean from the first config's (also per seed: same seed, same batch
order). `--dynamic` is `--configs dlrm_criteo,dlrm_criteo_dynamic` (issue 10: dynamic
vocabularies with a device cache vs the static vocabulary). The dynamic tables' stats
from summary.json (rows live, cache hit rate, ...) are printed for the first seed.

    PYTHONPATH=. python experiments/quality_criteo.py --dynamic --seeds 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparsejax import runner  # noqa: E402

SAMPLE = "criteo_kaggle_head10k/train_head10k.txt"
"""The shipped sample, relative to `$SPARSEJAX_DATA_DIR`."""


def default_data() -> str | None:
    data_dir = os.environ.get("SPARSEJAX_DATA_DIR")
    return os.path.join(data_dir, SAMPLE) if data_dir else None


def config_path(name: str) -> Path:
    """A config by name (configs/<name>.yaml) or path."""
    p = Path(name)
    return p if p.suffix in (".yaml", ".yml") else ROOT / f"configs/{name}.yaml"


def sparsejax_run(config: Path, seed: int, epochs: int, out_dir: str, data: str) -> dict:
    """The summary of one run of `config` (the runner's `train`, as `sparsejax train`)."""
    cfg = runner.load_config(
        [config],
        [
            f"seed={seed}",
            f"epochs={epochs}",
            "progress=false",
            "resume=false",
            f"out_dir={out_dir}",
            f"name={config.stem}_{seed}",
            f"data.path={data}",
        ],
    )
    return runner.train(cfg, log=lambda *_: None)


def sparsejax_auc(model: str, seed: int, epochs: int, out_dir: str, data: str) -> float:
    summary = sparsejax_run(config_path(f"{model}_criteo"), seed, epochs, out_dir, data)
    return summary["last_eval"]["auc"]


def compare_configs(names_in: list[str], seeds: list[int], epochs: int, data: str) -> None:
    """Eval AUC of sparsejax configs on the same split and seeds, vs the first one."""
    names = [config_path(n).stem if os.sep in n else n for n in names_in]
    paths = dict(zip(names, map(config_path, names_in), strict=True))
    aucs: dict[str, list[float]] = {n: [] for n in names}
    tables: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:  # seed-major: a slow drift of the machine hits every config
            for n in names:
                summary = sparsejax_run(paths[n], seed, epochs, tmp, data)
                aucs[n].append(summary["last_eval"]["auc"])
                if summary.get("tables") and n not in tables:
                    tables[n] = summary["tables"]
                print(f"seed {seed} {n}: eval AUC {aucs[n][-1]:.4f}", flush=True)
    ref = np.asarray(aucs[names[0]])
    print(
        f"\neval AUC, Criteo head-10k (8,000 train / 2,000 eval), {epochs} epoch(s), "
        f"seeds {seeds[0]}..{seeds[-1]}"
    )
    print(
        f"| config | eval AUC mean ± std ({len(seeds)} seeds) | difference of means "
        f"vs {names[0]} | per-seed difference mean ± std |"
    )
    print("|---|---|---|---|")
    for n in names:
        a = np.asarray(aucs[n])
        line = f"| {n} | {a.mean():.4f} ± {a.std():.4f} |"
        if n == names[0]:
            line += " | |"
        else:
            d = a - ref
            line += f" {a.mean() - ref.mean():+.4f} | {d.mean():+.4f} ± {d.std():.4f} |"
        print(line)
    for n in names:
        print(f"{n} per seed: {np.round(aucs[n], 4).tolist()}")
    for n, t in tables.items():
        print(f"\n{n}, seed {seeds[0]}: tables from summary.json")
        keys = ("rows_live", "cache_rows", "admitted", "rejected", "evicted")
        print("| table | " + " | ".join(keys) + " | cache hit rate | rows moved/step |")
        print("|---|" + "---|" * (len(keys) + 2))
        for name, st in t.items():
            print(
                f"| {name} | "
                + " | ".join(f"{st.get(k, '')}" for k in keys)
                + f" | {st.get('cache_hit_rate', float('nan')):.3f}"
                + f" | {st.get('rows_moved_per_step', float('nan')):.1f} |"
            )
        live = sum(st.get("rows_live", 0) for st in t.values())
        cache = sum(st.get("cache_rows", 0) for st in t.values())
        print(f"total: {live:,} rows live, {cache:,} cache rows")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--peer-python",
        default=os.environ.get("PEER_PYTHON"),
        help="python of a venv with torch (default $PEER_PYTHON; the PyTorch "
        "side is skipped without one)",
    )
    ap.add_argument(
        "--data",
        default=default_data(),
        help=f"the Criteo head-10k file (default $SPARSEJAX_DATA_DIR/{SAMPLE})",
    )
    ap.add_argument("--models", default="dlrm,deepfm")
    ap.add_argument(
        "--configs",
        help="compare these sparsejax configs (names under configs/ or paths, "
        "comma-separated; the first is the reference) instead of sparsejax vs PyTorch",
    )
    ap.add_argument(
        "--dynamic",
        action="store_true",
        help="--configs dlrm_criteo,dlrm_criteo_dynamic (issue 10)",
    )
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()
    if not args.data or not os.path.isfile(args.data):
        ap.error(
            f"--data={args.data!r}: no such file; pass --data or set "
            f"SPARSEJAX_DATA_DIR to the directory holding {SAMPLE}"
        )
    data = os.path.abspath(args.data)
    if args.dynamic or args.configs:
        names = (args.configs or "dlrm_criteo,dlrm_criteo_dynamic").split(",")
        for n in names:
            if not config_path(n).is_file():
                ap.error(f"--configs: {n!r}: no such config ({config_path(n)})")
        compare_configs(names, list(range(args.seeds)), args.epochs, data)
        return
    models = args.models.split(",")
    seeds = list(range(args.seeds))
    torch_aucs: dict[str, list[float]] = {}
    if args.peer_python:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run(
                [
                    args.peer_python,
                    str(ROOT / "experiments/torch_reference.py"),
                    "--models",
                    args.models,
                    "--seeds",
                    ",".join(map(str, seeds)),
                    "--epochs",
                    str(args.epochs),
                    "--json",
                    f.name,
                    "--data",
                    data,
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            res = json.loads(Path(f.name).read_text())
        for r in res["runs"]:
            torch_aucs.setdefault(r["model"], []).append(r["history"][-1]["auc"])
    ours: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:
            ours[m] = [sparsejax_auc(m, s, args.epochs, tmp, data) for s in seeds]
    print(
        f"eval AUC, Criteo head-10k (8,000 train / 2,000 eval), {args.epochs} epoch(s), "
        f"seeds 0..{args.seeds - 1}"
    )
    print("| model | sparsejax mean ± std | PyTorch mean ± std | difference |")
    print("|---|---|---|---|")
    for m in models:
        a = np.asarray(ours[m])
        line = f"| {m} | {a.mean():.4f} ± {a.std():.4f} |"
        if m in torch_aucs:
            t = np.asarray(torch_aucs[m])
            line += f" {t.mean():.4f} ± {t.std():.4f} | {a.mean() - t.mean():+.4f} |"
        else:
            line += " (no --peer-python) | |"
        print(line)
    for m in models:
        print(
            f"{m} per seed: sparsejax {np.round(ours[m], 4).tolist()}"
            + (f"; torch {np.round(torch_aucs[m], 4).tolist()}" if m in torch_aucs else "")
        )


if __name__ == "__main__":
    main()
