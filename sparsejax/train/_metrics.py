"""Evaluation metrics on host arrays (exact, float64): AUC, logloss, calibration,
recall@k. Rows with mask 0 (padding of the last batch) are ignored."""

from __future__ import annotations

import numpy as np


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


def recall_at_k(scores: np.ndarray, k: int, mask: np.ndarray | None = None) -> float:
    """In-batch retrieval: fraction of rows whose own item (the diagonal) ranks in the
    top k among the batch's items (padded columns excluded)."""
    scores = np.asarray(scores, np.float64)
    valid = np.ones(scores.shape[0], bool) if mask is None else np.asarray(mask) > 0
    s = np.where(valid[None, :], scores, -np.inf)
    own = np.diagonal(s)
    rank = (s > own[:, None]).sum(1)  # items scoring strictly higher
    return float((rank[valid] < k).mean()) if valid.any() else float("nan")
