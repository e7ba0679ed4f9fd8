#!/usr/bin/env python3
"""PyTorch side of experiments/bench_train.py (runs in the peer venv, not the project's).

One method per process. Loads the batches that bench_train.py generated with
`sparsejax.data.SyntheticCriteo` (an .npz: ids int64[NB, B, F], dense f32[NB, B, 13],
labels f32[NB, B], vocab int64[F]) and trains the same DLRM on them:
bottom MLP 13->512->256->64 (ReLU after each), dot interaction over the 27 vectors
(351 pairs, i < j row-major) concatenated after the bottom output, top MLP
415->512->256->1 (ReLU between), BCE-with-logits; dense params Adam(lr 1e-3).

Methods (sparse side):
  trec_dlrm  torchrec.models.dlrm.DLRM over a FusedEmbeddingBagCollection (one FBGEMM TBE
             per table group, EXACT_ROWWISE_ADAGRAD fused into backward, HOST location)
  tbe        one SplitTableBatchedEmbeddingBagsCodegen over the 26 tables
             (EXACT_ROWWISE_ADAGRAD fused into backward) + the same dense modules
  torch_eb   26 nn.EmbeddingBag(mode="sum", sparse=True) + torch.optim.Adagrad
             (element-wise Adagrad on the sparse rows it touches)
  dense_only the dense part alone (pooled embeddings given as a leaf tensor with grad):
             a reference for the MLP/interaction cost
Sparse optimizer: lr 0.01, eps 1e-8. Tables U(+-sqrt(1/V)) like sparsejax.

Prints one JSON line: per-repetition ms/step and the losses.
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.nn as nn

LR_SPARSE, EPS, LR_DENSE = 0.01, 1e-8, 1e-3
BOTTOM, TOP = (512, 256, 64), (512, 256, 1)


def mlp(sizes, in_f, final_relu):
    layers = []
    for i, w in enumerate(sizes):
        layers.append(nn.Linear(in_f, w))
        if i < len(sizes) - 1 or final_relu:
            layers.append(nn.ReLU())
        in_f = w
    return nn.Sequential(*layers)


class DenseDLRM(nn.Module):
    """Everything after the pooled embeddings (same math as torchrec's DLRM)."""

    def __init__(self, num_dense, F, D):
        super().__init__()
        self.bottom = mlp(BOTTOM, num_dense, True)
        self.top = mlp(TOP, D + (F + 1) * F // 2, False)
        self.register_buffer("tri", torch.triu_indices(F + 1, F + 1, offset=1), persistent=False)

    def forward(self, dense, pooled):  # pooled [B, F, D]
        x = self.bottom(dense)
        v = torch.cat([x.unsqueeze(1), pooled], dim=1)
        gram = torch.bmm(v, v.transpose(1, 2))
        inter = gram[:, self.tri[0], self.tri[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


def init_table_(w, rows):
    bound = (1.0 / rows) ** 0.5
    with torch.no_grad():
        w.uniform_(-bound, bound)


def build(method, data):
    ids, vocab = data["ids"], data["vocab"]
    NB, B, F = ids.shape
    D = BOTTOM[-1]
    dense = [torch.from_numpy(data["dense"][k]) for k in range(NB)]
    labels = [torch.from_numpy(data["labels"][k]) for k in range(NB)]
    fm = [torch.from_numpy(np.ascontiguousarray(ids[k].T)) for k in range(NB)]  # [F, B]
    torch.manual_seed(0)
    sopt = None

    if method == "trec_dlrm":
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from torchrec.models.dlrm import DLRM
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.optim import RowWiseAdagrad
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        cfgs = [
            EmbeddingBagConfig(
                name=f"t{f}", embedding_dim=D, num_embeddings=int(vocab[f]), feature_names=[f"f{f}"]
            )
            for f in range(F)
        ]
        febc = FusedEmbeddingBagCollection(
            tables=cfgs,
            optimizer_type=RowWiseAdagrad,
            optimizer_kwargs={"lr": LR_SPARSE, "eps": EPS},
            device=torch.device("cpu"),
            location=EmbeddingLocation.HOST,
        )
        for name, w in febc.state_dict().items():  # views of the fused weights
            if name.endswith(".weight") and w.dim() == 2:
                init_table_(w, w.shape[0])
        model = DLRM(
            embedding_bag_collection=febc,
            dense_in_features=dense[0].shape[1],
            dense_arch_layer_sizes=list(BOTTOM),
            over_arch_layer_sizes=list(TOP),
        )
        dense_params = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch")]
        keys = [f"f{f}" for f in range(F)]
        kjts = [
            KeyedJaggedTensor.from_lengths_sync(
                keys=keys, values=fm[k].reshape(-1), lengths=torch.ones(F * B, dtype=torch.int64)
            )
            for k in range(NB)
        ]

        def forward(k):
            return model(dense_features=dense[k], sparse_features=kjts[k]).squeeze(1)

        info = dict(fused_params=sum(p.numel() for p in febc.parameters()))
    else:
        net = DenseDLRM(dense[0].shape[1], F, D)
        dense_params = list(net.parameters())
        info = {}
        if method == "tbe":
            from fbgemm_gpu.split_embedding_configs import EmbOptimType
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
                BoundsCheckMode,
                EmbeddingLocation,
                PoolingMode,
            )
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
                ComputeDevice,
                SplitTableBatchedEmbeddingBagsCodegen,
            )

            tbe = SplitTableBatchedEmbeddingBagsCodegen(
                [(int(v), D, EmbeddingLocation.HOST, ComputeDevice.CPU) for v in vocab],
                optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                learning_rate=LR_SPARSE,
                eps=EPS,
                pooling_mode=PoolingMode.SUM,
                bounds_check_mode=BoundsCheckMode.WARNING,
                device=torch.device("cpu"),
            )
            for w in tbe.split_embedding_weights():
                init_table_(w, w.shape[0])
            offs = torch.arange(0, F * B + 1, dtype=torch.int64)
            flat = [fm[k].reshape(-1).contiguous() for k in range(NB)]

            def pooled_of(k):
                return tbe(flat[k], offs).view(B, F, D)

            keep = tbe
        elif method == "torch_eb":
            ebs = nn.ModuleList(
                [nn.EmbeddingBag(int(v), D, mode="sum", sparse=True) for v in vocab]
            )
            for e in ebs:
                init_table_(e.weight, e.weight.shape[0])
            off = torch.arange(0, B, dtype=torch.int64)
            sopt = torch.optim.Adagrad(ebs.parameters(), lr=LR_SPARSE, eps=EPS)

            def pooled_of(k):
                return torch.stack([ebs[f](fm[k][f], off) for f in range(F)], dim=1)

            keep = ebs
        elif method == "dense_only":
            g = torch.Generator().manual_seed(1)
            pooled = [
                (torch.rand(B, F, D, generator=g) * 0.02 - 0.01).requires_grad_() for _ in range(NB)
            ]

            def pooled_of(k):
                return pooled[k]

            keep = None
        else:
            raise SystemExit(f"unknown method {method}")

        def forward(k):
            return net(dense[k], pooled_of(k))

        info["keep"] = keep is not None
    dopt = torch.optim.Adam(dense_params, lr=LR_DENSE)
    lossf = nn.BCEWithLogitsLoss()

    def step(k):
        if sopt is not None:
            sopt.zero_grad(set_to_none=True)
        dopt.zero_grad(set_to_none=True)
        loss = lossf(forward(k), labels[k])
        loss.backward()
        if sopt is not None:
            sopt.step()
        dopt.step()
        return loss.detach()

    return step, NB, info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--method", required=True, choices=["trec_dlrm", "tbe", "torch_eb", "dense_only"]
    )
    ap.add_argument("--data", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = dict(np.load(args.data))
    t0 = time.perf_counter()
    step, NB, info = build(args.method, data)
    setup_s = time.perf_counter() - t0
    k = 0
    losses = []
    t0 = time.perf_counter()
    warm = 0
    while warm < 3 or time.perf_counter() - t0 < args.warmup_s:
        losses.append(float(step(k % NB)))
        k += 1
        warm += 1
    rep_ms = []
    for _ in range(args.reps):
        t = time.perf_counter()
        for _ in range(args.steps):
            loss = step(k % NB)
            k += 1
        rep_ms.append((time.perf_counter() - t) * 1e3 / args.steps)
        losses.append(float(loss))
    print(
        json.dumps(
            dict(
                method=args.method,
                rep_ms=rep_ms,
                median_ms=statistics.median(rep_ms),
                warmup_steps=warm,
                setup_s=round(setup_s, 2),
                loss_first=losses[0],
                loss_last=losses[-1],
                threads=torch.get_num_threads(),
                torch=torch.__version__,
                **{k: v for k, v in info.items() if k != "keep"},
            )
        )
    )


if __name__ == "__main__":
    main()
