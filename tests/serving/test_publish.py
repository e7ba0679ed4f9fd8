"""Training publishes, serving follows: a run with `publish` writes a full model dir and
then deltas; a predictor (and the server) that applies them in order scores exactly as
a model dir exported from the run's final checkpoint (fp32 and int8); deltas for
another model or base, corrupt ones and ones that arrive early are refused or wait, and
the served version stays."""

import asyncio
import json
import os
import pathlib
import re
import shutil

import numpy as np
import pytest
from _data import TWO_TOWER
from aiohttp.test_utils import TestClient, TestServer

from sparsejax import runner
from sparsejax.runner import export_run
from sparsejax.serving import DeltaError, Predictor, Publisher, make_app
from sparsejax.serving._delta import DELTA, delta_dirs
from sparsejax.serving._format import MANIFEST

SYNTHETIC = [
    "data.kind=synthetic",
    "data.max_vocab=5000",
    "data.batch_size=32",
    "data.eval_batches=1",
    "model.embedding_dim=8",
    "model.options={bottom: [16, 8], top: [16, 1]}",
    "progress=false",
    "log_every=1000",
    "eval_every=null",
    "steps=5",
]


def _published_run(tmp, quantize):
    pub = tmp / f"pub_{quantize}"
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp / 'runs'}",
            f"name=run_{quantize}",
            *SYNTHETIC,
            f"publish={{dir: {pub}, every_s: 1.0e-9, full_every_s: null, quantize: {quantize},"
            " buckets: [1, 8]}",
        ],
    )
    lines = []
    runner.train(cfg, log=lines.append)
    return str(tmp / "runs" / f"run_{quantize}"), pub, lines


@pytest.fixture(scope="module", params=["fp32", "int8"])
def published(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"publish_{request.param}")
    run, pub, lines = _published_run(tmp, request.param)
    final = str(tmp / "final")
    export_run(run, final, quantize=request.param, log=lambda _: None)
    return run, pub, lines, Predictor.load(final, warmup=False)


def _follow(pub) -> Predictor:
    p = Predictor.load(str(pub / "1"), warmup=False)
    deltas = delta_dirs(str(pub))
    for v in sorted(deltas):
        p = p.with_delta(deltas[v])
    return p


def test_deltas_applied_in_order_score_as_the_final_export(published):
    run, pub, lines, final = published
    assert sorted(os.listdir(pub)) == ["1", *[f"{v}.delta" for v in range(2, 6)]]
    assert sum("as full version 1" in ln for ln in lines) == 1
    assert sum(" as delta version " in ln for ln in lines) == 4
    first = Predictor.load(str(pub / "1"), warmup=False)
    p = _follow(pub)
    rows = final.example_request["examples"]
    assert p.version == "5" and p.info["full_version"] == "1"
    np.testing.assert_allclose(p.predict(rows), final.predict(rows), rtol=0, atol=1e-6)
    # the deltas moved the model, and the first predictor was left as it was
    assert np.abs(first.predict(rows) - final.predict(rows)).max() > 1e-6
    assert first.version == "1"
    # each new leaf is placed as the one it replaces: the compiled calls take it as it is
    second = first.with_delta(str(pub / "2.delta"))
    assert [x.committed for x in second._leaves] == [x.committed for x in first._leaves]


def test_a_new_version_of_the_same_model_takes_the_compiled_calls_of_the_one_before(tmp_path):
    """A publish folder's next full version has the same computations: loaded while the
    version before is alive (a reload), it takes that version's compiled calls rather
    than compiling them again, and scores with its own tables, as it does loaded
    alone."""
    import gc

    pub = tmp_path / "pub"
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp_path / 'runs'}",
            *SYNTHETIC[:-1],
            "steps=2",
            f"publish={{dir: {pub}, every_s: 1.0e-9, full_every_s: 1.0e-9, buckets: [1, 8]}}",
        ],
    )
    runner.train(cfg, log=lambda _: None)
    first = Predictor.load(str(pub / "1"), warmup=False)
    second = Predictor.load(str(pub / "2"), warmup=False)
    assert all(second._calls[b] is first._calls[b] for b in (1, 8))
    rows = first.example_request["examples"]
    got = second.predict(rows)
    assert np.abs(first.predict(rows) - got).max() > 1e-6  # its own tables
    assert first._calls[1] is not first._calls[8]  # another computation: its own call
    del first, second
    gc.collect()
    alone = Predictor.load(str(pub / "2"), warmup=False)  # compiled anew
    np.testing.assert_array_equal(alone.predict(rows), got)


