"""The host input pipeline: readers, id mappings, the columnar store, the synthetic
generator, packing errors and the prefetching, resumable loader."""

import math
import threading
import traceback
import types

import jax
import numpy as np
import pytest
from _data import CRITEO_SAMPLE, data_dir

from sparsejax import data
from sparsejax.embedding._spec import FeatureSpec, TableSpec

# The Criteo samples are not in the repository (docs/data.md, "The Criteo sample"); without
# them these tests skip.
DATA_DIR = data_dir()
HEAD10K = None if DATA_DIR is None else DATA_DIR / CRITEO_SAMPLE
HEAD10K_TEST = HEAD10K and HEAD10K.parent / "test_head10k_unlabeled.txt"
RANDOM4K = DATA_DIR and DATA_DIR / "criteo_kaggle_random4k" / "train_sample_4K.txt"
needs_criteo = pytest.mark.skipif(
    HEAD10K is None, reason=f"the Criteo sample {CRITEO_SAMPLE} is not under $SPARSEJAX_DATA_DIR"
)

# Distinct non-missing values of C1..C26 in train_head10k.txt, from its README.
HEAD10K_DISTINCT = [
    175,
    386,
    5520,
    4032,
    56,
    7,
    3184,
    93,
    3,
    2986,
    2084,
    5283,
    1725,
    24,
    2035,
    4723,
    9,
    1149,
    546,
    3,
    5036,
    7,
    12,
    2524,
    39,
    1938,
]


def test_public_api():
    for name in [
        "SparseBatch",
        "PaddedIds",
        "JaggedIds",
        "BatchPacker",
        "Examples",
        "ParseReport",
        "read_criteo",
        "iter_criteo_chunks",
        "HashMapping",
        "VocabMapping",
        "fit_vocab",
        "vocab_sizes",
        "specs_for_vocab",
        "TableSchema",
        "read_delimited",
        "SyntheticCriteo",
        "KAGGLE_CARDINALITIES",
        "Loader",
        "LoaderPosition",
        "measure_throughput",
    ]:
        assert hasattr(data, name), name


def test_old_names_are_deprecated_aliases():
    with pytest.warns(DeprecationWarning, match=r"data\.Jagged is deprecated.*PaddedIds"):
        assert data.Jagged is data.PaddedIds
    with pytest.warns(DeprecationWarning, match=r"data\.Ragged is deprecated.*JaggedIds"):
        from sparsejax.data import Ragged
    assert Ragged is data.JaggedIds
    with pytest.raises(AttributeError, match="has no attribute 'Jaged'"):
        data.Jaged  # noqa: B018


# ---------------------------------------------------------------------------------------
# Examples


def _random_examples(rng, n, *, weighted=True):
    lengths = rng.integers(0, 5, n)
    values = rng.integers(0, 1000, lengths.sum())
    weights = rng.random(lengths.sum()).astype(np.float32) if weighted else None
    return data.Examples(
        labels=rng.integers(0, 2, n).astype(np.float32),
        dense=rng.normal(size=(n, 3)).astype(np.float32),
        sparse={
            "bag": data.JaggedIds(lengths=lengths, values=values, weights=weights),
            "one": data.JaggedIds(lengths=np.ones(n, np.int32), values=np.arange(n) * 7),
        },
    )


def _rows(col: data.JaggedIds):
    """Per-example lists of (id, weight): the plain-Python view of a ragged column."""
    ends = np.cumsum(col.lengths)
    w = col.weights if col.weights is not None else np.zeros(len(col.values))
    return [
        list(zip(col.values[e - n : e].tolist(), w[e - n : e].tolist(), strict=True))
        for n, e in zip(col.lengths, ends, strict=True)
    ]


def test_examples_take_matches_per_example_reference():
    rng = np.random.default_rng(0)
    ex = _random_examples(rng, 50)
    idx = np.array([3, 0, 49, 3, -1, 17])
    sparse, labels, dense = ex.take(idx)
    for name in ("bag", "one"):
        full = _rows(ex.sparse[name])
        assert _rows(sparse[name]) == [full[i] for i in idx]
    np.testing.assert_array_equal(labels, ex.labels[idx])
    np.testing.assert_array_equal(dense, ex.dense[idx])
    sparse, labels, dense = ex.take(np.array([], np.int64))
    assert sparse["bag"].values.shape == (0,) and labels.shape == (0,)
    with pytest.raises(IndexError):
        ex.take([50])


