"""Ranking evaluation of any trained model: HR@k / NDCG@k on candidate sets (a held-out
item plus sampled negatives per user), full-corpus recall@k of two-tower models through
their towers, and per-example predictions to save.

Candidates are scored factored where the model allows (`score_candidates`): a two-tower
encodes each user and each distinct candidate item once and scores their dot products; a
DIN looks each user's history up once for all its candidates. Any other model scores each
(user, candidate) as a packed row, in fixed-shape batches of the packer's batch size (the
last one padded, so the eval step compiles once): CTR models (task "binary") by their
logit, retrieval models (whose output is the `[B, B]` in-batch score matrix) by its
diagonal, the row's own (user, item) score.

Example::

    data = build_sequences(log, SequenceConfig(eval_negatives=100))
    ...train a DIN on data.train...
    packer = BatchPacker(tables, features, batch_size=1024)
    evaluate_ranking(trainer, state, data.test, packer, ks=(5, 10))
    # {"hr@5": ..., "ndcg@5": ..., "hr@10": ..., "ndcg@10": ..., "mrr": ..., "auc": ...,
    #  "gauc": ..., "users": 6040, "candidates": 101}
"""

from __future__ import annotations

import copy
import csv
import os
import weakref
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..data import HISTORY, ITEM, BatchPacker, CandidateSets, Examples, JaggedIds
from ..nn import DIN, EMBEDDING, EmbeddingBagCollection, TwoTower, tables_on
from . import _metrics
from ._trainer import Trainer, TrainState


def score_candidates(
    trainer: Trainer,
    state: TrainState,
    sets: CandidateSets,
    packer: BatchPacker,
    *,
    max_negatives: int | None = None,
    method: str = "auto",
) -> np.ndarray:
    """`f32[users, candidates]`: the model's score of every candidate of every user
    (column 0 the held-out item). `max_negatives` scores only the first few negatives of
    each set.

    `method`: "factored" encodes each user once and each distinct candidate item once (a
    two-tower: the user tower on the users, the item tower on the items, scores their dot
    product / temperature; DIN: each user's features and history looked up once and
    attended by all its candidates); "rows" scores every (user, candidate) as its own
    packed row (any model; the reference); "auto" (default): factored where the model
    allows, else rows. Both give the same scores up to float rounding."""
    if method not in SCORING_METHODS:
        raise ValueError(
            f"score_candidates: method must be one of {SCORING_METHODS}, got {method!r}"
        )
    c = (
        sets.num_candidates
        if max_negatives is None
        else 1 + min(max_negatives, sets.num_candidates - 1)
    )
    scorer = None if method == "rows" else _factored_scorer(trainer)
    if scorer is None and method == "factored":
        raise ValueError(
            f"score_candidates: {type(trainer.model).__name__} cannot be scored factored (a "
            "two-tower with the item tower over 'item' alone, or a DIN over 'item' and "
            "'history', on a trainer without host or sharded tables); use method='rows'"
        )
    if scorer is not None:
        return scorer(trainer, state, sets, packer, c)
    return _score_rows(trainer, state, sets, packer, c, max_negatives)


SCORING_METHODS = ("auto", "factored", "rows")


def _score_rows(trainer, state, sets, packer, c, max_negatives) -> np.ndarray:
    """Every (user, candidate) a packed row of `packer`'s batch size (the last padded), so
    the eval step compiles once. CTR models score a row by their logit; retrieval models
    (whose output is the `[B, B]` in-batch score matrix) by its diagonal."""
    total, b = sets.num_users * c, packer.batch_size
    scores = np.empty(total, np.float32)
    pending = None  # the previous batch's output: packing overlaps the device step

    def collect(item):
        out, start, n = item
        scores[start : start + n] = np.asarray(out)[:n]

    for start in range(0, total, b):
        sparse, labels, dense = sets.rows(start, start + b, max_negatives=max_negatives)
        batch = packer.pack(sparse, labels=labels, dense=dense, first_example=start)
        out = trainer.eval_step(state, batch)
        row = jnp.diagonal(out) if trainer.task == "retrieval" else out.reshape(b, -1)[:, 0]
        if pending is not None:
            collect(pending)
        pending = (row, start, labels.shape[0])
    if pending is not None:
        collect(pending)
    return scores.reshape(sets.num_users, c)