def test_a_delta_carries_only_the_rows_training_changed(published):
    _, pub, _, final = published
    m = json.loads(pathlib.Path(pub, "3.delta", DELTA).read_text())
    assert m["base"] == 2 and m["version"] == 3 and m["step"] == 3
    table_rows = {k: e["shape"][0] for k, e in final.manifest["arguments"].items() if "pieces" in e}
    carried = {
        k: sum(q["rows"]["shape"][0] for q in e["pieces"])
        for k, e in m["arguments"].items()
        if "pieces" in e
    }
    assert carried and set(carried) <= set(table_rows)
    # one batch of 32 examples touches a few hundred of the 5000-row tables' rows
    for k, n in carried.items():
        assert 0 < n < table_rows[k] // 2


def _copy_pub(pub, tmp):
    dst = tmp / "pub"
    shutil.copytree(pub, dst)
    return dst


def test_bad_deltas_are_refused_naming_why(published, tmp_path):
    _, pub, _, _ = published
    pub = _copy_pub(pub, tmp_path)
    p = Predictor.load(str(pub / "1"), warmup=False)
    with pytest.raises(DeltaError, match=r"applies to version 2, this is version 1"):
        p.with_delta(str(pub / "3.delta"))
    meta = pub / "2.delta" / DELTA
    m = json.loads(meta.read_text())
    meta.write_text(json.dumps({**m, "model_id": "0" * 32}))
    with pytest.raises(DeltaError, match=r"is for model 0{32}, this is [0-9a-f]{32}"):
        p.with_delta(str(pub / "2.delta"))
    meta.write_text(json.dumps(m))
    victim = next((pub / "2.delta" / "arrays").glob("*values*.npy"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(DeltaError, match=r"delta file .*values.* is corrupt \(crc32 mismatch\)"):
        p.with_delta(str(pub / "2.delta"))
    assert p.version == "1"


def _server_calls(app, *rounds):
    """Each round: optionally a function run first (changes on disk), then its calls
    (method, path, JSON body) against one running `app`: [(status, body)] per round."""

    async def go():
        async with TestClient(TestServer(app)) as client:
            out = []
            for before, calls in rounds:
                if before is not None:
                    before()
                got = []
                for method, path, body in calls:
                    r = await getattr(client, method)(path, json=body)
                    is_json = r.content_type == "application/json"
                    got.append((r.status, await (r.json() if is_json else r.text())))
                out.append(got)
            return out

    return asyncio.run(go())


def test_the_server_follows_deltas_and_waits_for_their_base(published, tmp_path):
    _, pub, _, final = published
    pub = _copy_pub(pub, tmp_path)
    held = tmp_path / "held"
    held.mkdir()
    for v in (2, 3):  # 4 and 5 are there before their base: they wait
        shutil.move(pub / f"{v}.delta", held / f"{v}.delta")

    def arrive():
        for v in (2, 3):
            shutil.move(held / f"{v}.delta", pub / f"{v}.delta")

    app = make_app(str(pub), poll_seconds=0, log=lambda _: None)
    rows = final.example_request["examples"]
    first, then = _server_calls(
        app,
        (None, [("post", "/v1/reload", None), ("get", "/v1/model", None)]),
        (
            arrive,
            [
                ("post", "/v1/reload", None),
                ("post", "/v1/predict", {"examples": rows}),
                ("get", "/healthz", None),
                ("get", "/metrics", None),
            ],
        ),
    )
    (s1, r1), (_, m1) = first
    assert s1 == 200 and r1 == {"reloaded": False, "model_version": "1"}
    assert m1["version"] == "1" and m1["last_error"] is None
    (_, r2), (_, pred), (_, health), (_, metrics) = then
    assert r2["reloaded"] and r2["model_version"] == "5" and r2["previous_version"] == "1"
    assert pred["model_version"] == "5"
    np.testing.assert_allclose(pred["scores"], final.predict(rows), rtol=0, atol=1e-6)
    assert health["model_version"] == "5" and 0 <= health["model_version_age_s"] < 600
    assert 'sparsejax_model_deltas_total{result="applied"} 4.0' in metrics


def test_a_refused_delta_keeps_the_served_version(published, tmp_path):
    _, pub, _, _ = published
    pub = _copy_pub(pub, tmp_path)
    meta = pub / "3.delta" / DELTA
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "model_id": "f" * 32}))
    logs = []
    app = make_app(str(pub), poll_seconds=0, log=logs.append)
    calls = [("post", "/v1/reload", None), ("get", "/v1/model", None), ("get", "/metrics", None)]
    (((_, r), (_, m), (_, metrics)),) = _server_calls(app, (None, calls))
    assert r["model_version"] == "2" and "is for model f" in r["error"]
    assert m["version"] == "2" and "cannot apply" in m["last_error"]["message"]
    assert any("still serving 2" in ln and "3.delta" in ln for ln in logs)
    applied = [ln for ln in logs if "now serving 2 (delta" in ln]
    assert len(applied) == 1 and re.search(r"2\.delta on 1, published \d+\.\d s ago", applied[0])
    assert 'sparsejax_model_deltas_total{result="refused"} 1.0' in metrics