def test_examples_slice_split_concat_roundtrip():
    ex = _random_examples(np.random.default_rng(1), 40)
    a, b = ex.split(13)
    assert (len(a), len(b)) == (13, 27)
    assert _rows(b.sparse["bag"]) == _rows(ex.sparse["bag"])[13:]
    back = data.Examples.concat([a, ex[13:30], ex[30:]])
    for name in ("bag", "one"):
        for field in ("lengths", "values", "weights"):
            np.testing.assert_array_equal(
                getattr(back.sparse[name], field), getattr(ex.sparse[name], field)
            )
    np.testing.assert_array_equal(back.labels, ex.labels)
    np.testing.assert_array_equal(back.dense, ex.dense)
    with pytest.raises(ValueError, match="values but its lengths sum"):
        data.Examples(
            labels=np.zeros(2),
            dense=np.zeros((2, 0)),
            sparse={"x": data.JaggedIds(lengths=np.array([1, 1]), values=np.zeros(3))},
        )


# ---------------------------------------------------------------------------------------
# Criteo


@needs_criteo
def test_read_criteo_head10k_matches_readme():
    ex, report = data.read_criteo(HEAD10K)
    assert (report.lines_read, report.lines_kept, dict(report.errors)) == (10_000, 10_000, {})
    assert len(ex) == 10_000 and ex.num_dense == 13
    assert ex.feature_names == tuple(f"C{i}" for i in range(1, 27))
    assert round(float(ex.labels.mean()) * 100, 2) == 21.82
    distinct = [
        np.unique(ex.sparse[f"C{i}"].values[ex.sparse[f"C{i}"].values >= 0]).size
        for i in range(1, 27)
    ]
    assert distinct == HEAD10K_DISTINCT
    # Missing fractions from the README: C22 81.8%, I12 77.3% (missing dense -> 0).
    assert np.mean(ex.sparse["C22"].values == data.MISSING) == pytest.approx(0.818, abs=5e-4)
    # The first row: 0 1 1 5 0 1382 4 15 2 181 1 2 <empty> 2 68fd1e64 80e26c9b ...
    assert ex.labels[0] == 0
    np.testing.assert_array_equal(
        ex.dense[0],
        np.log1p(np.array([1, 1, 5, 0, 1382, 4, 15, 2, 181, 1, 2, 0, 2], np.float64)).astype(
            np.float32
        ),
    )
    assert ex.sparse["C1"].values[0] == 0x68FD1E64 and ex.sparse["C2"].values[0] == 0x80E26C9B


@needs_criteo
def test_read_criteo_exact_against_plain_python_and_chunks():
    lines = HEAD10K.read_text().splitlines()[:500]
    ref_dense = np.array(
        [[math.log1p(max(int(x), 0)) if x else 0.0 for x in ln.split("\t")[1:14]] for ln in lines]
    ).astype(np.float32)
    ref_raw = np.array([[int(x, 16) if x else -1 for x in ln.split("\t")[14:]] for ln in lines])
    chunks = list(data.iter_criteo_chunks(HEAD10K, chunk_lines=128, max_lines=500))
    assert [len(c) for c, _ in chunks] == [128, 128, 128, 116]
    ex = data.Examples.concat([c for c, _ in chunks])
    np.testing.assert_array_equal(ex.dense, ref_dense)
    np.testing.assert_array_equal(
        np.stack([ex.sparse[f"C{i}"].values for i in range(1, 27)], 1), ref_raw
    )
    np.testing.assert_array_equal(ex.labels, [float(ln[0]) for ln in lines])
    test_ex, report = data.read_criteo(HEAD10K_TEST, labeled=False, max_lines=300)
    assert len(test_ex) == 300 and report.lines_kept == 300 and not test_ex.labels.any()
    # A labeled read of the unlabeled file: every line has the wrong field count.
    _, report = data.read_criteo(HEAD10K_TEST, max_lines=20)
    assert report.errors == {"field_count": 20}
    if RANDOM4K.exists():
        ex4, _ = data.read_criteo(RANDOM4K)
        assert len(ex4) == 4584 and round(float(ex4.labels.mean()) * 100, 2) == 26.85


