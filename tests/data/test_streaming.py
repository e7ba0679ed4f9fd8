"""Streaming input (issue 9): per-process shares that are disjoint and cover every row,
resumable `FileSource` positions, and the `Loader` over a stream (window shuffle seeded
and reproducible, every example once per epoch, bit-identical resume, bounded reads)."""

import gzip
import json
import threading

import numpy as np
import pytest

from sparsejax import data
from sparsejax.embedding import FeatureSpec, TableSpec

SCHEMA = {"label": "y", "categorical": ["u"], "dense": ["i"]}
N = 600


def _csv(tmp_path, name="s.csv", n=N, start=0, header=True, bad_line=None):
    rows = [f"{i % 2},u{i % 50},{i}" for i in range(start, start + n)]
    if bad_line is not None:
        rows[bad_line] = "1,u,notanumber"
    text = ("y,u,i\n" if header else "") + "\n".join(rows) + "\n"
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return str(path)


def _rows(src) -> np.ndarray:
    return np.concatenate([c.examples.dense[:, 0] for c in src.chunks()] or [np.zeros(0)])


@pytest.mark.parametrize("kind", ["one_plain", "two_plain", "one_gz", "many_files"])
def test_shares_are_disjoint_and_cover_everything(tmp_path, kind):
    if kind == "one_plain":
        files = [_csv(tmp_path)]
    elif kind == "two_plain":
        files = [_csv(tmp_path, "a.csv", 300), _csv(tmp_path, "b.csv", 300, 300, header=False)]
    elif kind == "one_gz":
        files = [_csv(tmp_path, "s.csv.gz")]
    else:
        files = [_csv(tmp_path, f"p{k}.csv", 100, 100 * k, header=k == 0) for k in range(6)]
    for p in (1, 2, 3, 4, 7):
        shares = [
            _rows(
                data.FileSource(
                    files,
                    format="delimited",
                    schema=SCHEMA,
                    rank=r,
                    num_processes=p,
                    block_bytes=256,
                )
            )
            for r in range(p)
        ]
        allr = np.concatenate(shares)
        assert np.array_equal(np.sort(allr), np.arange(N)), (kind, p)  # disjoint + cover
        if kind == "many_files" and p <= 6:  # whole files per process
            assert all(len(s) % 100 == 0 for s in shares)


def test_shares_name_the_right_line(tmp_path):
    # A malformed line in the second half is reported with its line number by the rank
    # that reads it (byte-range shares count the lines before their start).
    path = _csv(tmp_path, bad_line=450)
    reports = []
    for r in range(2):
        src = data.FileSource(path, format="delimited", schema=SCHEMA, rank=r, num_processes=2)
        _, rep = src.read()
        reports.append(rep)
    assert reports[0].errors == {}
    assert reports[1].first_errors[0][:3] == (452, "bad_dense", "i")  # header + 451
    assert sum(r.lines_read for r in reports) == N