@pytest.mark.parametrize(
    "publish, words",
    [
        ("{every_s: 1}", "`dir` is required"),
        ("{dir: x, every_s: 0}", "`every_s` must be > 0, got 0"),
        ("{dir: x, evry_s: 1}", "unknown config key 'publish.evry_s'; did you mean 'every_s'?"),
        ("{dir: x, quantize: int3}", "quantize"),
    ],
)
def test_publish_config_errors_are_one_line(publish, words):
    with pytest.raises(runner.ConfigError, match=re.escape(words)):
        runner.load_config([], [*SYNTHETIC, f"publish={publish}"])


def test_a_retrieval_model_publishes_its_catalogs_embeddings(tmp_path, monkeypatch):
    """A two-tower run publishes: each delta carries the catalog's item embeddings, and
    the followed model retrieves as the final export does (items and scores); the deltas
    embed the catalog with one function (compiled once)."""
    from sparsejax.serving import _export

    built = []
    real = _export.inference_fn
    monkeypatch.setattr(_export, "inference_fn", lambda *a: built.append(a[-1]) or real(*a))
    pub = tmp_path / "pub"
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp_path / 'runs'}",
            "name=tt",
            *SYNTHETIC[6:],  # progress, logging, 5 steps
            *TWO_TOWER,
            f"publish={{dir: {pub}, every_s: 1.0e-9, full_every_s: null, buckets: [1, 8]}}",
        ],
    )
    lines = []
    runner.train(cfg, log=lines.append)
    assert built == ["retrieval", "retrieval"]  # the export's, then the catalog tower of all
    export_run(str(tmp_path / "runs" / "tt"), str(tmp_path / "final"), log=lambda _: None)
    # the towers' weights and the embeddings change whole: the log line counts them
    deltas = [ln for ln in lines if "as delta version" in ln]
    assert len(deltas) == 4 and all(re.search(r"rows and \d+ arrays whole", ln) for ln in deltas)
    final = Predictor.load(str(tmp_path / "final"), warmup=False)
    first, p = Predictor.load(str(pub / "1"), warmup=False), _follow(pub)
    assert p.version == "5"
    m = json.loads((pub / "3.delta" / DELTA).read_text())
    assert "retrieval.item_embeddings" in m["arguments"]
    user = json.loads((tmp_path / "final" / "example_retrieve.json").read_text())["user"]

    def scores(predictor):
        return _catalog_scores(predictor, user, 240)

    np.testing.assert_allclose(scores(p), scores(final), rtol=0, atol=1e-6)
    assert np.abs(scores(first) - scores(final)).max() > 1e-3  # training moved them
    assert scores(first).shape == (240,) and first.version == "1"


def _catalog_scores(predictor: Predictor, user: dict, items: int) -> np.ndarray:
    """`user`'s retrieval score of every one of the catalog's `items` items, by item id
    (the ranking must hold them all)."""
    ids, got = predictor.retrieve(user, items)
    assert sorted(ids) == list(range(items))
    return np.asarray(got)[np.argsort(ids)]