def _criteo_line(label="0", dense=None, cats=None):
    dense = ["1"] * 13 if dense is None else dense
    cats = ["68fd1e64"] * 26 if cats is None else cats
    return "\t".join([label, *dense, *cats])


def test_read_criteo_malformed_lines(tmp_path):
    big = "1" + "0" * 21  # 22 digits: not for the fast path, still an integer
    bad_dense = ["1"] * 13
    bad_dense[2] = "1.5"
    bad_hex = ["68fd1e64"] * 26
    bad_hex[4] = "zz12"
    long_hex = ["68fd1e64"] * 26
    long_hex[25] = "123456789"
    lines = [
        _criteo_line("1"),  # 1 ok
        "\t".join(_criteo_line().split("\t")[:39]),  # 2 field count
        _criteo_line(dense=bad_dense),  # 3 I3
        _criteo_line(cats=bad_hex),  # 4 C5
        _criteo_line("2"),  # 5 label
        _criteo_line(dense=[big] + [""] * 12, cats=[""] * 26),  # 6 ok, all missing
        _criteo_line(cats=long_hex),  # 7 C26 over-long
        "",  # 8 empty line
        _criteo_line(dense=["-5"] + ["-"] + ["1"] * 11),  # 9 I2 = "-"
        _criteo_line("1", cats=["ABCDEF01"] * 26),  # 10 ok, upper-case hex
    ]
    path = tmp_path / "bad.txt"
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1] + "\r\n")
    ex, report = data.read_criteo(path)
    assert report.lines_read == 10 and report.lines_kept == 3 and len(ex) == 3
    assert report.errors == {"field_count": 2, "bad_dense": 2, "bad_categorical": 2, "bad_label": 1}
    assert [(ln, r, f) for ln, r, f, _ in report.first_errors] == [
        (2, "field_count", "(line)"),
        (3, "bad_dense", "I3"),
        (4, "bad_categorical", "C5"),
        (5, "bad_label", "label"),
        (7, "bad_categorical", "C26"),
        (8, "field_count", "(line)"),
        (9, "bad_dense", "I2"),
    ]
    assert report.first_errors[1][3] == "1.5"
    summary = str(report)
    assert "kept 3 of 10" in summary and "bad_dense 2" in summary and "I3='1.5'" in summary
    np.testing.assert_array_equal(ex.labels, [1, 0, 1])
    assert ex.dense[1, 0] == np.float32(math.log1p(int(big))) and ex.dense[1, 1] == 0
    assert ex.sparse["C1"].values.tolist() == [0x68FD1E64, -1, 0xABCDEF01]
    with pytest.raises(ValueError, match=r"bad\.txt:2: field_count.*39 fields"):
        data.read_criteo(path, strict=True)
    path.write_text("\n".join([lines[0], lines[2]]) + "\n")
    with pytest.raises(ValueError, match=r"bad\.txt:2: bad_dense: field I3 = '1\.5'"):
        data.read_criteo(path, strict=True)


