"""Export and the Predictor: a trained run becomes a model dir whose predictions on raw
feature values equal the run's own model on the same rows read by the run's own data
pipeline (Criteo TSV, delimited CSV with a dynamic table, synthetic ids); quantized
tables shrink and stay close; bad requests get a `RequestError` naming the example and
feature; a corrupt or incompatible model dir is refused at load with one line."""

import asyncio
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from _data import TWO_TOWER
from aiohttp.test_utils import TestClient, TestServer

from sparsejax import runner
from sparsejax.__main__ import main
from sparsejax.data import BatchPacker, read_criteo
from sparsejax.runner import export_run
from sparsejax.runner._evaluate import restore_run
from sparsejax.serving import (
    ModelLoadError,
    Predictor,
    RequestError,
    _export,
    make_app,
)

FAST = ["progress=false", "log_every=1000", "eval_every=null", "epochs=null", "steps=6"]
BUCKETS = (1, 8)


def _criteo_file(path: pathlib.Path, n: int = 600, seed: int = 0) -> None:
    """Criteo-format lines: label, 13 integer fields (some empty or negative), 26 hex
    ids drawn from small vocabularies (some empty), so ids repeat across rows."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        dense = ["" if rng.random() < 0.1 else str(int(rng.integers(-2, 500))) for _ in range(13)]
        cats = [
            "" if rng.random() < 0.05 else f"{int(rng.zipf(1.5)) % (20 + 7 * j) * 7919:08x}"
            for j in range(26)
        ]
        lines.append("\t".join([str(int(rng.random() < 0.3)), *dense, *cats]))
    path.write_text("\n".join(lines) + "\n")


def _train(tmp, name, overrides):
    cfg = runner.load_config([], [f"out_dir={tmp / 'runs'}", f"name={name}", *FAST, *overrides])
    runner.train(cfg, log=lambda _: None)
    return str(tmp / "runs" / name)


@pytest.fixture(scope="module")
def criteo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("criteo")
    _criteo_file(tmp / "day.tsv")
    run = _train(
        tmp,
        "crit",
        [
            "data.kind=criteo",
            f"data.path={tmp / 'day.tsv'}",
            "data.train_rows=400",
            "data.id_mapping=vocab",
            "data.batch_size=64",
            "model.embedding_dim=8",
            "model.options={bottom: [16, 8], top: [16, 1]}",
        ],
    )
    models = {}
    for q in ("fp32", "int8"):
        out = str(tmp / f"model_{q}")
        models[q] = export_run(run, out, quantize=q, buckets=BUCKETS, log=lambda _: None), out
    return tmp, run, models


def _raw_criteo_rows(path, first: int, n: int) -> list[dict]:
    from sparsejax.data import CATEGORICAL_NAMES, DENSE_NAMES

    rows = []
    for line in pathlib.Path(path).read_text().splitlines()[first : first + n]:
        parts = line.split("\t")[1:]
        ex = {}
        for k, v in zip((*DENSE_NAMES, *CATEGORICAL_NAMES), parts, strict=True):
            if v != "":
                ex[k] = int(v) if k in DENSE_NAMES else v
        rows.append(ex)
    return rows


def _run_model_scores(run, path, first, n):
    """The run's own model on lines [first, first + n) of a Criteo file, read by the
    run's pipeline (reader, transform, id mappings, packer)."""
    cfg, data, trainer, state = restore_run(run, log=lambda _: None)
    ex, _ = read_criteo(path, labeled=True)
    ex = data.transform(ex[first : first + n]).map_ids(data.mappings)
    packer = BatchPacker(data.tables, data.features, batch_size=n, num_dense=ex.num_dense)
    batch = packer.pack(ex.sparse, labels=ex.labels, dense=ex.dense)
    logits = np.asarray(trainer.eval_step(state, batch), np.float64).reshape(-1)
    return 1 / (1 + np.exp(-logits))