@pytest.mark.parametrize("dtype", ["float32", "int8", "bfloat16"])
def test_every_leaf_is_committed_to_the_default_device_whatever_its_alignment(dtype):
    """A leaf's placement never depends on where its host array happens to lie (it
    would change the compiled computation's inputs: a compile per replaced leaf, and
    keys in JAX's compilation cache that differ by process); an aligned CPU array is
    shared, not copied."""
    import jax
    import ml_dtypes

    from sparsejax.embedding import aligned_empty
    from sparsejax.serving._predictor import _on_device

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    aligned = aligned_empty((64, 8), dt)
    aligned[...] = np.arange(64 * 8).reshape(64, 8) % 100
    raw = aligned_empty((aligned.nbytes + 64,), np.uint8)[dt.itemsize :][: aligned.nbytes]
    unaligned = raw.view(dt).reshape(64, 8)
    unaligned[...] = aligned
    assert unaligned.ctypes.data % 64
    for a in (aligned, unaligned, aligned[:0]):
        got = _on_device(a)
        assert got.committed and got.devices() == {jax.devices()[0]}, a.ctypes.data % 64
        np.testing.assert_array_equal(np.asarray(got), a)
    if dtype == "float32":  # shared: a change to the host array shows on the device
        shared = _on_device(aligned)
        aligned[0, 0] = -7
        assert float(shared[0, 0]) == -7


# ---- dynamic tables: new keys in spare rows, evicted keys removed ----------------------
@pytest.fixture(scope="module")
def published_dynamic(tmp_path_factory):
    """An int8 run whose tables are dynamic and evict keys unseen for 2 steps, publishing
    every step with few spare rows (they run out: a full version mid-run)."""
    tmp = tmp_path_factory.mktemp("publish_dynamic")
    pub = tmp / "pub"
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp / 'runs'}",
            "name=dyn",
            *SYNTHETIC,
            "steps=8",
            "tables={'*': {dynamic: true, cache_rows: 256, eviction: {ttl_steps: 2,"
            " every_steps: 2}}}",
            f"publish={{dir: {pub}, every_s: 1.0e-9, full_every_s: null, quantize: int8,"
            " buckets: [1, 8], key_headroom: 0.05}",
        ],
    )
    lines = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Publisher, "MIN_SPARE_ROWS", 40)
        runner.train(cfg, log=lines.append)
    final = str(tmp / "final")
    export_run(str(tmp / "runs" / "dyn"), final, quantize="int8", log=lambda _: None)
    return pub, lines, Predictor.load(final, warmup=False)


def test_dynamic_tables_publish_new_and_evicted_keys_as_deltas(published_dynamic):
    pub, lines, final = published_dynamic
    # the spare rows ran out once at least: that publish was a full one, with spare again
    assert any("is a full one, with rows to spare" in ln for ln in lines)
    fulls = sorted(int(n) for n in os.listdir(pub) if n.isdigit())
    assert len(fulls) >= 2 and fulls[-1] < 8, lines
    p = Predictor.load(str(pub / str(fulls[-1])), warmup=False)
    spare = {
        t: e["default_row"] - p._keys[t].keys.shape[0] for t, e in p.manifest["mappings"].items()
    }
    assert all(n >= 40 for n in spare.values())
    added = removed = 0
    evicted = {}
    deltas = delta_dirs(str(pub))
    for v in sorted(v for v in deltas if v > fulls[-1]):
        m = json.loads(pathlib.Path(deltas[v], DELTA).read_text())
        for t, parts in m["keys"].items():
            added += parts["added"]["shape"][0]
            removed += parts["removed"]["shape"][0]
            gone = np.load(os.path.join(deltas[v], parts["removed"]["file"]))
            evicted.setdefault(t, set()).update(int(k) for k in gone)
        p = p.with_delta(deltas[v])
    assert p.version == "8" and added > 0 and removed > 0
    # the keys served are the final export's (evicted ones gone), each at a row of its own
    for t, km in p._keys.items():
        np.testing.assert_array_equal(km.keys, final._keys[t].keys)
        at = np.arange(km.keys.shape[0]) if km.rows is None else km.rows
        assert np.unique(at).shape == at.shape and at.max(initial=0) < km.default_row
    rows = final.example_request["examples"]
    # an evicted key and a key never seen read the default row, as in the final export
    t = next(t for t, ks in evicted.items() if ks - set(p._keys[t].keys.tolist()))
    gone = next(iter(evicted[t] - set(p._keys[t].keys.tolist())))
    rows = [*rows, {**rows[0], t: gone}, {**rows[1], t: 10**12}]
    # int8 both sides: the same quantized rows, at other row numbers
    np.testing.assert_allclose(p.predict(rows), final.predict(rows), rtol=0, atol=1e-6)


