"""`sparsejax serve --workers N`: N server processes on one port, one copy of the tables,
supervised.

The supervisor reserves the port (a socket bound with SO_REUSEPORT, never listening) and
makes a folder in shared memory for the workers' arrays (`_shared`) and compiled
computations (JAX's compilation cache). It forks a first process that loads the model,
compiling it into that cache and making the shared tables, and exits; then N `sparsejax
serve` workers that each bind the port with SO_REUSEPORT: the kernel spreads the
connections over them. The workers read the compiled computations, so none compiles,
nor keeps the heap a compile leaves behind (the default model's supervisor and two
workers: 362 MiB of PSS, the shared tables aside, against 436 when each compiled).
The supervisor has imported the server's code but started no JAX backend, and its
objects are frozen out of the garbage collector before it forks, so the workers share
those pages instead of each importing its own. Each worker is a whole server (batcher,
reloads, deltas); a table argument, and a delta's patched one, is made once in the
shared folder and mapped by every worker. Each worker's model threads run on its own
share of the cores (`model_cores`). A model that does not load in the first process
stops the server with one line. A worker that dies is started again, its computations
read from the cache (its requests in flight are lost; the others keep serving); one that
dies within `_STARTUP_S` of its start three times in a row stops the server with one
line. SIGINT or SIGTERM stops the workers (each finishes its requests in flight) and
removes the shared folder; a supervisor killed with SIGKILL takes its workers with it
(the kernel sends them SIGTERM) and leaves its folder, which the next supervisor
removes. A worker that moves to a newer version removes the older one's shared files
(the others keep their mappings).
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence

from .._process import pid_alive
from ._shared import ENV

WORKER_ENV = "SPARSEJAX_SERVE_WORKER"
"""The worker's index, for its log lines."""
_STARTUP_S = 10.0