def _factored_scorer(trainer: Trainer) -> Callable | None:
    """The factored scorer of the trainer's model, or None where it has none: a model
    other than a two-tower or DIN reading the candidate sets' features, or tables the
    host executes, caches or shards (their lookups go through `Trainer.eval_step`)."""
    if trainer.host.maps_batches or trainer.shards_batch:
        return None
    model = trainer.model
    if isinstance(model, TwoTower):
        if tuple(model.item_features) == (ITEM,) and ITEM not in model.user_features:
            return _two_tower_scores
        return None
    if isinstance(model, DIN) and (model.target, model.history) == (ITEM, HISTORY):
        dims = {t.name: t.dim for t in model.tables}
        table = next((f.table for f in model.features if f.name == ITEM), None)
        if model.embedding_dim is None or dims.get(table) == model.embedding_dim:
            return _din_scores
    return None


def _item_ids_of(sets: CandidateSets, c: int) -> tuple[np.ndarray, np.ndarray]:
    """`(distinct items, i32[users, c] index of each candidate among them)`."""
    items, inverse = np.unique(sets.items[:, :c], return_inverse=True)
    return items, inverse.reshape(sets.num_users, c).astype(np.int32)


def _two_tower_scores(trainer, state, sets, packer, c) -> np.ndarray:
    """User tower on each user, item tower on each distinct candidate item, then each
    user's dot product with its candidates' item vectors / temperature."""
    items, index = _item_ids_of(sets, c)
    user, _ = tower_embeddings(trainer, state, sets.user_examples(), packer)
    _, item = tower_embeddings(trainer, state, _item_examples(packer, ITEM, items), packer)
    scores = np.empty((sets.num_users, c), np.float32)
    for start in range(0, sets.num_users, 4096):  # bounded [chunk, c, D] gathers
        stop = start + 4096
        dots = np.einsum("md,mcd->mc", user[start:stop], item[index[start:stop]])
        scores[start:stop] = dots / np.float32(trainer.model.temperature)
    return scores


_DIN_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _din_fns(trainer: Trainer) -> tuple[Callable, Callable]:
    """Jitted `(target rows of a batch's item feature, [B, C] logits of candidates)`."""
    fns = _DIN_FNS.get(trainer)
    if fns is None:
        model = trainer.model

        def variables(state):
            return {"params": state.params, EMBEDDING: state.tables}

        def rows(state, batch):
            with tables_on(trainer.mesh):
                _, aux = model.apply(
                    variables(state),
                    batch,
                    capture_intermediates=lambda mdl, name: (
                        isinstance(mdl, EmbeddingBagCollection) and mdl.name == EMBEDDING
                    ),
                    mutable=["intermediates"],
                )
            return aux["intermediates"][EMBEDDING]["__call__"][0][ITEM]

        def logits(state, batch, table, index):
            with tables_on(trainer.mesh):
                return model.apply(variables(state), batch, candidates=table[index])

        fns = _DIN_FNS[trainer] = (jax.jit(rows), jax.jit(logits))
    return fns