def test_key_changes_that_do_not_fit_are_refused_naming_the_key():
    from sparsejax.serving._preprocess import KeyMapping, TooFewRows

    km = KeyMapping(np.array([3, 7, 9]), 6, np.array([2, 0, 1]))
    got = km.updated(np.array([8, 1]), np.array([7]), np.array([3, 5]))
    np.testing.assert_array_equal(got.keys, [1, 3, 8, 9])
    np.testing.assert_array_equal(got(np.array([1, 3, 7, 8, 9, 4])), [5, 2, 6, 3, 1, 6])
    np.testing.assert_array_equal(km(np.array([7])), [0])  # the old mapping is kept
    # no rows given: the lowest free ones (the removed key's row 0 among them), in order
    got = km.updated(np.array([8, 1, 5]), np.array([7]))
    np.testing.assert_array_equal(got(np.array([8, 1, 5, 3, 9])), [0, 3, 4, 2, 1])
    with pytest.raises(TooFewRows, match="4 new keys, 3 free rows"):
        km.updated(np.array([1, 2, 4, 5]), np.array([], np.int64))
    for (added, rows, removed), words in [
        (([], [], [4]), "removes key 4, which is not served"),
        (([5], [6], []), "adds key 5 at row 6, outside rows 0..5"),
        (([5], [2], []), "adds key 5 at row 2, which another key has"),
        (([5, 6], [4, 4], []), "at row 4, which another key has"),
        (([9], [4], []), "adds key 9, which is served already"),
        (([5, 5], [4, 3], []), "adds key 5, which is served already"),
        (([9], None, []), "adds key 9, which is served already"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            km.updated(
                np.array(added, np.int64),
                np.array(removed, np.int64),
                None if rows is None else np.array(rows, np.int64),
            )


# ---- a run of two processes ------------------------------------------------------------
def test_two_processes_publish_the_rows_each_holds(tmp_path):
    """`launch -n 2` with C1 split row-wise over the processes, C2 and C3 dynamic (their
    keys owned by one process or the other, some evicted each step) and C4 static with a
    host cache: both processes write rows into each delta (C1's they hold, a share of
    the host-kept tables' gathered rows), process 0 the manifest and the key changes;
    the deltas, followed, score as the run's final checkpoint exported in one process,
    on its keys, evicted ones and ones never seen."""
    from _cli import run_sparsejax

    pub = tmp_path / "pub"
    dynamic = "{dynamic: true, cache_rows: 256, eviction: {ttl_steps: 1, every_steps: 1}}"
    out = run_sparsejax(
        "launch",
        "-n",
        "2",
        f"out_dir={tmp_path / 'runs'}",
        "name=two",
        *SYNTHETIC,
        "steps=4",
        f"tables={{C1: {{placement: row_wise}}, C2: {dynamic}, C3: {dynamic},"
        " C4: {dynamic: false, cache_rows: 64}}",
        f"publish={{dir: {pub}, every_s: 1.0e-9, full_every_s: null, buckets: [1, 8]}}",
    )
    assert "published step 4 as delta version 4" in out
    assert sorted(os.listdir(pub)) == ["1", "2.delta", "3.delta", "4.delta"]
    evicted: dict[str, set] = {}
    for v in (2, 3, 4):
        m = json.loads((pub / f"{v}.delta" / DELTA).read_text())
        writers = {f.name.split(".")[0] for f in (pub / f"{v}.delta" / "arrays").iterdir()}
        assert writers == {"p0", "p1"} and set(m["keys"]) <= {"C2", "C3"}, (v, m["keys"])
        for t, parts in m["keys"].items():
            gone = np.load(pub / f"{v}.delta" / parts["removed"]["file"])
            evicted.setdefault(t, set()).update(gone.tolist())
    final = str(tmp_path / "final")
    export_run(str(tmp_path / "runs" / "two"), final, log=lambda _: None)
    final = Predictor.load(final, warmup=False)
    followed = _follow(pub)
    assert followed.version == "4"
    for t in ("C2", "C3"):
        np.testing.assert_array_equal(followed._keys[t].keys, final._keys[t].keys)
    rng = np.random.default_rng(0)
    rows = list(final.example_request["examples"])
    for t in ("C2", "C3"):
        keys = final._keys[t].keys
        gone = sorted(evicted.get(t, set()) - set(keys.tolist()))
        for k in [*rng.choice(keys, 6), *gone[:3], 10**12]:
            rows.append({**rows[len(rows) % 4], t: int(k)})
    assert any(evicted.get(t, set()) - set(final._keys[t].keys.tolist()) for t in ("C2", "C3"))
    for i in rng.choice(final.manifest["tables"]["C4"]["rows"], 6, replace=False):
        rows.append({**rows[0], "C4": int(i)})
    first = Predictor.load(str(pub / "1"), warmup=False)
    assert np.abs(first.predict(rows) - final.predict(rows)).max() > 1e-6
    np.testing.assert_allclose(followed.predict(rows), final.predict(rows), rtol=0, atol=1e-6)


def test_a_retrieval_model_of_two_processes_publishes_deltas(tmp_path):
    """`launch -n 2` of a two-tower run with publish, its item table split row-wise over
    the processes and its category table tiered (a host cache): a full version, then deltas whose
    catalog embeddings process 0 makes from every process's rows (no process holds every
    table); the followed deltas retrieve as the final checkpoint exported in one
    process."""
    from _cli import run_sparsejax

    pub = tmp_path / "pub"
    out = run_sparsejax(
        "launch",
        "-n",
        "2",
        f"out_dir={tmp_path / 'runs'}",
        "name=tt",
        *SYNTHETIC[6:9],  # progress, logging
        "steps=3",
        *TWO_TOWER,
        "tables={item: {placement: row_wise}, category: {cache_rows: 12}}",
        f"publish={{dir: {pub}, every_s: 1.0e-9, full_every_s: null, buckets: [1, 8]}}",
    )
    assert "published step 1 as full version 1" in out
    assert [f"published step {s} as delta version {s}" in out for s in (2, 3)] == [True] * 2
    assert sorted(os.listdir(pub)) == ["1", "2.delta", "3.delta"]
    manifest = json.loads((pub / "1" / MANIFEST).read_text())
    assert manifest["processes"] == 2 and manifest["retrieval"]["items"] == 240
    for v in (2, 3):
        m = json.loads((pub / f"{v}.delta" / DELTA).read_text())
        writers = {f.name.split(".")[0] for f in (pub / f"{v}.delta" / "arrays").iterdir()}
        assert writers == {"p0", "p1", "made"}, writers
        assert "retrieval.item_embeddings" in m["arguments"]
    final = str(tmp_path / "final")
    export_run(str(tmp_path / "runs" / "tt"), final, log=lambda _: None)
    final = Predictor.load(final, warmup=False)
    first, followed = Predictor.load(str(pub / "1"), warmup=False), _follow(pub)
    assert followed.version == "3"
    user = json.loads((pub / "1" / "example_retrieve.json").read_text())["user"]

    def scores(predictor):
        return _catalog_scores(predictor, user, 240)

    np.testing.assert_allclose(scores(followed), scores(final), rtol=0, atol=1e-6)
    assert np.abs(scores(first) - scores(final)).max() > 1e-3  # training moved them


def test_a_delta_that_fails_in_the_background_stops_the_run_with_its_error(tmp_path, monkeypatch):
    """In one process a delta is written while training goes on; its error is raised by
    the next publish, and the versions before it stay as they were."""
    from sparsejax.serving import _delta

    real = _delta.write_delta

    def full_disk_at_3(out, *args, version, **kw):
        if version == 3:
            raise OSError(28, "No space left on device", out)
        return real(out, *args, version=version, **kw)

    monkeypatch.setattr(_delta, "write_delta", full_disk_at_3)
    pub = tmp_path / "pub"
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp_path / 'runs'}",
            "name=r",
            *SYNTHETIC,
            f"publish={{dir: {pub}, every_s: 1.0e-9, full_every_s: null, buckets: [1]}}",
        ],
    )
    lines = []
    with pytest.raises(OSError, match="No space left on device"):
        runner.train(cfg, log=lines.append)
    assert sorted(os.listdir(pub)) == ["1", "2.delta"]
    assert any("as delta version 2" in ln and "in the training loop" in ln for ln in lines)
    assert _follow(pub).version == "2"


