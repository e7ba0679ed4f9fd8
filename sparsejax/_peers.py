"""A host all-to-all of numpy arrays between the processes of a job, over TCP.

Dynamic embedding tables spread over N processes swap request keys and answers every
step. That runs on the host, beside the device computing the previous step, so it uses
plain TCP sockets rather than a device collective, and a dead peer is noticed at once:
its kernel closes the connection (EOF or reset) the moment it dies, with no heartbeat.

Protocol:
* Setup (`PeerExchange.__init__`): each process listens on an ephemeral port and
  publishes "host:port" under `sparsejax/{name}/{process_id}` in a `Rendezvous` (jax's
  coordination key-value store, a shared directory, or a dict for threads). A process
  connects to every lower id and sends a hello (magic, its id, a token hashed from
  `name` and the process count); it accepts the higher ids, checks their hello and
  answers with its own. One connection per pair, TCP_NODELAY, then non-blocking.
* Each `all_to_all` sends every peer one message: a prefix (magic, call counter, number
  of arrays, header length), a JSON header (per array: dtype descr, shape, nbytes), then
  the raw buffers. Receiving goes with `recv_into` straight into fresh numpy arrays.
  One selector loop sends to and receives from all peers at once, so no size deadlocks.
* A peer that closes or resets mid-exchange raises PeerLostError; one that sends nothing
  for `timeout` seconds raises PeerTimeoutError. Either closes every connection (so the
  other peers fail at once too) and every later call raises the same error.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import itertools
import json
import os
import selectors
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.lib.format import descr_to_dtype, dtype_to_descr

TIMEOUT_ENV = "SPARSEJAX_EXCHANGE_TIMEOUT"
HOST_ENV = "SPARSEJAX_EXCHANGE_HOST"
DEFAULT_TIMEOUT = 600.0

_HELLO = struct.Struct("!4sI16s")  # magic, process id, token
_HELLO_MAGIC = b"SJXH"
_PREFIX = struct.Struct("!4sQII")  # magic, call counter, number of arrays, header bytes
_MAGIC = b"SJX1"
_MAX_HEADER = 1 << 26  # a larger header length is garbage, not a message


class PeerLostError(RuntimeError):
    """A peer closed or reset its connection, or sent bytes that are not this protocol."""


class PeerTimeoutError(RuntimeError):
    """A peer sent nothing for the exchange's timeout (hung, or far behind)."""


class Rendezvous(Protocol):
    """Where the processes of a job publish their addresses and find each other's."""

    def publish(self, key: str, value: str) -> None: ...

    def fetch(self, key: str, timeout: float) -> str:
        """The value published under `key`, waiting for it; PeerTimeoutError after
        `timeout` seconds."""
        ...


class JaxRendezvous:
    """The key-value store of jax.distributed's coordination service (multi-host jobs)."""

    def __init__(self) -> None:
        from jax._src import distributed

        state = distributed.global_state
        if state.client is None:
            raise RuntimeError(
                "JaxRendezvous needs jax.distributed.initialize() first (or use DirRendezvous)"
            )
        self._client = state.client
        self.coordinator_address: str | None = state.coordinator_address

    def publish(self, key: str, value: str) -> None:
        try:
            self._client.key_value_set(key, value)
        except Exception as e:  # jax raises its own runtime error type
            if "ALREADY_EXISTS" not in str(e):
                raise
            raise RuntimeError(
                f"{key!r} is already in jax.distributed's key-value store: give each "
                "PeerExchange of a job its own name"
            ) from None

    def fetch(self, key: str, timeout: float) -> str:
        try:
            return self._client.blocking_key_value_get(key, max(1, int(timeout * 1000)))
        except Exception as e:  # jax raises its own runtime error type
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
        raise PeerTimeoutError(f"no {key!r} in jax.distributed's key-value store in {timeout:g} s")


class DirRendezvous:
    """Files in a directory every process sees; use a fresh one per job (a file left by
    an earlier job would be read as this job's)."""

    def __init__(self, directory: str | os.PathLike, *, poll: float = 0.01) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._poll = poll

    def _path(self, key: str) -> Path:
        return self.directory / urllib.parse.quote(key, safe="")

    def publish(self, key: str, value: str) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(value)
        os.replace(tmp, path)  # readers see the whole value or nothing

    def fetch(self, key: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._path(key).read_text()
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise PeerTimeoutError(
                        f"no {key!r} in {self.directory} in {timeout:g} s"
                    ) from None
                time.sleep(self._poll)


class MemoryRendezvous:
    """A dict shared by threads of one process (tests)."""

    def __init__(self) -> None:
        self._values: dict[str, str] = {}
        self._cond = threading.Condition()

    def publish(self, key: str, value: str) -> None:
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def fetch(self, key: str, timeout: float) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._values, timeout):
                raise PeerTimeoutError(f"no {key!r} published in {timeout:g} s")
            return self._values[key]


