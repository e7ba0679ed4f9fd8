"""Generated input files for the input-pipeline experiments (`bench_input.py`,
`stream_rss.py`): Criteo-shaped rows (label, 13 dense integers, 26 hex ids with Zipf
frequencies, some fields empty) written as Criteo TSV, CSV, libSVM, Parquet or gzip,
assembled with numpy byte gathers so a multi-GB file takes seconds per GB."""

from __future__ import annotations

import numpy as np

NUM_DENSE, NUM_CAT = 13, 26


def _rendered(values: list[bytes]):
    """A padded byte matrix of rendered values and their lengths."""
    width = max(1, max(len(v) for v in values))
    mat = np.zeros((len(values), width), np.uint8)
    for i, v in enumerate(values):
        mat[i, : len(v)] = np.frombuffer(v, np.uint8) if v else []
    return mat, np.array([len(v) for v in values], np.int64)


class CriteoRows:
    """Rows of the Criteo Kaggle shape from a seed: `rows(start, n)` gives the field
    choices of rows [start, start + n) (the same rows for the same arguments)."""

    def __init__(self, seed: int = 0, vocab: int = 50_000):
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.vocab = vocab
        dense_vals = [b""] + [str(x).encode() for x in range(0, 2000)]
        self.dense = _rendered(dense_vals)
        self.cats = []
        for _ in range(NUM_CAT):
            raw = rng.integers(0, 2**32, vocab, dtype=np.uint64)
            hexes = np.char.encode(np.char.zfill(np.char.mod("%x", raw), 8), "ascii")
            self.cats.append(_rendered([b""] + hexes.tolist()))
        self.labels = _rendered([b"0", b"1"])

    def choices(self, start: int, n: int) -> np.ndarray:
        """Index into each column's rendered values: int64[n, 40] (label, dense, ids)."""
        rng = np.random.default_rng([self.seed, start])
        out = np.empty((n, 1 + NUM_DENSE + NUM_CAT), np.int64)
        out[:, 0] = rng.random(n) < 0.25
        # Power-law values by inverse transform (rng.zipf is ~10x slower).
        dense = np.minimum(rng.random((n, NUM_DENSE)) ** -2.0, 2000).astype(np.int64)
        dense[rng.random((n, NUM_DENSE)) < 0.2] = 0  # empty
        out[:, 1 : 1 + NUM_DENSE] = dense
        cat = np.minimum(rng.random((n, NUM_CAT)) ** -4.0, self.vocab).astype(np.int64)
        cat[rng.random((n, NUM_CAT)) < 0.05] = 0  # empty
        out[:, 1 + NUM_DENSE :] = cat
        return out

    def columns(self):
        return [self.labels] + [self.dense] * NUM_DENSE + self.cats

    def text(self, start: int, n: int, sep: bytes = b"\t") -> bytes:
        """Rows [start, start + n) as Criteo TSV (or another separator)."""
        return assemble(self.columns(), self.choices(start, n), sep)


def assemble(columns, choice: np.ndarray, sep: bytes) -> bytes:
    """Lines of fields `columns[c][choice[:, c]]` joined by `sep`, each ending in a newline:
    every field is copied into a zero-padded slot of a [n, width] byte matrix, then the
    padding is dropped."""
    n, k = choice.shape
    widths = [mat.shape[1] + 1 for mat, _ in columns]
    lines = np.zeros((n, sum(widths)), np.uint8)
    pos = 0
    for c, (mat, _) in enumerate(columns):
        w = mat.shape[1]
        lines[:, pos : pos + w] = mat[choice[:, c]]
        lines[:, pos + w] = sep[0] if c < k - 1 else 10
        pos += w + 1
    return lines[lines != 0].tobytes()


def write_criteo(
    path: str,
    rows: CriteoRows,
    n: int,
    *,
    block: int = 200_000,
    sep=b"\t",
    header: bytes | None = None,
    progress=None,
) -> int:
    """Write n rows to `path` (plain, or gzip for a .gz name); returns bytes written."""
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    total = 0
    with opener(path, "wb") as f:
        if header:
            f.write(header)
        for start in range(0, n, block):
            data = rows.text(start, min(block, n - start), sep)
            f.write(data)
            total += len(data)
            if progress:
                progress(total)
    return total
