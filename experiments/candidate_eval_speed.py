#!/usr/bin/env python3
"""Candidate evaluation against one training epoch: per-row scoring vs factored scoring.

A generated event log (`sparsejax.data.synthetic_events`, --users users, --items items,
--events events per user) is made into leave-last-out sequence examples (history of the
last 20 items; test: the held-out item plus 100 uniform negatives per user). One model
(--model two_tower: user tower over user id + history mean, item tower over item id,
in-batch negatives on the positives; or din: 4 sampled negatives per positive) trains
one epoch (batch --batch-size, timed after the first, compiling, step); then the test
candidate sets are scored twice:

* rows: every (user, candidate) a packed row (users x 101 rows), the old path;
* factored: each user and each distinct candidate item encoded once (two-tower: the two
  towers and a [users, 101] dot product; DIN: the history looked up once per user).

The runner's evals during training used to add `Trainer.evaluate` over the same rows
(in-batch metrics of a two-tower; AUC/logloss of a CTR model): timed as well. Prints the
epoch time, both eval times (scores and metrics, as `evaluate_ranking`;
compilation included, as a user meets it), their ratios to the epoch and HR@10 / NDCG@10
/ MRR of both paths. Example::

    python experiments/candidate_eval_speed.py --users 31000 --model two_tower
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import optax

from sparsejax import data as sd
from sparsejax import nn as snn
from sparsejax import ops, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=31000)
    p.add_argument("--items", type=int, default=10000)
    p.add_argument("--events", type=int, nargs=2, default=(10, 30), help="per user: lo hi")
    p.add_argument("--model", choices=("two_tower", "din"), default="two_tower")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--eval-batch-size", type=int, default=2048)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    log = sd.synthetic_events(
        num_users=args.users,
        num_items=args.items,
        events_per_user=tuple(args.events),
        seed=args.seed,
    )
    negatives = 0 if args.model == "two_tower" else 4
    data = sd.build_sequences(
        log,
        sd.SequenceConfig(
            history_length=20, negatives=negatives, eval_negatives=100, seed=args.seed
        ),
    )
    print(data.report)
    tables, features = data.specs(dim=args.dim, optimizer=ops.RowWiseAdagrad(learning_rate=0.1))
    if args.model == "two_tower":
        model = snn.TwoTower(
            tables=tables,
            features=features,
            user_features=("user", "history"),
            item_features=("item",),
            tower=(64, 32),
        )
    else:
        model = snn.DIN(tables=tables, features=features, hidden=(64, 32), attention_hidden=(16,))
    trainer = train.Trainer(model, optax.adam(3e-3))
    packer = sd.BatchPacker(tables, features, batch_size=args.batch_size)
    with sd.Loader(data.train, packer, seed=args.seed, epochs=1, drop_remainder=True) as loader:
        it = iter(loader)
        batch = next(it)
        state = trainer.init(jax.random.key(args.seed), batch)
        state, m = trainer.train_step(state, batch)  # compiles
        float(m["loss"])
        t0 = time.perf_counter()
        steps = 1
        for batch in it:
            state, m = trainer.train_step(state, batch)
            steps += 1
        loss = float(m["loss"])
        t_epoch = time.perf_counter() - t0
    print(
        f"{args.model}: one epoch, {steps} steps of {args.batch_size}: {t_epoch:.1f} s, "
        f"loss {loss:.3f}"
    )

    sets = data.test
    eval_packer = sd.BatchPacker(tables, features, batch_size=args.eval_batch_size)
    results = {}
    for method in ("factored", "rows"):  # what evaluate_ranking does, timed as a whole
        t0 = time.perf_counter()
        scores = train.score_candidates(trainer, state, sets, eval_packer, method=method)
        metrics = train.ranking_report(scores, ks=(10,))
        results[method] = (time.perf_counter() - t0, scores, metrics)
    (t_new, new, m_new), (t_old, old, m_old) = results["factored"], results["rows"]
    # the runner's eval before: also Trainer.evaluate over the packed candidate rows
    batches = sd.pack_examples(sets.to_examples(), eval_packer)
    t0 = time.perf_counter()
    trainer.evaluate(state, batches)
    t_runner = t_old + time.perf_counter() - t0
    del batches
    print(
        f"{sets.num_users:,} test users x {sets.num_candidates} candidates "
        f"({sets.num_rows:,} rows), eval batch {args.eval_batch_size}; "
        f"device: {jax.devices()[0].platform}, {jax.local_device_count()} device(s)"
    )
    print(f"{'path':<9} {'eval (s)':>9} {'/ epoch':>8} {'HR@10':>8} {'NDCG@10':>8} {'MRR':>8}")
    for name, t, m in (("rows", t_old, m_old), ("factored", t_new, m_new)):
        print(
            f"{name:<9} {t:9.1f} {t / t_epoch:7.2f}x {m['hr@10']:8.4f} {m['ndcg@10']:8.4f} "
            f"{m['mrr']:8.4f}"
        )
    print(
        f"the runner's eval before (rows, plus Trainer.evaluate of the rows): {t_runner:.1f} s, "
        f"{t_runner / t_epoch:.1f}x the epoch"
    )
    print(
        f"speed-up {t_old / t_new:.1f}x; max |score difference| {np.abs(new - old).max():.2e}; "
        f"HR@10 and NDCG@10 identical: "
        f"{m_new['hr@10'] == m_old['hr@10'] and m_new['ndcg@10'] == m_old['ndcg@10']}"
    )


if __name__ == "__main__":
    main()
