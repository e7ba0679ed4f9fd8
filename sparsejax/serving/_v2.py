"""The Open Inference Protocol (KServe v2, as Triton speaks it) over HTTP/REST, beside
the JSON API: what a v2 request's tensors mean for this model, and the answers.

A model's inputs are its raw features, one tensor each, named as in /v1/predict: dense
values FP32 (Criteo's integer fields INT64), ids INT64 (synthetic data) or BYTES (the
raw strings of Criteo and delimited files). A tensor's first dimension is the examples;
a second one gives each example several values (multi-valued features; 1 for the
others). A feature left out is missing in every example, as in the JSON API. The output
is `scores`, FP32 [n]: the same numbers /v1/predict answers, from the same batcher.

Tensor data comes as JSON (`data`, flat or nested in row-major order) or, with the
binary tensor data extension, as raw little-endian bytes after the JSON header
(`Inference-Header-Content-Length`; BYTES elements each a 4-byte length then the bytes).
The output is binary when the request asks (`binary_data_output`, or `binary_data` on
the output). Anything wrong (an unknown input or output, a wrong datatype or shape,
data of the wrong size) is a `RequestError` naming it: a 400.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._version import __version__
from ._json import loads
from ._preprocess import RequestError

HEADER_LENGTH = "Inference-Header-Content-Length"
OUTPUT = "scores"
_NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
_INTS = {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
_OTHER_TYPES = {  # what else `_ACCEPTED` takes, in an error message
    "FP32": " (or another integer or float type)",
    "INT64": " (or another integer type)",
    "BYTES": "",
}
_ACCEPTED = {  # an input's declared datatype -> the datatypes a request may send it in
    "FP32": {"FP16", "FP32", "FP64", *_INTS},
    "INT64": _INTS,
    "BYTES": {"BYTES"},
}


def inputs(predictor: Any) -> list[dict]:
    """The model's v2 inputs: `{"name", "datatype", "shape"}` per raw feature."""
    p = predictor.preprocessor
    dense = "INT64" if p.kind == "criteo" else "FP32"
    sparse = "INT64" if p.kind == "ids" else "BYTES"
    return [
        *({"name": n, "datatype": dense, "shape": [-1]} for n in p.dense),
        *({"name": n, "datatype": sparse, "shape": [-1]} for n in p.sparse),
    ]


def server_metadata() -> dict:
    """The server metadata answer (GET /v2, gRPC ServerMetadata)."""
    return {"name": "sparsejax", "version": __version__, "extensions": ["binary_tensor_data"]}


def metadata(predictor: Any, name: str) -> dict:
    """The model metadata answer (GET /v2/models/{name})."""
    return {
        "name": name,
        "versions": [str(predictor.version)],
        "platform": "sparsejax",
        "inputs": inputs(predictor),
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1]}],
    }


def _flat(data: Any, name: str) -> list:
    """A JSON tensor's `data`, flattened (row-major)."""
    if not isinstance(data, list):
        raise RequestError(f"input {name!r}: 'data' must be an array, got {type(data).__name__}")
    if any(isinstance(x, list) for x in data):
        out: list = []
        for x in data:
            out.extend(_flat(x, name) if isinstance(x, list) else [x])
        return out
    return data


