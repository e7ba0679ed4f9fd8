"""Independent PyTorch reference for DLRM / DeepFM quality on Criteo Kaggle head-10k.

Self-contained (does not import sparsejax); parses the data itself.

Data: `--data`, default `$SPARSEJAX_DATA_DIR/criteo_kaggle_head10k/train_head10k.txt`
(tab-separated: label, I1..I13, C1..C26). Split: first 8,000 lines train, last 2,000
eval (file order).

Preprocessing:
  dense: empty -> 0, else log1p(max(x, 0)) as float32.
  categorical (per column): raw = int(hex, 16), or "missing" if empty. Vocabulary fitted
    on TRAIN: values (excluding missing) seen >= min_count (default 2) times get ids
    1..n in increasing order of raw integer value; missing, rare and unseen values -> 0.
    Table size n + 1.

Models (embedding dim 16):
  DLRM: bottom MLP 13 -> 64 -> 16, ReLU after each layer (incl. the last). Interaction:
    stack [bottom_out, emb_C1..emb_C26] (27 x 16), pairwise dots i < j in row-major
    order (351), concatenated after bottom_out -> 367. Top MLP 367 -> 64 -> 32 -> 1, ReLU
    between layers, raw logit output.
  DeepFM: logit = bias + first_order + fm + deep. first_order = sum of 26 1-dim
    embeddings (one table per feature) + Linear(13 -> 1, no bias) on dense.
    fm = 0.5 * sum_d((sum_f e_fd)^2 - sum_f e_fd^2) over the 26 16-dim embeddings.
    deep: concat(26*16 embeddings, 13 dense) = 429 -> 200 -> 200 -> 1, ReLU between
    layers. bias: scalar parameter, init 0.
Init: Linear weight xavier_uniform, bias 0. Embedding tables: U(-sqrt(1/V), sqrt(1/V)),
  V = rows.
Training: BCE-with-logits (batch mean). Embeddings sparse=True with Adagrad(lr=0.05,
  initial_accumulator_value=0, eps=1e-10); dense params Adam(lr=1e-3). Batch 256, seeded
  permutation each epoch, last partial batch kept. Eval AUC (rank-based Mann-Whitney,
  ties averaged) and logloss after each epoch.

Run (in a venv with torch, e.g. `$PEER_PYTHON`, see experiments/RESULTS.md):
  "$PEER_PYTHON" experiments/torch_reference.py --models dlrm,deepfm --seeds 0,1,2 \
      --epochs 2 [--data FILE] [--json results.json]
"""

import argparse
import json
import math
import os
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

N_DENSE, N_CAT, N_TRAIN = 13, 26, 8000
SAMPLE = "criteo_kaggle_head10k/train_head10k.txt"
DEFAULT_DATA = (
    Path(os.environ["SPARSEJAX_DATA_DIR"]) / SAMPLE
    if os.environ.get("SPARSEJAX_DATA_DIR")
    else None
)


def load(path, min_count):
    rows = [line.rstrip("\n").split("\t") for line in open(path)]
    assert all(len(r) == 1 + N_DENSE + N_CAT for r in rows)
    y = np.array([float(r[0]) for r in rows], np.float32)
    dense = np.array(
        [[math.log1p(max(int(v), 0)) if v else 0.0 for v in r[1 : 1 + N_DENSE]] for r in rows],
        np.float32,
    )
    raw = [[int(v, 16) if v else None for v in r[1 + N_DENSE :]] for r in rows]
    cat = np.zeros((len(rows), N_CAT), np.int64)
    sizes = []
    for c in range(N_CAT):
        counts = {}
        for r in raw[:N_TRAIN]:
            if r[c] is not None:
                counts[r[c]] = counts.get(r[c], 0) + 1
        kept = sorted(v for v, n in counts.items() if n >= min_count)
        vocab = {v: i + 1 for i, v in enumerate(kept)}
        cat[:, c] = [vocab.get(r[c], 0) for r in raw]
        sizes.append(len(vocab) + 1)

    def split(a):
        return torch.from_numpy(a[:N_TRAIN]), torch.from_numpy(a[N_TRAIN:])

    return split(dense), split(cat), split(y), sizes


def embedding(rows, dim):
    e = nn.Embedding(rows, dim, sparse=True)
    b = math.sqrt(1.0 / rows)
    nn.init.uniform_(e.weight, -b, b)
    return e


def linear(i, o, bias=True):
    lin = nn.Linear(i, o, bias=bias)
    nn.init.xavier_uniform_(lin.weight)
    if bias:
        nn.init.zeros_(lin.bias)
    return lin


