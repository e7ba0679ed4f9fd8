"""Optimizer and initializer defaults measured on the shipped Criteo samples (issue 22,
item 8): each candidate default (`optimizer.*`, `model.embedding_init`) trains DLRM and
DeepFM for a few epochs on each sample, evaluated after every epoch, over a few seeds;
prints the best and the last epoch's eval AUC and logloss of each (mean over seeds).

Samples (under `$SPARSEJAX_DATA_DIR`): the Kaggle head-10k (first 8,000 rows train, last
2,000 eval) and the random 4k spread over all 7 days (first 3,584 train, last 1,000
eval). Each run goes through the runner's `train`, as `sparsejax train` does.

    SPARSEJAX_DATA_DIR=/path/to/data PYTHONPATH=. python experiments/defaults_criteo.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparsejax import runner  # noqa: E402

SAMPLES = {
    "head10k": ("criteo_kaggle_head10k/train_head10k.txt", 8000),
    "random4k": ("criteo_kaggle_random4k/train_sample_4K.txt", 3584),
}
"""name: (file under $SPARSEJAX_DATA_DIR, train rows; the rest evaluate)."""

CANDIDATES = {
    "rowwise_adagrad 0.05, U(±1/sqrt(V))": [
        "optimizer.sparse=rowwise_adagrad",
        "optimizer.sparse_learning_rate=0.05",
    ],
    "rowwise_adagrad 0.01, N(0, 0.01)": [
        "optimizer.sparse=rowwise_adagrad",
        "optimizer.sparse_learning_rate=0.01",
        "model.embedding_init={kind: normal, stddev: 0.01}",
    ],
    "lazy_adam 1e-3, U(±1/sqrt(V))": [
        "optimizer.sparse=lazy_adam",
        "optimizer.sparse_learning_rate=0.001",
    ],
    "lazy_adam 1e-3, N(0, 0.01)": [
        "optimizer.sparse=lazy_adam",
        "optimizer.sparse_learning_rate=0.001",
        "model.embedding_init={kind: normal, stddev: 0.01}",
    ],
    "lazy_adam 3e-3, N(0, 0.01)": [
        "optimizer.sparse=lazy_adam",
        "optimizer.sparse_learning_rate=0.003",
        "model.embedding_init={kind: normal, stddev: 0.01}",
    ],
}
"""Candidate defaults (dense: adam 1e-3 in all)."""


def evals(sample: str, model: str, cand: str, seed: int, epochs: int, tmp: str) -> list[dict]:
    """The eval records (one per epoch) of one run."""
    path, train_rows = SAMPLES[sample]
    name = f"{sample}_{model}_{seed}_{abs(hash(cand)) % 10**8}"
    cfg = runner.load_config(
        [ROOT / f"configs/{model}_criteo.yaml"],
        [
            *CANDIDATES[cand],
            "optimizer.dense=adam",
            "optimizer.dense_learning_rate=0.001",
            f"seed={seed}",
            f"epochs={epochs}",
            "eval_every=epoch",
            "progress=false",
            "resume=false",
            f"out_dir={tmp}",
            f"name={name}",
            f"data.path={os.path.join(os.environ['SPARSEJAX_DATA_DIR'], path)}",
            f"data.train_rows={train_rows}",
        ],
    )
    runner.train(cfg, log=lambda *_: None)
    with open(os.path.join(tmp, name, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "eval"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--models", default="dlrm,deepfm")
    ap.add_argument("--samples", default="head10k,random4k")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sample in args.samples.split(","):
            for model in args.models.split(","):
                for cand in CANDIDATES:
                    runs = [
                        evals(sample, model, cand, s, args.epochs, tmp) for s in range(args.seeds)
                    ]
                    auc = np.array([[r["auc"] for r in e] for e in runs])  # [seed, epoch]
                    ll = np.array([[r["logloss"] for r in e] for e in runs])
                    row = (
                        f"| {sample} | {model} | {cand} | {auc.max(1).mean():.4f} "
                        f"(epoch {np.bincount(auc.argmax(1)).argmax() + 1}) | "
                        f"{auc[:, -1].mean():.4f} | {ll.min(1).mean():.4f} | "
                        f"{ll[:, -1].mean():.4f} | "
                        + " ".join(f"{a:.4f}" for a in auc.mean(0))
                        + " |"
                    )
                    rows.append(row)
                    print(row, flush=True)
    print(
        f"\n{args.seeds} seeds, {args.epochs} epochs, eval after each epoch; means over seeds\n"
        "| sample | model | sparse optimizer, init | best AUC (most common epoch) | last AUC "
        "| best logloss | last logloss | AUC by epoch |\n|---|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