def _bytes_elements(raw: bytes, count: int, name: str) -> list[bytes]:
    """`count` BYTES elements of the binary extension: a 4-byte length, then the bytes."""
    out, at = [], 0
    for _ in range(count):
        if at + 4 > len(raw):
            raise RequestError(f"input {name!r}: binary BYTES data ends early")
        (k,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + k > len(raw):
            raise RequestError(f"input {name!r}: binary BYTES data ends early")
        out.append(raw[at : at + k])
        at += k
    if at != len(raw):
        raise RequestError(f"input {name!r}: {len(raw) - at} bytes after its {count} elements")
    return out


def _values(t: Mapping, binary: memoryview, at: int, want: str) -> tuple[list, int]:
    """A request tensor's values as Python scalars (row-major) and where the binary
    data of the next tensor starts."""
    name, datatype, shape = t["name"], t.get("datatype"), t.get("shape")
    if datatype not in _ACCEPTED[want]:
        raise RequestError(
            f"input {name!r}: datatype {datatype!r}, expected {want}" + _OTHER_TYPES[want]
        )
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= 2
        or any(type(d) is not int or d < 0 for d in shape)
    ):
        raise RequestError(
            f"input {name!r}: shape {shape!r}; expected [examples] or [examples, values]"
        )
    count = math.prod(shape)
    size = (t.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0 or at + size > len(binary):
            raise RequestError(
                f"input {name!r}: binary_data_size {size!r} is more than the "
                f"{len(binary) - at} bytes left in the body"
            )
        raw = bytes(binary[at : at + size])
        at += size
        if datatype == "BYTES":
            values: list = _bytes_elements(raw, count, name)
        else:
            dtype = np.dtype(_NUMPY[datatype]).newbyteorder("<")
            if size != count * dtype.itemsize:
                raise RequestError(
                    f"input {name!r}: {size} bytes of binary data for shape {shape} of "
                    f"{datatype} ({count * dtype.itemsize} bytes)"
                )
            values = np.frombuffer(raw, dtype).tolist()
    else:
        if "data" not in t:
            raise RequestError(f"input {name!r} has neither 'data' nor binary_data_size")
        values = _flat(t["data"], name)
        if len(values) != count:
            raise RequestError(
                f"input {name!r}: {len(values)} values for shape {shape} ({count} values)"
            )
        ok = (str,) if datatype == "BYTES" else (int, float, bool)
        for v in values:
            if type(v) not in ok or (datatype in _INTS and type(v) is not int):
                raise RequestError(f"input {name!r}: value {v!r} is not of datatype {datatype}")
    if datatype == "BYTES":
        try:
            values = [v.decode() if isinstance(v, bytes) else v for v in values]
        except UnicodeDecodeError as e:
            raise RequestError(f"input {name!r}: a BYTES value is not UTF-8 ({e.reason})") from None
    elif datatype in ("FP16", "FP32", "FP64") and want == "FP32":
        values = [float(v) for v in values]
    return values, at


def parse_infer(body: bytes, header_length: str | None, predictor: Any) -> tuple[list, dict]:
    """A v2 infer request body (REST) -> (examples for the predictor, how to answer:
    {"id", "binary"})."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            n = -1
        if not 0 <= n <= len(body):
            raise RequestError(
                f"{HEADER_LENGTH} is {header_length!r}; the body has {len(body)} bytes"
            )
    else:
        n = len(body)
    try:
        request = loads(body[:n])
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON in the inference request: {e}") from None
    return parse_request(request, memoryview(body)[n:], predictor)


def parse_request(request: Any, binary: memoryview, predictor: Any) -> tuple[list, dict]:
    """A v2 infer request (the JSON header's object; `binary`, the tensor bytes after
    it) -> (examples, {"id", "binary"}); REST and gRPC requests both come here."""
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise RequestError("expected a JSON object with an 'inputs' array")
    declared = {i["name"]: i["datatype"] for i in inputs(predictor)}
    at = 0
    columns: dict[str, list] = {}
    examples = None
    for t in request["inputs"]:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise RequestError("each input must be an object with a 'name'")
        name = t["name"]
        if name not in declared:
            raise RequestError(
                f"unknown input {name!r} (the model's inputs: {', '.join(declared)})"
            )
        if name in columns:
            raise RequestError(f"input {name!r} is given twice")
        values, at = _values(t, binary, at, declared[name])
        rows = t["shape"][0]
        if examples is not None and rows != examples:
            first = next(iter(columns))
            raise RequestError(
                f"inputs {first!r} and {name!r} differ in examples (the first dimension of "
                f"the shape): {examples} and {rows}"
            )
        examples = rows
        per = t["shape"][1] if len(t["shape"]) == 2 else 1
        if per == 1:
            columns[name] = values
        elif name in predictor.preprocessor.dense:
            raise RequestError(f"input {name!r} is one value an example; got shape {t['shape']}")
        else:  # several ids an example
            columns[name] = [values[i * per : (i + 1) * per] for i in range(rows)]
    if at != len(binary):
        raise RequestError(f"{len(binary) - at} bytes of binary data belong to no input")
    if not examples:
        raise RequestError("the request has no examples (no input, or inputs of 0 examples)")
    params = request.get("parameters") or {}
    binary_out = bool(params.get("binary_data_output", False))
    for o in request.get("outputs") or []:
        if not isinstance(o, dict) or o.get("name") != OUTPUT:
            got = o.get("name") if isinstance(o, dict) else o
            raise RequestError(f"unknown output {got!r} (the model's output: {OUTPUT!r})")
        binary_out = bool((o.get("parameters") or {}).get("binary_data", binary_out))
    rows = [{} for _ in range(examples)]
    for name, values in columns.items():
        for ex, v in zip(rows, values, strict=True):
            ex[name] = v
    return rows, {"id": request.get("id"), "binary": binary_out}


def infer_response(
    scores: np.ndarray, *, name: str, version: str, id: Any, binary: bool
) -> tuple[bytes, dict]:
    """A v2 infer answer: (body, headers)."""
    scores = np.asarray(scores, "<f4")
    out: dict = {"name": OUTPUT, "datatype": "FP32", "shape": [int(scores.shape[0])]}
    if binary:
        out["parameters"] = {"binary_data_size": scores.nbytes}
    else:
        out["data"] = scores.tolist()
    answer = {"model_name": name, "model_version": str(version), "outputs": [out]}
    if id is not None:
        answer["id"] = id
    text = json.dumps(answer, separators=(",", ":")).encode()
    if not binary:
        return text, {"Content-Type": "application/json"}
    return text + scores.tobytes(), {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH: str(len(text)),
    }
