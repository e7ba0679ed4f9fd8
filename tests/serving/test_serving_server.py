"""The dynamic batcher and the HTTP server (sparsejax/serving/_batching.py, _server.py)
against a fake predictor (tests/_serving_fake.py: score = offset + sum of the features),
through aiohttp's test client: batching, a bad request failing alone, body limits, JSON
errors, metrics, retrieval, hot reload (and a failed one keeping the old model), and a
graceful shutdown of `serve` on SIGTERM."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from _serving_fake import FakePredictor, load, write_model
from aiohttp.test_utils import TestClient, TestServer

from sparsejax.serving._batching import BatcherClosedError, DynamicBatcher
from sparsejax.serving._predictor import RequestError
from sparsejax.serving._server import SERVER_KEY, make_app

TESTS = pathlib.Path(__file__).resolve().parents[1]


def run_client(app, fn):
    """Run `await fn(client)` against `app` on a fresh event loop."""

    async def main():
        async with TestClient(TestServer(app)) as client:
            app[SERVER_KEY].attach(client.server.runner)  # as serve() does
            return await fn(client)

    return asyncio.run(main())


def random_example(rng):
    names = rng.sample(["a", "b", "c"], rng.randint(1, 3))
    return {n: rng.randint(-1000, 1000) / 8 for n in names}  # exact in float32


# -- the batcher ------------------------------------------------------------------------


def test_batcher_groups_up_to_max_batch_and_answers_each_request_with_its_own_scores():
    rng = random.Random(0)
    fake = FakePredictor(delay=0.01)
    requests = [[random_example(rng) for _ in range(rng.choice([1, 1, 2]))] for _ in range(12)]
    with DynamicBatcher(fake, max_batch=4, max_wait_ms=500) as batcher:
        futures = [batcher.submit(r) for r in requests]
        results = [f.result(timeout=10) for f in futures]
    for r, got in zip(requests, results, strict=True):
        np.testing.assert_array_equal(got, [sum(ex.values()) for ex in r])
    sizes = [sum(c) for c in fake.calls]
    # Greedy grouping in arrival order: a request that does not fit opens the next batch.
    expected, n = [], 0
    for r in requests:
        if n + len(r) > 4:
            expected.append(n)
            n = 0
        n += len(r)
    expected.append(n)
    assert sizes == expected
    assert fake.parses == sizes  # each batch parsed as one request
    assert all(len(c) == 1 for c in fake.calls)  # and scored as one input
    assert batcher.stats()["requests"] == 12 and batcher.stats()["examples"] == sum(sizes)


def test_batcher_takes_what_queued_while_the_model_was_busy_even_without_waiting():
    fake = FakePredictor(delay=0.4)
    with DynamicBatcher(fake, max_batch=64, max_wait_ms=0) as batcher:
        first = batcher.submit([{"a": 1}])
        time.sleep(0.1)  # the worker is inside score() now
        rest = [batcher.submit([{"a": i}]) for i in range(10)]
        assert first.result(timeout=10).tolist() == [1]
        assert [f.result(timeout=10).tolist() for f in rest] == [[i] for i in range(10)]
    assert fake.calls == [[1], [10]] and fake.parses == [1, 10]


def test_batcher_scores_an_oversized_request_alone_and_batch_1_serving_never_groups():
    fake = FakePredictor()
    with DynamicBatcher(fake, max_batch=4, max_wait_ms=50) as batcher:
        big = batcher.submit([{"a": i} for i in range(9)])
        small = batcher.submit([{"b": 2}])
        assert big.result(timeout=10).tolist() == list(range(9))
        assert small.result(timeout=10).tolist() == [2]
    assert fake.calls == [[9], [1]]
    fake = FakePredictor(delay=0.01)
    with DynamicBatcher(fake, max_batch=1, max_wait_ms=0) as batcher:
        futures = [batcher.submit([{"a": i}]) for i in range(20)]
        assert [f.result(timeout=10).tolist() for f in futures] == [[i] for i in range(20)]
    assert fake.calls == [[1]] * 20


def test_batcher_does_not_wait_when_every_sender_has_a_request_in():
    on_the_way = [1]
    fake = FakePredictor()
    with DynamicBatcher(fake, max_wait_ms=5000, senders=lambda: on_the_way[0]) as batcher:
        t0 = time.monotonic()
        assert batcher.submit([{"a": 1}]).result(timeout=10).tolist() == [1]
        assert time.monotonic() - t0 < 2.0  # not the 5 s max wait
        on_the_way[0] = 3  # two more clients: wait for them
        first = batcher.submit([{"a": 1}])
        time.sleep(0.2)
        assert not first.done()
        second = batcher.submit([{"a": 2}])
        time.sleep(0.1)
        assert not second.done()
        third = batcher.submit([{"a": 3}])  # all three in the batch: it goes at once
        assert third.result(timeout=2).tolist() == [3] and first.result(0).tolist() == [1]
    assert fake.calls == [[1], [3]]


def test_server_answers_a_lone_client_without_the_max_wait():
    app = make_app(predictor=FakePredictor(), max_wait_ms=3000, log=lambda s: None)

    async def go(client):
        t0 = time.monotonic()
        for i in range(3):
            r = await client.post("/v1/predict", json={"example": {"a": i}})
            assert (await r.json())["scores"] == [i]
        return time.monotonic() - t0

    assert run_client(app, go) < 2.0


def test_batcher_fails_a_bad_request_alone_and_a_model_error_fails_its_batch():
    fake = FakePredictor(delay=0.05)
    with DynamicBatcher(fake, max_batch=64, max_wait_ms=100) as batcher:
        good1 = batcher.submit([{"a": 1}, {"b": 2}])
        bad = batcher.submit([{"a": 1}, {"zz": 3}])
        good2 = batcher.submit([{"c": 5}])
        assert good1.result(timeout=10).tolist() == [1, 2]
        assert good2.result(timeout=10).tolist() == [5]
        with pytest.raises(RequestError, match="example 1: unknown feature 'zz'"):
            bad.result(timeout=10)
    # The batch parsed as one request fails at its example 3, the bad request's example
    # 1: that request is parsed alone (its own error), the other two together again.
    assert fake.parses == [5, 2, 3]
    assert fake.calls == [[3]]  # one call, for the good requests only
    assert batcher.rejected == 1 and batcher.requests == 2
    with DynamicBatcher(FakePredictor(fail_score=True), max_wait_ms=50) as batcher:
        futures = [batcher.submit([{"a": 1}]) for _ in range(3)]
        for f in futures:
            with pytest.raises(RuntimeError, match="fell over"):
                f.result(timeout=10)
        ok = batcher.swap(FakePredictor("2", offset=10))  # the batcher survives it
        assert ok.version == "1"
        assert batcher.submit([{"a": 1}]).result(timeout=10).tolist() == [11]


def test_batcher_swap_close_and_cancelled_requests():
    old = FakePredictor("1", delay=0.4)
    new = FakePredictor("2", offset=100, delay=0.05)
    batcher = DynamicBatcher(old, max_batch=8, max_wait_ms=0)
    in_flight = batcher.submit([{"a": 1}])
    time.sleep(0.1)  # being scored by the old model
    assert batcher.swap(new) is old
    ahead = batcher.submit([{"a": 2}])  # queued while the old model scores
    time.sleep(0.1)
    assert new.parses == [] and not ahead.done()  # one thread: nothing parsed meanwhile
    cancelled = batcher.submit([{"a": 3}])  # queued too
    assert cancelled.cancel()
    queued = batcher.submit([{"a": 4}])
    assert in_flight.result(timeout=10).tolist() == [1]  # finished on the old model
    assert ahead.result(timeout=10).tolist() == [102]
    assert queued.result(timeout=10).tolist() == [104]
    pending = [batcher.submit([{"b": i}]) for i in range(5)]
    batcher.close()  # what was queued is still scored
    assert [f.result(timeout=0).tolist() for f in pending] == [[100 + i] for i in range(5)]
    with pytest.raises(BatcherClosedError):
        batcher.submit([{"a": 1}])
    assert old.calls == [[1]] and old.parses == [1]
    assert sum(sum(c) for c in new.calls) == 7  # ahead, queued, the 5 pending: not cancelled


def test_batcher_finds_bad_requests_by_halving_when_the_error_names_no_example():
    fake = FakePredictor(delay=0.05)
    fake.plain_errors = True
    requests = [[{"a": i}, {"b": 1}] for i in range(8)]
    requests[2][1] = {"zz": 1}
    requests[5][0] = {"b": "x"}
    with DynamicBatcher(fake, max_batch=64, max_wait_ms=200) as batcher:
        futures = [batcher.submit(r) for r in requests]
        for i, f in enumerate(futures):
            if i == 2:
                with pytest.raises(RequestError, match="^unknown feature 'zz'$"):
                    f.result(timeout=10)
            elif i == 5:
                with pytest.raises(RequestError, match="^feature 'b' must be a number"):
                    f.result(timeout=10)
            else:
                assert f.result(timeout=10).tolist() == [i, 1]
    assert len(fake.calls) == 1 and sum(fake.calls[0]) == 12
    assert batcher.rejected == 2 and batcher.requests == 6


def test_batcher_from_many_threads():
    fake = FakePredictor(delay=0.002)
    rng = random.Random(1)
    requests = [[random_example(rng) for _ in range(rng.randint(1, 3))] for _ in range(400)]
    with DynamicBatcher(fake, max_batch=32, max_wait_ms=1) as batcher:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = list(pool.map(batcher.submit, requests))
        for r, f in zip(requests, futures, strict=True):
            np.testing.assert_array_equal(f.result(timeout=10), [sum(e.values()) for e in r])
    assert max(sum(c) for c in fake.calls) <= 32
    assert batcher.requests == 400 and sum(sum(c) for c in fake.calls) == sum(map(len, requests))


# -- the server ---------------------------------------------------------------------------


def test_predict_body_forms_and_health():
    app = make_app(predictor=FakePredictor("7", offset=0.5), max_wait_ms=1, log=lambda s: None)

    async def go(client):
        out = []
        for body in (
            {"examples": [{"a": 1, "b": 2}, {"c": -4}]},
            {"example": {"a": 3}},
            {"b": 1.25, "c": 1},
            {"examples": []},
        ):
            r = await client.post("/v1/predict", json=body)
            out.append((r.status, await r.json()))
        r = await client.get("/healthz")
        out.append((r.status, await r.json()))
        r = await client.get("/v1/model")
        out.append((r.status, await r.json()))
        return out

    got = run_client(app, go)
    assert got[0] == (200, {"scores": [3.5, -3.5], "model_version": "7"})
    assert got[1] == (200, {"scores": [3.5], "model_version": "7"})
    assert got[2] == (200, {"scores": [2.75], "model_version": "7"})
    assert got[3] == (200, {"scores": [], "model_version": "7"})
    status, health = got[4]
    assert status == 200 and health["status"] == "ok" and health["model_version"] == "7"
    assert health["max_batch"] == 64 and health["task"] == "binary"
    want = {"path": None, "version": "7", "format": "fake", "task": "binary", "last_error": None}
    assert got[5] == (200, want)


BAD_BODIES = [
    (
        b'{"examples": [{"a": 1}',
        400,
        "malformed JSON: Expecting ',' delimiter at line 1 column 23 (char 22)",
    ),
    (
        b'{"examples":\n [{"a": 1,}]}',
        400,
        "malformed JSON: Expecting property name enclosed in double quotes at line 2 column 11",
    ),
    (b"", 400, "empty body"),
    (b'{"a": "\xff"}', 400, "malformed JSON: the body is not UTF-8 (invalid start byte at byte 7)"),
    (b"[" * 100000, 400, "nested too deeply"),
    (b"[1, 2]", 400, "expected a JSON object"),
    (b'{"examples": {"a": 1}}', 400, "'examples' must be an array of objects, got an object"),
    (b'{"examples": [{"a": 1}, 3]}', 400, "examples[1] must be an object, got a number"),
    (b'{"example": [1]}', 400, "'example' must be an object, got an array"),
    (b'{"examples": [], "k": 1}', 400, "unexpected key 'k' beside 'examples'"),
    (b'{"a": 1, "zz": 2}', 400, "example 0: unknown feature 'zz'"),
    (b'{"examples": [{"a": 1}, {"b": "x"}]}', 400, "example 1: feature 'b' must be a number"),
]


@pytest.mark.parametrize("body,status,message", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_bodies_are_answered_with_their_problem_and_the_server_keeps_serving(
    body, status, message
):
    app = make_app(predictor=FakePredictor(), max_wait_ms=0, log=lambda s: None)

    async def go(client):
        r = await client.post(
            "/v1/predict", data=body, headers={"Content-Type": "application/json"}
        )
        bad = (r.status, await r.json())
        r = await client.post("/v1/predict", json={"example": {"a": 2}})
        return bad, (r.status, await r.json())

    (got_status, got), ok = run_client(app, go)
    assert got_status == status and set(got) == {"error"}
    assert message in got["error"]
    assert ok == (200, {"scores": [2.0], "model_version": "1"})


@pytest.mark.parametrize(
    "raw",
    [
        b'{"examples": [{"a": 1, "b": -2.5e-3, "c": "x\\u00e9"}], "n": null}',
        b'{"a": NaN, "b": -Infinity}',  # json's literals, which orjson refuses
        # integers beyond 64 bits, which orjson makes floats
        b'{"a": 1180591620717411303424, "b": 18446744073709551616, "c": -9223372036854775809}',
        '{"a": "\u00e9"}'.encode("utf-16"),
        b'{"a": "\\ud800"}',  # a lone surrogate
        b'{"a": 1, "a": 2}',
    ],
)
def test_request_json_is_parsed_as_json_loads_parses_it(raw):
    """The fast parse (orjson) gives json.loads's value, and json's where orjson refuses."""
    from sparsejax.serving._server import _decode_json

    got, want = _decode_json(raw), json.loads(raw)
    assert repr(got) == repr(want)  # NaN == NaN by repr; the same types


def test_oversized_body_is_413_naming_the_limit_with_or_without_a_content_length():
    app = make_app(predictor=FakePredictor(), max_body_bytes=1000, log=lambda s: None)
    body = json.dumps({"examples": [{"a": 1}] * 200}).encode()  # 1.8 kB
    assert len(body) > 1000

    async def chunks():
        for i in range(0, len(body), 100):
            yield body[i : i + 100]

    async def go(client):
        out = []
        r = await client.post("/v1/predict", data=body)
        out.append((r.status, await r.json()))
        r = await client.post("/v1/predict", data=chunks())  # chunked: no Content-Length
        out.append((r.status, await r.json()))
        r = await client.post("/v1/predict", json={"examples": [{"a": 1}] * 50})  # 0.5 kB
        out.append((r.status, await r.json()))
        r = await client.get("/metrics")
        out.append(await r.text())
        return out

    (s1, e1), (s2, e2), (s3, ok), metrics = run_client(app, go)
    assert s1 == 413 and e1["error"].startswith(f"request body of {len(body)} bytes is over")
    assert "limit of 1000 bytes" in e1["error"]
    assert s2 == 413 and "over the limit of 1000 bytes" in e2["error"]
    assert s3 == 200 and ok["scores"] == [1.0] * 50
    assert 'sparsejax_request_errors_total{endpoint="predict",kind="too_large"} 2.0' in metrics


def test_concurrent_load_with_5_percent_malformed_requests_loses_no_good_request():
    fake = FakePredictor(delay=0.002)
    app = make_app(predictor=fake, max_wait_ms=2, log=lambda s: None)
    rng = random.Random(2)
    bodies = []
    for i in range(400):
        if i % 20 == 7:  # 5%: a mix of malformed JSON, bad structure and a bad feature
            kind = rng.choice(["json", "structure", "feature"])
            raw = {
                "json": b'{"examples": [{"a": 1}',
                "structure": b'{"examples": "a"}',
                "feature": b'{"examples": [{"a": 1}, {"nope": 1}]}',
            }[kind]
            bodies.append((raw, None))
        else:
            examples = [random_example(rng) for _ in range(rng.choice([1, 1, 1, 2, 5]))]
            examples[0]["a"] = i  # every request's scores are its own
            bodies.append((json.dumps({"examples": examples}).encode(), examples))

    async def go(client):
        sem = asyncio.Semaphore(32)

        async def one(raw):
            async with sem:
                r = await client.post("/v1/predict", data=raw)
                return r.status, await r.json()

        return await asyncio.gather(*(one(raw) for raw, _ in bodies))

    answers = run_client(app, go)
    for (raw, examples), (status, got) in zip(bodies, answers, strict=True):
        if examples is None:
            assert status == 400 and got["error"], raw
        else:
            assert status == 200, got
            assert got["scores"] == [float(np.float32(sum(e.values()))) for e in examples]
    assert sum(s == 200 for s, _ in answers) == 380
    batcher = app[SERVER_KEY].batcher
    assert batcher.requests == 380  # every good one scored once
    assert batcher.rejected == sum(b'"nope"' in raw for raw, _ in bodies)  # parse failures
    assert max(sum(c) for c in fake.calls) > 5  # requests were grouped


def test_metrics_text():
    app = make_app(predictor=FakePredictor("v3", delay=0.01), max_wait_ms=20, log=lambda s: None)

    async def go(client):
        rs = await asyncio.gather(
            *(client.post("/v1/predict", json={"examples": [{"a": 1}] * 3}) for _ in range(4))
        )
        assert [r.status for r in rs] == [200] * 4
        r = await client.post("/v1/predict", data=b"{")
        assert r.status == 400
        r = await client.get("/metrics")
        return r.status, r.headers["Content-Type"], await r.text()

    status, ctype, text = run_client(app, go)
    assert status == 200 and ctype.startswith("text/plain")
    lines = set(text.splitlines())
    assert 'sparsejax_requests_total{code="200",endpoint="predict"} 4.0' in lines
    assert 'sparsejax_requests_total{code="400",endpoint="predict"} 1.0' in lines
    assert 'sparsejax_request_errors_total{endpoint="predict",kind="bad_json"} 1.0' in lines
    assert 'sparsejax_request_latency_seconds_count{endpoint="predict"} 5.0' in lines
    assert "sparsejax_predictions_total 12.0" in lines
    assert 'sparsejax_model_info{task="binary",version="v3"} 1.0' in lines
    assert 'sparsejax_model_reloads_total{result="failure"} 0.0' in lines
    n = {line.split()[0]: float(line.split()[1]) for line in lines if line and line[0] != "#"}
    assert n["sparsejax_batch_size_examples_sum"] == 12.0
    assert 1.0 <= n["sparsejax_batch_size_examples_count"] <= 4.0
    assert (
        n['sparsejax_batch_size_requests_bucket{le="4.0"}']
        == n["sparsejax_batch_size_requests_count"]
    )
    assert n['sparsejax_batch_size_examples_bucket{le="2.0"}'] == 0.0


def test_retrieve():
    retrieval = FakePredictor("r1", task="retrieval")
    app = make_app(predictor=retrieval, log=lambda s: None)

    async def go(client):
        out = []
        for body in (
            {"user": {"a": 1}, "k": 3},
            {"user": {"a": -2}},
            {"user": {"a": 1}, "k": 0},
            {"user": [1]},
            {"user": {"zz": 1}},
            {"user": {"a": 1}, "n": 2},
        ):
            r = await client.post("/v1/retrieve", json=body)
            out.append((r.status, await r.json()))
        return out

    got = run_client(app, go)
    assert got[0] == (
        200,
        {"items": [109, 108, 107], "scores": [4.5, 3.5, 2.5], "model_version": "r1"},
    )
    assert got[1][0] == 200 and got[1][1]["items"] == list(range(100, 110))  # k defaults to 10
    assert got[2] == (400, {"error": "'k' must be an integer >= 1, got 0"})
    assert got[3] == (400, {"error": "'user' must be an object of features, got an array"})
    assert got[4] == (400, {"error": "example 0: unknown feature 'zz'"})
    assert got[5][0] == 400 and "unexpected key 'n'" in got[5][1]["error"]

    async def binary(client):
        r = await client.post("/v1/retrieve", json={"user": {"a": 1}})
        return r.status, await r.json()

    status, err = run_client(make_app(predictor=FakePredictor(), log=lambda s: None), binary)
    assert status == 400 and "needs a retrieval (two-tower) model" in err["error"]


def test_hot_reload_of_version_folders_and_a_failed_reload_keeps_the_old_model(tmp_path):
    write_model(tmp_path / "1", version="1")
    write_model(tmp_path / "10", version="10", broken=True)  # the newest, but corrupt
    (tmp_path / "11").mkdir()  # no model.json yet: not a version
    logs = []
    app = make_app(str(tmp_path), loader=load, poll_seconds=None, log=logs.append)
    assert app[SERVER_KEY].predictor.version == "1"  # fell back past the corrupt one
    assert logs == [
        f"sparsejax serve: cannot load {tmp_path / '10'}: {tmp_path / '10'}: "
        "table file emb_0.npy is corrupt"
    ]

    async def go(client):
        async def predict():
            r = await client.post("/v1/predict", json={"example": {"a": 1}})
            return await r.json()

        async def reload():
            r = await client.post("/v1/reload")
            return r.status, await r.json()

        steps = [await predict()]
        r = await client.post("/v1/reload")  # 10 is still broken: a failure, 1 keeps serving
        steps.append((r.status, await r.json()))
        write_model(tmp_path / "12", version="12", offset=1000)
        steps += [await reload(), await predict()]
        write_model(tmp_path / "13", version="13", broken=True)
        steps += [await reload(), await predict()]
        r = await client.post("/v1/reload", json={"path": str(tmp_path / "nowhere")})
        steps += [(r.status, await r.json()), await predict()]
        r = await client.get("/metrics")
        steps.append(await r.text())
        return steps

    steps = run_client(app, go)
    assert steps[0] == {"scores": [1.0], "model_version": "1"}
    assert steps[1][0] == 500 and steps[1][1]["model_version"] == "1"
    assert steps[2] == (200, {"reloaded": True, "model_version": "12", "previous_version": "1"})
    assert steps[3] == {"scores": [1001.0], "model_version": "12"}
    status, failed = steps[4]
    assert status == 500 and failed["reloaded"] is False and failed["model_version"] == "12"
    assert failed["error"] == (
        f"cannot load {tmp_path / '13'}: {tmp_path / '13'}: table file emb_0.npy is corrupt"
    )
    assert steps[5] == {"scores": [1001.0], "model_version": "12"}  # the old one serves
    assert steps[6][0] == 500 and "cannot read the model path" in steps[6][1]["error"]
    assert steps[7] == {"scores": [1001.0], "model_version": "12"}
    assert 'sparsejax_model_reloads_total{result="failure"} 3.0' in steps[8]
    assert 'sparsejax_model_reloads_total{result="success"} 1.0' in steps[8]
    assert 'sparsejax_model_info{task="binary",version="12"} 1.0' in steps[8]
    assert sum("still serving 12" in line for line in logs) == 2


def test_served_version_deleted_falls_back_past_corrupt_ones_to_the_newest_that_loads(tmp_path):
    """As at start-up: once the served version's folder is gone, the next versions are tried
    newest first, each corrupt one logged once, and /healthz says where the served model
    came from and whether that folder is still there."""
    write_model(tmp_path / "1", version="1", offset=1)
    write_model(tmp_path / "2", version="2", broken=True)
    write_model(tmp_path / "3", version="3", broken=True)
    write_model(tmp_path / "4", version="4", offset=4)
    logs = []
    app = make_app(str(tmp_path), loader=load, poll_seconds=None, log=logs.append)
    server = app[SERVER_KEY]

    async def go(client):
        async def health():
            r = await client.get("/healthz")
            h = await r.json()
            return h["model_version"], h["model_dir"], h["model_dir_on_disk"]

        steps = [await health()]
        shutil.rmtree(tmp_path / "4")
        r = await client.post("/v1/reload")
        steps += [(r.status, await r.json()), await health()]
        r = await client.post("/v1/predict", json={"example": {"a": 1}})
        steps.append(await r.json())
        shutil.rmtree(tmp_path / "1")  # now every version left is corrupt
        n_logs = len(logs)
        steps += [await server.check(), await server.check(), await health()]
        steps.append(logs[n_logs:])
        return steps

    steps = run_client(app, go)
    assert steps[0] == ("4", str(tmp_path / "4"), True)
    assert steps[1] == (200, {"reloaded": True, "model_version": "1", "previous_version": "4"})
    assert steps[2] == ("1", str(tmp_path / "1"), True)
    assert steps[3] == {"scores": [2.0], "model_version": "1"}
    failed = [line for line in logs[:-1] if "cannot load" in line]
    assert [line.split(": ")[1] for line in failed] == [
        f"cannot load {tmp_path / v}" for v in ("3", "2")
    ]
    assert failed[0].endswith("; still serving 4 (its folder is gone)")
    assert logs[len(failed)] == f"sparsejax serve: now serving 1 from {tmp_path / '1'} (was 4)"
    # 1 gone too: 1 keeps serving from memory, the corrupt ones are not logged again,
    # and /healthz says that its folder is gone
    assert steps[4]["reloaded"] is False and steps[4]["model_version"] == "1"
    assert steps[5] == {"reloaded": False, "model_version": "1"}
    assert steps[6] == ("1", str(tmp_path / "1"), False)
    assert steps[7] == []


def test_polling_swaps_a_new_version_in_under_load_without_dropping_a_request(tmp_path):
    write_model(tmp_path / "1", version="1", delay=0.002)
    logs = []
    app = make_app(str(tmp_path), loader=load, poll_seconds=0.05, max_wait_ms=1, log=logs.append)

    async def go(client):
        stop = asyncio.Event()
        answers = []

        async def user(u):
            i = 0
            while not stop.is_set():
                i += 1
                r = await client.post("/v1/predict", json={"example": {"a": u * 1000 + i}})
                answers.append((u * 1000 + i, r.status, await r.json()))

        users = [asyncio.create_task(user(u)) for u in range(8)]
        await asyncio.sleep(0.2)
        write_model(tmp_path / "2", version="2", offset=0.5, delay=0.002)
        await asyncio.sleep(0.4)
        write_model(tmp_path / "3", version="3", broken=True)  # fails: 2 keeps serving
        await asyncio.sleep(0.4)
        stop.set()
        await asyncio.gather(*users)
        return answers

    answers = run_client(app, go)
    versions = [got["model_version"] for _, status, got in answers]
    for x, status, got in answers:  # each answer scored by the model it names
        assert status == 200
        assert got["scores"] == [x + (0.5 if got["model_version"] == "2" else 0.0)]
    assert versions[0] == "1" and versions[-1] == "2" and "3" not in versions
    first_2 = versions.index("2")
    assert versions[first_2 + 50 :].count("1") == 0  # one swap
    assert sum("still serving 2" in line for line in logs) == 1  # logged once, not every poll


def test_polling_a_single_model_dir_changed_in_place(tmp_path):
    model = tmp_path / "model"
    write_model(model, version="a")
    logs = []
    app = make_app(str(model), loader=load, poll_seconds=0.05, log=logs.append)

    async def go(client):
        async def version():
            r = await client.post("/v1/predict", json={"example": {"a": 1}})
            return (await r.json())["model_version"]

        async def settle():
            await asyncio.sleep(0.4)  # several polls
            return await version()

        seen = [await version()]
        write_model(model, version="b", broken=True)  # a bad copy over the served one
        seen.append(await settle())
        write_model(model, version="c", offset=1)  # fixed
        seen.append(await settle())
        model.rename(tmp_path / "away")  # gone for a while: keeps serving c
        seen.append(await settle())
        (tmp_path / "away").rename(model)
        seen.append(await settle())
        return seen

    assert run_client(app, go) == ["a", "a", "c", "c", "c"]
    failures = [line for line in logs if "cannot" in line]
    assert len(failures) == 2, logs  # one line each, however many polls
    assert "table file emb_0.npy is corrupt; still serving a" in failures[0]
    assert "cannot read the model path" in failures[1] and "still serving c" in failures[1]
    assert sum("now serving c" in line for line in logs) == 1


def test_serve_stops_on_sigterm_after_finishing_the_requests_in_flight(tmp_path):
    write_model(tmp_path / "m", version="s1", delay=1.0)
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from _serving_fake import load;"
        "from sparsejax.serving._server import serve;"
        "sys.exit(serve(sys.argv[2], port=0, loader=load, poll_seconds=None,"
        " log=lambda s: print(s, flush=True)))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(TESTS), str(tmp_path / "m")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "listening on http://" in line:
                break
        url = lines[-1].split("listening on ")[1].split()[0]
        host, port = url.removeprefix("http://").split(":")

        async def request_then_stop():
            reader, writer = await asyncio.open_connection(host, int(port))
            body = b'{"example": {"a": 4}}'
            writer.write(
                b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            await asyncio.sleep(0.3)  # being scored (1 s)
            proc.send_signal(signal.SIGTERM)
            answer = await asyncio.wait_for(reader.read(), 20)  # until the server closes
            writer.close()
            return answer

        answer = asyncio.run(request_then_stop())
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + proc.stdout.read()
    proc.stdout.close()
    assert answer.startswith(b"HTTP/1.1 200 OK"), answer
    assert answer.endswith(b'{"scores":[4.0],"model_version":"s1"}')
    assert "stopping; finishing the requests in flight" in out and out.rstrip().endswith("stopped")


def test_batcher_swap_while_plain_threads_submit():
    fake = FakePredictor(delay=0.001)
    batcher = DynamicBatcher(fake, max_wait_ms=1)
    results = []

    def worker(k):
        for i in range(50):
            results.append((k, i, batcher.submit([{"a": k, "b": i}]).result(timeout=10)))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.02)
    batcher.swap(FakePredictor("2", offset=0.25, delay=0.001))
    for t in threads:
        t.join()
    batcher.close()
    assert len(results) == 200
    for k, i, scores in results:
        assert scores.tolist() in ([k + i], [k + i + 0.25])


class _Intake:
    """A fake request source for `DynamicBatcher.attach_intake` (the native front's role):
    `put` queues an example with its arrival time; `take` blocks until some are queued,
    `wake` or the timeout; `shut` ends it."""

    def __init__(self, batcher):
        self.batcher = batcher
        self.cond = threading.Condition()
        self.queue, self.woken, self.shut, self.waits = [], False, False, []
        self.answers: dict = {}
        self.delivered = threading.Event()

    def put(self, token, example, arrived):
        with self.cond:
            self.queue.append((token, example, arrived))
            self.cond.notify()

    def take(self, timeout):
        with self.cond:
            self.waits.append(timeout)
            self.cond.wait_for(lambda: self.queue or self.woken or self.shut, timeout)
            got, self.queue, self.woken = self.queue, [], False
            if not got and self.shut:
                return False
        for token, example, arrived in got:
            self.batcher.submit_to([example], token, self.deliver, arrived)
        return True

    def wake(self):
        with self.cond:
            self.woken = True
            self.cond.notify()

    def deliver(self, items):
        for token, result, error in items:
            self.answers[token] = (result[0].tolist(), result[1]) if error is None else error
        self.delivered.set()


def test_batcher_waits_in_an_attached_intake_and_wakes_for_other_requests():
    fake = FakePredictor("v", delay=0.01)
    batcher = DynamicBatcher(fake, max_wait_ms=60_000)  # no batch closes by waiting
    intake = _Intake(batcher)
    batcher.attach_intake(intake.take, intake.wake)
    # requests that arrived long ago are scored at once: the wait counts from `arrived`
    intake.put("a", {"a": 1.0}, time.monotonic() - 120)
    intake.put("b", {"b": 2.0}, time.monotonic() - 120)
    assert intake.delivered.wait(10)
    assert intake.answers == {"a": ([1.0], "v"), "b": ([2.0], "v")}
    assert fake.calls == [[2]]  # the bunch taken together, scored in one call
    assert None in intake.waits  # idle, the worker waited in the intake without a timeout
    # a submit from another thread wakes the worker out of its wait in the intake
    batcher._senders = lambda: 1  # one sender: a batch with its request closes at once
    assert batcher.submit([{"c": 3.0}]).result(timeout=10).tolist() == [3.0]
    # a shut intake: the batcher falls back to its own queue, and close still drains
    with intake.cond:
        intake.shut = True
        intake.cond.notify()
    assert batcher.submit([{"a": 4.0}]).result(timeout=10).tolist() == [4.0]
    pending = batcher.submit([{"a": 5.0}])
    batcher.close(timeout=10)
    assert pending.result(timeout=0).tolist() == [5.0]
