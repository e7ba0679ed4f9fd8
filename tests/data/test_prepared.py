"""Prepared data (`write_prepared` / `PreparedData`): the same batches as the examples it
was written from (host packing and the on-device unpacking), shuffled epochs that visit
every row once and resume exactly, and one-line refusals of truncated, corrupt and
mismatched directories."""

import os

import jax
import numpy as np
import pytest

from sparsejax import data
from sparsejax.embedding import DynamicVocab, FeatureSpec, TableSpec


def _specs(ragged: bool = True):
    tables = [
        TableSpec(name="a", vocab_size=50, dim=4),
        TableSpec(name="b", vocab_size=7, dim=4),
        TableSpec(name="k", vocab_size=None, dim=4, dynamic=DynamicVocab(max_rows=64)),
        TableSpec(name="bag", vocab_size=30, dim=4),
    ]
    features = [
        FeatureSpec(name="a", table="a"),
        FeatureSpec(name="b", table="b"),
        FeatureSpec(name="k", table="k"),
        FeatureSpec(name="bag", table="bag", max_ids=4, weighted=True),
    ]
    if not ragged:
        return tables[:2], features[:2]
    return tables, features


def _examples(rng, n: int, ragged: bool = True) -> data.Examples:
    ones = np.ones(n, np.int32)
    sparse = {
        "a": data.JaggedIds(lengths=ones, values=rng.integers(0, 50, n)),
        "b": data.JaggedIds(lengths=ones, values=rng.integers(0, 7, n)),
    }
    if ragged:
        lengths = rng.integers(0, 5, n)  # empty bags included
        sparse["k"] = data.JaggedIds(lengths=ones, values=rng.integers(0, 2**62, n))
        sparse["bag"] = data.JaggedIds(
            lengths=lengths,
            values=rng.integers(0, 30, lengths.sum()),
            weights=rng.random(lengths.sum(), np.float32),
        )
    return data.Examples(
        labels=rng.integers(0, 2, n).astype(np.float32),
        dense=rng.random((n, 3), np.float32),
        sparse=sparse,
    )


def _assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), x, y)


@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("batch_size", [16, 40])
def test_batches_equal_those_of_the_examples(tmp_path, ragged, batch_size):
    rng = np.random.default_rng(batch_size)
    ex = _examples(rng, 333, ragged)  # not a multiple of the batch or the row group
    tables, features = _specs(ragged)
    chunks = [ex[:100], ex[100:101], ex[101:]]
    prepared = data.write_prepared(tmp_path / "p", chunks, tables, features, row_group=32)
    assert len(prepared) == 333 and prepared.compact_for(
        data.BatchPacker(tables, features, batch_size=batch_size, num_dense=3)
    ) == (not ragged)
    packer = data.BatchPacker(tables, features, batch_size=batch_size, num_dense=3)
    for put in (False, True):  # True: unpacked on the device when every feature is one id
        _assert_same(
            list(data.Loader(ex, packer, shuffle=False, device_put=put)),
            list(data.Loader(prepared, packer, shuffle=False, device_put=put)),
        )


def test_compact_batches_honour_a_capacity_above_the_batch(tmp_path):
    tables = [TableSpec(name="a", vocab_size=50, dim=4)]
    features = [FeatureSpec(name="a", table="a", capacity=70)]
    ex = _examples(np.random.default_rng(0), 90, ragged=False)
    ex = data.Examples(labels=ex.labels, dense=ex.dense, sparse={"a": ex.sparse["a"]})
    prepared = data.write_prepared(tmp_path / "p", ex, tables, features, row_group=64)
    packer = data.BatchPacker(tables, features, batch_size=64, num_dense=3)
    _assert_same(
        list(data.Loader(ex, packer, shuffle=False, device_put=True)),
        list(data.Loader(prepared, packer, shuffle=False, device_put=True)),
    )


def test_shuffled_epochs_visit_every_row_once_and_resume_exactly(tmp_path):
    ex = _examples(np.random.default_rng(1), 1000)
    tables, features = _specs()
    prepared = data.write_prepared(tmp_path / "p", ex, tables, features, row_group=64)
    orders = []
    for epoch in range(2):
        rows = [
            prepared.batch_rows(epoch, i, 96, shuffle=True, seed=3, window_rows=200)
            for i in range(11)
        ]
        assert all(np.all(np.diff(r) > 0) for r in rows)  # sorted, no repeats in a batch
        orders.append(np.concatenate(rows))
        np.testing.assert_array_equal(np.sort(orders[-1]), np.arange(1000))
    assert not np.array_equal(orders[0], orders[1])
    np.testing.assert_array_equal(
        orders[0],
        np.concatenate([prepared.batch_rows(0, i, 96, seed=3, window_rows=200) for i in range(11)]),
    )
    packer = data.BatchPacker(tables, features, batch_size=96, num_dense=3)
    kw = dict(seed=3, epochs=3, shuffle_buffer=200)
    whole = list(data.Loader(prepared, packer, **kw))
    first = data.Loader(prepared, packer, **kw)
    head = [next(first) for _ in range(15)]
    rest = list(data.Loader(prepared, packer, position=first.position, **kw))
    _assert_same(whole, head + rest)


