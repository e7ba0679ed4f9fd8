"""The loader's fast paths give exactly the batches of the reference path: the C++
Criteo parser against the numpy one (values, kept lines and named errors), and batches
shipped as one id matrix and unpacked on the device against `BatchPacker.pack` put
with `jax.device_put`, for in-memory examples, streamed files (windows of both kinds,
batches across them) and the synthetic generator; an id outside its table still gets
the packer's named error. Worker threads make the same batches, resume exactly, stop
when closed and pass a batch's error on in its turn."""

import random

import jax
import numpy as np
import pytest

from sparsejax import data
from sparsejax.data import _criteo, _loader, _text
from sparsejax.data._csv import ParseErrors
from sparsejax.embedding import FeatureSpec, TableSpec

needs_native = pytest.mark.skipif(_text.NATIVE is None, reason="C++ extension not built")


def _fuzzed_criteo(seed: int, n: int, labeled: bool) -> bytes:
    """Criteo-like lines with every kind of good and bad field: empty, negative, long
    and malformed integers, short, long and non-hex ids, bad labels, wrong field
    counts, blank lines."""
    rng = random.Random(seed)

    def dense() -> str:
        r = rng.random()
        if r < 0.1:
            return ""
        if r < 0.15:
            return "-" + str(rng.randint(0, 99))
        if r < 0.17:
            return str(rng.randint(0, 10**25))  # > 18 digits: the exact re-check
        if r < 0.19:
            return rng.choice(["+3", "1.5", "x", "-", "--1", " 1", "1\x00"])
        return str(rng.randint(0, 10 ** rng.randint(1, 12)))

    def cat() -> str:
        r = rng.random()
        if r < 0.1:
            return ""
        if r < 0.12:
            return rng.choice(["g1", "123456789", "0x1", "ABCDEF12", "a b", "fF"])
        return format(rng.getrandbits(32), "x")[: rng.randint(1, 8)]

    lines = []
    for _ in range(n):
        fields = [dense() for _ in range(13)] + [cat() for _ in range(26)]
        if labeled:
            fields.insert(0, rng.choice(["0", "1"] * 20 + ["2", "", "0.5", "00"]))
        if rng.random() < 0.01:
            fields = fields[:-1]
        if rng.random() < 0.005:
            fields.append("x")
        lines.append("\t".join(fields))
        if rng.random() < 0.003:
            lines.append("")
    return ("\n".join(lines) + "\n").encode()


@needs_native
@pytest.mark.parametrize("labeled", [True, False])
def test_the_native_criteo_parser_matches_the_numpy_one(monkeypatch, labeled):
    raw = _fuzzed_criteo(seed=int(labeled), n=3000, labeled=labeled)
    parser = _criteo.CriteoParser(labeled=labeled)
    results = []
    for native in (_text.NATIVE, None):
        monkeypatch.setattr(_text, "NATIVE", native)
        errs = ParseErrors("f.tsv", strict=False)
        ex, lines = parser.parse(raw, 1, "f.tsv", errs)
        results.append((ex, lines, errs.counts, errs.first))
    (ex, lines, counts, first), (ref, ref_lines, ref_counts, ref_first) = results
    assert lines == ref_lines == raw.count(b"\n")
    assert counts == ref_counts and first == ref_first
    assert {"bad_dense", "bad_categorical", "field_count"} <= set(counts)
    assert 0 < len(ex) == len(ref) < lines
    np.testing.assert_array_equal(ex.labels, ref.labels)
    np.testing.assert_array_equal(ex.dense, ref.dense)
    for name in _criteo.CATEGORICAL_NAMES:
        np.testing.assert_array_equal(ex.sparse[name].values, ref.sparse[name].values)


@needs_native
def test_count_lines_counts_newlines():
    for blob in (b"", b"a", b"\n", b"a\nb", b"a\n\nb\n", bytes(range(256)) * 1000):
        assert _text.count_lines(blob) == blob.count(b"\n")


def _specs(capacity=None):
    tables = [TableSpec(name="a", vocab_size=40, dim=4), TableSpec(name="b", vocab_size=9, dim=4)]
    features = [
        FeatureSpec(name="a", table="a", capacity=capacity),
        FeatureSpec(name="b", table="b"),
    ]
    return tables, features


