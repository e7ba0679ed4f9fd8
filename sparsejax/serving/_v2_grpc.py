"""The Open Inference Protocol over gRPC (`sparsejax serve --grpc-port`): the service
`inference.GRPCInferenceService` of KServe v2 / Triton, on the HTTP server's event loop
and batcher. A request's tensors (typed `contents`, or `raw_input_contents`) are read
by the same code as the REST API's (`_v2.parse_request`), so both give /v1/predict's
scores; the output is `scores` as raw FP32 bytes. A bad request is INVALID_ARGUMENT, an
unknown model or version NOT_FOUND, each with the REST API's one-line message."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np

from . import _v2 as v2
from ._batching import BatcherClosedError
from ._grpc_messages import SERVICE, message
from ._preprocess import RequestError

_CONTENTS = {  # datatype -> the InferTensorContents field that holds it
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _parameter(p: Any) -> Any:
    return getattr(p, p.WhichOneof("parameter_choice") or "bool_param")


def _as_rest(request: Any) -> tuple[dict, bytes]:
    """A ModelInferRequest as the REST API's request object and its binary tensor data."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise RequestError(
            f"raw_input_contents has {len(raw)} tensors for {len(request.inputs)} inputs"
        )
    tensors = []
    for i, t in enumerate(request.inputs):
        d = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if raw:
            d["parameters"] = {"binary_data_size": len(raw[i])}
        else:
            field = _CONTENTS.get(t.datatype)
            values = [] if field is None else list(getattr(t.contents, field))
            if t.datatype == "BYTES":
                try:
                    values = [v.decode() for v in values]
                except UnicodeDecodeError as e:
                    raise RequestError(
                        f"input {t.name!r}: a BYTES value is not UTF-8 ({e.reason})"
                    ) from None
            d["data"] = values
        tensors.append(d)
    outputs = [
        {"name": o.name, "parameters": {k: _parameter(v) for k, v in o.parameters.items()}}
        for o in request.outputs
    ]
    rest = {"id": request.id or None, "inputs": tensors, "outputs": outputs}
    return rest, b"".join(raw)


class GrpcService:
    """The v2 gRPC methods over a `ModelServer` (its predictor, batcher, model name)."""

    def __init__(self, server: Any):
        self.server = server

    def _model(self, name: str, version: str) -> Any:
        return self.server.v2_model(name, version)

    async def ServerLive(self, request, context):
        return message("ServerLiveResponse")(live=True)

    async def ServerReady(self, request, context):
        return message("ServerReadyResponse")(ready=True)

    async def ModelReady(self, request, context):
        try:
            self._model(request.name, request.version)
        except LookupError:
            return message("ModelReadyResponse")(ready=False)
        return message("ModelReadyResponse")(ready=True)

    async def ServerMetadata(self, request, context):
        return message("ServerMetadataResponse")(**v2.server_metadata())

    async def ModelMetadata(self, request, context):
        try:
            predictor = self._model(request.name, request.version)
        except LookupError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        m = v2.metadata(predictor, self.server.model_name)
        return message("ModelMetadataResponse")(
            name=m["name"],
            versions=m["versions"],
            platform=m["platform"],
            inputs=m["inputs"],
            outputs=m["outputs"],
        )

    async def ModelInfer(self, request, context):
        s = self.server
        s.grpc_calls.enter()  # a batch may wait for the calls in flight (`_senders`)
        try:
            predictor = self._model(request.model_name, request.model_version)
            rest, binary = _as_rest(request)
            examples, answer = v2.parse_request(rest, memoryview(binary), predictor)
            scores, version = await s.batcher.submit_async(examples)
        except LookupError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e).splitlines()[0])
        except BatcherClosedError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            s.grpc_calls.leave()
        scores = np.asarray(scores, "<f4")
        out = message("ModelInferResponse")(
            model_name=s.model_name, model_version=str(version), id=request.id
        )
        out.outputs.add(name=v2.OUTPUT, datatype="FP32", shape=[int(scores.shape[0])])
        out.raw_output_contents.append(scores.tobytes())
        return out

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's methods as one generic handler (no generated stubs needed)."""
        methods = {}
        for name in (
            "ServerLive",
            "ServerReady",
            "ModelReady",
            "ServerMetadata",
            "ModelMetadata",
            "ModelInfer",
        ):
            methods[name] = grpc.unary_unary_rpc_method_handler(
                getattr(self, name),
                request_deserializer=message(f"{name}Request").FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )
        return grpc.method_handlers_generic_handler(SERVICE, methods)


async def start(server: Any, host: str, port: int) -> tuple[Any, int]:
    """A running grpc.aio server of `server`'s model on host:port (0: any free port):
    (the grpc server, the bound port)."""
    g = grpc.aio.server(options=[("grpc.max_receive_message_length", server.max_body_bytes)])
    g.add_generic_rpc_handlers((GrpcService(server).handler(),))
    bound = g.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await g.start()
    return g, bound
