"""The native HTTP front of `sparsejax serve`: /v1/predict and v2 infer without the
event loop.

An asyncio server spends ~100 us of Python a request on accepting, reading, framing and
answering it - several times the JSON parse and the request's share of its batch - and
all of it holds the GIL the batcher's threads need. `HttpFront` (csrc/http_front.cc)
does that work in a thread of its own, outside the GIL: it frames each
`POST /v1/predict` and `POST /v2/models/NAME/infer` (the served model's, KServe v2, with
JSON or binary tensors) with a Content-Length body; the batcher's worker thread, when it
is ready for requests, takes the bodies in bunches (`attach_intake`: no thread is woken
per request), parses them and queues them (`submit_to`), and hands each batch's answers
back in one call that sends them. The
answers are the bytes the aiohttp handlers give (the server's `predict_examples`,
`predict_answer` and `error_answer`; `_v2.parse_infer` and `infer_response`), and the
metrics count them the same way.

Every other request - another endpoint, chunked or `Expect: 100-continue` bodies, a body
over the limit, HTTP/1.0, a header the front does not frame (a second, or overlong,
`Inference-Header-Content-Length`) - moves its connection, once the answers before it
are out, to the aiohttp server with the bytes read so far: one implementation of the
API, the native one only a shortcut to it. `serve` uses the front where the C++
extension is built (SPARSEJAX_SERVE_NATIVE_HTTP=0: aiohttp only, as without it).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from . import _v2 as v2

__all__ = ["NativeFront", "available"]

_TAKE = 256  # most bodies taken at once
_V1, _V2 = 0, 1  # the front's routes (its paths' order)
_ENDPOINTS = ("predict", "v2_infer")  # their names in the metrics


def available() -> bool:
    """Whether `serve` puts /v1/predict on the native front."""
    if os.environ.get("SPARSEJAX_SERVE_NATIVE_HTTP", "1") == "0":
        return False
    try:
        from .._cpu_ext import HttpFront  # noqa: F401
    except ImportError:
        return False
    return True


class _Resumed(asyncio.Protocol):
    """An aiohttp connection that starts with the bytes the front read before it handed
    the connection over."""

    def __init__(self, inner: asyncio.Protocol, head: bytes):
        self._inner = inner
        self._head = head

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)
        if self._head:
            self._inner.data_received(self._head)  # before any byte the transport reads

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class NativeFront:
    """/v1/predict of `server` (a `ModelServer`) on the listening socket `sock`, other
    requests' connections handed to `aiohttp_server` (a set-up runner's `server`) in
    `loop`. `stop` (a coroutine) stops reading requests and waits until those read are
    queued; `close`, after the batcher drained, closes the connections."""

    def __init__(self, server: Any, sock: socket.socket, aiohttp_server: Callable, loop):
        from .._cpu_ext import HttpFront

        self._server = server
        self._aiohttp = aiohttp_server
        self._loop = loop
        paths = ["/v1/predict", f"/v2/models/{server.model_name}/infer"]
        self._front = HttpFront(sock.fileno(), paths, server.max_body_bytes)
        self._adopting: set[asyncio.Task] = set()
        self._drained = threading.Event()
        loop.add_reader(self._front.handoff_fd(), self._on_handoffs)
        server.batcher.attach_intake(self._take, self._front.wake)

    def connections(self) -> int:
        """Client connections the front holds."""
        return self._front.connections()

    def _on_handoffs(self) -> None:
        for fd, head in self._front.take_handoffs():
            task = self._loop.create_task(self._adopt(socket.socket(fileno=fd), head))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    async def _adopt(self, sock: socket.socket, head: bytes) -> None:
        try:
            await self._loop.connect_accepted_socket(lambda: _Resumed(self._aiohttp(), head), sock)
        except OSError:  # the client is gone
            sock.close()

    def _take(self, timeout: float | None) -> bool:
        """The batcher's intake (its worker thread): wait for framed bodies, parse their
        JSON, queue their examples; False once the front is shut and drained."""
        bodies = self._front.take(_TAKE, -1.0 if timeout is None else timeout)
        if bodies is None:
            self._drained.set()
            return False
        server = self._server
        now: list = []  # answered without the model, as `_deliver` takes them
        for token, raw, arrived, route, json_length in bodies:
            request = (token, arrived, route, None)  # + how a v2 answer is written
            try:
                if route == _V1:
                    examples = server.predict_examples(raw)
                else:
                    examples, how = v2.parse_infer(raw, json_length, server.predictor)
                    request = (token, arrived, route, how)
                if examples:
                    server.batcher.submit_to(examples, request, self._deliver, arrived)
                else:
                    now.append((request, ([], server.predictor.version), None))
            except Exception as e:  # the request's fault (400), or shutting down (503)
                now.append((request, None, e))
        if now:
            self._deliver(now)
        return True

    def _deliver(self, items: list) -> None:
        """Answer each request of `items`, [((token, arrival, route, v2 answer's form),
        (scores, version) or None, error or None)]: a batch's results (the batcher calls
        it), or `_take`'s."""
        server = self._server
        answers = []
        for (token, arrived, route, how), result, error in items:
            endpoint = _ENDPOINTS[route]
            if error is not None:
                status, body = server.error_answer(endpoint, error)
                answers.append((token, status, body))
            elif route == _V1:
                status, body = 200, server.predict_answer(*result)
                answers.append((token, status, body))
            else:
                scores, version = result
                body, headers = v2.infer_response(
                    scores, name=server.model_name, version=version, **how
                )
                status, lines = 200, "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                answers.append((token, status, body, lines.encode()))
            server.metrics.request(endpoint, status, time.monotonic() - arrived)
        self._front.respond(answers)

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting and reading; wait until the requests read are queued in the
        batcher (which answers them as it drains)."""
        self._loop.remove_reader(self._front.handoff_fd())
        self._front.shutdown()
        await self._loop.run_in_executor(None, self._drained.wait, timeout)
        self._on_handoffs()  # connections handed over meanwhile: aiohttp finishes them

    def close(self) -> None:
        """Close the connections the front still holds (after the batcher drained)."""
        self._front.close()
