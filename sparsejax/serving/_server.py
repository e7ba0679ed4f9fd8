"""The HTTP prediction server behind `sparsejax serve MODEL_PATH` (aiohttp).

Endpoints (JSON in and out; every error is `{"error": "<one line>"}`):

  POST /v1/predict   {"examples": [{feature: value, ...}, ...]}, {"example": {...}} or a
                     bare object of one example's features
                     -> {"scores": [p, ...], "model_version": "..."}
  POST /v1/retrieve  {"user": {feature: value, ...}, "k": 10} (two-tower models)
                     -> {"items": [raw item id, ...], "scores": [...], "model_version": "..."}
  GET  /healthz      -> {"status": "ok", "model_version": ..., "task": ..., "model_dir": the
                     folder the served model came from, "model_dir_on_disk": bool, ...}
  GET  /v1/model     -> the model's info (path, version, format, quantization, features)
  GET  /metrics      Prometheus text: requests by endpoint and code, errors by kind,
                     latency histograms, batch sizes, model calls, model version, reloads
  POST /v1/reload    check the model path now (empty body), or switch to another model
                     path ({"path": "/models/ctr"}) -> {"reloaded": bool, "model_version": ...}

The Open Inference Protocol (KServe v2, `_v2`; the model's name is `model_name`):

  GET  /v2, /v2/health/live, /v2/health/ready
  GET  /v2/models/{name}[/versions/{v}]          metadata: inputs (the raw features), output
  GET  /v2/models/{name}[/versions/{v}]/ready
  POST /v2/models/{name}[/versions/{v}]/infer    tensors in (JSON or the binary tensor
                     extension), "scores" out: the numbers /v1/predict gives

Status codes: 400 for a malformed body (the JSON parser's message with its line and
column), a request the model refuses (`RequestError`: unknown feature, wrong type, ...)
or /v1/retrieve on a binary model; 413 for a body over `max_body_bytes`; 500 for a model
or server fault (logged); 503 while shutting down. A bad request fails alone: the others
of its batch are scored.

Predictions go through a `DynamicBatcher`: the handler queues the request and awaits its
future, so the event loop parses HTTP and JSON while the batcher's thread runs the model.

Model path: a model dir (has model.json) or a folder of numbered version subfolders
(`1/`, `2/`, ...; the highest with a model.json is served). Every `poll_seconds` the
path is checked: a newer version (or the served dir's files changing) is loaded and
warmed up in a background thread, then swapped into the batcher; requests in flight
finish on the old model, none is dropped. A load that fails keeps the old model serving,
logs one line and counts `sparsejax_model_reloads_total{result="failure"}`; that version
is not tried again until its files change. When the served version's folder is gone
(removed, say), the newest version that loads is served, as at start-up: each one that
fails is logged once and skipped; if none loads, the old model keeps serving and /healthz
says `"model_dir_on_disk": false`. Write a version under a temporary name and rename it
into place, so the server never sees half a model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import prometheus_client as prom
from aiohttp import web

from . import _front
from . import _v2 as v2
from ._batching import BatcherClosedError, DynamicBatcher
from ._delta import DeltaError, delta_dirs
from ._json import loads as _loads
from ._predictor import ModelLoadError, Predictor, RequestError
from ._workers import WARM_UP_ENV

__all__ = ["ModelServer", "make_app", "serve", "SERVER_KEY"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
_JSON_TYPES.update({int: "a number", float: "a number", type(None): "null"})


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class _HttpError(Exception):
    """A request the server answers with `status` and `{"error": message}`."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


def _json_bytes(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def _json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


def _json(payload: Any, status: int = 200) -> web.Response:
    return _json_response(_json_bytes(payload), status)


def _predict_answer(scores: Any, version: str) -> bytes:
    """The body of a /v1/predict answer (`scores` an array, or a list)."""
    scores = scores.tolist() if hasattr(scores, "tolist") else list(scores)
    return _json_bytes({"scores": scores, "model_version": version})


def _decode_json(raw: bytes, *, empty_ok: bool = False) -> Any:
    """A request's JSON body; `_HttpError` 400 naming what is wrong with it."""
    if not raw.strip():
        if empty_ok:
            return None
        raise _HttpError(400, "bad_json", "empty body: expected a JSON object")
    try:
        return _loads(raw)
    except json.JSONDecodeError as e:
        raise _HttpError(
            400,
            "bad_json",
            f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})",
        ) from None
    except UnicodeDecodeError as e:
        raise _HttpError(
            400,
            "bad_json",
            f"malformed JSON: the body is not UTF-8 ({e.reason} at byte {e.start})",
        ) from None
    except RecursionError:
        raise _HttpError(400, "bad_json", "malformed JSON: nested too deeply") from None


