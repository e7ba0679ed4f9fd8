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


def sparsejax_auc(model: str, seed: int, epochs: int, out_dir: str, data: str) -> float:
    cfg = runner.load_config(
        [ROOT / f"configs/{model}_criteo.yaml"],
        [
            f"seed={seed}",
            f"epochs={epochs}",
            "progress=false",
            "resume=false",
            f"out_dir={out_dir}",
            f"name={model}_{seed}",
            f"data.path={data}",
        ],
    )
    return runner.train(cfg, log=lambda *_: None)["eval"]["auc"]


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
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()
    if not args.data or not os.path.isfile(args.data):
        ap.error(
            f"--data={args.data!r}: no such file; pass --data or set "
            f"SPARSEJAX_DATA_DIR to the directory holding {SAMPLE}"
        )
    data = os.path.abspath(args.data)
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
