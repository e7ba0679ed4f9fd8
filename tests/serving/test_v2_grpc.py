"""The Open Inference Protocol over gRPC: Triton's own gRPC client gets the scores
/v1/predict gives (raw and typed tensor contents), the metadata and readiness calls
answer, and a bad request is INVALID_ARGUMENT (an unknown model NOT_FOUND) with the REST
API's message. The compiled proto in `_grpc_messages` matches `proto/`."""

import asyncio
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from test_v2 import NAME, _examples, _live, _v1_scores, model_dir  # noqa: F401

from sparsejax.serving import _grpc_messages, make_app
from sparsejax.serving._server import SERVER_KEY

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from sparsejax.data import CATEGORICAL_NAMES, DENSE_NAMES  # noqa: E402

PROTO = pathlib.Path(__file__).parents[2] / "sparsejax" / "serving" / "proto"


@pytest.fixture(scope="module")
def servers(model_dir):  # noqa: F811
    app = make_app(model_dir, poll_seconds=0, log=lambda _: None)
    with _live(app) as (url, loop):
        port = asyncio.run_coroutine_threadsafe(
            app[SERVER_KEY].start_grpc("127.0.0.1", 0), loop
        ).result(30)
        yield url, f"127.0.0.1:{port}"


def _inputs(examples, *, raw: bool) -> list:
    out = []
    for k in DENSE_NAMES:
        t = grpcclient.InferInput(k, [len(examples)], "INT64")
        values = np.array([ex[k] for ex in examples], np.int64)
        if raw:
            t.set_data_from_numpy(values)
        else:  # typed contents
            t._input.contents.int64_contents.extend(values.tolist())
        out.append(t)
    for k in CATEGORICAL_NAMES:
        t = grpcclient.InferInput(k, [len(examples)], "BYTES")
        values = np.array([ex[k].encode() for ex in examples], dtype=np.object_)
        if raw:
            t.set_data_from_numpy(values)
        else:
            t._input.contents.bytes_contents.extend(values.tolist())
        out.append(t)
    return out


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "contents"])
def test_triton_grpc_client_gets_the_json_apis_scores(servers, raw):
    url, grpc_url = servers
    client = grpcclient.InferenceServerClient(grpc_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(NAME) and not client.is_model_ready("other")
    meta = client.get_model_metadata(NAME, as_json=True)
    assert meta["name"] == NAME and len(meta["inputs"]) == 39
    assert client.get_server_metadata(as_json=True)["name"] == "sparsejax"
    examples = _examples(9, seed=3)
    got = client.infer(NAME, _inputs(examples, raw=raw))
    scores = got.as_numpy("scores")
    assert scores.dtype == np.float32 and scores.shape == (9,)
    np.testing.assert_allclose(scores, _v1_scores(url, examples), rtol=0, atol=1e-6)
    assert got.get_response().model_version == meta["versions"][0]


def test_bad_grpc_requests_name_the_problem(servers):
    _, grpc_url = servers
    client = grpcclient.InferenceServerClient(grpc_url)
    wrong = grpcclient.InferInput("C1", [2], "FP32")
    wrong.set_data_from_numpy(np.zeros(2, np.float32))
    with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT") as e:
        client.infer(NAME, [wrong])
    assert "input 'C1': datatype 'FP32', expected BYTES" in str(e.value)
    ok = grpcclient.InferInput("I1", [1], "INT64")
    ok.set_data_from_numpy(np.zeros(1, np.int64))
    with pytest.raises(InferenceServerException, match="NOT_FOUND") as e:
        client.infer("other", [ok])
    assert "unknown model 'other'; this server serves 'ctr'" in str(e.value)


def test_compiled_proto_is_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools")
    from google.protobuf import descriptor_pb2

    out = tmp_path / "set.pb"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}", f"--descriptor_set_out={out}",
         str(PROTO / "open_inference.proto")],
        check=True,
    )  # fmt: skip
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]

    def strip(messages):  # python code generators leave out the fields' JSON names
        for m in messages:
            for f in m.field:
                f.ClearField("json_name")
            strip(m.nested_type)

    strip(compiled.message_type)
    assert compiled == descriptor_pb2.FileDescriptorProto.FromString(_grpc_messages._DESCRIPTOR), (
        "sparsejax/serving/_grpc_messages.py is out of date: put the new proto's serialized "
        "FileDescriptorProto in _DESCRIPTOR"
    )


def test_a_batch_waits_for_as_many_grpc_calls_as_were_lately_in_flight():
    """gRPC clients keep several calls in flight on one connection: the batcher's count
    of senders is the most calls in flight at once over the last second or two."""
    from sparsejax.serving import _server

    now = [100.0]
    calls = _server.InFlight(window_s=1.0, clock=lambda: now[0])
    for _ in range(3):
        calls.enter()
    calls.leave()
    assert calls.now == 2 and calls.recent_peak() == 3
    for _ in range(2):
        calls.leave()
    now[0] += 1.5  # the next window: the one before still counts
    assert calls.recent_peak() == 3
    now[0] += 1.0
    assert calls.recent_peak() == 0  # two windows with no call
    calls.enter()
    assert calls.recent_peak() == 1