def test_id_mappings_fit_on_train_apply_to_eval():
    train = np.array([30, 10, 10, -1, 20, 30, 30, 99], np.int64)
    vocab = data.VocabMapping.fit(train, min_count=2)
    assert vocab.vocab_size == 3  # 10 and 30 kept (20, 99 rare), plus row 0
    np.testing.assert_array_equal(vocab(train), [2, 1, 1, 0, 0, 2, 2, 0])
    np.testing.assert_array_equal(vocab(np.array([10, 30, 20, 12345, -1, 0])), [1, 2, 0, 0, 0, 0])
    assert data.VocabMapping.fit(train).vocab_size == 5
    assert data.VocabMapping.fit(np.array([-1, -1])).vocab_size == 1
    h = data.HashMapping(buckets=7)
    np.testing.assert_array_equal(
        h(np.array([-1, 0, 5, 6, 13, 0xFFFFFFFF])), [0, 1, 6, 1, 2, 1 + 0xFFFFFFFF % 6]
    )
    # On examples: fit on the train split, apply to both; sizes feed the table specs.
    rng = np.random.default_rng(0)
    ex = data.Examples(
        labels=np.zeros(100),
        dense=np.zeros((100, 0)),
        sparse={
            "a": data.JaggedIds(lengths=np.ones(100, np.int32), values=rng.integers(-1, 40, 100))
        },
    )
    tr, ev = ex.split(60)
    maps = data.fit_vocab(tr)
    tr_m, ev_m = tr.map_ids(maps), ev.map_ids(maps)
    unseen = ~np.isin(ev.sparse["a"].values, tr.sparse["a"].values) | (ev.sparse["a"].values < 0)
    assert unseen.any() and (ev_m.sparse["a"].values[unseen] == 0).all()
    assert (ev_m.sparse["a"].values[~unseen] > 0).all()
    assert data.vocab_sizes(maps) == {"a": maps["a"].vocab_size}
    assert tr_m.sparse["a"].values.max() == maps["a"].vocab_size - 1
    tables, features = data.specs_for_vocab(data.vocab_sizes(maps), dim=4)
    assert tables[0].vocab_size == maps["a"].vocab_size and features[0].table == "a"


# ---------------------------------------------------------------------------------------
# Delimited text with a schema


ALICE = 0x9DA54CE0CECEA4D  # stable_hash("alice"): blake2b-8, little-endian, top bit cleared
CSV_SCHEMA = {
    "delimiter": ",",
    "label": "click",
    "dense": ["age"],
    "categorical": ["user", "city"],
    "multi_hot": ["tags"],
    "weighted": ["tags"],
    "sequence": ["history"],
    "separator": "|",
}


def test_table_schema_from_dict_unknown_key():
    with pytest.raises(ValueError, match=r"unknown key 'catgorical'.*did you mean 'categorical'"):
        data.TableSchema.from_dict({**CSV_SCHEMA, "catgorical": ["x"]})
    with pytest.raises(ValueError, match="more than one role"):
        data.TableSchema.from_dict({"header": True, "dense": ["a"], "categorical": ["a"]})
    with pytest.raises(ValueError, match="columns` is required"):
        data.TableSchema(header=False)


