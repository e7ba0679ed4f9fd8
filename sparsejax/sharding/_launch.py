"""`sparsejax launch -n N CONFIG ...`: N local training processes on loopback.

The launcher starts `python -m sparsejax train ARGS` N times, with the variables
`sparsejax.sharding._distributed.initialize_from_env` reads (`SPARSEJAX_COORDINATOR`
= 127.0.0.1:PORT, the port taken from a socket bound and released just before;
`SPARSEJAX_NUM_PROCESSES`, `SPARSEJAX_PROCESS_ID`; `SPARSEJAX_LOCAL_DEVICES` with
`--devices-per-process`). Process 0 writes the run directory and its output is the
launcher's (the progress bar, the final line); the output of process i > 0 is appended
to `RUN/launch/p<i>.log` (a header line per launch, with its pid).

The launcher watches its children. When one exits with a non-zero status or is killed,
it gives the others `linger` seconds to end on their own, stops those still running
(SIGTERM, then SIGKILL after `grace` seconds) and returns a non-zero status with one
line naming the process, how it ended and where its output is (with the last line of
that output when it exited with a status: its error); when process 0 also exited with
the same status meanwhile, that is process 0 (other processes relay its start-up
errors, and may exit first). A process that is frozen (stopped by SIGSTOP, Ctrl-Z or a
debugger: Linux state T or t) when another fails is named as the cause instead: its
heartbeats stop, and the coordination service then aborts the others (process 0 by
SIGABRT). With `timeout`, it stops them all
when they run longer. Ctrl-C (or SIGTERM to the launcher) stops them all. Children
also get SIGTERM if the launcher itself dies (Linux `PR_SET_PDEATHSIG`), so no process
outlives it. Status 0 only when every process exits 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from ._distributed import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

LOG_DIR = "launch"
"""Where, inside the run directory, the output of processes 1.. goes."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (bound, then released for the coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: SIGTERM this child when the launcher dies (even by SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001, S110 - best effort, other platforms
        pass


def _drop_forced_devices(env: dict) -> None:
    """Take `--xla_force_host_platform_device_count` out of `env`'s XLA_FLAGS (the
    launcher's `--devices-per-process` sets the count instead), and XLA_FLAGS out of
    `env` if nothing else is left."""
    flags = " ".join(
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)


