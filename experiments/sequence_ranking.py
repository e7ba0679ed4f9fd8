#!/usr/bin/env python3
"""Sequence model from an event log, end to end: does DIN beat popularity?

A generated implicit-feedback log (`sparsejax.data.synthetic_events`: 3,000 users move
between 3 preferred of 20 item categories, staying in the current one with probability
--stickiness, 5% noise; 1,000 items, Zipf-popular within a category) is written as a CSV
(user,item,time), read back with `read_events`, turned into sequence examples
(leave-last-out split, history of the last 20 items, --negatives uniform negatives per
train positive, 100 uniform negatives per test user) and used to train

* DIN (target attention of the candidate over the history; item and history share one
  table) for --steps steps, scored on the test candidate sets (HR@10, NDCG@10, MRR,
  AUC, GAUC against 100 sampled negatives) next to the popularity baseline (train
  count of each candidate) on the same sets;
* a two-tower model (user tower: user id + mean of the history; item tower: item id)
  with in-batch negatives on the positives, evaluated on the same candidate sets and by
  full-corpus recall@10 through its towers (seen items excluded), next to popularity
  over the full corpus.

Prints one table; every number comes from this run. Example::

    python experiments/sequence_ranking.py --steps 400

Sparse tables: row-wise Adagrad (--sparse-lr); dense parameters: Adam (--lr); batch 256.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import numpy as np
import optax

from sparsejax import data as sd
from sparsejax import nn as snn
from sparsejax import ops, train


def train_model(model, examples, tables, features, *, steps, batch_size, lr, seed):
    packer = sd.BatchPacker(tables, features, batch_size=batch_size)
    trainer = train.Trainer(model, optax.adam(lr))
    with sd.Loader(examples, packer, seed=seed, epochs=None, drop_remainder=True) as loader:
        it = iter(loader)
        first = next(it)
        state = trainer.init(jax.random.key(seed), first)
        t0 = time.perf_counter()
        batch = first
        for _ in range(steps):
            state, metrics = trainer.train_step(state, batch)
            batch = next(it)
        loss = float(metrics["loss"])
    return trainer, state, loss, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=3000)
    p.add_argument("--items", type=int, default=1000)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stickiness", type=float, default=0.9)
    p.add_argument("--negatives", type=int, default=4, help="per train positive (DIN)")
    p.add_argument("--sparse-lr", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam, dense parameters")
    args = p.parse_args()

    log = sd.synthetic_events(
        num_users=args.users,
        num_items=args.items,
        stickiness=args.stickiness,
        noise=0.05,
        seed=args.seed,
    )
    cfg = sd.SequenceConfig(
        history_length=20, negatives=args.negatives, eval_negatives=100, seed=args.seed
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = log.write_csv(f"{tmp}/events.csv")
        t0 = time.perf_counter()
        data, parse = sd.load_sequences(path, cfg)
        t_build = time.perf_counter() - t0
    print(parse)
    print(data.report)
    print(f"read + build: {t_build:.2f} s for {len(log):,} events\n")
    test = data.test
    opt = ops.RowWiseAdagrad(learning_rate=args.sparse_lr)
    tables, features = data.specs(dim=args.dim, optimizer=opt)
    eval_packer = sd.BatchPacker(tables, features, batch_size=2048)
    rows = []

    pop = train.ranking_report(sd.popularity_scores(data, test), ks=(10,))
    rows.append(("popularity", "100 sampled", pop, None))

    din = snn.DIN(tables=tables, features=features, hidden=(64, 32), attention_hidden=(16,))
    trainer, state, loss, t_train = train_model(
        din,
        data.train,
        tables,
        features,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    rows.append(
        (
            "DIN",
            "100 sampled",
            train.evaluate_ranking(trainer, state, test, eval_packer, ks=(10,)),
            (t_train, time.perf_counter() - t0, loss),
        )
    )

    # two-tower on the positives only (in-batch negatives)
    positives = sd.build_sequences(log, sd.SequenceConfig(history_length=20, negatives=0))
    tt = snn.TwoTower(
        tables=tables,
        features=features,
        user_features=("user", "history"),
        item_features=("item",),
        tower=(64, 32),
    )
    trainer, state, loss, t_train = train_model(
        tt,
        positives.train,
        tables,
        features,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    rows.append(
        (
            "two-tower",
            "100 sampled",
            train.evaluate_ranking(trainer, state, test, eval_packer, ks=(10,)),
            (t_train, time.perf_counter() - t0, loss),
        )
    )
    t0 = time.perf_counter()
    full = train.evaluate_retrieval(trainer, state, test, eval_packer, ks=(10,))
    rows.append(
        (
            "two-tower",
            f"full corpus ({data.num_items})",
            {"hr@10": full["recall@10"], "ndcg@10": full["ndcg@10"], "mrr": full["mrr"]},
            (t_train, time.perf_counter() - t0, loss),
        )
    )
    counts = data.item_counts.astype(np.float32)[:, None]
    pop_full = train.full_corpus_recall(
        np.ones((test.num_users, 1), np.float32),
        counts,
        test.positives,
        (10,),
        exclude=(test.seen.lengths, test.seen.values),
    )
    rows.append(
        (
            "popularity",
            f"full corpus ({data.num_items})",
            {
                "hr@10": pop_full["recall@10"],
                "ndcg@10": pop_full["ndcg@10"],
                "mrr": pop_full["mrr"],
            },
            None,
        )
    )

    print(
        f"{'model':<11} {'candidates':<20} {'HR@10':>6} {'NDCG@10':>8} {'MRR':>6} {'AUC':>6} "
        f"{'GAUC':>6}  train (s, steps={args.steps})  eval (s)  loss"
    )
    for name, cands, m, timing in rows:
        auc = f"{m['auc']:6.3f}" if "auc" in m else f"{'-':>6}"
        gauc = f"{m['gauc']:6.3f}" if "gauc" in m else f"{'-':>6}"
        t = f"{timing[0]:10.2f} {timing[1]:25.2f} {timing[2]:7.3f}" if timing else ""
        print(
            f"{name:<11} {cands:<20} {m['hr@10']:6.3f} {m['ndcg@10']:8.3f} {m['mrr']:6.3f} "
            f"{auc} {gauc}  {t}"
        )
    print(f"\n{test.num_users} test users; ties averaged; device: {jax.devices()[0].platform}")


if __name__ == "__main__":
    main()