class _Transfer:
    """One exchange with one peer: the buffers still to send, and the buffer the next
    received bytes go to (from `reader`, which returns the arrays once all arrived)."""

    def __init__(self, outgoing: list[memoryview], reader: Iterator[memoryview]) -> None:
        self.outgoing = collections.deque(outgoing)
        self.reader = reader
        self.incoming: memoryview | None = next(reader)
        self.arrays: list[np.ndarray] = []
        self.last = time.monotonic()  # the last time bytes moved either way

    def events(self) -> int:
        return (selectors.EVENT_READ if self.incoming is not None else 0) | (
            selectors.EVENT_WRITE if self.outgoing else 0
        )

    def pump(self, sock: socket.socket) -> None:
        """Sends, then receives, each until the socket would block or that side is done
        (a full send buffer must not stop the receiving: that could deadlock)."""
        with contextlib.suppress(BlockingIOError):
            while self.outgoing:  # a header and small arrays go in one syscall
                n = sock.sendmsg(itertools.islice(self.outgoing, 512))
                self.last = time.monotonic()
                while n and n >= len(self.outgoing[0]):
                    n -= len(self.outgoing.popleft())
                if n:
                    self.outgoing[0] = self.outgoing[0][n:]
                    break  # the send buffer is full
        with contextlib.suppress(BlockingIOError):
            while self.incoming is not None:
                n = sock.recv_into(self.incoming)
                if not n:
                    raise ConnectionResetError  # EOF
                self.last = time.monotonic()
                if n < len(self.incoming):
                    self.incoming = self.incoming[n:]
                    break  # nothing more arrived yet
                try:
                    self.incoming = next(self.reader)
                except StopIteration as stop:
                    self.arrays, self.incoming = stop.value, None