def child_env(
    process_id: int,
    num_processes: int,
    coordinator: str,
    *,
    devices_per_process: int | None = None,
    base: dict | None = None,
) -> dict:
    """The environment of process `process_id` of a launch."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(process_id),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if devices_per_process is not None:
        env[ENV_LOCAL_DEVICES] = str(devices_per_process)
        _drop_forced_devices(env)
    return env


def _ended(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def _last_line(path: str, limit: int = 200) -> str | None:
    """The last line of a log file that sparsejax wrote (its error), else its last
    non-empty line (shortened), if any. Other libraries' threads (gloo's connection
    messages) may write after the error."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return None
    lines = [ln for ln in lines if ln and not ln.startswith("=== sparsejax launch")]
    if not lines:
        return None
    ours = [ln for ln in lines if ln.startswith("sparsejax")]
    text = " ".join((ours or lines)[-1].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _frozen(pid: int) -> bool:
    """Whether process `pid` is stopped (Linux `/proc/PID/stat` state T, or t when
    traced): it runs nothing, heartbeats included, until continued. False elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"T", b"t")


class _Stop(Exception):
    """SIGTERM to the launcher."""


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every running child, SIGKILL those still running after `grace` s. A
    stopped child is continued after its SIGTERM, so it ends now rather than at SIGKILL."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
                p.send_signal(signal.SIGCONT)
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
    for p in procs:
        p.wait()


def launch(
    num_processes: int,
    train_args: Sequence[str],
    *,
    log_dir: str,
    devices_per_process: int | None = None,
    timeout: float | None = None,
    grace: float = 10.0,
    linger: float = 5.0,
    python: str = sys.executable,
    say: Callable[[str], None] | None = None,
    poll: float = 0.1,
    command: str = "train",
) -> int:
    """Run `python -m sparsejax COMMAND *train_args` in `num_processes` local processes.

    Args:
      num_processes: N >= 1.
      train_args: what follows `sparsejax COMMAND` (train: configs, overrides,
        `--restart`; export: the run directory, `--out` and export options).
      log_dir: where the output of processes 1.. goes (`p<i>.log`, appended).
      devices_per_process: CPU devices per process (`SPARSEJAX_LOCAL_DEVICES`).
      timeout: seconds after which every process is stopped (None: no limit).
      grace: seconds between SIGTERM and SIGKILL when stopping them.
      linger: seconds the others get to end on their own after one fails (they
        usually fail in the same collective and say why) before they are stopped.
      say: where the launcher's own lines go (default: stderr).
      command: the sparsejax subcommand each process runs: "train" or "export".

    Returns:
      0 when all exit 0; else the failed process's status (128 + signal when killed),
      124 on timeout, 130 on Ctrl-C.
    """
    if num_processes < 1:
        raise ValueError(f"launch: -n must be >= 1, got {num_processes}")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"launch: --devices-per-process must be >= 1, got {devices_per_process}")
    if say is None:

        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

    coordinator = f"127.0.0.1:{free_port()}"
    if command not in ("train", "export"):
        raise ValueError(f"launch: runs train or export, not {command!r}")
    cmd = [python, "-m", "sparsejax", command, *train_args]
    os.makedirs(log_dir, exist_ok=True)
    logs: dict[int, str] = {}
    procs: list[subprocess.Popen] = []
    files = []
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise _Stop

    in_main = _in_main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, on_term)
    try:
        for i in range(num_processes):
            env = child_env(i, num_processes, coordinator, devices_per_process=devices_per_process)
            out = None
            if i > 0:
                logs[i] = os.path.join(log_dir, f"p{i}.log")
                out = open(logs[i], "ab")  # noqa: SIM115 - closed below
                files.append(out)
                out.write(
                    f"=== sparsejax launch {time.strftime('%Y-%m-%dT%H:%M:%S')}: process {i} "
                    f"of {num_processes}, launcher pid {os.getpid()}, {coordinator}\n".encode()
                )
                out.flush()
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT if out is not None else None,
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
                )
            )
            if out is not None:
                out.write(f"=== pid {procs[-1].pid}\n".encode())
                out.flush()
        return _watch(procs, logs, timeout=timeout, grace=grace, linger=linger, say=say, poll=poll)
    except (KeyboardInterrupt, _Stop) as e:
        _stop(procs, grace)
        say(
            "sparsejax launch: "
            + ("interrupted" if isinstance(e, KeyboardInterrupt) else "terminated")
            + f"; stopped all {len(procs)} processes"
        )
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    finally:
        _stop(procs, grace)
        for f in files:
            f.close()
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _watch(procs, logs, *, timeout, grace, linger, say, poll) -> int:
    n = len(procs)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i = failed[0]
            code = codes[i]
            break
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs, grace)
            say(
                f"sparsejax launch: the {n} processes ran past --timeout {timeout:g} s; "
                f"stopped them all"
            )
            return 124
        time.sleep(poll)
    end = time.monotonic() + linger  # the others often fail the same way: let them say so
    while time.monotonic() < end and any(p.poll() is None and not _frozen(p.pid) for p in procs):
        time.sleep(poll)
    running = [j for j, p in enumerate(procs) if p.poll() is None]
    frozen = [j for j in running if _frozen(procs[j].pid)]  # the cause: its heartbeats stopped
    if i > 0 and code > 0 and procs[0].poll() == code:
        i = 0  # the same failure on process 0 (often relayed from it): its output is above
    _stop(procs, grace)
    what = f"process {i} of {n} {_ended(code)} ({_where(i, code, logs)})"
    if frozen:
        who = f"process{'es' if len(frozen) > 1 else ''} {', '.join(map(str, frozen))} of {n}"
        logs_of = "; ".join(_where(j, 0, logs) for j in frozen)
        what = (
            f"{who} {'were' if len(frozen) > 1 else 'was'} frozen (stopped by a signal such "
            f"as SIGSTOP; {logs_of}), then process {i} {_ended(code)} "
            f"({_where(i, code, logs)})"
        )
    stopped = (
        f"; stopped process{'es' if len(running) > 1 else ''} {', '.join(map(str, running))}"
        if running
        else ""
    )
    say(f"sparsejax launch: {what}{stopped}")
    return code if code > 0 else 128 - code


def _where(i: int, code: int, logs: dict[int, str]) -> str:
    """Where process `i`'s output is; with its error line when it exited with `code` > 0."""
    if i == 0:
        return "its output is above"
    where = f"log {logs[i]}"
    last = _last_line(logs[i]) if code > 0 else None
    return f"{where}: {last}" if last else where
