"""Evaluation metrics on host arrays (exact, float64): AUC, per-user GAUC, logloss,
calibration, in-batch recall@k, HR@k / NDCG@k / MRR of candidate sets; and full-corpus
recall@k of embeddings (on the device, in bounded chunks). Rows with mask 0 (padding of
the last batch) are ignored.

Ties in ranking metrics: `ties="average"` (the default) gives the expected value when
tied candidates are put in a uniformly random order, so a model that scores everything
the same gets exactly the random baseline (HR@k = k / candidates); `ties="pessimistic"`
ranks the positive after every candidate that ties it (a lower bound).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

TIES = ("average", "pessimistic")


def _masked(*arrays, mask=None):
    arrays = [np.asarray(a, np.float64).reshape(-1) for a in arrays]
    if mask is None:
        return arrays
    keep = np.asarray(mask).reshape(-1) > 0
    return [a[keep] for a in arrays]


def auc(labels: np.ndarray, scores: np.ndarray, mask: np.ndarray | None = None) -> float:
    """ROC AUC by ranks (Mann-Whitney), ties get their average rank; NaN if only one
    class is present."""
    y, s = _masked(labels, scores, mask=mask)
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    ranks = np.empty_like(s)
    # average rank over ties
    _, first, counts = np.unique(sorted_s, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def logloss(labels: np.ndarray, logits: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Mean binary cross-entropy of sigmoid(logits), computed stably."""
    y, z = _masked(labels, logits, mask=mask)
    return float(np.mean(np.logaddexp(0.0, z) - y * z)) if y.size else float("nan")


