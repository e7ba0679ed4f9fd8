"""The Open Inference Protocol (KServe v2): Triton's own HTTP client (tritonclient),
with binary tensors and with JSON ones, gets the scores /v1/predict gives for the same
examples; the health, server and model metadata endpoints answer as the protocol says;
a wrong datatype, shape, input, output, model or version is a 400 / 404 naming it."""

import asyncio
import contextlib
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest
from _cli import sparsejax_env
from aiohttp import web

from sparsejax import runner
from sparsejax.data import CATEGORICAL_NAMES, DENSE_NAMES
from sparsejax.runner import export_run
from sparsejax.serving import make_app

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

HEADER = "Inference-Header-Content-Length"

NAME = "ctr"


def _criteo_file(path: pathlib.Path, n: int = 400, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        dense = [str(int(rng.integers(0, 500))) for _ in range(13)]
        cats = [f"{int(rng.zipf(1.5)) % (20 + 7 * j) * 7919:08x}" for j in range(26)]
        lines.append("\t".join([str(int(rng.random() < 0.3)), *dense, *cats]))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("v2")
    _criteo_file(tmp / "day.tsv")
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp / 'runs'}",
            "name=v2",
            "data.kind=criteo",
            f"data.path={tmp / 'day.tsv'}",
            "data.train_rows=300",
            "data.batch_size=64",
            "model.embedding_dim=8",
            "model.options={bottom: [16, 8], top: [16, 1]}",
            "progress=false",
            "eval_every=null",
            "steps=5",
        ],
    )
    runner.train(cfg, log=lambda _: None)
    out = tmp / NAME
    export_run(str(tmp / "runs" / "v2"), str(out), buckets=(1, 8), log=lambda _: None)
    return str(out)