def _din_scores(trainer, state, sets, packer, c) -> np.ndarray:
    """Each distinct candidate's row of the item table looked up once; each user's
    features and history packed and looked up once per batch of users, and attended by
    all its candidates (`DIN(..., candidates=...)`), `packer.batch_size // c` users (about
    `batch_size` rows) a step."""
    rows_fn, logits_fn = _din_fns(trainer)
    items, index = _item_ids_of(sets, c)
    examples = _item_examples(packer, ITEM, items)
    b = packer.batch_size
    parts = []
    for start in range(0, len(examples), b):
        sparse, labels, dense = examples.take(np.arange(start, min(start + b, len(examples))))
        batch = packer.pack(sparse, labels=labels, dense=dense)
        parts.append(rows_fn(state, batch)[: labels.shape[0]])
    table = jnp.concatenate(parts)
    per_step = max(1, b // c)
    users = copy.copy(packer)  # the same specs, `per_step` users a batch
    users.batch_size = per_step
    user_examples = sets.user_examples()
    scores = np.empty((sets.num_users, c), np.float32)
    pending = None  # the previous step's output: packing overlaps the device step
    for start in range(0, sets.num_users, per_step):
        idx = np.arange(start, min(start + per_step, sets.num_users))
        sparse, labels, dense = user_examples.take(idx)
        batch = users.pack(sparse, labels=labels, dense=dense, first_example=start)
        cand = np.zeros((per_step, c), np.int32)
        cand[: idx.size] = index[idx]
        out = logits_fn(state, batch, table, cand)
        if pending is not None:
            scores[pending[1]] = np.asarray(pending[0])[: pending[1].size]
        pending = (out, idx)
    if pending is not None:
        scores[pending[1]] = np.asarray(pending[0])[: pending[1].size]
    return scores


def evaluate_ranking(
    trainer: Trainer,
    state: TrainState,
    sets: CandidateSets,
    packer: BatchPacker,
    *,
    ks: int | Sequence[int] = (10,),
    ties: str = "average",
    max_negatives: int | None = None,
    max_users: int | None = None,
    seed: int = 0,
    method: str = "auto",
) -> dict[str, float]:
    """Ranking metrics of the model on `sets`: `hr@k` and `ndcg@k` for each k, `mrr`,
    and over the same rows (label 1 for the held-out item) the global `auc` and the
    per-user `gauc`; plus `users` and `candidates` (per user). Ties: see
    `sparsejax.train.ranking_metrics`. `max_users`: a random sample of that many users
    (drawn by `seed`, `CandidateSets.sample`), a cheaper estimate on large logs.
    `method`: see `score_candidates`."""
    if max_users is not None:
        sets = sets.sample(max_users, seed=seed)
    scores = score_candidates(
        trainer, state, sets, packer, max_negatives=max_negatives, method=method
    )
    return ranking_report(scores, ks=ks, ties=ties)


def candidate_eval(
    trainer: Trainer,
    state: TrainState,
    sets: CandidateSets,
    packer: BatchPacker,
    batches: Sequence = (),
    *,
    ks: int | Sequence[int] = (10,),
    method: str = "auto",
) -> dict[str, float]:
    """An eval on candidate sets with only the metrics that mean something there:
    `evaluate_ranking`'s, and

    * a CTR model (task "binary"): `loss`, `auc` and `logloss` of the candidate rows
      (`batches`, by `Trainer.evaluate`), but not `calibration`: the rows' positive rate
      is 1 / candidates by construction (the number of sampled negatives), so predicted
      over observed CTR measures the sampling, not the model;
    * a retrieval model: `loss`, the softmax cross-entropy of the held-out item among its
      candidates, instead of `Trainer.evaluate`'s in-batch loss and recall@k, which take
      every candidate row, negatives included, as a positive pair.
    """
    scores = score_candidates(trainer, state, sets, packer, method=method)
    ranking = ranking_report(scores, ks=ks)
    if trainer.task == "binary":
        rows = trainer.evaluate(state, batches)
        rows = {k: v for k, v in rows.items() if k in ("loss", "auc", "logloss", "examples")}
        return rows | {k: v for k, v in ranking.items() if k not in rows}
    s = scores.astype(np.float64)
    top = s.max(axis=1)
    lse = top + np.log(np.exp(s - top[:, None]).sum(axis=1))
    return {"loss": float(np.mean(lse - s[:, 0])), **ranking}


def candidate_metric_names(task: str, ks: Sequence[int]) -> set[str]:
    """The metrics `candidate_eval` reports for a model of `task` (early stopping may
    watch them)."""
    names = {"loss", "auc", "mrr", "gauc", *(f"{m}@{k}" for m in ("hr", "ndcg") for k in ks)}
    return names | ({"logloss"} if task == "binary" else set())


def ranking_report(
    scores: np.ndarray, *, ks: int | Sequence[int] = (10,), ties: str = "average"
) -> dict[str, float]:
    """`evaluate_ranking`'s dict from a score matrix `[users, 1 + K]` (positive in
    column 0), e.g. the popularity baseline's scores."""
    scores = np.asarray(scores)
    out = _metrics.ranking_metrics(scores, ks, ties=ties)
    # `auc` / `gauc` of the rows (label 1 in column 0, ties half), counted rather than by
    # sorting all rows: each user has one positive, so its AUC is the share of its
    # negatives below it, and the global AUC places each positive among all negatives
    pos, neg = scores[:, 0], scores[:, 1:]
    if neg.size:
        below = (neg < pos[:, None]).sum(1) + 0.5 * (neg == pos[:, None]).sum(1)
        out["gauc"] = float(np.mean(below / neg.shape[1]))
        flat = np.sort(neg, axis=None)
        lo, hi = np.searchsorted(flat, pos, "left"), np.searchsorted(flat, pos, "right")
        out["auc"] = float((lo + 0.5 * (hi - lo)).sum() / (pos.size * flat.size))
    else:  # one class only
        out["auc"] = out["gauc"] = float("nan")
    out["users"] = int(scores.shape[0])
    out["candidates"] = int(scores.shape[1])
    return out


# ---------------------------------------------------------------------------------------
# Two-tower models


_TOWER_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _towers_fn(trainer: Trainer) -> Callable:
    fn = _TOWER_FNS.get(trainer)
    if fn is None:
        model = trainer.model
        if trainer.task != "retrieval" or not callable(getattr(model, "towers", None)):
            raise ValueError(
                f"{type(model).__name__} has no towers; full-corpus retrieval needs a "
                "two-tower model (task 'retrieval' with a `towers` method)"
            )

        def towers(state, batch):
            _, aux = model.apply(
                {"params": state.params, EMBEDDING: state.tables},
                batch,
                capture_intermediates=lambda _mdl, name: name == "towers",
                mutable=["intermediates"],
            )
            return aux["intermediates"]["towers"][0]

        fn = _TOWER_FNS[trainer] = jax.jit(towers)
    return fn


def tower_embeddings(
    trainer: Trainer, state: TrainState, examples: Examples, packer: BatchPacker
) -> tuple[np.ndarray, np.ndarray]:
    """`(user [n, D], item [n, D])`: the two-tower model's normalized tower outputs of
    each example (user tower on its user features, item tower on its item features)."""
    fn = _towers_fn(trainer)
    users, items = [], []
    b = packer.batch_size
    for start in range(0, len(examples), b):
        idx = np.arange(start, min(start + b, len(examples)))
        sparse, labels, dense = examples.take(idx)
        batch = packer.pack(sparse, labels=labels, dense=dense, first_example=start)
        u, v = fn(state, batch)
        users.append((u, idx.size))
        items.append((v, idx.size))
    cat = lambda parts: np.concatenate([np.asarray(x)[:n] for x, n in parts])  # noqa: E731
    return cat(users), cat(items)


def _item_examples(packer: BatchPacker, item_feature: str, items: np.ndarray) -> Examples:
    """One example per item row of `items` in `item_feature`; every other feature an
    empty bag (an item tower, or an item table's lookup, reads only the item feature)."""
    n_items = items.shape[0]
    sparse = {}
    for spec in packer.features:
        if spec.name == item_feature:
            sparse[spec.name] = JaggedIds(np.ones(n_items, np.int64), items.astype(np.int64))
        else:
            sparse[spec.name] = JaggedIds(
                np.zeros(n_items, np.int64),
                np.zeros(0, np.int64),
                np.zeros(0, np.float32) if spec.weighted else None,
            )
    return Examples(
        labels=np.zeros(n_items, np.float32),
        dense=np.zeros((n_items, packer.num_dense), np.float32),
        sparse=sparse,
    )


def evaluate_retrieval(
    trainer: Trainer,
    state: TrainState,
    sets: CandidateSets,
    packer: BatchPacker,
    *,
    ks: int | Sequence[int] = (10,),
    item_feature: str = "item",
    exclude_seen: bool = True,
    ties: str = "average",
    user_chunk: int = 256,
    item_chunk: int = 8192,
) -> dict[str, float]:
    """Recall@k (= hit rate with one held-out item per user), NDCG@k and MRR of a
    two-tower model over its whole item corpus: every item row of `item_feature`'s table
    goes through the item tower, every evaluated user (its user features and history)
    through the user tower, and each user's held-out item is ranked against all items
    (not in-batch, not only the sampled candidates). `exclude_seen` leaves out the items
    the user interacted with before the held-out event (`sets.seen`), the usual protocol.
    Returns `{"recall@k", "ndcg@k", "mrr", "users", "items"}`."""
    model = trainer.model
    item_side = tuple(getattr(model, "item_features", ()))
    if item_side and set(item_side) != {item_feature}:
        raise ValueError(
            f"evaluate_retrieval: the item tower reads {list(item_side)}; only an item tower "
            f"over {item_feature!r} alone can embed the corpus from item ids"
        )
    specs = {f.name: f for f in packer.features}
    if item_feature not in specs:
        raise ValueError(f"evaluate_retrieval: no feature {item_feature!r} in {sorted(specs)}")
    n_items = packer.vocab[specs[item_feature].table]
    user_emb, _ = tower_embeddings(trainer, state, sets.user_examples(), packer)
    _, item_emb = tower_embeddings(
        trainer, state, _item_examples(packer, item_feature, np.arange(n_items)), packer
    )
    exclude = (sets.seen.lengths, sets.seen.values) if exclude_seen else None
    out = _metrics.full_corpus_recall(
        user_emb,
        item_emb,
        sets.positives,
        ks,
        exclude=exclude,
        ties=ties,
        user_chunk=user_chunk,
        item_chunk=item_chunk,
    )
    out["users"], out["items"] = sets.num_users, int(n_items)
    return out


# ---------------------------------------------------------------------------------------
# Predictions


def candidate_predictions(
    sets: CandidateSets,
    scores: np.ndarray,
    *,
    user_ids: np.ndarray | None = None,
    item_ids: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """One row per scored candidate: `user`, `item`, `score`, `label` (1 for the held-out
    item), user-major as `sets.rows`. `user_ids` / `item_ids` (`SequenceData.user_ids`,
    `.item_ids`) turn table rows back into the log's raw ids."""
    scores = np.asarray(scores)
    c = scores.shape[1]
    users = np.repeat(sets.users, c)
    items = sets.items[:, :c].reshape(-1)
    label = np.zeros(scores.shape, np.int8)
    label[:, 0] = 1
    return {
        "user": users if user_ids is None else np.asarray(user_ids)[users],
        "item": items if item_ids is None else np.asarray(item_ids)[items],
        "score": scores.reshape(-1),
        "label": label.reshape(-1),
    }


def write_predictions(path: str | os.PathLike, columns: Mapping[str, np.ndarray]) -> str:
    """Write equal-length columns as CSV (`.csv`, or `.tsv` tab-separated; `.gz`
    compressed) or Parquet (`.parquet`, needs pyarrow), by the file's extension. Returns
    the path written."""
    path = os.fspath(path)
    cols = {k: np.asarray(v) for k, v in columns.items()}
    lengths = {v.shape[0] for v in cols.values()}
    if len(lengths) > 1:
        raise ValueError(f"write_predictions: columns differ in length {sorted(lengths)}")
    base = path[:-3] if path.endswith(".gz") else path
    if base.endswith(".parquet"):
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(
                f"{path}: writing Parquet needs pyarrow (pip install pyarrow); or use .csv"
            ) from None
        pq.write_table(pa.table(cols), path)
        return path
    if not base.endswith((".csv", ".tsv")):
        raise ValueError(f"{path}: predictions are written as .csv, .tsv or .parquet")
    delimiter = "\t" if base.endswith(".tsv") else ","
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", newline="") as f:
        w = csv.writer(f, delimiter=delimiter, lineterminator="\n")
        w.writerow(list(cols))
        n = next(iter(lengths), 0)
        for start in range(0, n, 65536):
            w.writerows(
                zip(*(v[start : start + 65536].tolist() for v in cols.values()), strict=True)
            )
    return path
