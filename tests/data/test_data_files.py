"""Input files and formats (issue 9): file lists and globs, headers over several files,
compression, label rules, libSVM/libFM, Parquet, the vectorized delimited parser against
its exact per-line reference, and every bad input with its one-line message."""

import gzip

import numpy as np
import pytest

from sparsejax import data
from sparsejax.data._csv import DelimitedParser, ParseErrors
from sparsejax.data._text import parse_decimal, parse_float, parse_hex

SCHEMA = {"label": "click", "categorical": ["user"], "dense": ["age"], "multi_hot": ["tags"]}


def _write(path, text: str):
    path.write_text(text)
    return str(path)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


# ---------------------------------------------------------------------------------------
# Files


def test_expand_files_paths_globs_lists(tmp_path, monkeypatch):
    for name in ["b.csv", "a.csv", "c.tsv"]:
        _write(tmp_path / name, "x\n")
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "d.csv", "x\n")
    t = str(tmp_path)
    assert data.expand_files(f"{t}/*.csv", key="k") == [f"{t}/a.csv", f"{t}/b.csv"]
    # A list keeps its order; a glob's matches are sorted; duplicates go.
    got = data.expand_files([f"{t}/c.tsv", f"{t}/*.csv", f"{t}/a.csv"], key="k")
    assert got == [f"{t}/c.tsv", f"{t}/a.csv", f"{t}/b.csv"]
    assert data.expand_files(f"{t}/**/*.csv", key="k")[-1] == f"{t}/sub/d.csv"
    monkeypatch.chdir(tmp_path / "sub")
    assert data.expand_files("a.csv", key="k", data_dir=t) == [f"{t}/a.csv"]
    with pytest.raises(data.DataFileError) as e:
        data.expand_files([f"{t}/a.csv", f"{t}/*.parquet"], key="data.train")
    assert _one_line(e) == f"data.train: the pattern '{t}/*.parquet' matches no files"
    with pytest.raises(data.DataFileError, match=r"^data\.eval: 'nope\.csv': no such file"):
        data.expand_files("nope.csv", key="data.eval")
    with pytest.raises(data.DataFileError, match="is a directory"):
        data.expand_files(t, key="data.eval")


def test_header_on_first_file_only(tmp_path):
    head = _write(tmp_path / "part1.csv", "click,user,age,tags\n1,alice,30,a|b\n0,bob,,\n")
    cont = _write(tmp_path / "part2.csv", "0,carol,7,c\n1,dave,8,\n")  # no header
    again = _write(tmp_path / "part3.csv", "click,user,age,tags\n1,erin,9,a\n")  # repeated
    ex, rep = data.read_delimited([head, cont, again], SCHEMA)
    assert (rep.lines_read, rep.lines_kept) == (5, 5)
    np.testing.assert_array_equal(ex.labels, [1, 0, 0, 1, 1])
    np.testing.assert_array_equal(ex.dense[:, 0], [30, 0, 7, 8, 9])
    h = data.stable_hash
    assert ex.sparse["user"].values.tolist() == [h(u) for u in "alice bob carol dave erin".split()]
    assert ex.sparse["tags"].lengths.tolist() == [2, 0, 1, 0, 1]
    one, _ = data.read_delimited(head, SCHEMA)
    assert len(one) == 2
    # A later file with a different header: both files and the first differing column.
    other = _write(tmp_path / "part4.csv", "click,usr,age,tags\n1,x,1,\n")
    with pytest.raises(data.DataFileError) as e:
        data.read_delimited([head, other], SCHEMA)
    msg = _one_line(e)
    assert "part1.csv has column 2 = 'user'" in msg and "part4.csv has 'usr'" in msg


