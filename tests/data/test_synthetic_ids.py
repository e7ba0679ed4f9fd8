"""`SyntheticCriteo(id_space=...)`: raw int64 keys from a huge ID space (issue 10)."""

import numpy as np
import pytest

from sparsejax import runner
from sparsejax.data import SyntheticCriteo
from sparsejax.data._synthetic import scramble_ids


def test_keys_are_int64_in_the_space_skewed_and_deterministic():
    gen = SyntheticCriteo(id_space=10**9, zipf_exponent=1.05, vocab_sizes=(1,) * 4, seed=3)
    assert gen.vocab == {f"C{i}": 10**9 for i in range(1, 5)}
    sparse, labels, dense = gen.batch(7, 8192)
    again = gen.batch(7, 8192)
    other = gen.batch(8, 8192)
    for name, col in sparse.items():
        v = col.values
        assert v.dtype == np.int64 and v.shape == (8192,)
        assert v.min() >= 0 and v.max() < 10**9
        np.testing.assert_array_equal(v, again[0][name].values)
        assert not np.array_equal(v, other[0][name].values)
        # Zipf: the 10 hottest keys carry a large share, and they are not small integers
        keys, counts = np.unique(v, return_counts=True)
        top = keys[np.argsort(counts)[-10:]]
        assert np.sort(counts)[-10:].sum() > 0.1 * v.size
        assert top.min() > 1000
        assert keys.size > 0.3 * v.size  # and a long tail of rare keys
    np.testing.assert_array_equal(labels, again[1])
    np.testing.assert_array_equal(dense, again[2])
    # each feature has its own bijection: the hottest rank is a different key per feature
    hottest = set()
    for col in sparse.values():
        keys, counts = np.unique(col.values, return_counts=True)
        hottest.add(int(keys[counts.argmax()]))
    assert len(hottest) == 4
    # another seed, other keys
    moved = SyntheticCriteo(id_space=10**9, zipf_exponent=1.05, vocab_sizes=(1,) * 4, seed=4)
    assert not np.array_equal(moved.batch(7, 8192)[0]["C1"].values, sparse["C1"].values)


def test_the_scramble_is_a_bijection_of_the_space():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 1000, 1024, 1025, 77777):
        keys = rng.integers(0, 2**63, (4, 3), dtype=np.int64).view(np.uint64)
        ranks = np.repeat(np.arange(n, dtype=np.int64)[:, None], 3, axis=1)
        out = scramble_ids(ranks, n, keys)
        assert out.dtype == np.int64
        for j in range(3):
            np.testing.assert_array_equal(np.sort(out[:, j]), np.arange(n))
        assert n < 1000 or not np.array_equal(out[:, 0], out[:, 1])


def test_the_whole_63_bit_space_and_float_ids():
    gen = SyntheticCriteo(id_space=2**63, vocab_sizes=(1, 1), seed=1)
    v = gen.batch(0, 4096)[0]["C1"].values
    assert v.dtype == np.int64 and v.min() >= 0
    assert v.max() > 2**62  # keys spread over all 63 bits
    assert SyntheticCriteo(id_space=1e9, vocab_sizes=(1,)).id_space == 10**9
    specs, _ = gen.specs(dim=4)
    assert specs[0].vocab_size == 2**31 - 2  # a static stand-in, for dynamic tables
    for bad in (0, 2**63 + 1, 1.5, "big"):
        with pytest.raises(ValueError, match="id_space"):
            SyntheticCriteo(id_space=bad)


def test_labels_stay_learnable_from_raw_keys():
    """The hidden per-key weights make hot keys predictive: the mean label of a hot key's
    examples follows its hidden weight."""
    gen = SyntheticCriteo(id_space=10**9, vocab_sizes=(1,) * 3, num_dense=0, signal=3.0)
    sparse, y, _ = gen.batch(0, 20000)
    ids = np.stack([sparse[n].values for n in gen.feature_names], 1)
    w = gen.hidden_weights(ids)[:, 0]
    keys, inv, counts = np.unique(ids[:, 0], return_inverse=True, return_counts=True)
    hot = np.nonzero(counts >= 200)[0]
    assert hot.size >= 3
    rate = np.bincount(inv, weights=y)[hot] / counts[hot]
    weight = np.bincount(inv, weights=w)[hot] / counts[hot]
    assert np.corrcoef(rate, weight)[0, 1] > 0.7


def test_runner_takes_id_space_for_dynamic_tables_only(tmp_path):
    base = [
        f"out_dir={tmp_path}",
        "data.kind=synthetic",
        "data.synthetic_options={id_space: 1000000000, vocab_sizes: [1, 1, 1]}",
        "data.batch_size=64",
        "data.eval_batches=1",
    ]
    cfg = runner.load_config([], [*base, "tables.*={dynamic: true, cache_rows: 256}"])
    data = runner.build_data(cfg)
    assert all(t.dynamic is not None and t.device_rows == 256 for t in data.tables)
    batch = data.eval_batches[0]
    ids = np.asarray(batch.features["C1"].ids)
    assert ids.dtype == np.int64 and ids.max() < 10**9 and ids.max() > 2**31 // 4
    with pytest.raises(runner.ConfigError, match=r"id_space.*table 'C1' is static"):
        runner.load_config([], base)
    with pytest.raises(runner.ConfigError, match=r"table 'C2' is static"):
        runner.load_config(
            [],
            [
                *base,
                "tables={'*': {dynamic: true, cache_rows: 256},"
                " C2: {dynamic: false, cache_rows: 0}}",
            ],
        )