def calibration(labels: np.ndarray, logits: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Mean predicted probability / observed positive rate (1.0 is calibrated)."""
    y, z = _masked(labels, logits, mask=mask)
    rate = y.mean() if y.size else 0.0
    return float((1.0 / (1.0 + np.exp(-z))).mean() / rate) if rate > 0 else float("nan")


def recall_at_k(
    scores: np.ndarray,
    k: int,
    mask: np.ndarray | None = None,
    *,
    queries: np.ndarray | None = None,
) -> float:
    """In-batch retrieval: fraction of the query rows whose own item (the diagonal) ranks
    in the top k among the batch's items (padded columns excluded). `queries` (default:
    `mask`) picks the rows that are positive pairs: a label-0 row is none, but its item
    still ranks against the others (`sparsejax.train.retrieval_queries`). NaN without
    queries."""
    scores = np.asarray(scores, np.float64)
    valid = np.ones(scores.shape[0], bool) if mask is None else np.asarray(mask) > 0
    rows = valid if queries is None else valid & (np.asarray(queries) > 0)
    s = np.where(valid[None, :], scores, -np.inf)
    own = np.diagonal(s)
    rank = (s > own[:, None]).sum(1)  # items scoring strictly higher
    return float((rank[rows] < k).mean()) if rows.any() else float("nan")


def gauc(
    labels: np.ndarray, scores: np.ndarray, users: np.ndarray, mask: np.ndarray | None = None
) -> float:
    """Per-user AUC averaged with impression weights, as in the DIN paper:
    `sum_u n_u * AUC_u / sum_u n_u` over users with both classes (users whose examples are
    all positive or all negative are skipped); `n_u` is the user's example count. Ties
    get their average rank, as in `auc`. NaN if no user has both classes.

    `users` holds any sortable id per example (the same length as `labels`).
    """
    y, s = _masked(labels, scores, mask=mask)
    g = np.asarray(users).reshape(-1)
    if mask is not None:
        g = g[np.asarray(mask).reshape(-1) > 0]
    if g.shape != y.shape:
        raise ValueError(f"gauc: {g.shape[0]} users for {y.shape[0]} labels")
    if y.size == 0:
        return float("nan")
    order = np.lexsort((s, g))
    g, s, pos = g[order], s[order], y[order] > 0.5
    n = y.size
    new_user = np.r_[True, g[1:] != g[:-1]]
    user_of = np.cumsum(new_user) - 1
    user_start = np.flatnonzero(new_user)
    new_tie = new_user | np.r_[True, s[1:] != s[:-1]]
    tie_of = np.cumsum(new_tie) - 1
    tie_start = np.flatnonzero(new_tie)
    tie_count = np.diff(np.r_[tie_start, n])
    # 1-based average rank of each example within its user
    rank = tie_start[tie_of] + (tie_count[tie_of] - 1) / 2.0 - user_start[user_of] + 1.0
    n_pos = np.bincount(user_of, weights=pos.astype(np.float64))
    n_all = np.bincount(user_of).astype(np.float64)
    n_neg = n_all - n_pos
    rank_sum = np.bincount(user_of, weights=np.where(pos, rank, 0.0))
    both = (n_pos > 0) & (n_neg > 0)
    if not both.any():
        return float("nan")
    per_user = (rank_sum[both] - n_pos[both] * (n_pos[both] + 1) / 2) / (n_pos[both] * n_neg[both])
    return float((n_all[both] * per_user).sum() / n_all[both].sum())


def _check_ties(ties: str) -> None:
    if ties not in TIES:
        raise ValueError(f"ties must be one of {TIES}, got {ties!r}")


def _check_ks(ks) -> tuple[int, ...]:
    ks = (ks,) if isinstance(ks, int | np.integer) else tuple(ks)
    for k in ks:
        if not isinstance(k, int | np.integer) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
    return tuple(int(k) for k in ks)


def _discount_cumsum(n: int) -> np.ndarray:
    """`c[r] = sum_{q < r} 1 / log2(q + 2)`, r in [0, n]."""
    return np.r_[0.0, np.cumsum(1.0 / np.log2(np.arange(n) + 2.0))]


def ranks_from_counts(
    greater: np.ndarray, equal: np.ndarray, ks: int | Sequence[int], *, ties: str = "average"
) -> dict[str, float]:
    """HR@k, NDCG@k (one relevant item) and MRR from, per evaluated user, the number of
    other candidates scoring strictly higher than its positive (`greater`) and equal to
    it (`equal`). See the module doc for `ties`."""
    _check_ties(ties)
    ks = _check_ks(ks)
    g = np.asarray(greater, np.int64).reshape(-1)
    e = np.asarray(equal, np.int64).reshape(-1)
    if g.size == 0:
        return {**{f"{m}@{k}": float("nan") for k in ks for m in ("hr", "ndcg")}, "mrr": math.nan}
    if ties == "pessimistic":
        g, e = g + e, np.zeros_like(e)
    # the positive's 0-based rank is uniform over g .. g + e
    top = int((g + e).max()) + 1
    disc = _discount_cumsum(max(top, max(ks)))
    recip = np.r_[0.0, np.cumsum(1.0 / np.arange(1, top + 1))]  # sum_{q<r} 1/(q+1)
    out = {}
    for k in ks:
        lo, hi = np.minimum(g, k), np.minimum(g + e + 1, k)
        out[f"hr@{k}"] = float(((hi - lo) / (e + 1)).mean())
        out[f"ndcg@{k}"] = float(((disc[hi] - disc[lo]) / (e + 1)).mean())
    out["mrr"] = float(((recip[g + e + 1] - recip[g]) / (e + 1)).mean())
    return out


def _candidate_counts(scores: np.ndarray, mask: np.ndarray | None):
    s = np.asarray(scores, np.float64)
    if s.ndim != 2 or s.shape[1] < 1:
        raise ValueError(f"scores must be [users, 1 + negatives], got shape {s.shape}")
    if mask is not None:
        s = s[np.asarray(mask).reshape(-1) > 0]
    if np.isnan(s).any():
        raise ValueError("scores contain NaN; a ranking of NaN scores is meaningless")
    pos = s[:, :1]
    return (s[:, 1:] > pos).sum(1), (s[:, 1:] == pos).sum(1)


def ranking_metrics(
    scores: np.ndarray,
    ks: int | Sequence[int] = (10,),
    *,
    ties: str = "average",
    mask: np.ndarray | None = None,
) -> dict[str, float]:
    """`{"hr@k", "ndcg@k" for each k, "mrr"}` of candidate sets: `scores[u, 0]` is user
    u's held-out (positive) item, `scores[u, 1:]` its negatives. A k at or above the
    number of candidates gives HR 1. `mask[u] = 0` leaves a row out."""
    g, e = _candidate_counts(scores, mask)
    return ranks_from_counts(g, e, ks, ties=ties)


def hit_rate_at_k(
    scores: np.ndarray, k: int, *, ties: str = "average", mask: np.ndarray | None = None
) -> float:
    """Fraction of users whose positive (column 0 of `scores [users, 1 + K]`) ranks in
    the top k of its candidates."""
    return ranking_metrics(scores, (k,), ties=ties, mask=mask)[f"hr@{k}"]


def ndcg_at_k(
    scores: np.ndarray, k: int, *, ties: str = "average", mask: np.ndarray | None = None
) -> float:
    """Mean NDCG@k with one relevant item (column 0 of `scores [users, 1 + K]`):
    `1 / log2(rank + 2)` when its 0-based rank is below k, else 0."""
    return ranking_metrics(scores, (k,), ties=ties, mask=mask)[f"ndcg@{k}"]


# ---------------------------------------------------------------------------------------
# Full-corpus retrieval


@functools.partial(jax.jit, static_argnames=("n_items",))
def _corpus_counts(users, items, n_items, targets, ex_row, ex_item):
    """Per user: corpus items scoring above / equal to its target, excluded items and the
    target itself left out. `items` is `[chunks, chunk, D]` (padded past `n_items`)."""
    c = users.shape[0]
    n_chunks, chunk = items.shape[0], items.shape[1]

    def block(j):
        return users @ items[j].T  # [c, chunk]

    def target_step(t, j):
        col = targets - j * chunk
        inside = (col >= 0) & (col < chunk)
        val = jnp.take_along_axis(block(j), jnp.clip(col, 0, chunk - 1)[:, None], axis=1)[:, 0]
        return jnp.where(inside, val, t), None

    t, _ = jax.lax.scan(target_step, jnp.zeros(c, users.dtype), jnp.arange(n_chunks))

    def count_step(acc, j):
        s = block(j)
        ids = j * chunk + jnp.arange(chunk)
        keep = (ids < n_items)[None, :] & (ids[None, :] != targets[:, None])
        local = ex_item - j * chunk
        inside = (ex_row >= 0) & (local >= 0) & (local < chunk)
        excluded = (
            jnp.zeros((c, chunk), jnp.bool_)
            .at[jnp.where(inside, ex_row, c), jnp.clip(local, 0, chunk - 1)]
            .set(True, mode="drop")
        )
        keep &= ~excluded
        g = (keep & (s > t[:, None])).sum(1, dtype=jnp.int32)
        e = (keep & (s == t[:, None])).sum(1, dtype=jnp.int32)
        return (acc[0] + g, acc[1] + e), None

    zero = jnp.zeros(c, jnp.int32)
    (g, e), _ = jax.lax.scan(count_step, (zero, zero), jnp.arange(n_chunks))
    return g, e


def full_corpus_recall(
    user_emb: np.ndarray,
    item_emb: np.ndarray,
    targets: np.ndarray,
    ks: int | Sequence[int] = (10,),
    *,
    exclude: tuple[np.ndarray, np.ndarray] | None = None,
    ties: str = "average",
    user_chunk: int = 256,
    item_chunk: int = 8192,
) -> dict[str, float]:
    """Recall@k of retrieval over the whole item corpus: user u's score of item i is
    `user_emb[u] @ item_emb[i]`; its held-out item `targets[u]` is ranked against every
    other item (not in-batch). With one held-out item per user, recall@k is the hit rate;
    NDCG@k and MRR come with it (`{"recall@k", "ndcg@k", "mrr"}`).

    `exclude = (lengths[U], items[sum])`: per user, items left out of its ranking (the
    items it was seen with in training, as `CandidateSets.seen`); the target itself is
    never excluded. Scores run on the default device in `[user_chunk, item_chunk]`
    blocks, so memory is bounded whatever the corpus size; every chunk has the same
    shape, so one compile serves the whole corpus.
    """
    u = np.asarray(user_emb, np.float32)
    v = np.asarray(item_emb, np.float32)
    t = np.asarray(targets, np.int64).reshape(-1)
    if u.ndim != 2 or v.ndim != 2 or u.shape[1] != v.shape[1]:
        raise ValueError(f"user_emb {u.shape} and item_emb {v.shape} must be [n, D] alike")
    if t.shape[0] != u.shape[0]:
        raise ValueError(f"{t.shape[0]} targets for {u.shape[0]} users")
    n_users, n_items = u.shape[0], v.shape[0]
    if t.size and (t.min() < 0 or t.max() >= n_items):
        raise ValueError(f"targets must lie in [0, {n_items}), got {t.min()}..{t.max()}")
    if not (np.isfinite(u).all() and np.isfinite(v).all()):
        raise ValueError("full_corpus_recall: embeddings contain NaN or inf")
    if exclude is None:
        lengths, ex_items = np.zeros(n_users, np.int64), np.zeros(0, np.int64)
    else:
        lengths, ex_items = (np.asarray(a, np.int64) for a in exclude)
        if lengths.shape != (n_users,) or ex_items.shape != (lengths.sum(),):
            raise ValueError("exclude must be (lengths[users], items[sum(lengths)])")
    item_chunk = max(1, min(item_chunk, n_items))
    n_chunks = -(-n_items // item_chunk)
    items = np.zeros((n_chunks * item_chunk, v.shape[1]), np.float32)
    items[:n_items] = v
    items = jnp.asarray(items.reshape(n_chunks, item_chunk, -1))
    user_chunk = max(1, min(user_chunk, n_users))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    owner = np.repeat(np.arange(n_users), lengths)
    bounds = list(range(0, n_users, user_chunk))
    most = max((int(ends[min(b + user_chunk, n_users) - 1] - starts[b]) for b in bounds), default=0)
    most = max(1, 1 << (most - 1).bit_length())  # few distinct shapes across calls
    greater, equal = [], []
    for b in bounds:
        e_ = min(b + user_chunk, n_users)
        uc = np.zeros((user_chunk, u.shape[1]), np.float32)
        uc[: e_ - b] = u[b:e_]
        tc = np.zeros(user_chunk, np.int64)
        tc[: e_ - b] = t[b:e_]
        lo, hi = int(starts[b]), int(ends[e_ - 1])
        row = np.full(most, -1, np.int32)
        item = np.zeros(most, np.int32)
        row[: hi - lo] = owner[lo:hi] - b
        item[: hi - lo] = ex_items[lo:hi]
        g, e = _corpus_counts(
            jnp.asarray(uc), items, n_items, jnp.asarray(tc, jnp.int32), row, item
        )
        greater.append(g[: e_ - b])
        equal.append(e[: e_ - b])
    g = np.concatenate([np.asarray(x) for x in greater]) if greater else np.zeros(0, np.int64)
    e = np.concatenate([np.asarray(x) for x in equal]) if equal else np.zeros(0, np.int64)
    out = ranks_from_counts(g, e, ks, ties=ties)
    return {k.replace("hr@", "recall@"): v for k, v in out.items()}