def mlp(sizes, final_relu):
    layers = []
    for k, (i, o) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(linear(i, o))
        if final_relu or k < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, sizes, dim):
        super().__init__()
        self.embs = nn.ModuleList(embedding(v, dim) for v in sizes)
        self.bottom = mlp([N_DENSE, 64, dim], final_relu=True)
        n = N_CAT + 1
        self.iu = torch.triu_indices(n, n, offset=1)  # row-major (i, j), i < j
        self.top = mlp([dim + n * (n - 1) // 2, 64, 32, 1], final_relu=False)

    def forward(self, dense, cat):
        b = self.bottom(dense)
        z = torch.stack([b] + [e(cat[:, f]) for f, e in enumerate(self.embs)], dim=1)  # (B, 27, d)
        inter = torch.bmm(z, z.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([b, inter], dim=1)).squeeze(1)


class DeepFM(nn.Module):
    def __init__(self, sizes, dim):
        super().__init__()
        self.embs = nn.ModuleList(embedding(v, dim) for v in sizes)
        self.first = nn.ModuleList(embedding(v, 1) for v in sizes)
        self.dense_lin = linear(N_DENSE, 1, bias=False)
        self.deep = mlp([N_CAT * dim + N_DENSE, 200, 200, 1], final_relu=False)
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, dense, cat):
        e = torch.stack([m(cat[:, f]) for f, m in enumerate(self.embs)], dim=1)  # (B, 26, d)
        first = sum(m(cat[:, f]) for f, m in enumerate(self.first)).squeeze(1)
        first = first + self.dense_lin(dense).squeeze(1)
        fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1)
        deep = self.deep(torch.cat([e.flatten(1), dense], dim=1)).squeeze(1)
        return self.bias + first + fm + deep


def auc(y, p):
    """Rank-based AUC (Mann-Whitney U) with average ranks for ties."""
    order = np.argsort(p, kind="mergesort")
    sp = p[order]
    ranks = np.empty(len(p), np.float64)
    i = 0
    while i < len(p):
        j = i
        while j + 1 < len(p) and sp[j + 1] == sp[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    pos = y == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def run(model_name, seed, data, args):
    (dtr, dev), (ctr, cev), (ytr, yev), sizes = data
    torch.manual_seed(seed)
    np.random.seed(seed)
    rng = np.random.default_rng(seed)
    model = {"dlrm": DLRM, "deepfm": DeepFM}[model_name](sizes, args.dim)
    sparse = [p for n, p in model.named_parameters() if n.startswith(("embs.", "first."))]
    dense = [p for n, p in model.named_parameters() if not n.startswith(("embs.", "first."))]
    opts = [
        torch.optim.Adagrad(sparse, lr=args.lr_sparse, initial_accumulator_value=0.0, eps=1e-10),
        torch.optim.Adam(dense, lr=args.lr_dense),
    ]
    history = []
    for epoch in range(args.epochs):
        model.train()
        perm = torch.from_numpy(rng.permutation(N_TRAIN))
        for s in range(0, N_TRAIN, args.batch_size):
            idx = perm[s : s + args.batch_size]
            loss = F.binary_cross_entropy_with_logits(model(dtr[idx], ctr[idx]), ytr[idx])
            for o in opts:
                o.zero_grad()
            loss.backward()
            for o in opts:
                o.step()
        model.eval()
        with torch.no_grad():
            logits = model(dev, cev)
            ll = F.binary_cross_entropy_with_logits(logits, yev).item()
        history.append(
            {"epoch": epoch + 1, "auc": auc(yev.numpy(), logits.double().numpy()), "logloss": ll}
        )
    return history


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA,
        help=f"the Criteo file (default $SPARSEJAX_DATA_DIR/{SAMPLE})",
    )
    ap.add_argument("--models", default="dlrm,deepfm")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--min-count", type=int, default=2)
    ap.add_argument("--lr-sparse", type=float, default=0.05)
    ap.add_argument("--lr-dense", type=float, default=1e-3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.data is None or not args.data.is_file():
        ap.error(
            f"--data={args.data}: no such file; pass --data or set SPARSEJAX_DATA_DIR "
            f"to the directory holding {SAMPLE}"
        )
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    t0 = time.time()
    data = load(args.data, args.min_count)
    print(f"loaded {args.data} in {time.time() - t0:.1f}s; table sizes {data[3]}")
    results = {"config": {k: str(v) for k, v in vars(args).items()}, "runs": [], "summary": {}}
    for m in args.models.split(","):
        finals = []
        for seed in map(int, args.seeds.split(",")):
            t = time.time()
            hist = run(m, seed, data, args)
            dt = time.time() - t
            results["runs"].append({"model": m, "seed": seed, "history": hist, "seconds": dt})
            finals.append(hist[-1]["auc"])
            per_epoch = "  ".join(
                f"e{h['epoch']}: auc={h['auc']:.4f} ll={h['logloss']:.4f}" for h in hist
            )
            print(f"{m:7s} seed={seed}  {per_epoch}  ({dt:.1f}s)")
        mean, std = float(np.mean(finals)), float(np.std(finals))
        results["summary"][m] = {"final_auc_mean": mean, "final_auc_std": std, "final_aucs": finals}
        print(f"{m:7s} final AUC {mean:.4f} ± {std:.4f} (population std over {len(finals)} seeds)")
    print(f"total {time.time() - t0:.1f}s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
