"""float64 numpy references for the ops and optimizers (independent of sparsejax's jnp
references, so a shared bug cannot hide)."""

import numpy as np


def valid_mask(ids, seg, vocab, num_segments):
    return (ids >= 0) & (ids < vocab) & (seg >= 0) & (seg < num_segments)


def embedding_bag(table, ids, seg, num_segments, weights=None, combiner="sum"):
    table = np.asarray(table, np.float64)
    ids, seg = np.asarray(ids), np.asarray(seg)
    w = np.ones(len(ids)) if weights is None else np.asarray(weights, np.float64)
    out = np.zeros((num_segments, table.shape[1]))
    for s in range(num_segments):
        ks = [k for k in range(len(ids))
              if seg[k] == s and 0 <= ids[k] < table.shape[0]]
        if not ks:
            continue
        rows = np.stack([w[k] * table[ids[k]] for k in ks])
        if combiner == "max":
            out[s] = rows.max(0)
            continue
        total = rows.sum(0)
        if combiner == "mean":
            norm = sum(w[k] for k in ks)
        elif combiner == "sqrtn":
            norm = np.sqrt(sum(w[k] ** 2 for k in ks))
        else:
            norm = 1.0
        out[s] = total / norm if norm != 0 else 0.0
    return out


def segment_spmm(values, col, seg, dense, num_segments):
    dense = np.asarray(dense, np.float64)
    out = np.zeros((num_segments, dense.shape[1]))
    for v, c, s in zip(np.asarray(values, np.float64), np.asarray(col), np.asarray(seg),
                       strict=True):
        if 0 <= c < dense.shape[0] and 0 <= s < num_segments:
            out[s] += v * dense[c]
    return out


def random_bags(rng, *, vocab, num_segments, nnz, pad_frac=0.1, dup_frac=0.3, empty_frac=0.2):
    """Sorted segment ids with some empty bags, repeated ids and padding (-1) entries."""
    live = np.nonzero(rng.random(num_segments) >= empty_frac)[0]
    if live.size == 0 or nnz == 0:
        return np.full(nnz, -1, np.int32), np.zeros(nnz, np.int32)
    seg = np.sort(rng.choice(live, nnz)).astype(np.int32)
    ids = rng.integers(0, vocab, nnz).astype(np.int32)
    dup = rng.random(nnz) < dup_frac
    ids[dup] = ids[rng.integers(0, nnz, dup.sum())]
    ids[rng.random(nnz) < pad_frac] = -1
    return ids, seg