def test_exported_predictions_equal_the_runs_model_on_raw_rows(criteo_run):
    tmp, run, models = criteo_run
    manifest, out = models["fp32"]
    assert manifest["check"]["max_abs_diff"] <= 1e-6
    assert manifest["check"]["examples"] == 200
    p = Predictor.load(out)
    rows = _raw_criteo_rows(tmp / "day.tsv", 450, 21)  # eval rows: unseen ids included
    want = _run_model_scores(run, str(tmp / "day.tsv"), 450, 21)
    got = p.predict(rows)  # 21 examples: buckets of 8, in chunks
    assert got.shape == (21,) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    # batched requests give each its own scores, whatever the grouping
    parts = p.score([p.parse(rows[:3]), p.parse(rows[3:4]), p.parse(rows[4:])])
    np.testing.assert_allclose(np.concatenate(parts), got, atol=1e-6, rtol=0)
    assert [len(x) for x in parts] == [3, 1, 17]


def test_example_request_is_a_valid_body_from_real_rows(criteo_run):
    tmp, _, models = criteo_run
    _, out = models["fp32"]
    body = json.loads((pathlib.Path(out) / "example_request.json").read_text())
    assert len(body["examples"]) == 8
    first = _raw_criteo_rows(tmp / "day.tsv", 0, 1)[0]
    assert body["examples"][0] == first
    p = Predictor.load(out, warmup=False)
    scores = p.predict(body["examples"])
    assert np.all((scores > 0) & (scores < 1))
    # the same body through the HTTP server (dynamic batcher, JSON both ways)
    status, got = _post(make_app(predictor=p, log=lambda _: None), "/v1/predict", body)
    assert status == 200
    np.testing.assert_allclose(got["scores"], scores, rtol=1e-6)


def test_int8_tables_are_under_30_percent_and_close(criteo_run):
    _, _, models = criteo_run
    fp32, int8 = models["fp32"][0], models["int8"][0]
    mem = int8["memory"]
    assert mem["tables_fp32_bytes"] == fp32["memory"]["tables_bytes"]
    # dim 8: 8 bytes + fp16 scale + uint8 zero point = 11 of 32 bytes a row
    assert mem["tables_bytes"] / mem["tables_fp32_bytes"] == pytest.approx(11 / 32, rel=1e-9)
    assert 0 < int8["check"]["max_abs_diff"] < 0.02
    assert abs(int8["check"]["auc"] - fp32["check"]["auc"]) < 0.01
    p8, p32 = Predictor.load(models["int8"][1]), Predictor.load(models["fp32"][1])
    rows = p32.example_request["examples"]
    assert np.max(np.abs(p8.predict(rows) - p32.predict(rows))) < 0.02


def test_defaults_for_missing_and_unseen_values(criteo_run):
    _, _, models = criteo_run
    p = Predictor.load(models["fp32"][1], warmup=False)
    empty = p.predict([{}])  # every feature missing: the documented defaults
    unseen = p.predict([{f"C{j}": "fffffff0" for j in range(1, 27)}])
    # an unseen id and a missing one both map to row 0 of a vocabulary
    np.testing.assert_allclose(unseen, empty, atol=1e-7)
    assert 0 < float(empty[0]) < 1