def test_read_delimited(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_text(
        "click,user,age,tags,history,city,ignored\n"
        "1,alice,31,a:0.5|b:2,7|8|9,paris,x\n"
        "0,bob,,,,,x\n"  # missing dense, empty bags, missing city
        "1,carol,abc,a:1,1,rome,x\n"  # bad dense
        "0,dave,40,a:1|b,1,rome,x\n"  # weight missing
        "0,erin,22,a:1\n"  # field count
        "1,alice,50,c:3,9|9,rome,x\n"
    )
    ex, report = data.read_delimited(path, data.TableSchema.from_dict(CSV_SCHEMA))
    assert (report.lines_read, report.lines_kept) == (6, 3)
    assert report.errors == {"bad_dense": 1, "bad_weight": 1, "field_count": 1}
    assert [(ln, r, f) for ln, r, f, _ in report.first_errors] == [
        (4, "bad_dense", "age"),
        (5, "bad_weight", "tags"),
        (6, "field_count", "(line)"),
    ]
    np.testing.assert_array_equal(ex.labels, [1, 0, 1])
    np.testing.assert_array_equal(ex.dense, [[31], [0], [50]])
    h = data.stable_hash
    assert ex.sparse["user"].values.tolist() == [h("alice"), h("bob"), h("alice")]
    assert ex.sparse["city"].values.tolist() == [h("paris"), data.MISSING, h("rome")]
    assert ex.sparse["tags"].lengths.tolist() == [2, 0, 1]
    assert ex.sparse["tags"].values.tolist() == [h("a"), h("b"), h("c")]
    np.testing.assert_allclose(ex.sparse["tags"].weights, [0.5, 2, 3])
    assert ex.sparse["history"].lengths.tolist() == [3, 0, 2]
    assert ex.sparse["history"].weights is None
    assert h("alice") == ALICE  # stable across processes and versions
    with pytest.raises(ValueError, match=r"clicks\.csv:4: bad_dense: field age = 'abc'"):
        data.read_delimited(path, CSV_SCHEMA, strict=True)
    # Integer ids, no header, explicit column names, tab-separated.
    path2 = tmp_path / "ints.tsv"
    path2.write_text("1\t5\t3;4\n0\t\t\n1\t-2\t1\n")
    ex2, report2 = data.read_delimited(
        path2,
        {
            "header": False,
            "columns": ["y", "item", "seq"],
            "delimiter": "\t",
            "label": "y",
            "categorical": ["item"],
            "sequence": ["seq"],
            "separator": ";",
            "int_ids": True,
        },
    )
    assert report2.errors == {"bad_id": 1} and report2.first_errors[0][:3] == (3, "bad_id", "item")
    assert ex2.sparse["item"].values.tolist() == [5, -1]
    assert ex2.sparse["seq"].values.tolist() == [3, 4]
    with pytest.raises(ValueError, match="column 'itme' is not in the file's columns.*'item'"):
        data.read_delimited(
            path2, {"header": False, "columns": ["y", "item", "seq"], "categorical": ["itme"]}
        )


# ---------------------------------------------------------------------------------------
# Synthetic


def test_synthetic_deterministic_and_in_range():
    gen = data.SyntheticCriteo(max_vocab=1_000_000)
    assert gen.vocab_sizes[2] == 1_000_000 and gen.vocab_sizes[0] == 1460
    sparse, labels, dense = gen.batch(5, 4096)
    again = gen.batch(5, 4096)
    other = gen.batch(6, 4096)
    for j, name in enumerate(gen.feature_names):
        v = sparse[name].values
        assert v.min() >= 0 and v.max() < gen.vocab_sizes[j]
        np.testing.assert_array_equal(v, again[0][name].values)
    np.testing.assert_array_equal(labels, again[1])
    np.testing.assert_array_equal(dense, again[2])
    assert not np.array_equal(labels, other[1])
    assert dense.shape == (4096, 13) and dense.dtype == np.float32
    assert 0.15 < labels.mean() < 0.4
    # Zipf: a few ids carry much of the mass, even in a 1M-row table.
    _, counts = np.unique(sparse["C3"].values, return_counts=True)
    assert np.sort(counts)[-10:].sum() > 0.1 * 4096


def test_synthetic_labels_are_learnable():
    """Logistic regression on one-hot ids (plain numpy SGD) must beat the base rate."""
    gen = data.SyntheticCriteo(vocab_sizes=(200,) * 6, num_dense=4, signal=3.0, seed=3)
    w = np.zeros((6, 200))
    b = 0.0

    def loss_and_grad(i):
        sparse, y, _ = gen.batch(i, 1024)
        ids = np.stack([sparse[n].values for n in gen.feature_names], 1)
        p = 1 / (1 + np.exp(-(w[np.arange(6), ids].sum(1) + b)))
        loss = -np.mean(y * np.log(p + 1e-7) + (1 - y) * np.log(1 - p + 1e-7))
        return loss, ids, p - y

    eval_ids = range(10_000, 10_004)
    rate = np.mean([gen.batch(i, 1024)[1].mean() for i in eval_ids])
    base = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))  # best constant model
    for i in range(200):
        _, ids, g = loss_and_grad(i)
        for f in range(6):
            np.add.at(w[f], ids[:, f], -0.01 * g)
        b -= 0.5 * g.mean()
    after = np.mean([loss_and_grad(i)[0] for i in eval_ids])
    assert after < base - 0.04, (base, after)


# ---------------------------------------------------------------------------------------
# Packer errors