def test_gzip_zstd_and_truncation(tmp_path):
    import zstandard

    text = "".join(f"{i % 2},u{i},{i},t{i % 7}\n" for i in range(3000))
    body = ("click,user,age,tags\n" + text).encode()
    plain = _write(tmp_path / "d.csv", body.decode())
    gz = tmp_path / "d.csv.gz"
    # Two gzip members (as `cat a.gz b.gz` makes) read as one stream.
    gz.write_bytes(gzip.compress(body[:20000]) + gzip.compress(body[20000:]))
    zst = tmp_path / "d.csv.zst"
    c = zstandard.ZstdCompressor()
    zst.write_bytes(c.compress(body[:30000]) + c.compress(body[30000:]))
    ref, _ = data.read_delimited(plain, SCHEMA)
    for path in (gz, zst):
        ex, rep = data.read_delimited(path, SCHEMA)
        assert rep.lines_kept == 3000
        np.testing.assert_array_equal(ex.sparse["user"].values, ref.sparse["user"].values)
    # Truncated: an error naming the file and how far it got, after every whole line
    # before the cut was delivered (streamed), and never a silently shorter table.
    big = ("click,user,age,tags\n" + text * 20).encode()
    cut_gz = tmp_path / "cut.csv.gz"
    comp = gzip.compress(big)
    cut_gz.write_bytes(comp[: len(comp) // 2])
    src = data.FileSource(cut_gz, format="delimited", schema=SCHEMA, block_bytes=1 << 14)
    rows = 0
    with pytest.raises(data.DataFileError) as e:
        for chunk in src.chunks():
            rows += len(chunk.examples)
    msg = _one_line(e)
    assert str(cut_gz) in msg and "truncated or corrupt gzip data after" in msg
    assert "complete lines" in msg and rows > 0
    cut_zst = tmp_path / "cut.csv.zst"
    comp = c.compress(big)
    cut_zst.write_bytes(comp[: len(comp) // 2])
    with pytest.raises(data.DataFileError, match=r"cut\.csv\.zst: truncated or corrupt zstd"):
        data.read_delimited(cut_zst, SCHEMA)


# ---------------------------------------------------------------------------------------
# Labels


def test_label_rule_map_threshold_check():
    r = data.LabelRule.from_dict({"map": {-1: 0}})
    np.testing.assert_array_equal(r.apply(np.array([-1, 1, 1]), path="f"), [0, 1, 1])
    t = data.LabelRule(threshold=4)
    np.testing.assert_array_equal(t.apply(np.array([1, 3.5, 4, 5]), path="f"), [0, 0, 1, 1])
    u = data.LabelRule(check="unit")
    np.testing.assert_allclose(u.apply(np.array([0, 0.25, 1]), path="f"), [0, 0.25, 1])
    assert data.LabelRule(check="none").apply(np.array([-3.0]), path="f")[0] == -3
    with pytest.raises(data.LabelError) as e:
        u.apply(np.array([0.5, 1.5]), path="f.csv", lines=np.array([7, 9]))
    assert _one_line(e).startswith("f.csv: line 9: label 1.5 is not in [0, 1]; set label.map")
    with pytest.raises(ValueError, match=r"unknown key 'treshold'.*did you mean 'threshold'"):
        data.LabelRule.from_dict({"treshold": 4})
    with pytest.raises(ValueError, match="label.check must be one of"):
        data.LabelRule(check="binary01")


def test_labels_outside_the_allowed_set_name_file_line_value(tmp_path):
    csv = _write(tmp_path / "pm1.csv", "click,user,age,tags\n1,a,1,\n-1,b,2,\n1,c,3,\n")
    with pytest.raises(data.LabelError) as e:
        data.read_delimited(csv, SCHEMA)
    msg = _one_line(e)
    assert msg.startswith(f"{csv}: line 3: label -1 is not in {{0, 1}}")
    assert "label.map (e.g. {-1: 0})" in msg and "label.threshold" in msg
    ex, _ = data.read_delimited(csv, SCHEMA, label={"map": {-1: 0}})
    np.testing.assert_array_equal(ex.labels, [1, 0, 1])
    # A rating column with a threshold.
    ratings = _write(tmp_path / "r.csv", "rating,user,age,tags\n5,a,1,\n2,b,2,\n4,c,3,\n")
    ex, _ = data.read_delimited(ratings, SCHEMA, label={"column": "rating", "threshold": 4})
    np.testing.assert_array_equal(ex.labels, [1, 0, 1])
    # Criteo with a rule: any number, mapped and checked; without one, its own 0/1 rule.
    line = "\t".join(["-1"] + ["1"] * 13 + ["68fd1e64"] * 26)
    crit = _write(tmp_path / "c.txt", line.replace("-1", "0", 1) + "\n" + line + "\n")
    with pytest.raises(data.LabelError, match=r"c\.txt: line 2: label -1 is not in"):
        data.read_criteo(crit, label={})
    ex, _ = data.read_criteo(crit, label={"map": {-1: 0}})
    np.testing.assert_array_equal(ex.labels, [0, 0])
    _, rep = data.read_criteo(crit)
    assert rep.errors == {"bad_label": 1}


# ---------------------------------------------------------------------------------------
# libSVM / libFM


def test_libsvm_one_weighted_bag(tmp_path):
    path = _write(tmp_path / "a.svm", "+1 3:0.5 10:1 # a comment\n-1 qid:4 7:2e-1\n-1\n")
    with pytest.raises(data.LabelError, match=r"a\.svm: line 2: label -1 is not in"):
        data.read_libsvm(path)
    ex, rep = data.read_libsvm(path, label={"map": {-1: 0}})
    assert rep.lines_kept == 3 and ex.feature_names == ("features",) and ex.num_dense == 0
    np.testing.assert_array_equal(ex.labels, [1, 0, 0])
    col = ex.sparse["features"]
    assert col.lengths.tolist() == [2, 1, 0] and col.values.tolist() == [3, 10, 7]
    np.testing.assert_allclose(col.weights, [0.5, 1, 0.2])


def test_libfm_field_aware(tmp_path):
    path = _write(
        tmp_path / "a.libfm",
        "1 0:17:1 1:5:1 2:40:0.5 2:41:1\n"
        "0 0:18:1 2:40:1\n"
        "1 0:19:1 9:1:1\n"  # field 9 is not in the map: counted, never dropped silently
        "1 0:x:1\n",  # bad index
    )
    fmap = {0: "user", 1: "item", 2: "tags"}
    ex, rep = data.read_libsvm(path, field_map=fmap)
    assert ex.feature_names == ("user", "item", "tags")
    assert rep.errors == {"unmapped_feature": 1, "bad_feature": 1}
    assert [(ln, r, f) for ln, r, f, _ in rep.first_errors] == [
        (3, "unmapped_feature", "field 9"),
        (4, "bad_feature", "(token)"),
    ]
    assert ex.sparse["user"].values.tolist() == [17, 18]
    assert ex.sparse["item"].lengths.tolist() == [1, 0]
    assert ex.sparse["tags"].lengths.tolist() == [2, 1]
    np.testing.assert_allclose(ex.sparse["tags"].weights, [0.5, 1, 1])
    with pytest.raises(ValueError, match=r"a\.libfm:3: unmapped_feature: field field 9"):
        data.read_libsvm(path, field_map=fmap, strict=True)
    # libSVM index ranges as fields.
    svm = _write(tmp_path / "r.svm", "1 1:1 150:1 151:1\n0 2:1\n")
    ex, _ = data.read_libsvm(svm, field_map={"1-100": "user", "101-200": "item"})
    assert ex.sparse["user"].lengths.tolist() == [1, 1]
    assert ex.sparse["item"].values.tolist() == [150, 151]
    with pytest.raises(ValueError, match="overlap"):
        data.read_libsvm(svm, field_map={"1-100": "a", "50-60": "b"})


# ---------------------------------------------------------------------------------------
# Parquet


def test_parquet_matches_csv_and_missing_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    csv = _write(tmp_path / "t.csv", "click,user,age,tags\n1,alice,30,a|b\n0,,,\n1,bob,7,c\n")
    table = pa.table(
        {
            "click": [1, 0, 1],
            "user": ["alice", None, "bob"],
            "age": [30.0, None, 7.0],
            "tags": [["a", "b"], None, ["c"]],
            "extra": [1, 2, 3],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    ex_csv, _ = data.read_delimited(csv, SCHEMA)
    ex_pq, rep = data.read_parquet(tmp_path / "t.parquet", SCHEMA)
    assert rep.lines_kept == 3
    np.testing.assert_array_equal(ex_pq.labels, ex_csv.labels)
    np.testing.assert_array_equal(ex_pq.dense, ex_csv.dense)
    for name in ("user", "tags"):
        np.testing.assert_array_equal(ex_pq.sparse[name].values, ex_csv.sparse[name].values)
        np.testing.assert_array_equal(ex_pq.sparse[name].lengths, ex_csv.sparse[name].lengths)
    bad = {**SCHEMA, "categorical": ["user", "city"]}
    with pytest.raises(data.DataFileError) as e:
        data.read_parquet(tmp_path / "t.parquet", bad)
    msg = _one_line(e)
    assert msg.startswith(f"{tmp_path / 't.parquet'}: column 'city' is not in the Parquet file")
    # Labels outside the set name the file and the row.
    pq.write_table(pa.table({"click": [1, 2], "user": ["a", "b"]}), tmp_path / "l.parquet")
    with pytest.raises(data.LabelError, match=r"l\.parquet: row 2: label 2 is not in"):
        data.read_parquet(tmp_path / "l.parquet", {"label": "click", "categorical": ["user"]})


# ---------------------------------------------------------------------------------------
# The vectorized parsers against their exact references


def test_number_parsers_match_python():
    rng = np.random.default_rng(0)
    vals = []
    for _ in range(3000):
        k = rng.integers(0, 5)
        if k == 0:
            v = str(rng.integers(-(10**9), 10**9))
        elif k == 1:
            v = str(rng.integers(0, 10 ** int(rng.integers(1, 19))))
        elif k == 2:
            v = "".join(rng.choice(list("0123456789-ae.x+"), rng.integers(0, 9)))
        elif k == 3:
            v = f"{int(rng.integers(0, 2**32)):x}"
        else:
            v = repr(float(rng.normal() * 10.0 ** int(rng.integers(-5, 5))))[: rng.integers(1, 25)]
        vals.append(v)
    buf = np.frombuffer(("\t".join(vals) + "\n").encode(), np.uint8)
    lens = np.array([len(v) for v in vals])
    starts = np.concatenate([[0], np.cumsum(lens + 1)[:-1]])
    dec, dbad = parse_decimal(buf, starts, lens)
    hx, hbad = parse_hex(buf, starts, lens, 8)
    fl, fbad = parse_float(buf, starts, lens)
    for i, v in enumerate(vals):
        digits = v[1:] if v.startswith("-") else v
        ok = v == "" or (digits.isdigit() and len(digits) <= 18)
        assert ok == (not dbad[i]), v
        if ok and v:
            assert dec[i] == int(v), v
        okh = v == "" or (len(v) <= 8 and all(c in "0123456789abcdefABCDEF" for c in v))
        assert okh == (not hbad[i]), v
        if okh:
            assert hx[i] == (int(v, 16) if v else -1), v
        if v and not fbad[i]:
            assert fl[i] == float(v), v  # accepted values are exactly Python's


def test_delimited_fast_path_matches_exact_per_line_path():
    rng = np.random.default_rng(1)
    schema = data.TableSchema.from_dict(
        {
            "label": "y",
            "dense": ["d1", "d2"],
            "categorical": ["c"],
            "multi_hot": ["w"],
            "weighted": ["w"],
            "sequence": ["s"],
        }
    )
    names = ["y", "d1", "c", "w", "s", "d2"]
    pieces = ["0", "1", "", "-2", "3.5", "1e3", "x", "ab", "nan", "7:0.5", "8:", ":1", "9"]
    lines = []
    for _ in range(400):
        cells = [str(rng.integers(0, 2))]
        cells.append(rng.choice(pieces))
        cells.append(rng.choice(pieces))
        cells.append(
            "|".join(rng.choice(["1:0.5", "2:3", "x:1", "4", "5:1e-2"], rng.integers(0, 3)))
        )
        cells.append("|".join(rng.choice(["1", "22", "abc", ""], rng.integers(0, 4))))
        cells.append(rng.choice(pieces))
        if rng.random() < 0.05:
            cells.pop()
        lines.append(",".join(cells))
    chunk = ("\n".join(lines) + "\n").encode()
    for int_ids in (False, True):
        s = data.TableSchema(**{**schema.__dict__, "int_ids": int_ids})
        p = DelimitedParser(s, names)
        e1, e2 = ParseErrors("f", False), ParseErrors("f", False)
        fast, n = p.parse(chunk, 5, "f", e1)
        exact = p._exact_chunk(chunk.split(b"\n")[:-1], 5, "f", e2)
        assert p.exact_chunks == 0  # the fast path decided every line itself
        assert n == 400 and e1.first == e2.first and e1.counts == e2.counts
        assert len(fast) == len(exact) > 0
        np.testing.assert_array_equal(fast.labels, exact.labels)
        np.testing.assert_array_equal(fast.dense, exact.dense)
        for c in ("c", "w", "s"):
            a, b = fast.sparse[c], exact.sparse[c]
            np.testing.assert_array_equal(a.lengths, b.lengths)
            np.testing.assert_array_equal(a.values, b.values)
            if c == "w":
                np.testing.assert_array_equal(a.weights, b.weights)