@pytest.mark.parametrize(
    "examples, words",
    [
        ([{"C1": "68fd1e64", "C99": "1"}], ["example 0", "unknown feature 'C99'"]),
        ([{"I1": 3}, {"I2": "x7"}], ["example 1", "'I2'", "bad_dense", "x7"]),
        ([{"C3": "not-hex"}], ["example 0", "'C3'", "bad_categorical"]),
        ([{"C3": "123456789"}], ["example 0", "'C3'", "bad_categorical"]),
        ([{"I4": [1, 2]}], ["example 0", "'I4'", "expected a string, a number or null"]),
        ([{"I4": True}], ["example 0", "'I4'", "True"]),
        ([{"C1": "ab\tcd"}], ["example 0", "'C1'", "without"]),
        ([{"I1": float("nan")}], ["example 0", "'I1'", "finite"]),
        ([], ["no examples"]),
        ({"I1": 1}, ["expected a list of examples"]),
        (["I1"], ["example 0", "expected an object"]),
    ],
)
def test_bad_requests_name_the_example_and_feature(criteo_run, examples, words):
    _, _, models = criteo_run
    p = Predictor.load(models["fp32"][1], warmup=False)
    with pytest.raises(RequestError) as e:
        p.parse(examples)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_too_many_examples_in_one_request(criteo_run):
    _, _, models = criteo_run
    p = Predictor.load(models["fp32"][1], warmup=False, max_examples=4)
    with pytest.raises(RequestError, match="5 examples; at most 4"):
        p.parse([{}] * 5)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_corrupt_or_incompatible_model_dirs_are_refused(criteo_run, tmp_path):
    _, _, models = criteo_run
    src = models["fp32"][1]
    # a flipped byte, a truncated and a missing table shard file: each names the table,
    # the rows and the file
    m = json.loads((pathlib.Path(src) / "model.json").read_text())
    pieces = [p for e in m["arguments"].values() for p in e.get("pieces", ())]
    piece = max(pieces, key=lambda e: e["bytes"])
    t0, t1 = piece["table_rows"]
    for name, damage, words in [
        ("flip", lambda b: b[:-3] + bytes([b[-3] ^ 0xFF]) + b[-2:], "is corrupt"),
        ("cut", lambda b: b[:-40], "bytes, the manifest says"),
        ("gone", None, "is missing"),
    ]:
        bad = _copy(src, tmp_path / name)
        f = bad / piece["file"]
        if damage is None:
            f.unlink()
        else:
            f.write_bytes(damage(f.read_bytes()))
        with pytest.raises(ModelLoadError) as e:
            Predictor.load(str(bad))
        msg = str(e.value)
        assert "\n" not in msg and words in msg, msg
        assert f"table {piece['table']!r}, rows {t0}..{t1 - 1}" in msg and str(f) in msg, msg
    # a truncated exported computation
    bad = _copy(src, tmp_path / "trunc")
    f = bad / "exported" / "b8.jaxexport"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="not a readable exported computation"):
        Predictor.load(str(bad))
    # a newer format version, another platform, native kernels of another version
    for name, change, words in [
        ("future", {"format_version": 99}, "format version 99"),
        ("tpu", {"platforms": ["tpu"]}, "exported for tpu"),
        (
            "native",
            {"custom_calls": ["sparsejax_spmm"], "sparsejax_version": "0.0.1"},
            "native kernels",
        ),
    ]:
        d = _copy(src, tmp_path / name)
        m = json.loads((d / "model.json").read_text())
        m.update(change)
        (d / "model.json").write_text(json.dumps(m))
        with pytest.raises(ModelLoadError, match=words):
            Predictor.load(str(d))
    with pytest.raises(ModelLoadError, match="not a sparsejax model dir"):
        Predictor.load(str(tmp_path))


def test_format_1_model_dirs_still_load(criteo_run, tmp_path):
    """A model dir of format 1 (each argument one whole file) serves the same scores."""
    from sparsejax import checkpoint
    from sparsejax.serving._format import read_argument

    tmp, _, models = criteo_run
    src = models["fp32"][1]
    old = _copy(src, tmp_path / "v1")
    m = json.loads((old / "model.json").read_text())
    for i, (key, e) in enumerate(m["arguments"].items()):
        if "pieces" in e:
            a = read_argument(str(src), e)
            entry = checkpoint.write_array(str(old / "arrays" / f"whole{i}.npy"), a)
            entry["file"] = f"arrays/{entry['file']}"
            m["arguments"][key] = entry
    m["format_version"] = 1
    (old / "model.json").write_text(json.dumps(m))
    rows = _raw_criteo_rows(tmp / "day.tsv", 500, 20)
    want = Predictor.load(str(src), warmup=False).predict(rows)
    got = Predictor.load(str(old), warmup=False).predict(rows)
    np.testing.assert_array_equal(got, want)