def test_parquet_shares_and_resume(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.table({"y": np.arange(N) % 2, "u": [f"u{i}" for i in range(N)], "i": np.arange(N)})
    pq.write_table(t, tmp_path / "t.parquet", row_group_size=250)
    for p in (1, 2, 3):
        got = [
            _rows(
                data.FileSource(
                    tmp_path / "t.parquet",
                    format="parquet",
                    schema=SCHEMA,
                    rank=r,
                    num_processes=p,
                    batch_rows=64,
                )
            )
            for r in range(p)
        ]
        assert np.array_equal(np.sort(np.concatenate(got)), np.arange(N))
    src = data.FileSource(tmp_path / "t.parquet", format="parquet", schema=SCHEMA, batch_rows=64)
    chunks = list(src.chunks())
    assert [c.first_line for c in chunks[:5]] == [1, 65, 129, 193, 251]  # row groups of 250
    rest = list(src.chunks(chunks[5].position.to_dict()))
    assert [c.first_line for c in rest] == [c.first_line for c in chunks[6:]]


@pytest.mark.parametrize("name", ["s.csv", "s.csv.gz"])
def test_file_source_resumes_at_any_chunk(tmp_path, name):
    files = [_csv(tmp_path, name, 300), _csv(tmp_path, "b.csv", 300, 300, header=False)]
    src = data.FileSource(files, format="delimited", schema=SCHEMA, block_bytes=300)
    chunks = list(src.chunks())
    assert len(chunks) > 10
    for k in (0, 3, len(chunks) // 2, len(chunks) - 1):
        pos = json.loads(json.dumps(chunks[k].position.to_dict()))  # a checkpoint roundtrip
        rest = list(src.chunks(pos))
        assert len(rest) == len(chunks) - k - 1
        for a, b in zip(rest, chunks[k + 1 :], strict=True):
            assert a.first_line == b.first_line and a.path == b.path
            np.testing.assert_array_equal(a.examples.dense, b.examples.dense)


# ---------------------------------------------------------------------------------------
# The Loader over a stream


def _packer(batch_size=64):
    tables = [TableSpec(name="u", vocab_size=64, dim=4)]
    return data.BatchPacker(
        tables, [FeatureSpec(name="u", table="u")], batch_size=batch_size, num_dense=1
    )


def _source(tmp_path, **kw):
    mapping = data.HashMapping(buckets=64)
    path = _csv(tmp_path)
    threads = []

    def transform(ex):
        threads.append(threading.current_thread().name)
        return ex.map_ids({"u": mapping})

    src = data.FileSource(
        path, format="delimited", schema=SCHEMA, block_bytes=500, transform=transform, **kw
    )
    return src, threads


def _batches(src, packer, n=None, **kw):
    out, positions = [], []
    with data.Loader(src, packer, **kw) as loader:
        for b in loader:
            out.append(b)
            positions.append(loader.position)
            if n is not None and len(out) == n:
                break
    return out, positions


def _rows_of(batch) -> np.ndarray:
    return np.asarray(batch.dense[:, 0])[np.asarray(batch.mask) > 0]


def test_stream_loader_epochs_shuffle_and_transform_thread(tmp_path):
    src, threads = _source(tmp_path)
    packer = _packer()
    kw = dict(seed=3, epochs=2, shuffle_buffer=150)
    batches, positions = _batches(src, packer, **kw)
    per_epoch = -(-N // 64)
    assert len(batches) == 2 * per_epoch
    for e in range(2):
        rows = np.concatenate([_rows_of(b) for b in batches[e * per_epoch : (e + 1) * per_epoch]])
        assert np.array_equal(np.sort(rows), np.arange(N))  # every example once per epoch
        assert not np.array_equal(rows, np.arange(N))  # shuffled
    # Shuffled only within windows of ~150 rows: no example moves far.
    first = np.concatenate([_rows_of(b) for b in batches[:per_epoch]])
    assert np.abs(first - np.arange(N)).max() < 300
    assert float(np.asarray(batches[per_epoch - 1].mask).sum()) == N % 64  # padded last batch
    assert positions[per_epoch - 1] == data.LoaderPosition(epoch=1, batch=0)
    assert set(threads) == {"sparsejax-loader"}  # parsed in the loader's thread
    again, _ = _batches(src, packer, **kw)
    for a, b in zip(batches, again, strict=True):
        np.testing.assert_array_equal(a.dense, b.dense)
    other, _ = _batches(src, packer, seed=4, epochs=1, shuffle_buffer=150)
    assert not np.array_equal(other[0].dense, batches[0].dense)
    dropped, _ = _batches(src, packer, seed=3, epochs=1, shuffle_buffer=150, drop_remainder=True)
    assert len(dropped) == N // 64
    ordered, _ = _batches(src, packer, shuffle=False, epochs=1)
    assert np.array_equal(np.concatenate([_rows_of(b) for b in ordered]), np.arange(N))


def test_stream_loader_resume_is_bit_identical(tmp_path):
    src, _ = _source(tmp_path)
    packer = _packer()
    kw = dict(seed=1, epochs=2, shuffle_buffer=150)
    full, positions = _batches(src, packer, **kw)
    for k in (1, 2, 5, 9, 10, 13, len(full) - 1):
        pos = json.loads(json.dumps(positions[k - 1].to_dict()))  # through a checkpoint
        rest, _ = _batches(src, packer, position=pos, **kw)
        assert len(rest) == len(full) - k, k
        for a, b in zip(rest, full[k:], strict=True):
            np.testing.assert_array_equal(a.dense, b.dense)
            np.testing.assert_array_equal(a.labels, b.labels)
            np.testing.assert_array_equal(a.features["u"].ids, b.features["u"].ids)


def test_stream_loader_reads_lazily(tmp_path):
    # Bounded memory: the loader holds one shuffle window (and the prefetched batches),
    # so after the first batch it has read about one window of chunks, not the file.
    src, threads = _source(tmp_path)
    with data.Loader(src, _packer(), seed=0, epochs=1, shuffle_buffer=100, prefetch=1) as ld:
        next(iter(ld))
        read_rows = src.report.lines_read
    assert read_rows < 400 < N


def test_in_memory_examples_still_shuffle_globally(tmp_path):
    src, _ = _source(tmp_path)
    ex, _ = src.read()
    batches, _ = _batches(ex, _packer(), seed=0, epochs=1)
    rows = np.concatenate([_rows_of(b) for b in batches])
    assert np.array_equal(np.sort(rows), np.arange(N))
    assert np.abs(rows - np.arange(N)).max() > 300  # a global permutation moves rows far


def test_stream_with_no_usable_rows_says_why(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("y,u,i\n1,a,x\n0,b,y\n")
    src = data.FileSource(path, format="delimited", schema=SCHEMA)
    with pytest.raises(ValueError) as e:
        _batches(src, _packer(), epochs=None)
    msg = str(e.value)
    assert "has no usable rows" in msg and "kept 0 of 2 lines" in msg and "bad_dense 2" in msg


def _share_rows(src, packer, position=None, n=None, **kw):
    """Rows (dense value = line number) of the batches of one process's loader."""
    batches, positions = _batches(src, packer, n=n, position=position, **kw)
    rows = np.concatenate([_rows_of(b) for b in batches] or [np.zeros(0)])
    return rows, positions


@pytest.mark.parametrize("new", [1, 3])
def test_stream_positions_of_2_processes_resume_on_another_count(tmp_path, new):
    """Positions saved by 2 processes, resumed on 1 and on 3: the remaining examples
    (the rest of the epoch, then the next) are those an uninterrupted run reads."""
    src, _ = _source(tmp_path)
    packer = _packer(batch_size=32)
    kw = dict(seed=5, epochs=2, shuffle_buffer=100)
    old = [src.share(r, 2) for r in range(2)]
    want, saved = [], []
    for r, s in enumerate(old):
        full, positions = _share_rows(s, packer, **kw)
        done, _ = _share_rows(s, packer, n=3 + r, **kw)  # stopped mid-window, mid-epoch
        want.append(full[len(done) :])
        saved.append(json.loads(json.dumps(positions[2 + r].to_dict())))
    resumed = data.resplit_stream_positions(saved, new)
    assert len(resumed) == new
    got = [
        _share_rows(src.share(j, new), packer, position=p, **kw)[0] for j, p in enumerate(resumed)
    ]
    want, got = np.concatenate(want), np.concatenate(got)
    assert want.size > N  # part of epoch 0, then all of epoch 1
    np.testing.assert_array_equal(np.sort(got), np.sort(want))
    # a position saved mid-way through the re-split epoch resumes on the new count too
    j = new - 1 if new == 1 else 0
    first, positions = _share_rows(src.share(j, new), packer, position=resumed[j], n=2, **kw)
    rest, _ = _share_rows(src.share(j, new), packer, position=positions[-1].to_dict(), **kw)
    whole, _ = _share_rows(src.share(j, new), packer, position=resumed[j], **kw)
    np.testing.assert_array_equal(np.concatenate([first, rest]), whole)


def test_stream_positions_of_another_kind_are_refused(tmp_path):
    ok = {"epoch": 0, "batch": 2, "stream": {"window": None, "index": 0, "skip": 64}}
    with pytest.raises(ValueError, match=r"different epochs \(\[0, 1\]\); resume on 2"):
        data.resplit_stream_positions([ok, {**ok, "epoch": 1}], 3)
    with pytest.raises(ValueError, match="is not a streamed source's; resume on 2"):
        data.resplit_stream_positions([ok, {"epoch": 0, "batch": 5}], 1)
    nested = data.resplit_stream_positions([ok, ok], 1)
    with pytest.raises(ValueError, match="itself re-split"):
        data.resplit_stream_positions(nested + nested, 3)