def _write(tmp_path, n=300, row_group=64):
    ex = _examples(np.random.default_rng(2), n)
    tables, features = _specs()
    path = tmp_path / "p"
    data.write_prepared(path, ex, tables, features, row_group=row_group)
    return path, tables, features


def test_a_truncated_file_is_refused_naming_it_and_its_row_group(tmp_path):
    path, *_ = _write(tmp_path)
    ids = path / "ids.bin"
    with open(ids, "r+b") as f:  # rows of 2 int32 ids: 8 bytes; row 200 is in group 3
        f.truncate(200 * 8 + 3)
    with pytest.raises(data.PreparedDataError, match=r"ids\.bin: 1,603 bytes.* row group 3 "):
        data.PreparedData(path)


def test_a_truncated_values_file_names_the_example_it_ends_in(tmp_path):
    path, *_ = _write(tmp_path)
    off = np.fromfile(path / "bag.offsets", np.int64)
    with open(path / "bag.values", "r+b") as f:
        f.truncate(int(off[150]) * 4)  # ends before example 150's values
    with pytest.raises(data.PreparedDataError, match=r"bag\.values: .*row group 2 \(example 1"):
        data.PreparedData(path)


def test_a_corrupt_row_group_is_refused_when_first_read(tmp_path):
    path, tables, features = _write(tmp_path)
    with open(path / "dense.bin", "r+b") as f:  # rows of 3 f32: 12 bytes; row 130 in group 2
        f.seek(130 * 12 + 5)
        byte = f.read(1)
        f.seek(130 * 12 + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    prepared = data.PreparedData(path)  # opening reads no rows
    prepared.take(np.arange(0, 64))  # group 0 is sound
    with pytest.raises(data.PreparedDataError, match=r"dense\.bin: row group 2 \(examples 128-191"):
        prepared.take(np.array([5, 140]))
    packer = data.BatchPacker(tables, features, batch_size=50, num_dense=3)
    with pytest.raises(data.PreparedDataError, match="row group 2"):
        list(data.Loader(data.PreparedData(path), packer, shuffle=False))


def test_a_run_with_other_features_or_tables_is_refused_naming_the_column(tmp_path):
    path, tables, features = _write(tmp_path)
    prepared = data.PreparedData(path)
    bigger = [t if t.name != "b" else TableSpec(name="b", vocab_size=8, dim=4) for t in tables]
    cases = [
        (bigger, features, 3, r"column 'b' was prepared with table rows 7, the run has 8"),
        (tables[:3], features[:3], 3, r"column 'bag' is not a feature of the run"),
        (
            [*tables, TableSpec(name="c", vocab_size=5, dim=4)],
            [*features, FeatureSpec(name="c", table="c")],
            3,
            r"the run's feature 'c' is not a column",
        ),
        (tables, features, 4, r"column 'dense' holds 3 features, the run has 4"),
    ]
    for t, f, nd, msg in cases:
        with pytest.raises(data.PreparedDataError, match=msg):
            data.Loader(prepared, data.BatchPacker(t, f, batch_size=8, num_dense=nd))


def test_writing_refuses_bad_ids_and_leaves_nothing_behind(tmp_path):
    tables, features = _specs()
    ex = _examples(np.random.default_rng(3), 100)
    bad = dict(ex.sparse)
    values = np.array(ex.sparse["a"].values)
    values[77] = 50
    bad["a"] = data.JaggedIds(lengths=ex.sparse["a"].lengths, values=values)
    bad_ex = data.Examples(labels=ex.labels, dense=ex.dense, sparse=bad)
    with pytest.raises(
        data.PreparedDataError, match=r"feature 'a': id 50 of example 177 is outside"
    ):
        data.write_prepared(tmp_path / "p", [ex, bad_ex], tables, features, row_group=16)
    assert os.listdir(tmp_path) == []  # no directory, no temporary files

    def dies():
        yield ex
        raise KeyboardInterrupt  # a writer stopped midway

    with pytest.raises(KeyboardInterrupt):
        data.write_prepared(tmp_path / "p", dies(), tables, features, row_group=16)
    assert os.listdir(tmp_path) == []
    data.write_prepared(tmp_path / "p", ex, tables, features)
    with pytest.raises(FileExistsError, match="exists"):
        data.write_prepared(tmp_path / "p", ex, tables, features)
    with pytest.raises(data.PreparedDataError, match="not a prepared data directory"):
        data.PreparedData(tmp_path)