def test_packer_errors_name_feature_value_and_capacity():
    tables = [TableSpec(name="t", vocab_size=10, dim=4)]
    features = [FeatureSpec(name="tags", table="t", max_ids=3, capacity=4)]
    packer = data.BatchPacker(tables, features, batch_size=3)
    ok = data.JaggedIds(lengths=np.array([1, 0, 2]), values=np.array([1, 2, 3]))
    batch = packer.pack({"tags": ok}, labels=np.zeros(3))
    np.testing.assert_array_equal(batch.features["tags"].ids, [1, 2, 3, -1])
    np.testing.assert_array_equal(batch.features["tags"].segments, [0, 2, 2, 2])
    out_of_range = data.JaggedIds(lengths=np.array([1, 0, 2]), values=np.array([1, 2, 10]))
    with pytest.raises(ValueError, match=r"'tags'.*id 10 of example 2 .*table 't' of 10 rows"):
        packer.pack({"tags": out_of_range}, labels=np.zeros(3))
    overflow = data.JaggedIds(lengths=np.array([2, 2, 1]), values=np.array([1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match=r"'tags'.*holds 5 ids.*capacity is 4.*capacity>=5"):
        packer.pack({"tags": overflow}, labels=np.zeros(3))


# ---------------------------------------------------------------------------------------
# Loader


def _leaves(batch):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(batch)]


def _assert_same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        for a, b in zip(_leaves(x), _leaves(y), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


def _loader_setup(n=70, batch_size=16):
    ex = _random_examples(np.random.default_rng(2), n)
    tables = [TableSpec(name="t", vocab_size=1000, dim=4)]
    features = [
        FeatureSpec(name="bag", table="t", max_ids=4, weighted=True),
        FeatureSpec(name="one", table="t"),
    ]
    return ex, data.BatchPacker(tables, features, batch_size=batch_size, num_dense=3)


def test_loader_epochs_shuffle_and_padding():
    ex, packer = _loader_setup()
    with data.Loader(ex, packer, seed=1, epochs=2) as loader:
        batches = list(loader)
    assert len(batches) == 10 and loader.position == data.LoaderPosition(epoch=2, batch=0)
    assert batches[4].mask.sum() == 70 - 64 and batches[4].mask[6:].sum() == 0
    # Each epoch sees every example once ("one" holds 7 * index), in a different order.
    seen = [
        np.concatenate([b.features["one"].ids[b.mask > 0] for b in batches[e : e + 5]])
        for e in (0, 5)
    ]
    for s in seen:
        np.testing.assert_array_equal(np.sort(s), np.arange(70) * 7)
    assert not np.array_equal(seen[0], seen[1])
    with data.Loader(ex, packer, shuffle=False, drop_remainder=True) as loader:
        batches = list(loader)
    assert len(batches) == 4 and all(b.mask.all() for b in batches)
    np.testing.assert_array_equal(batches[1].features["one"].ids, np.arange(16, 32) * 7)


def test_loader_peek_shows_the_next_batch_and_keeps_the_position():
    """What host-executed tables' look-ahead reads: `peek` never moves the position a
    checkpoint records, and `next` then yields the same batch."""
    ex, packer = _loader_setup()
    with data.Loader(ex, packer, shuffle=False) as plain:
        want = list(plain)
    with data.Loader(ex, packer, shuffle=False) as loader:
        for i, b in enumerate(want):
            ahead = loader.peek()
            assert loader.peek() is ahead and loader.position.batch == i
            _assert_same_batches([ahead], [b])
            assert next(loader) is ahead
        assert loader.peek() is None
        with pytest.raises(StopIteration):
            next(loader)


@pytest.mark.parametrize("source", ["examples", "synthetic"])
def test_loader_resume_is_bit_identical(source):
    ex, packer = _loader_setup()
    if source == "synthetic":
        ex = data.SyntheticCriteo(vocab_sizes=(50, 1000), num_dense=3, seed=4)
        tables = [
            TableSpec(name="a", vocab_size=50, dim=4),
            TableSpec(name="b", vocab_size=1000, dim=4),
        ]
        features = [FeatureSpec(name="C1", table="a"), FeatureSpec(name="C2", table="b")]
        packer = data.BatchPacker(tables, features, batch_size=16, num_dense=3)
    kwargs = dict(seed=7, epochs=3 if source == "examples" else None, prefetch=3)
    with data.Loader(ex, packer, **kwargs) as loader:
        full = [next(loader) for _ in range(13)]
    for stop_at in (3, 5, 7):  # mid-epoch, at an epoch boundary, in the second epoch
        with data.Loader(ex, packer, **kwargs) as first:
            head = [next(first) for _ in range(stop_at)]
            saved = first.position.to_dict()  # what a checkpoint stores
        with data.Loader(ex, packer, position=saved, **kwargs) as resumed:
            tail = [next(resumed) for _ in range(13 - stop_at)]
        _assert_same_batches(head + tail, full)
    if source == "examples":
        assert data.LoaderPosition.from_dict(saved) == data.LoaderPosition(epoch=1, batch=2)


class _FailingSource:
    def batch(self, index, batch_size):
        if index == 3:
            raise ValueError(f"corrupt record in batch {index}")
        ids = np.full(batch_size, index, np.int64)
        return (
            {"f": data.JaggedIds(lengths=np.ones(batch_size, np.int32), values=ids)},
            np.zeros(batch_size, np.float32),
            np.zeros((batch_size, 0), np.float32),
        )


def test_loader_propagates_thread_exceptions_and_joins():
    packer = data.BatchPacker(
        [TableSpec(name="t", vocab_size=10, dim=2)],
        [FeatureSpec(name="f", table="t")],
        batch_size=4,
    )
    before = threading.active_count()
    loader = data.Loader(_FailingSource(), packer)
    got = []
    with pytest.raises(ValueError, match="corrupt record in batch 3") as info:
        for batch in loader:
            got.append(int(batch.features["f"].ids[0]))
    assert got == [0, 1, 2]
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "batch" in frames  # the traceback reaches into the producer thread
    assert threading.active_count() == before
    # A packer error in the thread names the feature (id 10 is outside 10 rows).
    ex = data.Examples(
        labels=np.zeros(8),
        dense=np.zeros((8, 0)),
        sparse={"f": data.JaggedIds(lengths=np.ones(8, np.int32), values=np.arange(8) + 3)},
    )
    with pytest.raises(ValueError, match=r"feature 'f': id 10 of example 7"):
        list(data.Loader(ex, packer, shuffle=False))
    # Closing early (or dropping the loader) stops the thread.
    loader = data.Loader(
        data.SyntheticCriteo(vocab_sizes=(10,), num_dense=0),
        data.BatchPacker(
            [TableSpec(name="t", vocab_size=10, dim=2)],
            [FeatureSpec(name="C1", table="t")],
            batch_size=4,
        ),
        epochs=None,
        prefetch=2,
    )
    next(loader)
    assert threading.active_count() == before + 1
    loader.close()
    assert threading.active_count() == before
    with pytest.raises(StopIteration):
        next(loader)
    loader = data.Loader(
        data.SyntheticCriteo(vocab_sizes=(10,), num_dense=0), loader.packer, epochs=None
    )
    next(loader)
    del loader
    assert threading.active_count() == before


def test_loader_device_put():
    ex, packer = _loader_setup()
    with data.Loader(ex, packer, epochs=1, device_put=True) as loader:
        batch = next(loader)
    assert isinstance(batch.dense, jax.Array)
    assert isinstance(batch.features["bag"].ids, jax.Array)
    assert batch.features["bag"].weights.dtype == np.float32


def test_measure_throughput_counts_batches_over_the_timed_span(monkeypatch):
    """Batches per second over the timed batches only (warm-up excluded); a clock that
    reads 1.0 then 3.5 makes the expected rate exact."""
    from sparsejax.data import _loader

    ex, packer = _loader_setup()  # 70 examples, batches of 16: 5 per epoch
    clock = iter([1.0, 3.5])
    monkeypatch.setattr(_loader, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    with data.Loader(ex, packer, epochs=None) as loader:
        assert data.measure_throughput(loader, num_batches=10, warmup=2) == 10 / 2.5
        assert loader.position == data.LoaderPosition(epoch=2, batch=2)  # 12 consumed
    clock = iter([0.0, 2.0])
    with data.Loader(ex, packer, epochs=1) as loader:  # ends after 2 warm-up + 3 timed
        assert data.measure_throughput(loader, num_batches=10, warmup=2) == 3 / 2.0
    with (
        data.Loader(ex, packer, epochs=1) as loader,
        pytest.raises(ValueError, match="ended during warm-up"),
    ):
        data.measure_throughput(loader, warmup=6)
    clock = iter([0.0, 1.0])
    with (
        data.Loader(ex, packer, epochs=1) as loader,
        pytest.raises(ValueError, match="ended before any batch was timed"),
    ):
        data.measure_throughput(loader, warmup=5)
