"""Synthetic Criteo-like click data: Zipf ids per feature, log-count dense features, and
labels from a hidden logistic model, so a model trained on it must see its loss fall."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .._hashing import mix64
from ..embedding import FeatureSpec, TableSpec
from ._batch import JaggedIds
from ._criteo import specs_for_vocab
from ._loader import HostBatch

KAGGLE_CARDINALITIES = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)
"""Distinct values of C1..C26 in the full Criteo Kaggle DAC train set."""


_ROUNDS = 4
"""Feistel rounds of the raw-key scramble (`SyntheticCriteo.id_space`)."""


def _feistel(x: np.ndarray, keys: np.ndarray, half: int) -> np.ndarray:
    """A fixed pseudo-random bijection of [0, 2**(2 * half)): `_ROUNDS` Feistel rounds
    with splitmix64 as the round function. x: uint64[..., F]; keys: uint64[rounds, F]
    (one key per round and feature, broadcast over the leading axes)."""
    mask = np.uint64((1 << half) - 1)
    h = np.uint64(half)
    left, right = x >> h, x & mask
    for k in keys:
        left, right = right, left ^ (mix64(right ^ k) & mask)
    return (left << h) | right


def scramble_ids(ranks: np.ndarray, id_space: int, keys: np.ndarray) -> np.ndarray:
    """A bijection of [0, id_space) (id_space <= 2**63), per column: `_feistel` over the
    smallest even bit width holding the space, cycle-walked (values that land outside
    the space are permuted again until they land inside; a permutation of a superset
    restricted this way is a permutation of the space). ranks: int64[B, F] in [0,
    id_space); keys: uint64[rounds, F]. Returns int64[B, F] in [0, id_space)."""
    bits = max(2, (int(id_space) - 1).bit_length())
    half = (bits + 1) // 2
    shape = ranks.shape
    flat = _feistel(ranks.astype(np.uint64), keys, half).reshape(-1)
    col = None
    top = np.uint64(id_space) if id_space < 1 << 64 else None
    bad = np.flatnonzero(flat >= top)
    while bad.size:  # each pass keeps at least 1 - id_space / 2**(2 * half) >= 1/4 of them
        if col is None:
            col = np.broadcast_to(np.arange(shape[-1]), shape).reshape(-1)
        y = _feistel(flat[bad], keys[:, col[bad]], half)
        flat[bad] = y
        bad = bad[y >= top]
    return flat.reshape(shape).view(np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticCriteo:
    """An endless, deterministic source of Criteo-shaped batches (features "C1".."CF").

    Batch `i` depends only on the config and `i` (its generator is seeded by `(seed, i)`),
    so a `Loader` over it resumes exactly. Ids of feature f follow a Zipf law over
    `vocab_sizes[f]` rows: a rank r is drawn by inverting the continuous power law's CDF
    (O(1) memory, vectorized) and mapped to an id by a fixed per-feature permutation
    `(r * a + b) % V`, so hot ids are spread over the table. The label of an example is
    Bernoulli(sigmoid(bias + signal * (mean-square-normalized sum of hidden per-id weights +
    hidden dense weights . dense))); the per-id weights are a hash of (feature, id, seed),
    so hot ids are learnable.

    With `id_space`, the ids are raw 64-bit keys for dynamic tables (no vocabulary):
    every feature draws its Zipf ranks over `[0, id_space)` (in float64, so the tail of a
    1e9-ID space is not rounded to a coarse grid) and maps them through a fixed
    pseudo-random bijection of `[0, id_space)` per feature (a cycle-walked Feistel
    network keyed by the seed), so the hot keys are scattered over the whole space, not
    small integers. Still O(batch) per batch, whatever the space.
    """

    num_dense: int = 13
    """Dense features, log1p of exponential counts like Criteo's I1..I13."""
    vocab_sizes: tuple[int, ...] | None = None
    """Rows per sparse feature; None: the Criteo Kaggle cardinalities capped at
    `max_vocab` (26 features)."""
    max_vocab: int = 1_000_000
    """Cap of the default vocab sizes."""
    zipf_exponent: float = 1.1
    """Exponent s of P(rank r) ~ r^-s."""
    signal: float = 2.0
    """Scale of the hidden logit (0: labels are pure noise)."""
    bias: float = -2.2
    """Hidden logit offset (about 27% positives at the defaults)."""
    seed: int = 0
    """Seeds the hidden model, the id permutations and every batch."""
    id_space: int | None = None
    """Raw keys: every feature's ids are int64 keys in `[0, id_space)` (at most 2**63),
    a fixed per-feature bijection of Zipf ranks over the whole space (for dynamic tables;
    e.g. 10**9). `vocab_sizes` then only gives the number of features (default 26), and
    `vocab` reports `id_space` rows for each. None: ids in `[0, vocab_sizes[f])`."""

    def __post_init__(self):
        sizes = self.vocab_sizes
        if sizes is None:
            sizes = tuple(min(v, self.max_vocab) for v in KAGGLE_CARDINALITIES)
        sizes = tuple(int(v) for v in sizes)
        if not sizes or min(sizes) < 1:
            raise ValueError(f"SyntheticCriteo: vocab_sizes must be positive, got {sizes}")
        if self.id_space is not None:
            space = self.id_space
            if isinstance(space, float) and space.is_integer():
                space = int(space)  # 1e9 from a config
            if isinstance(space, bool) or not isinstance(space, (int, np.integer)):
                raise ValueError(f"SyntheticCriteo: id_space must be an int, got {space!r}")
            if not 1 <= space <= 1 << 63:
                raise ValueError(f"SyntheticCriteo: id_space must be in [1, 2**63], got {space}")
            object.__setattr__(self, "id_space", int(space))
        if self.zipf_exponent <= 0:
            raise ValueError(
                f"SyntheticCriteo: zipf_exponent must be > 0, got {self.zipf_exponent}"
            )
        object.__setattr__(self, "vocab_sizes", sizes)
        rng = np.random.default_rng([self.seed, 1 << 30])
        mult, add = [], []
        for v in sizes:  # a multiplier coprime with v makes r -> (r*a + b) % v a bijection
            a = int(rng.integers(1 << 20, 1 << 30)) | 1
            while math.gcd(a, v) != 1:
                a += 2
            mult.append(a % v if v > 1 else 0)
            add.append(int(rng.integers(0, v)))
        object.__setattr__(self, "_vocab", np.asarray(sizes, np.int64))
        object.__setattr__(self, "_mult", np.asarray(mult, np.int64))
        object.__setattr__(self, "_add", np.asarray(add, np.int64))
        if self.id_space is not None:  # every feature ranges over the raw key space
            object.__setattr__(self, "vocab_sizes", (self.id_space,) * len(sizes))
        object.__setattr__(
            self,
            "_dense_w",
            rng.normal(size=self.num_dense).astype(np.float32)
            / np.float32(math.sqrt(max(self.num_dense, 1))),
        )
        scale = np.exp(rng.uniform(0, 5, self.num_dense)).astype(np.float32)
        object.__setattr__(self, "_dense_scale", scale)
        sample = self._dense(np.random.default_rng([self.seed, 1 << 31]), 1 << 14)
        object.__setattr__(self, "_dense_center", sample.mean(0))  # centers the dense term
        if self.id_space is not None:  # Feistel round keys, one per round and feature
            seq = np.random.SeedSequence([self.seed, 1 << 29])
            keys = seq.generate_state(_ROUNDS * len(sizes), np.uint64)
            object.__setattr__(self, "_round_keys", keys.reshape(_ROUNDS, len(sizes)))

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f"C{i + 1}" for i in range(len(self.vocab_sizes)))

    @property
    def vocab(self) -> dict[str, int]:
        """Rows per feature, for `specs_for_vocab` / `TableSpec`s."""
        return dict(zip(self.feature_names, self.vocab_sizes, strict=True))

    def specs(
        self, *, dim: int, **table_kwargs
    ) -> tuple[tuple[TableSpec, ...], tuple[FeatureSpec, ...]]:
        """One table per feature with this generator's vocab sizes (with `id_space`: static
        stand-ins of at most 2**31 - 2 rows, for dynamic tables to replace)."""
        vocab = self.vocab
        if self.id_space is not None:
            vocab = {k: min(v, 2**31 - 2) for k, v in vocab.items()}
        return specs_for_vocab(vocab, dim=dim, **table_kwargs)

    def ranks(self, rng: np.random.Generator, batch_size: int) -> np.ndarray:
        """Zipf ranks (0 = most frequent), int64[batch_size, num_features]."""
        if self.id_space is not None:
            return self._space_ranks(rng, batch_size)
        s = self.zipf_exponent
        top = self._vocab.astype(np.float32) + np.float32(1)  # power law's support [1, V+1)
        u = rng.random((batch_size, top.shape[0]), np.float32)
        if abs(s - 1.0) < 1e-6:
            x = np.exp(u * np.log(top))
        else:
            e = np.float32(1.0 - s)
            x = (np.float32(1) + u * (top**e - np.float32(1))) ** (np.float32(1) / e)
        # f32 rounding can step one past either end; clip keeps every id in range
        return np.clip(x.astype(np.int64) - 1, 0, self._vocab - 1)

    def _space_ranks(self, rng: np.random.Generator, batch_size: int) -> np.ndarray:
        """`ranks` over `[0, id_space)`: the continuous power law's inverse CDF in
        float64 (f32 would put ranks beyond 2**24 on a grid)."""
        s, n = self.zipf_exponent, self.id_space
        u = rng.random((batch_size, len(self.vocab_sizes)))
        top = float(n) + 1.0  # the power law's support [1, n + 1)
        if abs(s - 1.0) < 1e-6:
            x = np.exp(u * math.log(top))
        else:
            e = 1.0 - s
            x = (1.0 + u * (top**e - 1.0)) ** (1.0 / e)
        cap = min(float(n) - 1.0, float(np.nextafter(2.0**63, 0.0)))  # casts without overflow
        ranks = np.clip(np.floor(x) - 1.0, 0.0, cap).astype(np.int64)
        return np.minimum(ranks, n - 1)

    def ids(self, rng: np.random.Generator, batch_size: int) -> np.ndarray:
        """The ids of a batch, int64[batch_size, num_features]: Zipf ranks through the
        per-feature bijection (`[0, vocab_sizes[f])`, or the raw keys of `id_space`)."""
        ranks = self.ranks(rng, batch_size)
        if self.id_space is not None:
            return scramble_ids(ranks, self.id_space, self._round_keys)
        return (ranks * self._mult + self._add) % self._vocab

    def hidden_weights(self, ids: np.ndarray) -> np.ndarray:
        """The hidden per-id weights in [-1, 1) of ids[B, num_features] (f32)."""
        f = np.arange(ids.shape[1], dtype=np.uint64)
        key = (
            ids.astype(np.uint64) * np.uint64(len(self.vocab_sizes))
            + f
            + np.uint64((self.seed * 0x9E3779B97F4A7C15) % (1 << 64))
        )
        bits = mix64(key) >> np.uint64(40)  # 24 bits
        return bits.astype(np.float32) * np.float32(2.0 / (1 << 24)) - np.float32(1.0)

    def _dense(self, rng: np.random.Generator, batch_size: int) -> np.ndarray:
        x = rng.standard_exponential((batch_size, self.num_dense), np.float32)
        return np.log1p(np.floor(x * self._dense_scale))

    def batch(self, index: int, batch_size: int) -> HostBatch:
        """Batch `index` as host arrays `(sparse by name, labels f32[B], dense f32[B, D])`."""
        rng = np.random.default_rng([self.seed, int(index)])
        ids = self.ids(rng, batch_size)
        dense = self._dense(rng, batch_size)
        score = self.hidden_weights(ids).sum(1) * np.float32(
            math.sqrt(3.0 / ids.shape[1])
        )  # unit variance
        score += (dense - self._dense_center) @ self._dense_w
        logit = np.float32(self.bias) + np.float32(self.signal) * score
        labels = (rng.random(batch_size, np.float32) * (1 + np.exp(-logit)) < 1).astype(np.float32)
        ones = np.ones(batch_size, np.int32)
        sparse = {
            name: JaggedIds(lengths=ones, values=ids[:, j])
            for j, name in enumerate(self.feature_names)
        }
        return sparse, labels, dense