def _why(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _term_when_parent_dies(parent: int) -> None:
    """Have the kernel send this process SIGTERM when its parent dies (Linux), so the
    workers of a supervisor killed with SIGKILL stop too (finishing their requests)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: such workers outlive it, as before
        return
    if os.getppid() != parent:  # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a container's cpuset
    sets it), or the machine's where the OS does not say."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def model_cores(cores: Sequence[int], workers: int) -> list[list[int]]:
    """Each worker's share of `cores` for its model: disjoint where there are enough
    cores (as OMP_NUM_THREADS=cores/N would size them), round-robin where there are not.

    A worker's model threads are XLA's thread pool, sized by the cores it may run on when
    JAX starts, and the batcher's thread that calls it. Left on every core, each worker's
    pool takes every core, and a small batch's computation hops between cores: on a
    2-core VM, 90-130 us of wall time and 110-150 us of CPU a DLRM batch, against 40-60
    us on one core (experiments/RESULTS.md, "Each worker's model on its own core")."""
    cores = sorted(cores)
    if len(cores) < workers:
        return [[cores[k % len(cores)]] for k in range(workers)]
    return [
        cores[k * len(cores) // workers : (k + 1) * len(cores) // workers] for k in range(workers)
    ]


WARM_UP_ENV = "SPARSEJAX_SERVE_WARM_UP"
"""Set in the process a `--workers` supervisor starts first: `serve` loads the model
(compiling it into the workers' cache) and returns without listening."""


def worker_label() -> str | None:
    """This process's label in the log of `serve --workers`: "worker K", or "warm-up"
    for the process that loads the model for the workers; None outside them."""
    k = os.environ.get(WORKER_ENV)
    if k is None:
        return None
    return "warm-up" if os.environ.get(WARM_UP_ENV) == "1" else f"worker {k}"


def _share_compiles(directory: str) -> None:
    """The workers' compiled computations in JAX's compilation cache in `directory`
    (unless the user set a cache of their own): a worker started again after a crash
    loads the model's computations instead of compiling them (the default model: 0.7 s
    to serve again, not 4.4-5.1 s). Called before the worker's JAX backend starts."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _remove_stale(parent: str) -> None:
    """Remove the shared folders of supervisors that are gone (killed with SIGKILL)."""
    for name in os.listdir(parent):
        m = re.match(r"sparsejax-serve-(\d+)-", name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def serve_workers(
    model_path: str,
    workers: int,
    *,
    host: str,
    port: int,
    worker_args: Sequence[str],
    run_worker: Callable[[list[str]], int],
    grpc_port: int | None = None,
    pin_cores: bool = True,
    log: Callable[[str], object] = print,
) -> int:
    """Run `workers` servers of `model_path` on host:port (0: a free port) until SIGINT
    or SIGTERM (see the module docstring): each is a forked process that calls
    `run_worker` (the command line's main) with its `sparsejax serve` arguments, of
    which `worker_args` are the options; with `grpc_port` (0: a free one), the v2 gRPC
    API on one port too; with `pin_cores`, each worker's model threads on its share of
    the cores (`model_cores`). Returns 0 after a stop, 1 if a worker cannot
    start, 2 if the port is taken."""
    holds = []
    for what, want in (("", port), ("gRPC ", grpc_port)):
        if want is None:
            continue
        hold = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            hold.bind((host, want))
        except OSError as e:
            log(f"sparsejax serve: cannot listen for {what}on {host}:{want}: {e.strerror or e}")
            for h in holds:
                h.close()
            return 2
        holds.append(hold)
    port = holds[0].getsockname()[1]
    grpc = [] if grpc_port is None else ["--grpc-port", str(holds[1].getsockname()[1])]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    _remove_stale(shm)
    shared = tempfile.mkdtemp(prefix=f"sparsejax-serve-{os.getpid()}-", dir=shm)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: stop.append(s))

    argv = ["serve", model_path, "--host", host, "--port", str(port), "--reuse-port",
            *grpc, *worker_args]  # fmt: skip
    shares = None
    if pin_cores and hasattr(os, "sched_getaffinity"):
        shares = model_cores(os.sched_getaffinity(0), workers)
    gc.freeze()  # the objects so far stay untouched: their pages stay shared after a fork

    stops = {signal.SIGINT, signal.SIGTERM}
    supervisor = os.getpid()

    def start(k: int, warm_up: bool = False) -> tuple[int, float]:
        """Fork worker `k`; with `warm_up`, a process that loads the model as worker `k`
        would and exits (`WARM_UP_ENV`)."""
        sys.stdout.flush()
        sys.stderr.flush()
        # a stop signal that comes while forking waits for the handlers each side sets
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        pid = os.fork()
        if pid:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
            return pid, time.monotonic()
        code = 1  # the worker: a whole server, until the supervisor's SIGTERM
        try:
            os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor, which drains us
            _term_when_parent_dies(supervisor)
            for sig in stops:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
            for h in holds:
                h.close()
            os.environ.update({ENV: shared, WORKER_ENV: str(k)})
            if warm_up:
                os.environ[WARM_UP_ENV] = "1"
            _share_compiles(os.path.join(shared, "xla"))
            pin = [] if shares is None else ["--model-cores", ",".join(map(str, shares[k]))]
            code = run_worker([*argv, *pin])
        except SystemExit as e:
            code = 0 if e.code is None else e.code
        except BaseException:  # noqa: BLE001 - the worker's end: say why, then exit
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)

    def exited(pid: int, block: bool = False) -> int | None:
        """The worker's exit code (negative: killed by that signal; 0 if it was reaped
        before), None if it runs."""
        try:
            got, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return 0
        return None if got == 0 else os.waitstatus_to_exitcode(status)

    procs: dict[int, tuple[int, float]] = {}
    quick_deaths = {k: 0 for k in range(workers)}
    status = 0
    try:
        # A first process loads the model, compiles its computations into the shared
        # cache and makes the shared tables, then exits: every worker then reads them,
        # with no compile, and none keeps the heap a compile leaves behind
        warm, _ = start(0, warm_up=True)
        code = None
        while code is None and not stop:
            time.sleep(0.05)
            code = exited(warm)
        if code is None:  # stopped meanwhile
            os.kill(warm, signal.SIGKILL)
            exited(warm, block=True)
        elif code:
            log(f"sparsejax serve: the model did not load ({_why(code)}); stopping")
            return 1
        procs.update({k: start(k) for k in range(workers) if not stop})
        log(
            f"sparsejax serve: {workers} workers on http://{host}:{port}"
            f"{'' if not grpc else f', v2 gRPC on {host}:{grpc[1]}'} (pids "
            f"{', '.join(str(pid) for pid, _ in procs.values())}); tables shared in {shared}"
        )
        while not stop:
            time.sleep(0.2)
            for k, (pid, t0) in list(procs.items()):
                code = exited(pid)
                if code is None or stop:
                    continue
                quick = time.monotonic() - t0 < _STARTUP_S
                quick_deaths[k] = quick_deaths[k] + 1 if quick else 0
                if quick_deaths[k] >= 3:
                    log(
                        f"sparsejax serve: worker {k} died within {_STARTUP_S:g} s of its "
                        f"start 3 times ({_why(code)}); stopping"
                    )
                    status = 1
                    stop.append(None)
                    procs.pop(k)
                    break
                log(f"sparsejax serve: worker {k} (pid {pid}) died ({_why(code)}); restarting")
                procs[k] = start(k)
    finally:
        running = {pid for pid, _ in procs.values() if exited(pid) is None}
        for pid in running:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while running and time.monotonic() < deadline:
            running = {pid for pid in running if exited(pid) is None}
            time.sleep(0.05)
        for pid in running:
            os.kill(pid, signal.SIGKILL)
            exited(pid, block=True)
        for h in holds:
            h.close()
        shutil.rmtree(shared, ignore_errors=True)
    log("sparsejax serve: stopped")
    return status