def _reference(loader_args, packer, **kw):
    """The batches packed on the host and put by `jax.device_put`."""
    with data.Loader(*loader_args, packer, device_put=False, **kw) as loader:
        return [jax.device_put(b) for b in loader]


@pytest.fixture
def shipped(monkeypatch):
    """Counts the batches shipped as id matrices (so a test sees the fast path ran)."""
    calls = []
    put = _loader._put_compact

    def counted(*args):
        calls.append(1)
        return put(*args)

    monkeypatch.setattr(_loader, "_put_compact", counted)
    return calls


def _assert_same(xs, ys):
    assert len(xs) == len(ys) > 0
    for x, y in zip(xs, ys, strict=True):
        assert jax.tree.structure(x) == jax.tree.structure(y)
        jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), x, y)


@pytest.mark.parametrize("capacity", [None, 50])
@pytest.mark.parametrize("shuffle", [False, True])
def test_one_id_batches_of_examples_equal_the_packed_ones(shipped, capacity, shuffle):
    rng = np.random.default_rng(0)
    n = 101  # a partial last batch
    ones = np.ones(n, np.int32)
    ex = data.Examples(
        labels=rng.integers(0, 2, (n, 2)).astype(np.float32),  # two tasks
        dense=rng.random((n, 3), np.float32),
        sparse={
            "a": data.JaggedIds(lengths=ones, values=rng.integers(0, 40, n)),
            "b": data.JaggedIds(lengths=ones, values=rng.integers(0, 9, n).astype(np.int32)),
        },
    )
    tables, features = _specs(capacity)
    packer = data.BatchPacker(tables, features, batch_size=32, num_dense=3)
    assert packer.one_id_matrix(ex.sparse, n) is not None
    with data.Loader(ex, packer, shuffle=shuffle, seed=3, device_put=True) as loader:
        fast = list(loader)
    assert len(shipped) == len(fast)
    _assert_same(fast, _reference([ex], packer, shuffle=shuffle, seed=3))


def _criteo_two_features(path, n: int, missing_rows: range) -> None:
    rng = np.random.default_rng(5)
    lines = []
    for i in range(n):
        dense = [str(int(x)) for x in rng.integers(0, 9, 13)]
        cats = [f"{int(x):x}" for x in rng.integers(0, 1000, 26)]
        if i in missing_rows:
            cats[1] = ""  # an empty C2: that window's batches are packed per feature
        lines.append("\t".join([str(i % 2), *dense, *cats]))
    path.write_text("\n".join(lines) + "\n")


def _two_feature_stream(path):
    def transform(ex: data.Examples) -> data.Examples:
        a = 1 + ex.sparse["C1"].values % 39
        b = ex.sparse["C2"].values
        return data.Examples(
            labels=ex.labels,
            dense=ex.dense,
            sparse={
                "a": data.JaggedIds.from_dense(a),
                "b": data.JaggedIds.from_dense(np.where(b < 0, -1, b % 9)),  # missing: no id
            },
        )

    return data.FileSource(path, format="criteo", transform=transform, block_lines=16)


@pytest.mark.parametrize("shuffle", [False, True])
def test_streamed_one_id_batches_equal_the_packed_ones(tmp_path, shipped, shuffle):
    path = tmp_path / "train.tsv"
    _criteo_two_features(path, 230, missing_rows=range(100, 110))
    tables, features = _specs()
    packer = data.BatchPacker(tables, features, batch_size=24, num_dense=13)
    kw = dict(shuffle=shuffle, seed=1, shuffle_buffer=40, epochs=2)
    with data.Loader(_two_feature_stream(path), packer, device_put=True, **kw) as loader:
        fast = list(loader)
    assert 0 < len(shipped) < len(fast)  # windows of both kinds
    ref = _reference([_two_feature_stream(path)], packer, **kw)
    _assert_same(fast, ref)
    empty = [
        int(np.sum(np.asarray(b.features["b"].ids) == -1) - (24 - int(b.mask.sum()))) for b in ref
    ]
    assert any(empty), "no batch with an example without a b id: the test lost its mixed windows"