def _examples(body: Any) -> list:
    """The list of examples of a /v1/predict body (see the module docstring)."""
    if not isinstance(body, dict):
        raise _HttpError(
            400,
            "bad_request",
            f'expected a JSON object ({{"examples": [...]}}, {{"example": {{...}}}} or one '
            f"example's features), got {_json_type(body)}",
        )
    if "examples" in body or "example" in body:
        key = "examples" if "examples" in body else "example"
        extra = sorted(k for k in body if k != key)
        if extra:
            raise _HttpError(
                400, "bad_request", f"unexpected key {extra[0]!r} beside {key!r} in the body"
            )
        value = body[key]
        if key == "example":
            if not isinstance(value, dict):
                raise _HttpError(
                    400, "bad_request", f"'example' must be an object, got {_json_type(value)}"
                )
            return [value]
        if not isinstance(value, list):
            raise _HttpError(
                400,
                "bad_request",
                f"'examples' must be an array of objects, got {_json_type(value)}",
            )
        for i, ex in enumerate(value):
            if type(ex) is not dict:
                raise _HttpError(
                    400, "bad_request", f"examples[{i}] must be an object, got {_json_type(ex)}"
                )
        return value
    return [body]


def _plain(values: Any) -> list:
    """Raw item ids as JSON values (numpy scalars to Python ones)."""
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    return [v.item() if hasattr(v, "item") else v for v in values]


def _candidates(source: str) -> list[str]:
    """The model dirs `source` offers, the one to serve first: `source` itself if it
    holds model.json, else its numbered subfolders that hold one, highest first."""
    if os.path.isfile(os.path.join(source, "model.json")):
        return [source]
    try:
        names = os.listdir(source)
    except OSError as e:
        raise ModelLoadError(f"cannot read the model path {source}: {e.strerror}") from None
    versions = sorted(
        (int(n), n)
        for n in names
        if n.isdigit() and os.path.isfile(os.path.join(source, n, "model.json"))
    )
    if not versions:
        raise ModelLoadError(
            f"{source} is neither a model dir (no model.json) nor a folder of numbered "
            "version subfolders holding one (1/, 2/, ...)"
        )
    return [os.path.join(source, n) for _, n in reversed(versions)]


def _release(old: Any, new: Any) -> None:
    """Free what the replaced predictor held in the workers' shared memory."""
    release = getattr(old, "release_shared", None)
    if release is not None:
        release(new)


def return_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc's `malloc_trim`); False where
    the C library has none. A model's load and warm-up compile leave ~75 MiB of freed
    heap that glibc keeps mapped: each `--workers` worker would hold it as its own."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def _age(predictor: Any) -> float | None:
    """Seconds since the served version was published (None: unknown)."""
    created = getattr(predictor, "created", None)
    return None if created is None else round(time.time() - created, 3)


def _signature(model_dir: str) -> tuple | None:
    """What changes when a model dir's files are replaced: name, size and mtime of each
    entry (and of the dir). None if it cannot be read."""
    try:
        with os.scandir(model_dir) as it:
            entries = []
            for e in it:
                st = e.stat()
                entries.append((e.name, st.st_size, st.st_mtime_ns))
        return (os.stat(model_dir).st_mtime_ns, tuple(sorted(entries)))
    except OSError:
        return None