def test_cli_export_errors_are_one_line(criteo_run, tmp_path, capsys):
    _, run, models = criteo_run
    assert main(["export", run, "--out", models["fp32"][1]]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_export_leaves_no_temp_folders(criteo_run, tmp_path, monkeypatch):
    """A killed export's `<version>.tmp-<pid>` is removed by the next export into its
    folder (one of a live process stays); a failed export removes its own."""
    _, run, _ = criteo_run
    models = tmp_path / "models"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (models / f"1.tmp-{dead.pid}" / "exported").mkdir(parents=True)  # killed midway
    (models / f"2.tmp-{os.getppid()}" / "exported").mkdir(parents=True)  # under way
    export_run(run, str(models / "3"), buckets=BUCKETS, log=lambda _: None)
    assert sorted(os.listdir(models)) == ["2.tmp-" + str(os.getppid()), "3"]

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_export, "write_arrays", fail)
    with pytest.raises(OSError, match=f"No space left on device \\(writing {models / '4'}\\)"):
        export_run(run, str(models / "4"), buckets=BUCKETS, log=lambda _: None)
    assert sorted(os.listdir(models)) == ["2.tmp-" + str(os.getppid()), "3"]


def _csv(path: pathlib.Path, n: int = 240, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lines = ["label,price,user,item,tags"]
    for _ in range(n):
        user = f"u{int(rng.zipf(1.3)) % 60}"
        item = "" if rng.random() < 0.1 else str(int(rng.integers(0, 40)) * 1_000_003)
        tags = "|".join(f"t{int(t)}" for t in rng.integers(0, 9, int(rng.integers(0, 4))))
        price = f"{rng.uniform(0, 50):.2f}"
        lines.append(f"{int(rng.random() < 0.3)},{price},{user},{item},{tags}")
    path.write_text("\n".join(lines) + "\n")


def test_delimited_data_with_a_dynamic_table(tmp_path):
    _csv(tmp_path / "clicks.csv")
    run = _train(
        tmp_path,
        "csv",
        [
            "data.kind=delimited",
            f"data.train={tmp_path / 'clicks.csv'}",
            "data.schema={label: label, dense: [price], categorical: [user, item],"
            " multi_hot: [tags]}",
            "data.batch_size=32",
            "data.split={by: rows, train: 180}",
            "tables.user.dynamic=true",
            "tables.user.cache_rows=0.5",
            "model.embedding_dim=8",
            "model.options={bottom: [16, 8], top: [16, 1]}",
        ],
    )
    m = export_run(run, str(tmp_path / "model"), buckets=BUCKETS, log=lambda _: None)
    assert m["check"]["max_abs_diff"] <= 1e-6
    assert m["mappings"]["user"]["kind"] == "keys" and m["mappings"]["user"]["raw_keys"]
    p = Predictor.load(str(tmp_path / "model"))
    rows = p.example_request["examples"]
    assert rows and all("user" in r and "label" not in r for r in rows)
    assert any("tags" in r for r in rows)
    base = p.predict([{"price": 3.5, "user": "u1", "item": "1000003", "tags": ["t1", "t2"]}])
    same = p.predict([{"price": "3.5", "user": "u1", "item": 1000003, "tags": "t1|t2"}])
    np.testing.assert_allclose(base, same, atol=1e-7)
    # a user the run never saw gets the dynamic table's default row: like no user at all
    unseen = p.predict([{"price": 3.5, "user": "never-seen", "item": "1000003", "tags": []}])
    missing = p.predict([{"price": 3.5, "item": "1000003"}])
    np.testing.assert_allclose(unseen, missing, atol=1e-7)
    with pytest.raises(RequestError, match="'tags'"):
        p.parse([{"tags": ["a|b"]}])


def test_synthetic_ids_and_the_cli(tmp_path, capsys):
    run = _train(
        tmp_path,
        "syn",
        [
            "data.kind=synthetic",
            "data.max_vocab=500",
            "data.batch_size=64",
            "data.eval_batches=2",
            "model.embedding_dim=8",
            "model.options={bottom: [16, 8], top: [16, 1]}",
        ],
    )
    out = str(tmp_path / "models" / "1")
    assert main(["export", run, "--out", out, "--buckets", "1,8", "--quantize", "bf16"]) == 0
    assert "bfloat16 tables" in capsys.readouterr().out
    m = json.loads(pathlib.Path(out, "model.json").read_text())
    assert m["quantize"] == "bfloat16" and m["check"]["max_abs_diff"] < 0.02
    assert m["version"] == "1"
    p = Predictor.load(out)
    rows = p.example_request["examples"]
    assert len(rows) == 8 and "dense0" in rows[0]
    assert p.predict(rows).shape == (8,)
    with pytest.raises(RequestError, match=r"'C1': expected an integer id in \[0, "):
        p.parse([{"C1": 10**9}])
    # a column of plain numbers is read at once, any other value by value: the same rows
    rows = [{**rows[0], "C1": 3}, {**rows[1], "C1": None, "dense0": None}, {**rows[2], "C1": 7}]
    batch = p.parse(rows)
    alone = [p.parse([r]) for r in rows]
    np.testing.assert_array_equal(batch.dense, np.concatenate([a.dense for a in alone]))
    for name, col in batch.sparse.items():
        np.testing.assert_array_equal(col.lengths, [a.sparse[name].lengths[0] for a in alone])
        np.testing.assert_array_equal(
            col.values, np.concatenate([a.sparse[name].values for a in alone])
        )
    assert batch.sparse["C1"].lengths.tolist() == [1, 0, 1] and batch.dense[1, 0] == 0.0
    # every value plain: all the features read as one table, the values as sent
    plain = p.example_request["examples"]
    batch, pre = p.parse(plain), p.preprocessor
    want = [[r[k] for k in pre.dense] for r in plain]
    np.testing.assert_array_equal(batch.dense, np.asarray(want, np.float32))
    for name in pre.sparse:
        assert batch.sparse[name].lengths.tolist() == [1] * len(plain)
        assert batch.sparse[name].values.tolist() == [r[name] for r in plain], name
    for bad, words in [
        ({"C1": -1}, "example 1: feature 'C1': expected an integer id in [0, "),
        ({"C1": 2**70}, "example 1: feature 'C1': expected an integer id in [0, "),
        ({"C1": True}, "example 1: feature 'C1': expected an integer id in [0, "),
        ({"dense0": float("nan")}, "example 1: feature 'dense0': expected a finite number"),
        ({"dense0": 10**400}, "example 1: feature 'dense0': expected a finite number"),
        ({"dense0": "1"}, "example 1: feature 'dense0': expected a finite number"),
    ]:
        with pytest.raises(RequestError, match=re.escape(words)):
            p.parse([rows[0], {**rows[0], **bad}])


def test_exported_model_runs_without_the_run_dir(criteo_run, tmp_path):
    """The model dir is self-contained: moved away from its run, it loads and predicts
    the same (the computation is deserialized, not rebuilt from model code)."""
    _, _, models = criteo_run
    moved = _copy(models["int8"][1], tmp_path / "elsewhere")
    rows = Predictor.load(models["int8"][1]).example_request["examples"]
    a = Predictor.load(models["int8"][1]).predict(rows)
    b = Predictor.load(str(moved)).predict(rows)
    np.testing.assert_array_equal(a, b)
    assert os.path.exists(moved / "exported" / "b1.jaxexport")
    assert jax.default_backend() == "cpu"


def test_two_tower_retrieval_is_exact_over_the_catalog(tmp_path):
    run = _train(
        tmp_path,
        "tt",
        TWO_TOWER,
    )
    m = export_run(run, str(tmp_path / "model"), buckets=BUCKETS, log=lambda _: None)
    assert m["retrieval"]["items"] == 240
    assert m["check"]["max_abs_diff"] < 1e-4  # scores are cosines / 0.05
    p = Predictor.load(str(tmp_path / "model"))
    body = json.loads((tmp_path / "model" / "example_retrieve.json").read_text())
    assert set(body["user"]) <= {"user", "history"} and body["k"] == 10
    items, scores = p.retrieve(body["user"], 240)
    assert sorted(items) == list(range(240)) and np.all(np.diff(scores) <= 0)
    # the same scores through the predict path (both towers in the exported computation)
    pairs = [{**body["user"], "item": i, "category": i % 12} for i in items]
    np.testing.assert_allclose(p.predict(pairs), scores, atol=1e-4, rtol=1e-5)
    top, top_scores = p.retrieve(body["user"], 5)
    assert top == items[:5] and np.allclose(top_scores, scores[:5])
    with pytest.raises(RequestError, match=r"k must be an integer in \[1, 240\]"):
        p.retrieve(body["user"], 0)
    with pytest.raises(RequestError, match="unknown feature"):
        p.retrieve({"nope": 1}, 3)
    # and through the server: example_retrieve.json as the body
    status, got = _post(make_app(predictor=p, log=lambda _: None), "/v1/retrieve", body)
    assert status == 200 and got["items"] == items[:10]
    np.testing.assert_allclose(got["scores"], scores[:10], rtol=1e-6)


def _post(app, path, body):
    """POST `body` to `app` through aiohttp's test client: (status, JSON answer)."""

    async def go():
        async with TestClient(TestServer(app)) as client:
            r = await client.post(path, json=body)
            return r.status, await r.json()

    return asyncio.run(go())


def test_retrieve_on_a_binary_model_is_a_request_error(criteo_run):
    _, _, models = criteo_run
    with pytest.raises(RequestError, match="two-tower"):
        Predictor.load(models["fp32"][1], warmup=False).retrieve({}, 3)


def test_joined_call_equals_the_exported_call_for_every_dtype():
    """The batch arrays joined per 4-byte dtype and split in the call give the exported
    computation exactly the arrays it was given one by one (others pass alone)."""
    from sparsejax.serving._predictor import _JoinedCall

    def f(model, batch):
        w = model["w"]
        return {
            "a": batch["ids"].sum(axis=1).astype(np.float32) * w[0] + batch["dense"] @ w,
            "b": batch["small"].astype(np.float32).sum()
            + batch["segments"][::-1, None].astype(np.float32) * w,
            "c": batch["mask"] * batch["half"].astype(np.float32).mean(),
        }

    rng = np.random.default_rng(0)
    model = {"w": rng.normal(size=3).astype(np.float32)}
    batch = {
        "ids": rng.integers(-5, 2**31 - 1, size=(4, 2), dtype=np.int32),
        "segments": rng.integers(0, 4, size=4, dtype=np.int32),
        "dense": rng.normal(size=(4, 3)).astype(np.float32),
        "mask": np.array([1, 1, 0, 1], np.float32),
        "small": rng.integers(-100, 100, size=(2, 5), dtype=np.int8),
        "half": rng.normal(size=7).astype(np.float16),
        "empty": np.zeros((0, 3), np.int32),
    }
    exp = jax.export.export(jax.jit(f))(model, batch)
    joined = _JoinedCall(exp, num_model_args=1)
    assert len(joined._groups) == 2 and len(joined._alone) == 2
    got = joined([model["w"]], jax.tree.leaves(batch))
    want = exp.call(model, batch)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