def test_synthetic_one_id_batches_equal_the_packed_ones(shipped):
    gen = data.SyntheticCriteo(num_dense=4, vocab_sizes=(50, 7, 300), seed=2)
    tables, features = gen.specs(dim=4)
    packer = data.BatchPacker(tables, features, batch_size=64, num_dense=4)
    kw = dict(epochs=None, prefetch=1)
    with data.Loader(gen, packer, device_put=True, **kw) as loader:
        fast = [next(loader) for _ in range(3)]
    assert len(shipped) >= 3
    with data.Loader(gen, packer, device_put=False, **kw) as loader:
        ref = [jax.device_put(next(loader)) for _ in range(3)]
    _assert_same(fast, ref)


def test_an_id_outside_its_table_still_names_the_feature(tmp_path):
    path = tmp_path / "train.tsv"
    _criteo_two_features(path, 60, missing_rows=range(0))
    tables, features = _specs()
    tables[1] = TableSpec(name="b", vocab_size=5, dim=4)  # b's ids go up to 8
    packer = data.BatchPacker(tables, features, batch_size=24, num_dense=13)
    with (
        pytest.raises(ValueError, match=r"feature 'b'.*(out of range|outside)"),
        data.Loader(_two_feature_stream(path), packer, device_put=True) as loader,
    ):
        list(loader)


def _one_id_examples(n: int, seed: int = 0, bad_at: int | None = None) -> data.Examples:
    rng = np.random.default_rng(seed)
    ones = np.ones(n, np.int32)
    b = rng.integers(0, 9, n)
    if bad_at is not None:
        b[bad_at] = 9  # outside table b
    return data.Examples(
        labels=rng.integers(0, 2, n).astype(np.float32),
        dense=rng.random((n, 3), np.float32),
        sparse={
            "a": data.JaggedIds(lengths=ones, values=rng.integers(0, 40, n)),
            "b": data.JaggedIds(lengths=ones, values=b),
        },
    )


@pytest.mark.parametrize("put", [False, True])
def test_worker_threads_make_the_same_batches(tmp_path, put):
    tables, features = _specs()
    packer = data.BatchPacker(tables, features, batch_size=8, num_dense=3)
    ex = _one_id_examples(30)  # 4 batches an epoch, the last one partial
    prepared = data.write_prepared(tmp_path / "p", ex, tables, features, row_group=8)
    gen = data.SyntheticCriteo(num_dense=3, vocab_sizes=(40, 9), seed=4)
    gen_packer = data.BatchPacker(*gen.specs(dim=4), batch_size=8, num_dense=3)
    for source, pk, kw in (
        (ex, packer, dict(epochs=3)),
        (prepared, packer, dict(epochs=3, shuffle_buffer=16)),
        (gen, gen_packer, dict(epochs=None)),
    ):
        runs = []
        for workers in (1, 3):
            with data.Loader(source, pk, seed=2, device_put=put, workers=workers, **kw) as ld:
                runs.append([next(ld) for _ in range(10)] if kw["epochs"] is None else list(ld))
        _assert_same(runs[1], runs[0])


def test_worker_threads_resume_exactly_and_stop_cleanly():
    tables, features = _specs()
    packer = data.BatchPacker(tables, features, batch_size=8, num_dense=3)
    ex = _one_id_examples(30)
    with data.Loader(ex, packer, seed=1, epochs=3, workers=3) as loader:
        first = [next(loader) for _ in range(5)]
        position = loader.position
        rest = list(loader)
    with data.Loader(ex, packer, seed=1, epochs=3, workers=3, position=position) as loader:
        _assert_same(list(loader), rest)
    loader = data.Loader(ex, packer, seed=1, epochs=None, workers=3)
    _assert_same([next(loader) for _ in range(5)], first)
    thread = loader._thread
    loader.close()  # mid-epoch, the workers busy ahead of the consumer
    assert thread is not None and not thread.is_alive()


def test_a_failing_worker_stops_the_loader_with_the_packers_error():
    tables, features = _specs()
    packer = data.BatchPacker(tables, features, batch_size=8, num_dense=3)
    ex = _one_id_examples(64, bad_at=50)  # batch 6
    got = []
    with (
        pytest.raises(ValueError, match=r"feature 'b'.*example 50"),
        data.Loader(ex, packer, shuffle=False, workers=3) as loader,
    ):
        for batch in loader:
            got.append(batch)
    assert len(got) == 6
    with pytest.raises(ValueError, match="workers must be >= 1"):
        data.Loader(ex, packer, workers=0)