@contextlib.contextmanager
def _live(app):
    """`app` served on a free local port from a thread: yields ("host:port", its loop)."""
    loop = asyncio.new_event_loop()
    site_runner = web.AppRunner(app)
    loop.run_until_complete(site_runner.setup())
    site = web.TCPSite(site_runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        host, port = site_runner.addresses[0][:2]
        yield f"{host}:{port}", loop
    finally:
        asyncio.run_coroutine_threadsafe(site_runner.cleanup(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def native(model_dir):
    """`sparsejax serve` of the model with its native HTTP front (which takes v2 infer
    requests, JSON and binary tensors): "host:port"."""
    from sparsejax.serving import _front

    if not _front.available():
        pytest.skip("the C++ extension is not built")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sparsejax",
            "serve",
            model_dir,
            "--port",
            "0",
            "--poll-seconds",
            "0",
            "--name",
            NAME,
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**sparsejax_env(), "SPARSEJAX_SERVE_NATIVE_HTTP": "1"},
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "listening on http://" in line:
            break
    try:
        assert any("on the native HTTP front" in line for line in lines), lines
        yield lines[-1].split("listening on http://")[1].split()[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        proc.stdout.close()


@pytest.fixture(scope="module")
def plain(model_dir):
    """The model's app on aiohttp alone: "host:port"."""
    with _live(make_app(model_dir, poll_seconds=0, log=lambda _: None)) as (url, _):
        yield url


@pytest.fixture(scope="module", params=["aiohttp", "native"])
def server(request):
    """The v2 API of aiohttp alone, and of `serve`'s native front beside it."""
    return request.getfixturevalue("native" if request.param == "native" else "plain")


def _examples(n: int, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ex = {k: int(rng.integers(0, 500)) for k in DENSE_NAMES}
        for j, k in enumerate(CATEGORICAL_NAMES):  # some unseen, some empty
            ex[k] = "" if rng.random() < 0.1 else f"{int(rng.zipf(1.5)) % (25 + 7 * j) * 7919:08x}"
        out.append(ex)
    return out


def _v2_inputs(examples: list[dict], *, binary: bool) -> list:
    inputs = []
    for k in DENSE_NAMES:
        t = httpclient.InferInput(k, [len(examples)], "INT64")
        t.set_data_from_numpy(np.array([ex[k] for ex in examples], np.int64), binary_data=binary)
        inputs.append(t)
    for k in CATEGORICAL_NAMES:
        t = httpclient.InferInput(k, [len(examples)], "BYTES")
        values = np.array([ex[k].encode() for ex in examples], dtype=np.object_)
        t.set_data_from_numpy(values, binary_data=binary)
        inputs.append(t)
    return inputs


def _v1_scores(url: str, examples: list[dict]) -> np.ndarray:
    import json
    import urllib.request

    req = urllib.request.Request(
        f"http://{url}/v1/predict",
        data=json.dumps({"examples": examples}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req) as r:
        return np.asarray(json.load(r)["scores"], np.float32)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_gets_the_json_apis_scores(server, binary):
    client = httpclient.InferenceServerClient(server)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(NAME)
    meta = client.get_model_metadata(NAME)
    assert meta["name"] == NAME and meta["outputs"][0]["name"] == "scores"
    kinds = {i["name"]: i["datatype"] for i in meta["inputs"]}
    assert kinds["I1"] == "INT64" and kinds["C1"] == "BYTES" and len(kinds) == 39
    examples = _examples(11)
    outputs = [httpclient.InferRequestedOutput("scores", binary_data=binary)]
    got = client.infer(NAME, _v2_inputs(examples, binary=binary), outputs=outputs)
    scores = got.as_numpy("scores")
    assert scores.dtype == np.float32 and scores.shape == (11,)
    np.testing.assert_allclose(scores, _v1_scores(server, examples), rtol=0, atol=1e-6)
    assert got.get_response()["model_version"] == client.get_model_metadata(NAME)["versions"][0]
    # no outputs named: binary by the request's default
    again = client.infer(NAME, _v2_inputs(examples, binary=binary)).as_numpy("scores")
    np.testing.assert_array_equal(again, scores)


def test_server_metadata_and_versions(server, model_dir):
    client = httpclient.InferenceServerClient(server)
    meta = client.get_server_metadata()
    assert meta["name"] == "sparsejax" and "binary_tensor_data" in meta["extensions"]
    version = client.get_model_metadata(NAME)["versions"][0]
    assert client.is_model_ready(NAME, model_version=version)
    assert not client.is_model_ready(NAME, model_version="999")
    assert not client.is_model_ready("other")


def _infer_error(server, inputs, outputs=None, name=NAME) -> str:
    client = httpclient.InferenceServerClient(server)
    with pytest.raises(InferenceServerException) as e:
        client.infer(name, inputs, outputs=outputs)
    return str(e.value)


def test_bad_v2_requests_name_the_problem(server):
    ex = _examples(3)
    good = _v2_inputs(ex, binary=False)
    wrong = httpclient.InferInput("C1", [3], "FP32")
    wrong.set_data_from_numpy(np.zeros(3, np.float32))
    assert "input 'C1': datatype 'FP32', expected BYTES" in _infer_error(
        server, [*good[:13], wrong, *good[14:]]
    )
    unknown = httpclient.InferInput("nope", [3], "FP32")
    unknown.set_data_from_numpy(np.zeros(3, np.float32))
    assert "unknown input 'nope'" in _infer_error(server, [*good, unknown])
    short = httpclient.InferInput("I1", [2], "INT64")
    short.set_data_from_numpy(np.zeros(2, np.int64))
    assert (
        "inputs 'I1' and 'I2' differ in examples (the first dimension of the shape): 2 and 3"
        in (_infer_error(server, [short, *good[1:]]))
    )
    out = [httpclient.InferRequestedOutput("logits")]
    assert "unknown output 'logits'" in _infer_error(server, good, out)
    assert "unknown model 'other'; this server serves 'ctr'" in _infer_error(
        server, good, name="other"
    )


def _post_raw(model_dir, path, body: bytes, headers=None):
    from aiohttp.test_utils import TestClient, TestServer

    async def go():
        app = make_app(model_dir, poll_seconds=0, log=lambda _: None)
        async with TestClient(TestServer(app)) as client:
            r = await client.post(path, data=body, headers=headers or {})
            return r.status, await r.json()

    return asyncio.run(go())


def _request(inputs, **extra) -> bytes:
    import json

    return json.dumps({"inputs": inputs, **extra}).encode()


@pytest.mark.parametrize(
    "body, header, status, words",
    [
        (_request([{"name": "I1", "datatype": "INT64", "shape": [2], "data": [1]}]), None, 400,
         "input 'I1': 1 values for shape [2] (2 values)"),
        (_request([{"name": "I1", "datatype": "INT64", "shape": [1], "data": [1.5]}]), None, 400,
         "input 'I1': value 1.5 is not of datatype INT64"),
        (_request([{"name": "I1", "datatype": "INT64", "shape": [2, 3], "data": [0] * 6}]), None,
         400, "input 'I1' is one value an example; got shape [2, 3]"),
        (_request([{"name": "I1", "datatype": "INT64", "shape": [1],
                    "parameters": {"binary_data_size": 8}}]), "99999", 400,
         "Inference-Header-Content-Length is '99999'; the body has"),
        (_request([{"name": "I1", "datatype": "INT64", "shape": [2],
                    "parameters": {"binary_data_size": 16}}]) + b"\0" * 8, "HDR", 400,
         "input 'I1': binary_data_size 16 is more than the 8 bytes left in the body"),
        (_request([{"name": "C1", "datatype": "BYTES", "shape": [1],
                    "parameters": {"binary_data_size": 6}}]) + b"\x09\0\0\0ab", "HDR", 400,
         "input 'C1': binary BYTES data ends early"),
        (_request([{"name": "I1", "datatype": "INT64", "shape": [1], "data": [1]}]) + b"xx",
         "HDR", 400, "2 bytes of binary data belong to no input"),
        (_request([{"name": "I1", "datatype": "FP32", "shape": [1], "data": [1.5]}]), None, 400,
         "input 'I1': datatype 'FP32', expected INT64 (or another integer type)"),
        (b"{not json", None, 400, "malformed JSON in the inference request"),
        (_request([]), None, 400, "the request has no examples"),
    ],
)  # fmt: skip
def test_malformed_v2_bodies_are_400s_naming_why(model_dir, native, body, header, status, words):
    if header == "HDR":  # the JSON part's length
        header = str(body.index(b"}]}") + 3)
    headers = {} if header is None else {"Inference-Header-Content-Length": header}
    got = _post_raw(model_dir, f"/v2/models/{NAME}/infer", body, headers)
    assert got[0] == status and words in got[1]["error"], got
    # the native front answers alike, itself, binary tensors included
    status, answer, by_aiohttp = _post_http(native, f"/v2/models/{NAME}/infer", body, headers)
    assert (status, answer) == got
    assert not by_aiohttp


def test_a_v2_header_the_native_front_does_not_frame_goes_to_aiohttp(model_dir, native):
    """An Inference-Header-Content-Length value longer than any length, or sent twice:
    the connection goes to aiohttp, which answers as it would alone."""
    import http.client
    import json

    body = _request([{"name": "I1", "datatype": "INT64", "shape": [1], "data": [1]}])
    long = "9" * 40
    got = _post_raw(model_dir, f"/v2/models/{NAME}/infer", body, {HEADER: long})
    assert got[0] == 400 and f"{HEADER} is '{long}'" in got[1]["error"], got
    assert _post_http(native, f"/v2/models/{NAME}/infer", body, {HEADER: long}) == (*got, True)
    host, port = native.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:  # twice: aiohttp reads the first
        conn.putrequest("POST", f"/v2/models/{NAME}/infer")
        for value in (str(len(body)), "0"):
            conn.putheader(HEADER, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        answer = json.loads(r.read())
        assert r.status == 200 and "aiohttp" in r.getheader("Server"), answer
    finally:
        conn.close()


def _post_http(address: str, path: str, body: bytes, headers=None) -> tuple[int, dict, bool]:
    """(status, JSON answer, whether aiohttp answered: the native front sends no Server
    header) of a POST to a live server."""
    import http.client
    import json

    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, json.loads(r.read()), "aiohttp" in (r.getheader("Server") or "")
    finally:
        conn.close()


def test_the_native_front_answers_v2_json_as_aiohttp_does(plain, native):
    """Byte for byte, a JSON answer and a binary one (asked for in the JSON request)."""
    import http.client

    ex = _examples(3)
    inputs = [{"name": k, "datatype": "INT64", "shape": [3], "data": [e[k] for e in ex]}
              for k in DENSE_NAMES] + [
              {"name": k, "datatype": "BYTES", "shape": [3], "data": [e[k] for e in ex]}
              for k in CATEGORICAL_NAMES]  # fmt: skip
    answers = {}
    for binary in (False, True):
        body = _request(inputs, id="r1", outputs=[{"name": "scores", "parameters":
                                                    {"binary_data": binary}}])  # fmt: skip
        for address in (plain, native):
            host, port = address.rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("POST", f"/v2/models/{NAME}/infer", body=body)
            r = conn.getresponse()
            kept = ("content-type", "inference-header-content-length")
            head = {k: v for k, v in r.getheaders() if k.lower() in kept}
            answers.setdefault(binary, []).append((r.status, head, r.read()))
            conn.close()
    for binary, got in answers.items():
        assert len({str(a) for a in got}) == 1, got  # the same from both
        status, head, body = got[0]
        assert status == 200
        assert ("Inference-Header-Content-Length" in head) == binary, head
        if binary:
            n = int(head["Inference-Header-Content-Length"])
            scores = np.frombuffer(body[n:], "<f4")
        else:
            import json

            scores = np.asarray(json.loads(body)["outputs"][0]["data"], np.float32)
        np.testing.assert_allclose(scores, _v1_scores(native, ex), rtol=0, atol=1e-6)


def test_another_version_is_a_404(model_dir):
    body = _request([{"name": "I1", "datatype": "INT64", "shape": [1], "data": [1]}])
    status, got = _post_raw(model_dir, f"/v2/models/{NAME}/versions/999/infer", body)
    assert status == 404 and "version '999' is not served" in got["error"]


def test_the_benchs_binary_body_reads_as_its_json_body_and_survives_wrks_script(model_dir):
    """experiments/bench_serving.py's `v2bin` path: its body (binary tensors) gives the
    examples its JSON body gives, and the wrk script carries its bytes exactly (Lua's
    decimal escapes, read back here by Lua's rule)."""
    import importlib.util
    import re

    from sparsejax.serving import Predictor
    from sparsejax.serving import _v2 as v2

    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "_load_tools", root / "experiments" / "_load_tools.py"
    )
    lt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lt)
    p = Predictor.load(model_dir, warmup=False)
    inputs = v2.inputs(p)
    for ex in _examples(3):
        body, n = lt.v2_binary_body(ex, inputs)
        got, how = v2.parse_infer(body, str(n), p)
        assert got == v2.parse_infer(lt.v2_body(ex, inputs), None, p)[0] and how["binary"] is False
        lua = lt._post_lua(body, {HEADER: str(n)})
        assert f'wrk.headers["{HEADER}"] = "{n}"' in lua
        escaped = re.search(r'^wrk\.body = "(.*)"$', lua, re.M).group(1)
        assert bytes(int(d) for d in re.findall(r"\\(\d{1,3})", escaped)) == body
        assert re.fullmatch(r"(\\\d{1,3})*", escaped)
