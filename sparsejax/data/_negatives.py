"""Negative sampling for sequence examples: per row, `k` items that are never the
positive, avoid the user's seen items and (for candidate sets) are distinct, drawn
uniformly or by popularity, by vectorized rejection with an exact fill of the rare rows
rejection cannot fill."""

from __future__ import annotations

import numpy as np

_REJECTION_ROUNDS = 32


def probs(sampler: str, counts: np.ndarray, exponent: float) -> np.ndarray | None:
    """Cumulative sampling distribution over items, or None for uniform."""
    if sampler == "uniform":
        return None
    w = counts.astype(np.float64) ** exponent
    w[counts == 0] = 0.0
    total = w.sum()
    if total <= 0:
        return None
    cdf = np.cumsum(w / total)
    cdf[-1] = 1.0
    return cdf


def _draw(rng: np.random.Generator, shape, n_items: int, cdf: np.ndarray | None) -> np.ndarray:
    if cdf is None:
        return rng.integers(0, n_items, shape, dtype=np.int64)
    return np.minimum(np.searchsorted(cdf, rng.random(shape), side="right"), n_items - 1)


def _is_seen(keys: np.ndarray | None, users: np.ndarray, items: np.ndarray, n_items: int):
    if keys is None or keys.size == 0:
        return np.zeros(items.shape, bool)
    q = users * n_items + items
    at = np.minimum(np.searchsorted(keys, q), keys.size - 1)
    return keys[at] == q


def _duplicates(neg: np.ndarray) -> np.ndarray:
    """bool mask of entries equal to an earlier-sorted entry of the same row."""
    order = np.argsort(neg, axis=1, kind="stable")
    s = np.take_along_axis(neg, order, axis=1)
    dup_sorted = np.zeros(neg.shape, bool)
    dup_sorted[:, 1:] = s[:, 1:] == s[:, :-1]
    out = np.zeros(neg.shape, bool)
    np.put_along_axis(out, order, dup_sorted, axis=1)
    return out


def sample(
    rng: np.random.Generator,
    users: np.ndarray,
    positives: np.ndarray,
    k: int,
    n_items: int,
    cdf: np.ndarray | None,
    seen_keys: np.ndarray | None,
    *,
    distinct: bool,
) -> tuple[np.ndarray, int]:
    """`[n, k]` negatives: never the positive, outside `seen_keys` (user * n_items + item)
    and (if `distinct`) distinct within a row, by vectorized rejection; the few rows that
    rejection cannot fill (users who saw nearly every item) are filled exactly, relaxing
    the seen rule, then the sampler. Returns (negatives, rows relaxed)."""
    n = users.shape[0]
    if k == 0 or n == 0:
        return np.zeros((n, k), np.int64), 0
    neg = _draw(rng, (n, k), n_items, cdf)

    def bad_of(rows):
        nb = neg[rows]
        bad = (nb == positives[rows, None]) | _is_seen(seen_keys, users[rows, None], nb, n_items)
        if distinct and k > 1:
            bad |= _duplicates(nb)
        return bad

    rows = np.arange(n)
    for _ in range(_REJECTION_ROUNDS):
        bad = bad_of(rows)
        hit = bad.any(axis=1)
        rows, bad = rows[hit], bad[hit]
        if rows.size == 0:
            return neg, 0
        sub = neg[rows]
        sub[bad] = _draw(rng, int(bad.sum()), n_items, cdf)
        neg[rows] = sub
    rows = rows[bad_of(rows).any(axis=1)]
    relaxed = 0
    for row in rows:  # rare: a user who has seen (nearly) every item, or a skewed sampler
        relaxed += _fill_row(
            rng, neg, row, users[row], positives[row], k, n_items, seen_keys, distinct
        )
    return neg, relaxed


def _fill_row(rng, neg, row, user, positive, k, n_items, seen_keys, distinct) -> int:
    """Fill one row exactly (uniform over what is allowed); 1 if a rule had to give."""
    allowed = np.ones(n_items, bool)
    allowed[positive] = False
    if seen_keys is not None:
        lo, hi = np.searchsorted(seen_keys, [user * n_items, (user + 1) * n_items])
        allowed[seen_keys[lo:hi] - user * n_items] = False
    pool = np.flatnonzero(allowed)
    relaxed = False
    if pool.size < (k if distinct else 1):
        relaxed = True  # not enough unseen items: any item but the positive
        pool = np.delete(np.arange(n_items), positive)
    repeat = not distinct or pool.size < k
    neg[row] = rng.choice(pool, k, replace=repeat)
    return int(relaxed or (distinct and repeat))