class PeerExchange:
    """Connections from this process to every other one of the job, for `all_to_all`.

    Args:
      process_id: this process, in [0, num_processes).
      num_processes: the processes of the job; 1 opens no socket.
      rendezvous: where the processes find each other's addresses.
      name: tells the exchanges of one job apart (keys and hello token).
      timeout: seconds a peer may send nothing before PeerTimeoutError; default the
        env SPARSEJAX_EXCHANGE_TIMEOUT, else 600.
      host: the address to listen on and publish; default the env
        SPARSEJAX_EXCHANGE_HOST, else (JaxRendezvous) the local address that routes to
        the jax coordinator, else 127.0.0.1.
    """

    def __init__(
        self,
        process_id: int,
        num_processes: int,
        rendezvous: Rendezvous,
        *,
        name: str = "peers",
        timeout: float | None = None,
        host: str | None = None,
    ) -> None:
        if not 0 <= process_id < num_processes:
            raise ValueError(f"{name}: process_id {process_id} not in [0, {num_processes})")
        self.process_id, self.num_processes, self.name = process_id, num_processes, name
        self.timeout = _default_timeout() if timeout is None else float(timeout)
        if not self.timeout > 0:
            raise ValueError(f"{name}: timeout must be > 0 seconds, got {self.timeout}")
        self.bytes_sent = self.bytes_received = self.calls = 0
        self._socks: dict[int, socket.socket] = {}
        self._selector = selectors.DefaultSelector()
        self._error: PeerLostError | PeerTimeoutError | None = None
        self._closed = False
        if num_processes > 1:
            try:
                self._connect(rendezvous, host or _default_host(rendezvous))
            except BaseException:
                self.close()
                raise

    def _connect(self, rendezvous: Rendezvous, host: str) -> None:
        digest = hashlib.sha256(f"sparsejax/{self.name}/{self.num_processes}".encode()).digest()
        token = digest[:16]
        hello = _HELLO.pack(_HELLO_MAGIC, self.process_id, token)
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((host, 0), family=family, backlog=self.num_processes) as srv:
            port = srv.getsockname()[1]
            rendezvous.publish(f"sparsejax/{self.name}/{self.process_id}", _join(host, port))
            for j in range(self.process_id):  # the higher id connects
                address = rendezvous.fetch(f"sparsejax/{self.name}/{j}", self.timeout)
                where = f"process {j} at {address}"
                peer_host, _, peer_port = address.rpartition(":")
                try:
                    sock = socket.create_connection(
                        (peer_host.strip("[]"), int(peer_port)), timeout=self.timeout
                    )
                except (OSError, ValueError) as e:
                    raise PeerLostError(f"{self.name}: cannot connect to {where}: {e}") from None
                self._socks[j] = sock
                sock.sendall(hello)
                self._check_hello(sock, where, token, expect={j})
            srv.settimeout(self.timeout)
            while len(self._socks) < self.num_processes - 1:
                missing = set(range(self.process_id + 1, self.num_processes)) - set(self._socks)
                try:
                    sock, addr = srv.accept()
                except TimeoutError:
                    raise PeerTimeoutError(
                        f"{self.name}: processes {sorted(missing)} did not connect in "
                        f"{self.timeout:g} s; set {TIMEOUT_ENV} (seconds) to wait longer"
                    ) from None
                try:
                    sock.settimeout(self.timeout)
                    where = f"a connection from {_join(*addr[:2])}"
                    j = self._check_hello(sock, where, token, expect=missing)
                    sock.sendall(hello)
                except BaseException:
                    sock.close()  # a refused connection is not kept
                    raise
                self._socks[j] = sock
        for sock in self._socks.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)

    def _check_hello(self, sock: socket.socket, where: str, token: bytes, expect: set[int]) -> int:
        """The peer's process id from its hello; a one-line error for anything else."""
        try:
            data = sock.recv(_HELLO.size, socket.MSG_WAITALL)
        except TimeoutError:
            msg = f"{self.name}: {where} sent no hello in {self.timeout:g} s"
            raise PeerTimeoutError(msg) from None
        if len(data) < _HELLO.size:
            raise PeerLostError(
                f"{self.name}: {where} closed the connection in the handshake (another exchange "
                f"name or number of processes than {self.name!r}, {self.num_processes}?)"
            )
        magic, j, theirs = _HELLO.unpack(data)
        if magic != _HELLO_MAGIC:
            problem = "it is not a sparsejax exchange"
        elif theirs != token:
            problem = "it belongs to another exchange name or number of processes"
        elif j not in expect:
            problem = f"it says process {j}, expected one of {sorted(expect)}"
        else:
            return j
        raise PeerLostError(
            f"{self.name}: refused {where}: {problem} (this is {self.name!r}, process "
            f"{self.process_id} of {self.num_processes})"
        )

    def all_to_all(self, messages: Sequence[Sequence[np.ndarray]]) -> list[list[np.ndarray]]:
        """Send `messages[j]` to each process j and receive what each sent this one.

        A collective: every process of the job calls it the same number of times.
        `messages[self.process_id]` comes back as it is (no socket, no copy). Arrays of
        any dtype without Python objects, any shape (0-d and empty included); a
        non-contiguous one is sent as a contiguous copy, and none is modified.

        Returns:
          out[j]: the arrays process j sent this one, in order, new numpy arrays of the
          dtypes and shapes they were sent with.

        Raises:
          PeerLostError: a peer closed its connection (exited or killed), or the
            processes got out of step.
          PeerTimeoutError: a peer sent nothing for `timeout` seconds.
        """
        if self._error is not None:
            raise type(self._error)(*self._error.args)
        if self._closed:
            raise RuntimeError(f"{self.name}: all_to_all on a closed PeerExchange")
        if len(messages) != self.num_processes:
            raise ValueError(
                f"{self.name}: all_to_all takes one message per process "
                f"({self.num_processes}), got {len(messages)}"
            )
        call, me = self.calls, self.process_id
        out = [list(messages[me]) if j == me else [] for j in range(self.num_processes)]
        sizes, transfers = {}, {}
        for j in self._socks:
            outgoing, sizes[j] = self._encode(call, messages[j])
            transfers[j] = _Transfer(outgoing, self._reader(j, call))
        self.calls += 1
        if not transfers:
            return out
        try:
            self._run(call, transfers)
        except BaseException as e:  # half a message may be sent: the exchange is unusable
            self._error = (
                e
                if isinstance(e, PeerLostError | PeerTimeoutError)
                else PeerLostError(
                    f"{self.name}: exchange {call} was interrupted ({type(e).__name__}); stopping"
                )
            )
            self._close_sockets()
            raise
        for j, t in transfers.items():
            out[j] = t.arrays
            self.bytes_received += sum(a.nbytes for a in t.arrays)
        self.bytes_sent += sum(sizes.values())
        return out

    def _encode(self, call: int, arrays: Sequence[np.ndarray]) -> tuple[list[memoryview], int]:
        """The buffers of one message (header first) and its payload bytes."""
        specs, views = [], []
        for a in arrays:
            a = np.asarray(a)
            if a.dtype.hasobject:
                raise TypeError(f"{self.name}: cannot send arrays of dtype {a.dtype} (objects)")
            specs.append([dtype_to_descr(a.dtype), list(a.shape), a.nbytes])
            if a.nbytes:  # ascontiguousarray is a no-op for a contiguous array
                views.append(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
        header = json.dumps(specs).encode()
        prefix = _PREFIX.pack(_MAGIC, call, len(specs), len(header))
        return [memoryview(prefix + header), *views], sum(s[2] for s in specs)

    def _reader(self, j: int, call: int) -> Iterator[memoryview]:
        """Yields the buffers to fill with process j's message in turn; returns its arrays."""
        prefix = bytearray(_PREFIX.size)
        yield memoryview(prefix)
        magic, got, count, size = _PREFIX.unpack(prefix)
        if magic != _MAGIC or size > _MAX_HEADER:
            raise PeerLostError(f"{self.name}: process {j} sent garbage in exchange {call}")
        if got != call:
            raise PeerLostError(
                f"{self.name}: process {j} is at exchange {got}, this process at {call}: the "
                "processes are out of step (each must call all_to_all as often)"
            )
        header = bytearray(size)
        yield memoryview(header)
        try:
            specs = json.loads(header)
            arrays = [np.empty(shape, descr_to_dtype(descr)) for descr, shape, _ in specs]
            valid = len(arrays) == count and all(  # no objects: raw bytes would be pointers
                a.nbytes == spec[2] and not a.dtype.hasobject
                for a, spec in zip(arrays, specs, strict=True)
            )
        except Exception:
            valid = False
        if not valid:
            raise PeerLostError(f"{self.name}: process {j} sent a bad header in exchange {call}")
        for a in arrays:
            if a.nbytes:
                yield memoryview(a.reshape(-1).view(np.uint8))
        return arrays

    def _run(self, call: int, transfers: dict[int, _Transfer]) -> None:
        """Moves bytes with every peer at once until all messages are sent and received."""
        sel = self._selector
        ready = list(transfers.items())  # try each once before waiting
        waiting: set[int] = set()  # the peers registered with the selector
        try:
            while True:
                for j, t in ready:
                    sock = self._socks[j]
                    try:
                        t.pump(sock)
                    except OSError as e:
                        why = "it exited or was killed" if isinstance(e, ConnectionError) else e
                        raise PeerLostError(
                            f"{self.name}: process {j} closed its connection during exchange "
                            f"{call} ({why}); stopping"
                        ) from None
                    if t.events():
                        (sel.modify if j in waiting else sel.register)(sock, t.events(), j)
                        waiting.add(j)
                    elif j in waiting:
                        sel.unregister(sock)
                        waiting.remove(j)
                if not waiting:
                    return
                now = time.monotonic()
                for j, t in transfers.items():
                    if t.events() and now - t.last > self.timeout:
                        raise PeerTimeoutError(
                            f"{self.name}: process {j} sent nothing for {self.timeout:g} s in "
                            f"exchange {call} (hung or far behind); set {TIMEOUT_ENV} (seconds) "
                            "to wait longer"
                        )
                oldest = min(t.last for t in transfers.values() if t.events())
                events = sel.select(oldest + self.timeout - now)
                ready = [(key.data, transfers[key.data]) for key, _ in events]
        finally:
            for j in waiting:
                sel.unregister(self._socks[j])

    def _close_sockets(self) -> None:
        socks, self._socks = self._socks, {}
        for sock in socks.values():
            with contextlib.suppress(OSError):  # already reset by the peer
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        """Closes the connections (a peer still exchanging gets PeerLostError). Idempotent."""
        self._closed = True
        self._close_sockets()
        self._selector.close()

    def __enter__(self) -> PeerExchange:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_JOB: PeerExchange | None = None


def job_exchange() -> PeerExchange:
    """The host exchange of this process's `jax.distributed` job: one per process, made
    at its first use (where every process must first use it: a collective), shared by
    whoever exchanges on the host (dynamic tables' keys, the trainer's exchange sizes),
    closed at exit. Calls on it are collectives in one order on every process."""
    global _JOB
    if _JOB is None:
        import jax

        _JOB = PeerExchange(jax.process_index(), jax.process_count(), JaxRendezvous(), name="job")
        atexit.register(_JOB.close)
    return _JOB


def all_gather(array: np.ndarray) -> np.ndarray:
    """`array` of every process of the job, stacked in process order (`job_exchange`)."""
    ex = job_exchange()
    got = ex.all_to_all([[array]] * ex.num_processes)
    return np.stack([g[0] for g in got])


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _default_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


def _default_host(rendezvous: Rendezvous) -> str:
    """The env's host, else the local address routing to the jax coordinator, else
    loopback."""
    if host := os.environ.get(HOST_ENV):
        return host
    if not isinstance(rendezvous, JaxRendezvous) or not rendezvous.coordinator_address:
        return "127.0.0.1"
    address = rendezvous.coordinator_address
    host, _, port = address.rpartition(":")
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, socket.SOCK_DGRAM) as udp:
            udp.connect(sockaddr)  # sends nothing: only picks the route
            return udp.getsockname()[0]
    except (OSError, ValueError) as e:
        raise RuntimeError(
            f"no local address routes to the jax coordinator {address} ({e}); set {HOST_ENV}"
        ) from None