@pytest.mark.parametrize("shape", [(0, 4), (1,), (), (7, 3), (5000, 1), (9, 0), (3000, 2, 5)])
@pytest.mark.parametrize("dtype", ["float32", "int8", "float16", "int64"])
def test_changed_rows_are_the_rows_whose_bytes_differ(shape, dtype, monkeypatch):
    """Against a plain byte comparison; blocks of a few rows, so rows fall on both sides
    of a block's edge; NaNs compare by their bits, -0.0 differs from 0.0."""
    from sparsejax.serving import _delta

    monkeypatch.setattr(_delta, "_COMPARE_BYTES", 64)
    rng = np.random.default_rng(abs(hash((shape, dtype))) % 2**32)
    old = rng.integers(-100, 100, shape).astype(dtype)
    new = old.copy()
    n = shape[0] if shape else 1
    if new.size:
        flat = new.reshape(n, -1)  # a view: writes reach `new`
        for r in rng.choice(n, size=max(1, n // 7), replace=False):
            flat[r, rng.integers(flat.shape[1])] += 1
        if dtype.startswith("float"):
            old.reshape(n, -1)[0, 0], flat[0, 0] = np.nan, np.nan  # the same bits: unchanged
            if n > 1:  # the last row: 0.0 became -0.0, other bits
                old.reshape(n, -1)[-1, -1], flat[-1, -1] = 0.0, -0.0
    want = [
        r for r in range(n) if old.reshape(n, -1)[r].tobytes() != new.reshape(n, -1)[r].tobytes()
    ]
    got = _delta.changed_rows(old, new)
    np.testing.assert_array_equal(got, want)
    assert got.dtype.kind == "i"


def test_a_delta_completed_by_process_0_carries_what_it_made_and_fails_whole(tmp_path):
    """`write_delta(complete=)`: the arguments `previous` has and `current` lacks are made
    from the written rows (cut like the others, `current` gains them); a `complete` that
    fails, or makes other arguments, leaves no delta, naming why."""
    from sparsejax.serving._delta import _array, write_delta

    rng = np.random.default_rng(0)
    table = rng.normal(size=(50, 4)).astype(np.float32)
    previous = {"t": table, "made": np.zeros((6, 2), np.float32)}
    new = table.copy()
    new[[3, 40]] += 1.0
    seen = []

    def complete(tmp, arguments):  # the sum of the new table's rows, made from what was written
        seen.append(sorted(arguments))
        rows = _array(tmp, arguments["t"]["pieces"][0]["rows"])
        return {"made": np.full((6, 2), rows.sum(), np.float32)}

    common = dict(model_id="m", version=2, base=1, step=0)
    current = {"t": new}
    m = write_delta(str(tmp_path / "2.delta"), previous, current, complete=complete, **common)
    assert seen == [["t"]] and set(m["arguments"]) == {"t", "made"}
    np.testing.assert_array_equal(current["made"], np.full((6, 2), 43.0, np.float32))
    got = _array(str(tmp_path / "2.delta"), m["arguments"]["made"]["whole"])
    np.testing.assert_array_equal(got, current["made"])

    def broken(tmp, arguments):
        raise ValueError("the tower failed")

    for bad, why in ((broken, "the tower failed"), (lambda *_: {"other": new}, "made")):
        with pytest.raises(RuntimeError, match=f"not completed: process 0: .*{why}"):
            write_delta(str(tmp_path / "3.delta"), previous, {"t": new}, complete=bad, **common)
        assert sorted(os.listdir(tmp_path)) == ["2.delta"]
    with pytest.raises(ValueError, match="the arguments differ"):
        write_delta(str(tmp_path / "3.delta"), previous, {"t": new}, **common)