class _Metrics:
    """The server's Prometheus metrics, in a registry of its own (several apps in one
    process, as in the tests, do not share counters)."""

    def __init__(self) -> None:
        r = self.registry = prom.CollectorRegistry(auto_describe=True)
        self.requests = prom.Counter(
            "sparsejax_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "code"],
            registry=r,
        )
        self.errors = prom.Counter(
            "sparsejax_request_errors",
            "Requests answered with an error, by endpoint and kind (bad_json, too_large, "
            "bad_request, model_error, unavailable, internal)",
            ["endpoint", "kind"],
            registry=r,
        )
        self.latency = prom.Histogram(
            "sparsejax_request_latency_seconds",
            "Seconds from a request's handler start to its answer, by endpoint",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_examples = prom.Histogram(
            "sparsejax_batch_size_examples",
            "Examples per model call (the dynamic batch size)",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.batch_requests = prom.Histogram(
            "sparsejax_batch_size_requests",
            "Requests per model call",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.model_seconds = prom.Histogram(
            "sparsejax_model_call_seconds",
            "Seconds per model call (score of one batch)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.predictions = prom.Counter("sparsejax_predictions", "Examples scored", registry=r)
        self.model = prom.Gauge(
            "sparsejax_model_info",
            "The model being served (1 for its version and task)",
            ["version", "task"],
            registry=r,
        )
        self.reloads = prom.Counter(
            "sparsejax_model_reloads",
            "Model loads after start-up, by result (success, failure)",
            ["result"],
            registry=r,
        )
        self.reloads.labels("success")
        self.reloads.labels("failure")
        self.deltas = prom.Counter(
            "sparsejax_model_deltas",
            "Published deltas, by result (applied, refused)",
            ["result"],
            registry=r,
        )
        self.deltas.labels("applied")
        self.deltas.labels("refused")
        self.version_created = prom.Gauge(
            "sparsejax_model_version_created_seconds",
            "When the served version was published (Unix time; its age is now minus this)",
            registry=r,
        )
        self._children: dict = {}

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        key = (endpoint, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = (
                self.requests.labels(endpoint, str(status)),
                self.latency.labels(endpoint),
            )
        child[0].inc()
        child[1].observe(seconds)

    def on_batch(self, examples: int, requests: int, seconds: float) -> None:
        """The batcher's per-batch hook (runs in its worker thread)."""
        self.batch_examples.observe(examples)
        self.batch_requests.observe(requests)
        self.model_seconds.observe(seconds)
        self.predictions.inc(examples)

    def serving(self, predictor: Any) -> None:
        self.model.clear()
        self.model.labels(str(predictor.version), str(predictor.task)).set(1)
        created = getattr(predictor, "created", None)
        if created is not None:
            self.version_created.set(created)


class InFlight:
    """Calls in flight (`enter`/`leave`) and the most at once over the last one to two
    `window_s` (`recent_peak`): the senders of a protocol whose clients keep several
    calls in flight on one connection."""

    def __init__(self, window_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.window_s, self._clock = window_s, clock
        self.now = 0
        self._peaks = [0, 0]  # this window's, the one before's
        self._since = clock()
        self._lock = threading.Lock()  # the event loop enters, the batcher reads

    def _roll(self) -> None:
        t = self._clock()
        if t - self._since >= self.window_s:
            before = self._peaks[0] if t - self._since < 2 * self.window_s else 0
            self._peaks, self._since = [self.now, before], t

    def enter(self) -> None:
        with self._lock:
            self._roll()
            self.now += 1
            self._peaks[0] = max(self._peaks[0], self.now)

    def leave(self) -> None:
        with self._lock:
            self.now -= 1

    def recent_peak(self) -> int:
        with self._lock:
            self._roll()
            return max(self._peaks)


class ModelServer:
    """The state behind the HTTP app: the model path, the batcher, metrics and reloads.

    Loads the model path's best model at construction (see the module docstring; the
    newest version that loads, each failure logged); raises `ModelLoadError` if none
    loads. `make_app` builds one and wires it into an aiohttp app (`app[SERVER_KEY]`).
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        predictor: Any = None,
        loader: Callable[[str], Any] | None = None,
        max_batch: int | None = None,
        max_wait_ms: float = 2.0,
        max_body_bytes: int = 1 << 20,
        poll_seconds: float | None = 2.0,
        model_name: str | None = None,
        log: Callable[[str], Any] = print,
    ):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if poll_seconds is not None and not poll_seconds >= 0:
            raise ValueError(
                f"poll_seconds must be >= 0 (0 or None: no polling), got {poll_seconds}"
            )
        poll_seconds = poll_seconds or None
        if loader is None:

            def loader(model_dir: str) -> Any:
                predictor = Predictor.load(model_dir, warmup=True)
                return_free_heap()  # what the warm-up compile freed
                return predictor

        self.loader = loader
        self.max_body_bytes = int(max_body_bytes)
        self.poll_seconds = poll_seconds
        self.log = log
        self.metrics = _Metrics()
        self.source = None if model_path is None else os.fspath(model_path)
        self.model_name = model_name or (
            os.path.basename(os.path.abspath(self.source)) if self.source else "model"
        )
        self.model_dir: str | None = None  # the dir the served model came from
        self._signature: tuple | None = None
        self._failed: dict[str, Any] = {}  # dir -> its signature when its load failed
        self._unreadable: dict[str, str] = {}  # model path -> why it could not be listed
        self._last_error = ("", 0.0)
        self.last_error: dict | None = None  # the last refused load or delta (/v1/model)
        self.started = time.time()
        self.connections: Callable[[], int] | None = None  # open connections (`attach`)
        self.grpc_calls = InFlight()  # v2 gRPC calls (`_v2_grpc`)
        if predictor is None:
            if self.source is None:
                raise ValueError("give a model path or a predictor")
            predictor = self._load_first()
        self.batcher = DynamicBatcher(
            predictor,
            max_batch=max_batch,
            max_wait_ms=max_wait_ms,
            on_batch=self.metrics.on_batch,
            senders=self._senders,
        )
        self.metrics.serving(predictor)
        # Model loads (and warm-up compiles) and retrieval run in threads of their own,
        # never in the event loop, and a slow load does not hold up retrieval.
        self._load_pool = concurrent.futures.ThreadPoolExecutor(1, "sparsejax-load")
        self._retrieve_pool = concurrent.futures.ThreadPoolExecutor(1, "sparsejax-retrieve")
        self._reload_lock: asyncio.Lock | None = None
        self._poll_task: asyncio.Task | None = None
        self._grpc: Any = None  # the v2 gRPC server (start_grpc)

    @property
    def predictor(self) -> Any:
        return self.batcher.predictor

    def attach(self, runner: web.BaseRunner, front: Any = None) -> None:
        """Tell the batcher how many client connections `runner` (set up) and the native
        `front` have open, so a batch stops waiting once every one of them has a request
        in it (`serve` does this; a test server's runner can be attached the same way)."""
        server = runner.server
        if front is None:
            self.connections = lambda: len(server.connections)
        else:
            self.connections = lambda: len(server.connections) + front.connections()

    def _on_disk(self) -> bool | None:
        """Whether the served model's dir still holds its model.json (None: no dir, the
        predictor was given)."""
        if self.model_dir is None:
            return None
        return os.path.isfile(os.path.join(self.model_dir, "model.json"))

    def _senders(self) -> int:
        """How many requests could join a batch: one per open HTTP connection, and the
        most gRPC calls in flight at once lately (HTTP/2 carries many a connection)."""
        connections = self.connections
        if connections is None:
            return sys.maxsize
        return connections() + self.grpc_calls.recent_peak()

    def _load_first(self) -> Any:
        dirs = _candidates(self.source)
        first_error = None
        for d in dirs:
            sig = _signature(d)
            try:
                predictor = self.loader(d)
            except Exception as e:
                self._failed[d] = sig
                first_error = first_error or e
                self.log(f"sparsejax serve: cannot load {d}: {_one_line(e)}")
                continue
            self.model_dir, self._signature = d, sig
            return predictor
        if len(dirs) == 1 and isinstance(first_error, ModelLoadError):
            raise first_error
        raise ModelLoadError(
            f"no model in {self.source} could be loaded (the newest: {_one_line(first_error)})"
        )

    # -- reloads ------------------------------------------------------------------------

    async def check(self, path: str | None = None, *, retry_failed: bool = False) -> dict:
        """Load and swap in the model `path` (default: the current model path) offers if
        it differs from the one served. Returns {"reloaded", "model_version", and
        "error" if a load failed (the old model keeps serving)}."""
        if self._reload_lock is None:
            self._reload_lock = asyncio.Lock()
        async with self._reload_lock:
            source = self.source if path is None else os.fspath(path)
            current = self.predictor
            try:
                dirs = _candidates(source)
            except ModelLoadError as e:
                if not retry_failed and self._unreadable.get(source) == str(e):
                    return {"reloaded": False, "model_version": current.version}
                self._unreadable[source] = str(e)
                return self._failure(source, None, e, current)
            self._unreadable.pop(source, None)  # readable again: a later failure is logged
            # The served dir gone (or another path): as at start-up, the newest that loads,
            # past failing ones. Else the newest, if newer than the served one.
            fall_back = self.model_dir not in dirs
            first_failure = None
            for d in dirs:  # the newest first; older than the served one only if it is gone
                sig = _signature(d)
                failed = not retry_failed and d in self._failed and self._failed[d] == sig
                if d == self.model_dir and (sig == self._signature or failed):
                    self.source = source  # unchanged, or its change failed to load before
                    return await self._follow_deltas(source, current)
                if failed:
                    continue  # failed before and unchanged since
                loop = asyncio.get_running_loop()
                try:
                    predictor = await loop.run_in_executor(self._load_pool, self.loader, d)
                except Exception as e:
                    failure = self._failure(d, sig, e, current)
                    if not fall_back:
                        return failure
                    first_failure = first_failure or failure
                    continue
                self._failed.pop(d, None)
                self.batcher.swap(predictor)
                _release(current, predictor)
                self.source, self.model_dir, self._signature = source, d, sig
                self.metrics.serving(predictor)
                self.metrics.reloads.labels("success").inc()
                self.log(
                    f"sparsejax serve: now serving {predictor.version} from {d} "
                    f"(was {current.version})"
                )
                return {
                    "reloaded": True,
                    "model_version": predictor.version,
                    "previous_version": current.version,
                }
            return first_failure or {"reloaded": False, "model_version": current.version}

    async def _follow_deltas(self, source: str, current: Any) -> dict:
        """Apply the publish folder's deltas that follow the served version, in order:
        `<v+1>.delta` on version v (one that arrives before its base waits for it). Each
        is applied off the event loop and swapped in at once; a refused one is logged
        and counted, and the served version stays (`_failure`)."""
        result = {"reloaded": False, "model_version": current.version}
        deltas = delta_dirs(source) if getattr(current, "model_id", None) else {}
        loop = asyncio.get_running_loop()
        while current.version.isdigit() and int(current.version) + 1 in deltas:
            path = deltas[int(current.version) + 1]
            sig = _signature(path)
            if self._failed.get(path) == sig:
                break  # refused before and unchanged since
            try:
                predictor = await loop.run_in_executor(self._load_pool, current.with_delta, path)
            except Exception as e:
                self.metrics.deltas.labels("refused").inc()
                return {**self._failure(path, sig, e, current), **{"reloaded": result["reloaded"]}}
            self._failed.pop(path, None)
            self.batcher.swap(predictor)
            _release(current, predictor)
            self.metrics.serving(predictor)
            self.metrics.deltas.labels("applied").inc()
            age = _age(predictor)
            self.log(
                f"sparsejax serve: now serving {predictor.version} (delta {path} on "
                f"{current.version}{'' if age is None else f', published {age:.1f} s ago'})"
            )
            result = {
                "reloaded": True,
                "model_version": predictor.version,
                "previous_version": result.get("previous_version", current.version),
                "delta": path,
            }
            current = predictor
        return result

    def _failure(self, where: str, sig: Any, e: Exception, current: Any) -> dict:
        """Log and count a failed load; a model dir's `sig` is remembered so that polling
        does not try (and log) it again until it changes."""
        if sig is not None:
            self._failed[where] = sig
        if not isinstance(e, DeltaError):
            self.metrics.reloads.labels("failure").inc()
        verb = "apply" if isinstance(e, DeltaError) else "load"
        message = f"cannot {verb} {where}: {_one_line(e)}"
        self.last_error = {"message": message, "time": time.time()}
        gone = " (its folder is gone)" if self._on_disk() is False else ""
        self.log(f"sparsejax serve: {message}; still serving {current.version}{gone}")
        return {"reloaded": False, "model_version": current.version, "error": message}

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                await self.check()
            except Exception as e:  # a bug must not stop the polling
                self._log_error("poll", e)

    # -- the app's lifecycle ------------------------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        if self.poll_seconds is not None and self.source is not None:
            self._poll_task = asyncio.create_task(self._poll())

    async def start_grpc(self, host: str, port: int) -> int:
        """Serve the v2 gRPC API (`_v2_grpc`) on host:port too (0: any free port);
        returns the bound port. It stops with the app (`on_cleanup`)."""
        from . import _v2_grpc

        self._grpc, bound = await _v2_grpc.start(self, host, port)
        return bound

    async def on_cleanup(self, app: web.Application) -> None:
        """After the last handler: stop gRPC and polling, drain the batcher, stop the
        threads."""
        if self._grpc is not None:
            await self._grpc.stop(grace=5.0)
        if self._poll_task is not None:
            self._poll_task.cancel()
            try:
                await self._poll_task
            except asyncio.CancelledError:
                pass
        await asyncio.get_running_loop().run_in_executor(None, self.batcher.close)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self._retrieve_pool.shutdown(wait=False, cancel_futures=True)

    # -- handlers -----------------------------------------------------------------------

    def _log_error(self, endpoint: str, e: BaseException) -> None:
        """Log an unexpected error, the same one at most every 10 s (a failing model
        fails every request of a batch)."""
        line = f"{endpoint}: {type(e).__name__}: {_one_line(e)}"
        now = time.monotonic()
        if line != self._last_error[0] or now - self._last_error[1] > 10.0:
            self._last_error = (line, now)
            self.log(f"sparsejax serve: error in {line}")

    def route(self, endpoint: str, handler: Callable) -> Callable:
        """`handler` with its errors mapped to JSON answers and its metrics counted."""
        metrics = self.metrics

        async def handle(request: web.Request) -> web.Response:
            t0 = time.perf_counter()
            try:
                response = await handler(request)
            except Exception as e:
                status, body = self.error_answer(endpoint, e)
                response = _json_response(body, status)
                if status == 413:
                    response.force_close()  # do not read the rest of an oversized body
            metrics.request(endpoint, response.status, time.perf_counter() - t0)
            return response

        return handle

    def predict_examples(self, raw: bytes) -> list:
        """The examples of a /v1/predict body; an error for `error_answer` if it is not
        one."""
        return _examples(_decode_json(raw))

    predict_answer = staticmethod(_predict_answer)

    def error_answer(self, endpoint: str, e: Exception) -> tuple[int, bytes]:
        """A handler's exception as (HTTP status, JSON body), counted in the metrics by
        kind; a fault of the server or model (500) is logged too."""
        if isinstance(e, _HttpError):
            status, kind, message = e.status, e.kind, e.message
        elif isinstance(e, RequestError):
            status, kind, message = 400, "bad_request", _one_line(e)
        elif isinstance(e, BatcherClosedError):
            status, kind, message = 503, "unavailable", _one_line(e)
        else:
            self._log_error(endpoint, e)
            status, kind, message = 500, "model_error", f"{type(e).__name__}: {_one_line(e)}"
        self.metrics.errors.labels(endpoint, kind).inc()
        return status, _json_bytes({"error": message})

    async def _raw_body(self, request: web.Request) -> bytes:
        """The request's body; 413 over the size limit."""
        limit = self.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise _HttpError(
                413,
                "too_large",
                f"request body of {length} bytes is over the limit of {limit} bytes "
                "(serve --max-body-bytes)",
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _HttpError(
                413,
                "too_large",
                f"request body is over the limit of {limit} bytes (serve --max-body-bytes)",
            ) from None
        return raw

    async def _body(self, request: web.Request, *, empty_ok: bool = False) -> Any:
        """The request's JSON body; 413 over the size limit, 400 if it is not JSON."""
        return _decode_json(await self._raw_body(request), empty_ok=empty_ok)

    async def predict(self, request: web.Request) -> web.Response:
        examples = _examples(await self._body(request))
        if not examples:
            return _json_response(_predict_answer([], self.predictor.version))
        scores, version = await self.batcher.submit_async(examples)
        return _json_response(_predict_answer(scores, version))

    async def retrieve(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict):
            raise _HttpError(
                400, "bad_request", f'expected {{"user": {{...}}, "k": 10}}, got {_json_type(body)}'
            )
        extra = sorted(k for k in body if k not in ("user", "k"))
        if extra:
            raise _HttpError(400, "bad_request", f"unexpected key {extra[0]!r} (expected user, k)")
        user, k = body.get("user"), body.get("k", 10)
        if not isinstance(user, dict):
            raise _HttpError(
                400, "bad_request", f"'user' must be an object of features, got {_json_type(user)}"
            )
        if type(k) is not int or k < 1:
            raise _HttpError(400, "bad_request", f"'k' must be an integer >= 1, got {k!r}")
        predictor = self.predictor
        if predictor.task != "retrieval":
            raise _HttpError(
                400,
                "bad_request",
                f"/v1/retrieve needs a retrieval (two-tower) model; model {predictor.version} "
                f"is a {predictor.task} model (use /v1/predict)",
            )
        loop = asyncio.get_running_loop()
        items, scores = await loop.run_in_executor(self._retrieve_pool, predictor.retrieve, user, k)
        return _json(
            {
                "items": _plain(items),
                "scores": [float(s) for s in scores],
                "model_version": predictor.version,
            }
        )

    async def healthz(self, request: web.Request) -> web.Response:
        predictor = self.predictor
        return _json(
            {
                "status": "ok",
                "model_version": predictor.version,
                "model_version_age_s": _age(predictor),
                "task": predictor.task,
                "model_dir": self.model_dir,
                "model_dir_on_disk": self._on_disk(),
                "max_batch": self.batcher.max_batch,
                "max_wait_ms": self.batcher.max_wait_ms,
                "pending": self.batcher.pending,
                "uptime_s": round(time.time() - self.started, 3),
                "pid": os.getpid(),
            }
        )

    async def model(self, request: web.Request) -> web.Response:
        return _json({**self.predictor.info, "last_error": self.last_error})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=prom.generate_latest(self.metrics.registry),
            headers={"Content-Type": prom.CONTENT_TYPE_LATEST},
        )

    # -- the Open Inference Protocol (KServe v2; `_v2`) -----------------------------------

    def v2_model(self, name: str, version: str | None = None) -> Any:
        """The served predictor if `name` (and `version`, unless empty) name it; else a
        LookupError naming what is served (REST: 404, gRPC: NOT_FOUND)."""
        predictor = self.predictor
        if name != self.model_name:
            raise LookupError(f"unknown model {name!r}; this server serves {self.model_name!r}")
        if version and version != str(predictor.version):
            raise LookupError(
                f"model {name!r} version {version!r} is not served; version {predictor.version} is"
            )
        return predictor

    def _v2_model(self, request: web.Request) -> Any:
        """`v2_model` of the request's path; 404 if it names another model or version."""
        try:
            return self.v2_model(request.match_info["name"], request.match_info.get("version"))
        except LookupError as e:
            raise _HttpError(404, "not_found", str(e)) from None

    async def v2_server(self, request: web.Request) -> web.Response:
        return _json(v2.server_metadata())

    async def v2_live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def v2_ready(self, request: web.Request) -> web.Response:
        return _json({"ready": True})

    async def v2_model_ready(self, request: web.Request) -> web.Response:
        self._v2_model(request)
        return _json({"name": self.model_name, "ready": True})

    async def v2_metadata(self, request: web.Request) -> web.Response:
        return _json(v2.metadata(self._v2_model(request), self.model_name))

    async def v2_infer(self, request: web.Request) -> web.Response:
        predictor = self._v2_model(request)
        body = await self._raw_body(request)
        examples, answer = v2.parse_infer(body, request.headers.get(v2.HEADER_LENGTH), predictor)
        scores, version = await self.batcher.submit_async(examples)
        payload, headers = v2.infer_response(
            scores, name=self.model_name, version=version, **answer
        )
        return web.Response(body=payload, headers=headers)

    async def reload(self, request: web.Request) -> web.Response:
        body = await self._body(request, empty_ok=True)
        path = None
        if body is not None:
            if not isinstance(body, Mapping) or set(body) - {"path"}:
                raise _HttpError(
                    400, "bad_request", 'expected an empty body or {"path": "/a/model/path"}'
                )
            path = body.get("path")
            if path is not None and not isinstance(path, str):
                raise _HttpError(
                    400, "bad_request", f"'path' must be a string, got {_json_type(path)}"
                )
        if path is None and self.source is None:
            raise _HttpError(400, "bad_request", "no model path to reload from: give one")
        result = await self.check(path, retry_failed=True)
        return _json(result, 500 if "error" in result else 200)


SERVER_KEY = web.AppKey("sparsejax_server", ModelServer)


def make_app(
    model_path: str | None = None,
    *,
    predictor: Any = None,
    loader: Callable[[str], Any] | None = None,
    max_batch: int | None = None,
    max_wait_ms: float = 2.0,
    max_body_bytes: int = 1 << 20,
    poll_seconds: float | None = 2.0,
    model_name: str | None = None,
    log: Callable[[str], Any] = print,
) -> web.Application:
    """The prediction server as an aiohttp app (for `serve`, or aiohttp's test client).

    Args:
      model_path: a model dir or a folder of numbered version subfolders (see the module
        docstring); loaded now, with `loader`.
      predictor: serve this predictor instead of loading one (tests); `model_path`, if
        given too, is where reloads look.
      loader: `model_dir -> predictor` (default `Predictor.load(model_dir, warmup=True)`).
      max_batch: most examples per model call (None: the model's largest bucket); 1
        with `max_wait_ms=0` is batch-1 serving.
      max_wait_ms: how long a request may wait for others to share its model call.
      max_body_bytes: larger request bodies are refused with 413.
      poll_seconds: how often the model path is checked for a new version (0 or None:
        only on POST /v1/reload).
      model_name: the model's name in the v2 API (/v2/models/{name}; default: the model
        path's folder name).
      log: where the server's lines go (start, reloads, failures, unexpected errors).

    Raises:
      ModelLoadError: no model of `model_path` could be loaded.
    """
    server = ModelServer(
        model_path,
        predictor=predictor,
        loader=loader,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        max_body_bytes=max_body_bytes,
        poll_seconds=poll_seconds,
        model_name=model_name,
        log=log,
    )
    app = web.Application(client_max_size=server.max_body_bytes)
    app[SERVER_KEY] = server
    app.router.add_post("/v1/predict", server.route("predict", server.predict))
    app.router.add_post("/v1/retrieve", server.route("retrieve", server.retrieve))
    app.router.add_post("/v1/reload", server.route("reload", server.reload))
    app.router.add_get("/v1/model", server.route("model", server.model))
    app.router.add_get("/healthz", server.route("healthz", server.healthz))
    app.router.add_get("/metrics", server.route("metrics", server.prometheus))
    app.router.add_get("/v2", server.route("v2", server.v2_server))
    app.router.add_get("/v2/health/live", server.route("v2_live", server.v2_live))
    app.router.add_get("/v2/health/ready", server.route("v2_ready", server.v2_ready))
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        app.router.add_get(base, server.route("v2_metadata", server.v2_metadata))
        app.router.add_get(f"{base}/ready", server.route("v2_model_ready", server.v2_model_ready))
        app.router.add_post(f"{base}/infer", server.route("v2_infer", server.v2_infer))
    app.on_startup.append(server.on_startup)
    app.on_cleanup.append(server.on_cleanup)
    return app


def serve(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int | None = None,
    max_wait_ms: float = 2.0,
    max_body_bytes: int = 1 << 20,
    poll_seconds: float | None = 2.0,
    model_name: str | None = None,
    grpc_port: int | None = None,
    reuse_port: bool = False,
    model_cores: Sequence[int] | None = None,
    shutdown_timeout: float = 30.0,
    loader: Callable[[str], Any] | None = None,
    log: Callable[[str], Any] = print,
) -> int:
    """Serve `model_path` over HTTP until SIGINT or SIGTERM (`sparsejax serve`).

    Loads (and warms up) the model, listens on host:port (port 0: any free port; the
    line "listening on http://HOST:PORT" says which), and on a signal stops accepting
    connections, lets requests in flight finish (up to `shutdown_timeout` seconds) and
    returns 0. Returns 2 if it cannot listen. With `grpc_port`, the v2 gRPC API listens
    there too (0: any free port). `reuse_port`: bind with SO_REUSEPORT (the workers of
    `serve --workers`, `_workers`). `model_cores`: the cores the model's threads run on
    (XLA's thread pool and the batcher, started with the model; `_workers.model_cores`);
    the event loop and the HTTP front stay on every core. The other arguments are
    `make_app`'s.
    The event loop is uvloop's where it is installed (it is a dependency of
    orbax-checkpoint; SPARSEJAX_SERVE_UVLOOP=0 uses asyncio's own). The objects alive
    after the model's load are moved out of the garbage collector's reach
    (`gc.freeze`): a full collection over them takes ~120 ms with JAX and a DLRM loaded,
    a pause every request in flight would wait for (SPARSEJAX_SERVE_GC_FREEZE=0: off).

    Raises:
      ModelLoadError: no model of `model_path` could be loaded (one line).
    """
    with _threads_started_on(model_cores):
        app = make_app(
            model_path,
            loader=loader,
            max_batch=max_batch,
            max_wait_ms=max_wait_ms,
            max_body_bytes=max_body_bytes,
            poll_seconds=poll_seconds,
            model_name=model_name,
            log=log,
        )
    if os.environ.get(WARM_UP_ENV) == "1":  # a `--workers` supervisor's first process
        log("sparsejax serve: loaded and compiled for the workers")
        return 0
    if model_cores:
        log(f"sparsejax serve: the model's threads on cores {','.join(map(str, model_cores))}")
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(_serve(app, host, port, grpc_port, reuse_port, shutdown_timeout, log))


@contextlib.contextmanager
def _threads_started_on(cores: Sequence[int] | None):
    """Threads started inside run on `cores` (Linux: a thread starts with its parent's
    affinity), as does JAX's backend if it starts inside (XLA sizes its pool by them);
    the calling thread is back on its own cores after."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)  # 0: the calling thread
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _listen(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket listening on host:port (SO_REUSEPORT with `reuse_port`)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024, reuse_port=reuse_port)


def _loop_factory() -> Callable | None:
    """uvloop's event loop where it is installed (orbax-checkpoint installs it): the
    server's per-request cost is mostly the event loop's, and uvloop's is lower."""
    if os.environ.get("SPARSEJAX_SERVE_UVLOOP", "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve(
    app: web.Application,
    host: str,
    port: int,
    grpc_port: int | None,
    reuse_port: bool,
    shutdown_timeout: float,
    log: Callable,
) -> int:
    server = app[SERVER_KEY]
    if os.environ.get("SPARSEJAX_SERVE_GC_FREEZE", "1") != "0":
        gc.collect()
        gc.freeze()
    return_free_heap()  # what the collection freed (and a given `loader`'s load)
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, shutdown_timeout=shutdown_timeout
    )
    await runner.setup()
    try:
        sock = _listen(host, port, reuse_port)
    except OSError as e:
        log(f"sparsejax serve: cannot listen on {host}:{port}: {e.strerror or e}")
        await runner.cleanup()
        return 2
    bound = sock.getsockname()
    loop = asyncio.get_running_loop()
    front = None
    if _front.available():
        front = _front.NativeFront(server, sock, runner.server, loop)
    else:
        await web.SockSite(runner, sock).start()
    server.attach(runner, front)
    grpc_line = ""
    if grpc_port is not None:
        try:
            grpc_bound = await server.start_grpc(host, grpc_port)
        except (OSError, RuntimeError) as e:
            log(f"sparsejax serve: cannot listen for gRPC on {host}:{grpc_port}: {e}")
            await runner.cleanup()
            return 2
        grpc_line = f", v2 gRPC on {host}:{grpc_bound}"
    predictor = server.predictor
    poll = f"every {server.poll_seconds:g} s" if server.poll_seconds else "on /v1/reload only"
    log(
        f"sparsejax serve: model {predictor.version} ({predictor.task}) from "
        f"{server.model_dir}; max batch {server.batcher.max_batch}, max wait "
        f"{server.batcher.max_wait_ms:g} ms, body limit {server.max_body_bytes} bytes, "
        f"reload check {poll}; /v1/predict on the "
        f"{'native HTTP front' if front is not None else 'aiohttp server'}"
    )
    log(
        f"sparsejax serve: listening on http://{bound[0]}:{bound[1]}{grpc_line} (Ctrl-C "
        f"stops); v2 (KServe) model name {server.model_name!r}"
    )
    stop = asyncio.Event()
    signals = [signal.SIGINT, signal.SIGTERM]
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in signals:  # a second Ctrl-C interrupts the shutdown
            loop.remove_signal_handler(sig)
        log("sparsejax serve: stopping; finishing the requests in flight")
        if front is not None:
            await front.stop()
        await runner.cleanup()
        if front is not None:
            front.close()
        sock.close()
    log("sparsejax serve: stopped")
    return 0
