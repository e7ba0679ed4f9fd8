"""Dynamic batching: concurrent prediction requests grouped into one model call.

A model call costs about the same for 1 example as for 100 (the fixed cost is the Python
dispatch, the padding to a bucket and XLA's launch), so a server that scores each
request alone spends most of its time on overhead. `DynamicBatcher` puts requests in a
queue; a worker thread takes what is pending, up to `max_batch` examples or until the
oldest request has waited `max_wait_ms`, parses them, scores them in one
`predictor.score` call and hands each request its own slice of the scores.

Parsing has a fixed cost per call too (about 1 ms for one Criteo example, against 30 us
an example in a batch of 256), so the batch is parsed as one request. When that fails,
the request holding the example the error names is parsed alone - it fails alone, with
its own `RequestError` - and the others are parsed together again; an error that names
no example splits the batch in halves. A bad request costs its batch two extra parse
calls, and never another request's answer.

Waiting is bounded by the oldest request's arrival, not by the worker's: requests that
queued while the model was busy are taken at once, so under load batches form by
themselves and `max_wait_ms=0` still batches ("natural" batching). `max_batch=1,
max_wait_ms=0` is batch-1 serving, the baseline the benchmark compares against. Given
`senders` (a server's count of open client connections), a batch stops waiting as soon
as it holds a request of every one of them: nobody else can join, so a lone client pays
no `max_wait_ms` (half the latency at concurrency 1 with the 2 ms default) and 16
clients are scored together as soon as the 16th request arrives. Idle keep-alive
connections only make the batch wait as it would without `senders`.

Requests wait in a list, and the worker sleeps until the oldest one's `max_wait_ms` is
up; a request wakes it early only when it opens a batch, fills one, or is the last of
`senders` - not on every arrival (a thread switch each, which cost more CPU than the
request's own parse when requests arrive one by one).

One thread does the work: it gathers, parses and scores a batch and answers its
requests, then takes the next; requests queue meanwhile, so under load batches form by
themselves. Two threads a batch apart (parsing batch k+1 while the model scored batch k)
were slower: both hold the GIL for most of their work (the model's own compute is a
small share of a recommendation model's call at these batch sizes) and passing it back
and forth cost more than the overlap gave. With `serve`'s native HTTP front, one
worker's closed-loop peak went 20.3k -> 23.3k requests/s (medians of 6 runs of 4 s on
the 2-core VM, experiments/RESULTS.md). A source of requests can be attached
(`attach_intake`: `serve`'s native HTTP front); the worker then waits in it, and takes
its requests in bunches when it is ready for them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["BatcherClosedError", "DynamicBatcher"]


class BatcherClosedError(RuntimeError):
    """A request submitted to (or still queued in) a batcher that was closed."""


class _Request:
    """One submitted request. `deliver` is None for a concurrent.futures.Future, else
    what takes a batch's results for `future`, a token of the caller's (`submit_to`)."""

    __slots__ = ("examples", "n", "t", "future", "deliver")

    def __init__(self, examples, n, t, future, deliver):
        self.examples = examples
        self.n = n
        self.t = t
        self.future = future
        self.deliver = deliver


class _ToLoop:
    """Delivers a batch's results to the asyncio futures of one event loop (equal for
    the same loop, so a batch's requests from one loop go in one call)."""

    __slots__ = ("loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ToLoop) and other.loop is self.loop

    def __hash__(self) -> int:
        return id(self.loop)

    def __call__(self, items: list) -> None:
        try:
            self.loop.call_soon_threadsafe(_resolve, items)
        except RuntimeError:  # the loop was closed: nobody is waiting any more
            pass


def _resolve(done: list) -> None:
    """Runs in the event loop: settle the asyncio futures of one batch (a future whose
    request was cancelled, e.g. the client went away, is skipped)."""
    for future, result, error in done:
        if future.done():
            continue
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


_EXAMPLE = re.compile(r"example (\d+)\b")


def _bad_example(error: BaseException) -> int | None:
    """The index of the example a parse error blames: its `example` attribute, else the
    "example N:" its message starts with (`RequestError`'s form), else None."""
    i = getattr(error, "example", None)
    if isinstance(i, int):
        return i
    m = _EXAMPLE.match(str(error))
    return int(m.group(1)) if m else None


def _parse_groups(parse: Callable, requests: list[_Request], failed: list) -> list[tuple]:
    """Parse `requests` in as few `parse` calls as possible: [(Parsed, its requests)].

    Parsing costs a fixed overhead per call, so the batch's examples are parsed as one
    request. If that fails, the request holding the example the error names is parsed
    alone (its error then names its own example index) and the others together again;
    an error that names no example splits the requests in halves. A request that does
    not parse alone goes to `failed` as (request, error): it fails alone."""
    groups = []
    todo = [requests]
    while todo:
        part = todo.pop()
        if len(part) == 1:
            r = part[0]
            try:
                groups.append((parse(r.examples), part))
            except Exception as e:  # RequestError, or any other fault of this request
                failed.append((r, e))
            continue
        examples = [ex for r in part for ex in r.examples]
        try:
            groups.append((parse(examples), part))
            continue
        except Exception as e:
            i = _bad_example(e)
        if i is not None and 0 <= i < len(examples):
            j = 0
            while i >= part[j].n:
                i -= part[j].n
                j += 1
            todo.append(part[:j] + part[j + 1 :])
            todo.append([part[j]])
        else:
            half = len(part) // 2
            todo.append(part[half:])
            todo.append(part[:half])
    return groups


class DynamicBatcher:
    """Groups concurrent requests into batches for one model, scored by a worker thread.

    Args:
      predictor: anything with `parse(examples) -> Parsed` (raises `RequestError` for a
        bad request; `len(Parsed)` = its examples), `score(list[Parsed]) ->
        list[np.ndarray]` (one array per Parsed, in order), `version` and `buckets`
        (`sparsejax.serving.Predictor`).
      max_batch: most examples in one `score` call; None = the predictor's largest
        bucket (followed across `swap`). A request with more examples than this is
        scored alone (the predictor chunks it).
      max_wait_ms: how long the oldest pending request may wait for others to join its
        batch. 0 = take only what is already queued.
      on_batch: called by the worker thread after each `score` call with (examples, requests,
        seconds) - for metrics; it must be quick and must not raise.
      senders: how many clients could send a request now (a server's open connections);
        when the pending requests are that many, the batch stops waiting (see the
        module docstring).

    `submit` is thread-safe and returns a `concurrent.futures.Future` of that request's
    scores (f32[n]); `submit_async` (from a running event loop) returns an
    `asyncio.Future` of `(scores, model_version)`, settled with one
    `call_soon_threadsafe` per batch rather than one per request; `submit_to` hands
    each batch's results to a callable of the caller's, in the worker's thread. A
    request's parse error fails that request only (see the module docstring); an error from `score`
    fails every request of the batch. `swap` changes the model for later batches;
    `close` finishes what is queued and stops the thread.

    Example:
        batcher = DynamicBatcher(Predictor.load("model"), max_wait_ms=2)
        scores = batcher.submit([{"I1": 3, "C1": "68fd1e64"}]).result()
        batcher.close()
    """

    def __init__(
        self,
        predictor: Any,
        *,
        max_batch: int | None = None,
        max_wait_ms: float = 2.0,
        on_batch: Callable[[int, int, float], None] | None = None,
        senders: Callable[[], int] | None = None,
        name: str = "sparsejax-batcher",
    ):
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (or None for the model's), got {max_batch}")
        if not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self._predictor = predictor
        self._max_batch = max_batch
        self._max_wait = max_wait_ms / 1000.0
        self._on_batch = on_batch
        self._senders = senders
        # the requests not yet taken, their examples, and what the gatherer waits for
        # (None: nothing it must be woken for; "first": any request; "more": a batch's end)
        self._pending: collections.deque[_Request] = collections.deque()
        self._pending_examples = 0
        self._waiting: str | None = None
        self._changed = threading.Condition(threading.Lock())
        self._intake: tuple[Callable, Callable] | None = None  # (take, wake): attach_intake
        self._closed = False
        # Counters, written by the worker thread (read them for metrics or tests).
        self.batches = 0  # score calls
        self.requests = 0  # requests scored
        self.examples = 0  # examples scored
        self.rejected = 0  # requests whose parse failed
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------

    @property
    def predictor(self) -> Any:
        """The model later batches use."""
        return self._predictor

    @property
    def max_batch(self) -> int:
        """Most examples per `score` call (the predictor's largest bucket if not given)."""
        return self._max_batch or self._predictor.buckets[-1]

    @property
    def max_wait_ms(self) -> float:
        return self._max_wait * 1000.0

    @property
    def pending(self) -> int:
        """Requests queued and not yet taken by the worker (approximate)."""
        return len(self._pending)

    def submit(self, examples: Sequence[Mapping]) -> concurrent.futures.Future:
        """Queue one request (a list of raw-feature examples); thread-safe.

        Returns a Future whose result is that request's scores (f32[len(examples)]) or
        whose exception is its `RequestError` (or the batch's model error).
        Raises `BatcherClosedError` after `close`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_Request(examples, len(examples), time.monotonic(), future, None))
        return future

    def submit_async(self, examples: Sequence[Mapping]) -> asyncio.Future:
        """`submit` for a coroutine in a running event loop: an asyncio.Future of
        `(scores, model_version)`, the version of the model that scored the request."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._put(_Request(examples, len(examples), time.monotonic(), future, _ToLoop(loop)))
        return future

    def submit_to(
        self,
        examples: Sequence[Mapping],
        token: Any,
        deliver: Callable,
        arrived: float | None = None,
    ) -> None:
        """Queue one request whose result goes to `deliver`, called from the worker thread
        once per batch with that batch's `[(token, (scores, model_version) or None, error
        or None)]` (the same `deliver` object for the batch's requests). It must be quick
        and must not raise. `arrived`: when the request came (`time.monotonic()`; default
        now), which its `max_wait_ms` counts from. Raises `BatcherClosedError` after
        `close`."""
        t = time.monotonic() if arrived is None else arrived
        self._put(_Request(examples, len(examples), t, token, deliver))

    def _put(self, request: _Request) -> None:
        with self._changed:
            if self._closed:
                raise BatcherClosedError("the batcher is closed (the server is shutting down)")
            self._pending.append(request)
            self._pending_examples += request.n
            if self._waiting is None:
                return
            if self._waiting == "first" or self._batch_closes():
                self._waiting = None
                self._changed.notify()
                intake = self._intake
                if intake is not None and threading.get_ident() != self._thread.ident:
                    intake[1]()  # the worker waits in the intake: wake it

    def _batch_closes(self) -> bool:
        """Whether the pending requests end a batch before its wait is up: they fill
        one, or they hold a request of every sender."""
        if self._pending_examples >= self.max_batch:
            return True
        senders = self._senders
        return senders is not None and senders() <= len(self._pending)

    def attach_intake(self, take: Callable[[float | None], bool], wake: Callable[[], None]) -> None:
        """Have the worker thread wait in `take(timeout)` instead of idling: a source of
        requests that blocks (without the GIL) until it has some or `timeout` seconds
        (None: as long as it likes) pass, and queues them with `submit_to` from the
        worker's thread; it returns False once it is shut, after its last requests.
        `wake()` makes a waiting `take` return early (a `submit` from another thread, or
        `close`). The worker takes requests in bunches when it is ready for them: no
        thread hands them over one by one."""
        with self._changed:
            self._intake = (take, wake)
            self._changed.notify()

    def swap(self, predictor: Any) -> Any:
        """Parse and score the batches taken from now on with `predictor`; the batch
        being scored finishes on the old one. Returns the old predictor."""
        old, self._predictor = self._predictor, predictor
        return old

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests, score those already queued, stop the thread."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.notify()
            if self._intake is not None:
                self._intake[1]()
        self._thread.join(timeout)

    def __enter__(self) -> DynamicBatcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """The worker's counters (batches, requests, examples, rejected, pending)."""
        return {
            "batches": self.batches,
            "requests": self.requests,
            "examples": self.examples,
            "rejected": self.rejected,
            "pending": self.pending,
        }

    # -- the workers --------------------------------------------------------------------

    def _run(self) -> None:
        while batch := self._gather():
            self._process(batch)

    def _gather(self) -> list[_Request]:
        """The next batch: the oldest pending request and those after it that fit, once
        its wait is up or the batch closes (`_batch_closes`); [] once closed and empty.
        Waits on the intake, if one is attached and open, else for `_put`."""
        monotonic = time.monotonic
        while True:
            if self._intake is not None and not self._intake[0](0.0):  # what it holds now
                self._intake = None
            with self._changed:
                remaining = None
                if self._pending:
                    remaining = self._pending[0].t + self._max_wait - monotonic()
                    if self._closed or remaining <= 0 or self._batch_closes():
                        self._waiting = None
                        return self._take_batch()
                    self._waiting = "more"
                elif self._closed:
                    return []
                else:
                    self._waiting = "first"
                intake = self._intake
                if intake is None:
                    self._changed.wait(remaining)
                    continue
            if not intake[0](remaining):  # its source is shut: wait for `_put` from now on
                with self._changed:
                    self._intake = None

    def _take_batch(self) -> list[_Request]:
        limit = self.max_batch
        pending = self._pending
        batch = [pending.popleft()]  # alone if it is larger than a batch
        n = batch[0].n
        while pending and n + pending[0].n <= limit:
            n += pending[0].n
            batch.append(pending.popleft())
        self._pending_examples -= n
        return batch

    def _process(self, batch: list[_Request]) -> None:
        """Parse the batch (as one request when it can), fail the requests that do not
        parse, score the rest."""
        predictor = self._predictor  # one model for the whole batch, even during a swap
        live = [
            r for r in batch if r.deliver is not None or r.future.set_running_or_notify_cancel()
        ]
        failed: list = []  # (request, error) of requests that did not parse
        groups = _parse_groups(predictor.parse, live, failed) if live else []
        if failed:
            done: list = []
            self.rejected += len(failed)
            for r, e in failed:
                self._fail(r, e, done)
            if done:
                self._settle(done)
        if groups:
            self._score(predictor, groups)

    def _score(self, predictor: Any, groups: list[tuple]) -> None:
        """Score the parsed groups of one batch in one call, settle every future."""
        version = predictor.version
        done: list = []  # (request, result, error) for asyncio futures
        if groups:
            t0 = time.perf_counter()
            try:
                outs = predictor.score([parsed for parsed, _ in groups])
                if len(outs) != len(groups):
                    raise RuntimeError(
                        f"predictor.score returned {len(outs)} arrays for {len(groups)} inputs"
                    )
            except Exception as e:  # the model failed: every request of this batch fails
                for _, requests in groups:
                    for r in requests:
                        self._fail(r, e, done)
            else:
                for (_, requests), out in zip(groups, outs, strict=True):
                    start = 0
                    for r in requests:
                        scores = out if len(requests) == 1 else out[start : start + r.n]
                        start += r.n
                        if r.deliver is None:
                            r.future.set_result(scores)
                        else:
                            done.append((r, (scores, version), None))
            seconds = time.perf_counter() - t0
            examples = sum(len(parsed) for parsed, _ in groups)
            requests = sum(len(rs) for _, rs in groups)
            self.batches += 1
            self.requests += requests
            self.examples += examples
            if self._on_batch is not None:
                self._on_batch(examples, requests, seconds)
        if done:
            self._settle(done)

    def _fail(self, r: _Request, error: BaseException, done: list) -> None:
        if r.deliver is None:
            r.future.set_exception(error)
        else:
            done.append((r, None, error))

    @staticmethod
    def _settle(done: list) -> None:
        """One delivery (one call_soon_threadsafe per event loop) for the whole batch."""
        by_deliver: dict = {}
        for r, result, error in done:
            by_deliver.setdefault(r.deliver, []).append((r.future, result, error))
        for deliver, items in by_deliver.items():
            deliver(items)
