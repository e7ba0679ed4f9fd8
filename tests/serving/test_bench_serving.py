"""experiments/bench_serving.py: its load client counts what it documents (bounded by
requests and by time, every status counted, errors kept) against the server on a fake
predictor, the predictor section takes the median of its repetitions, and a tiny
end-to-end run exports a small model, starts `python -m sparsejax serve` for batch-1
and dynamic batching and writes the JSON. No timing is checked."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import pathlib
import threading

import pytest
from _serving_fake import FakePredictor
from aiohttp import web

from sparsejax.serving._server import SERVER_KEY, make_app

PATH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serving", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def serving(predictor, **kw):
    """The server on `predictor` in a thread of its own; yields its URL."""
    app = make_app(predictor=predictor, log=lambda s: None, **kw)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    app[SERVER_KEY].attach(runner)
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_load_client_is_bounded_by_requests_and_by_time_and_counts_every_status(bench):
    fake = FakePredictor(delay=0.001)
    bodies = [json.dumps({"examples": [{"a": i}]}).encode() for i in range(7)]
    bodies.append(b'{"examples": [{"zz": 1}]}')  # 1 in 8 is refused
    with serving(fake, max_wait_ms=1) as url:
        r = bench.run_load(url, bodies, concurrency=1, requests=200, seconds=30, warmup_seconds=0)
        assert r["requests"] == 200 and r["ok"] + r["errors"] == 200
        assert r["statuses"] == {"200": 175, "400": 25}  # one connection: the bodies rotate
        assert "unknown feature 'zz'" in r["first_error"]
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["throughput"] == pytest.approx(175 / r["seconds"], rel=1e-3)
        timed = bench.run_load(
            url, bodies[:1], concurrency=4, requests=10**9, seconds=0.3, warmup_seconds=0.1
        )
        assert 0.3 <= timed["seconds"] < 2.0 and timed["errors"] == 0 and timed["ok"] > 10
        many = bench.run_load(url, bodies, concurrency=4, requests=400, seconds=30)
        assert many["requests"] == 400 and 30 <= many["statuses"]["400"] <= 70
    assert sum(sum(c) for c in fake.calls) >= 175 + timed["ok"] + many["ok"]  # + warm-ups


def test_bench_against_a_running_server_writes_the_table_and_json(bench, tmp_path, capsys):
    examples = tmp_path / "examples.json"
    examples.write_text(json.dumps({"examples": [{"a": 1, "b": 2}, {"c": 3}]}))
    out = tmp_path / "bench.json"
    with serving(FakePredictor(delay=0.002), max_wait_ms=2) as url:
        status = bench.main(
            ["--url", f"fake={url}", "--examples", str(examples), "--concurrency", "1", "8"]
            + ["--requests", "150", "--seconds", "10", "--warmup-seconds", "0.1"]
            + ["--out", str(out)]
        )
    assert status == 0
    got = json.loads(out.read_text())
    cells = got["models"]["fake"]["server"]["given"]
    assert set(cells) == {"1", "8"}
    for c, cell in cells.items():
        assert cell["requests"] == cell["ok"] == 150 and cell["errors"] == 0, cell
        assert cell["concurrency"] == int(c)
    assert cells["1"]["mean_batch"] == pytest.approx(1.0)
    assert cells["8"]["mean_batch"] > 1.5  # 8 clients, a 2 ms model: requests share calls
    text = capsys.readouterr().out
    assert "given req/s" in text and "fake" in text


def test_malformed_load_every_good_request_answered_and_every_bad_one_refused(bench, tmp_path):
    examples = [{"a": 1, "b": 2}, {"c": 3}, {"a": 0.5}]
    bodies, expect = bench._bodies(examples, 0.05)
    assert len(bodies) == 60 and expect.count(400) == 3  # 5%, one of each kind
    assert sum(b.endswith(b"}]}") for b, e in zip(bodies, expect, strict=True) if e == 400) == 2
    path = tmp_path / "examples.json"
    path.write_text(json.dumps({"examples": examples}))
    out = tmp_path / "bench.json"
    fake = FakePredictor(delay=0.001)
    with serving(fake, max_wait_ms=2) as url:
        assert (
            bench.main(
                ["--url", f"fake={url}", "--examples", str(path), "--concurrency", "16"]
                + ["--requests", "600", "--warmup-seconds", "0", "--malformed", "0.05"]
                + ["--out", str(out), "--strict"]
            )
            == 0
        )
    got = json.loads(out.read_text())
    cell = got["models"]["fake"]["server"]["given"]["16"]
    assert cell["unexpected"] == 0 and cell["requests"] == 600
    assert 15 <= cell["statuses"]["400"] <= 45 and cell["ok"] == 600 - cell["statuses"]["400"]
    assert [c["ok"] for c in got["checks"]] == [True]
    # A server that refused a good request would be caught:
    fake2 = FakePredictor()
    with serving(fake2) as url:
        r = bench.run_load(url, bodies, concurrency=1, requests=60, seconds=10, expect=[200] * 60)
    assert r["unexpected"] == 3 and r["first_unexpected"].startswith("expected 200, got 400")


def test_predictor_throughput_is_the_median_of_its_repetitions(bench):
    fake = FakePredictor(delay=0.002)
    got = bench.predictor_throughput(fake, [{"a": 1}, {"b": 2}], [1, 5], reps=3, min_seconds=0.02)
    assert set(got) == {"1", "5"}
    for b, v in got.items():
        assert v["reps"] == 3 and v["min"] <= v["predictions_per_s"] <= v["max"]
        assert v["ms_per_call"] == pytest.approx(1000 * int(b) / v["predictions_per_s"])
        assert v["ms_per_call"] >= 2.0  # the fake's 2 ms per call
    assert {sum(c) for c in fake.calls} == {1, 5}


@pytest.mark.parametrize("line", [0.1, 0.37, 0.62, 0.9, 1.2])
def test_slo_rate_bisects_between_the_measured_fractions(bench, monkeypatch, line):
    """A server whose p99 reaches 10 ms at `line` of the peak: the rate found is under
    it, within the bisection's width of it, and above the measured fractions that met
    it; the search stays between those and the first that did not."""
    peak, rates = 10_000.0, []

    def cell(target, cpu, args, rate):
        rates.append(rate)
        return {"p99_ms": 10.0 * rate / peak / line, "errors": 0, "behind": False}

    monkeypatch.setattr(bench, "_native_cell", cell)
    monkeypatch.setattr(bench, "_median", lambda reps: reps[len(reps) // 2])
    monkeypatch.setattr(bench, "_cell_line", lambda *a: "")
    measured = (0.5, 0.8)
    cells = {
        "peak": {"throughput": peak},
        "open": {f"{f:g}": cell(0, 0, 0, f * peak) for f in measured},
    }
    rates.clear()
    args = type("Args", (), {"slo_steps": 5, "load_reps": 3})()
    got = bench._slo_rate("v1", {}, None, args, cells)
    met = max([f for f in measured if f < line], default=0.0)
    missed = min([f for f in measured if f >= line], default=1.0)
    assert len(rates) == 5 * 3 and all(met * peak < r < missed * peak for r in rates)
    assert met <= got["fraction"] < line and got["rate"] == got["fraction"] * peak
    if line < 1.0:
        assert line <= got["below"] / peak <= got["fraction"] + (missed - met) / 2**5 + 1e-9
    else:
        assert got["below"] == peak and got["fraction"] == 1.0 - (missed - met) / 2**5


@pytest.mark.slow  # ~30 s: a training run, an export, two server processes
def test_tiny_end_to_end_run_with_an_exported_model(bench, tmp_path):
    from sparsejax import runner
    from sparsejax.runner import export_run

    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp_path / 'runs'}",
            "name=tiny",
            "progress=false",
            "log_every=1000",
            "eval_every=null",
            "epochs=null",
            "steps=3",
            "data.kind=synthetic",
            "data.max_vocab=200",
            "data.batch_size=32",
            "data.eval_batches=1",
            "model.embedding_dim=4",
            "model.options={bottom: [8, 4], top: [8, 1]}",
        ],
    )
    runner.train(cfg, log=lambda _: None)
    model = tmp_path / "model"
    export_run(str(tmp_path / "runs" / "tiny"), str(model), buckets=(1, 8), log=lambda _: None)
    out = tmp_path / "bench.json"
    status = bench.main(
        ["--model", f"tiny={model}", "--concurrency", "1", "4", "--requests", "60"]
        + ["--seconds", "5", "--warmup-seconds", "0.1", "--no-predictor", "--out", str(out)]
    )
    assert status == 0
    got = json.loads(out.read_text())["models"]["tiny"]
    assert got["examples"] == 8  # example_request.json's
    assert set(got["server"]) == {"batch1", "dynamic"}
    for mode, cells in got["server"].items():
        for cell in cells.values():
            assert cell["ok"] == 60 and cell["errors"] == 0, (mode, cell)
    assert got["server"]["batch1"]["4"]["mean_batch"] == pytest.approx(1.0)
    checks = json.loads(out.read_text())["checks"]
    assert [c["label"] for c in checks] == ["tiny", "tiny"]  # p99 and ratio: no predictor


def test_server_latency_counts_read_one_endpoints_histogram(bench):
    """The server's own latency histogram, per endpoint, as the bench reads it: every
    request counted in +Inf, the buckets cumulative, another endpoint's apart."""
    with serving(FakePredictor()) as url:
        for a in range(3):
            status, _ = bench.http_post(
                url, "/v1/predict", json.dumps({"example": {"a": a}}).encode()
            )
            assert status == 200
        got = bench.server_latency_counts(url, "predict")
        assert bench.server_latency_counts(url, "v2_infer") == {}
    assert got["+Inf"] == 3 and "0.01" in got
    counts = list(got.values())
    assert counts == sorted(counts), got
