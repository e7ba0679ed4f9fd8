"""Joining a multi-process job: `jax.distributed.initialize` from the environment.

`initialize_from_env()` is the first thing `sparsejax train` does (before any JAX call
that starts a backend). It decides from the environment whether this process is one of
several and, if so, connects it to the others:

* `sparsejax launch` (local processes on loopback) sets `SPARSEJAX_COORDINATOR`
  (host:port), `SPARSEJAX_NUM_PROCESSES` and `SPARSEJAX_PROCESS_ID`.
* Any launcher may set the JAX names instead: `JAX_COORDINATOR_ADDRESS` (host:port of
  process 0, which jax 0.10.2 reads itself), `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`
  (which it does not: sparsejax reads them). On Kubernetes (an indexed Job or a JobSet),
  set `JAX_PROCESS_ID` from `JOB_COMPLETION_INDEX` and the address to the headless
  service name of index 0.
* SLURM (inside `srun`: `SLURM_JOB_ID`, `SLURM_STEP_NODELIST`, `SLURM_NTASKS` > 1,
  `SLURM_PROCID`, `SLURM_LOCALID`) and Open MPI (`OMPI_MCA_orte_hnp_uri`,
  `OMPI_COMM_WORLD_SIZE` > 1) are detected by `jax.distributed.initialize()` itself;
  sparsejax only checks they are there and passes the timeouts.
* `SPARSEJAX_DISTRIBUTED=1` forces `jax.distributed.initialize()` with its own
  auto-detection (Cloud TPU, Kubernetes with the `kubernetes` package, mpi4py via
  `SPARSEJAX_CLUSTER_DETECTION=mpi4py`); `SPARSEJAX_DISTRIBUTED=0` turns all of this off.

Timeouts (seconds, environment): `SPARSEJAX_INIT_TIMEOUT` (default 60: every process
must have joined by then), `SPARSEJAX_HEARTBEAT_TIMEOUT` (default 30: a process whose
heartbeats stop is declared dead and the coordination service fails the others),
`SPARSEJAX_SHUTDOWN_TIMEOUT` (default 60: how long a finished process waits at the
shutdown barrier for the others). A process that dies is therefore noticed by the
survivors within about the heartbeat timeout; a gloo collective with a dead peer fails
sooner (its connection resets). `sparsejax launch` does not rely on either: it watches
its children and ends them all when one fails. A cluster launcher should do the same
(SLURM: `srun --kill-on-bad-exit=1`; Kubernetes: a JobSet failure policy or a Job with
`backoffLimit: 0`), so no task outlives a failed one by more than these timeouts.

`SPARSEJAX_LOCAL_DEVICES=K` gives each process K CPU devices (`jax_num_cpu_devices`;
`sparsejax launch --devices-per-process K`), so two processes of four devices make a
2x4 mesh on one machine. CPU collectives between processes go through gloo (jax 0.10.2's
default `jax_cpu_collectives_implementation`; set explicitly here).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

ENV_COORDINATOR = "SPARSEJAX_COORDINATOR"
ENV_NUM_PROCESSES = "SPARSEJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SPARSEJAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "SPARSEJAX_LOCAL_DEVICES"
ENV_DISTRIBUTED = "SPARSEJAX_DISTRIBUTED"

DEFAULT_INIT_TIMEOUT = 60
DEFAULT_HEARTBEAT_TIMEOUT = 30
DEFAULT_SHUTDOWN_TIMEOUT = 60


class DistributedConfigError(ValueError):
    """The environment describes a multi-process job inconsistently (one line)."""


@dataclasses.dataclass(frozen=True)
class ProcessEnv:
    """What the environment says about this process's job."""

    source: str
    """Which variables said so: "sparsejax", "jax", "slurm", "ompi", "auto"; "" = one process."""
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def distributed(self) -> bool:
        return bool(self.source)


def _int(env: dict, name: str) -> int:
    text = env.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise DistributedConfigError(f"{name}={text!r}: expected an integer") from None


def _seconds(env: dict, name: str, default: int) -> int:
    if not env.get(name):
        return default
    value = _int(env, name)
    if value < 1:
        raise DistributedConfigError(f"{name}={value}: expected seconds >= 1")
    return value


def process_env(env: dict | None = None) -> ProcessEnv:
    """Read the environment (see the module docstring); no JAX call."""
    env = dict(os.environ if env is None else env)
    if env.get(ENV_DISTRIBUTED) == "0":
        return ProcessEnv("")
    for source, (addr, count, pid) in {
        "sparsejax": (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID),
        "jax": ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
    }.items():
        if not env.get(count):
            continue
        n = _int(env, count)
        if n == 1 and env.get(ENV_DISTRIBUTED) != "1":
            return ProcessEnv("")
        missing = [v for v in (addr, pid) if not env.get(v)]
        if missing:
            raise DistributedConfigError(
                f"{count}={n} but {' and '.join(missing)} unset: a multi-process job needs "
                f"the coordinator's host:port ({addr}) and this process's number ({pid})"
            )
        p = _int(env, pid)
        if n < 1 or not 0 <= p < n:
            raise DistributedConfigError(f"{pid}={p} of {count}={n}: need 0 <= {pid} < {count}")
        return ProcessEnv(source, env[addr], n, p)
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in env for v in slurm) and _int(env, "SLURM_NTASKS") > 1:
        return ProcessEnv("slurm", num_processes=_int(env, "SLURM_NTASKS"))
    if "OMPI_MCA_orte_hnp_uri" in env and _int(env, "OMPI_COMM_WORLD_SIZE") > 1:
        return ProcessEnv("ompi", num_processes=_int(env, "OMPI_COMM_WORLD_SIZE"))
    if env.get(ENV_DISTRIBUTED) == "1":
        return ProcessEnv("auto")
    return ProcessEnv("")


def configure_local_devices(env: dict | None = None) -> int | None:
    """`SPARSEJAX_LOCAL_DEVICES=K`: K CPU devices in this process (before the backend
    starts). Returns K, or None when unset."""
    import jax

    env = os.environ if env is None else env
    if not env.get(ENV_LOCAL_DEVICES):
        return None
    k = _int(dict(env), ENV_LOCAL_DEVICES)
    if k < 1:
        raise DistributedConfigError(f"{ENV_LOCAL_DEVICES}={k}: expected >= 1")
    jax.config.update("jax_num_cpu_devices", k)
    return k


_INITIALIZED: ProcessEnv | None = None


def initialize_from_env(env: dict | None = None) -> bool:
    """Join the multi-process job the environment describes, if any.

    Call before any JAX computation (or `jax.devices()`). Sets the per-process CPU
    device count (`SPARSEJAX_LOCAL_DEVICES`), then, when this process is one of several,
    calls `jax.distributed.initialize` with bounded timeouts (module docstring). Calling
    it again is a no-op.

    Returns:
      True when this process is part of a multi-process job (initialized now or
      before), False for a single process.

    Raises:
      DistributedConfigError: inconsistent variables (e.g. a count without an id).
      RuntimeError: from JAX, e.g. the coordinator unreachable within the timeout.
    """
    global _INITIALIZED
    if _INITIALIZED is not None:
        return _INITIALIZED.distributed
    import jax

    environ = dict(os.environ if env is None else env)
    pe = process_env(environ)
    configure_local_devices(environ)
    if not pe.distributed:
        _INITIALIZED = pe
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service catches SIGTERM (as a preemption notice); sparsejax does
    # not use it, and a launcher's SIGTERM must end the process
    jax.config.update("jax_enable_preemption_service", False)
    kw: dict = dict(
        initialization_timeout=_seconds(environ, "SPARSEJAX_INIT_TIMEOUT", DEFAULT_INIT_TIMEOUT),
        heartbeat_timeout_seconds=_seconds(
            environ, "SPARSEJAX_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT
        ),
        shutdown_timeout_seconds=_seconds(
            environ, "SPARSEJAX_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT
        ),
    )
    if pe.source in ("sparsejax", "jax"):
        kw.update(
            coordinator_address=pe.coordinator,
            num_processes=pe.num_processes,
            process_id=pe.process_id,
        )
    elif environ.get("SPARSEJAX_CLUSTER_DETECTION"):
        kw["cluster_detection_method"] = environ["SPARSEJAX_CLUSTER_DETECTION"]
    jax.distributed.initialize(**kw)
    if pe.process_id is None:  # auto-detected: what jax.distributed chose
        from jax._src import distributed

        state = distributed.global_state
        pe = dataclasses.replace(pe, num_processes=state.num_processes, process_id=state.process_id)
    _INITIALIZED = pe
    return True


def process_of_many() -> int | None:
    """This process's number when `initialize_from_env` joined it to several (no JAX
    call), else None."""
    pe = _INITIALIZED
    if pe is None or not pe.distributed or (pe.num_processes or 0) < 2:
        return None
    return pe.process_id


def is_primary() -> bool:
    """Whether this process writes the run directory's files (process 0)."""
    import jax

    return jax.process_index() == 0


_TEXT_BYTES = 4096


def broadcast_text(text: str | None) -> str | None:
    """Process 0's `text` on every process (a collective: all call it; only process
    0's argument counts). At most 4096 UTF-8 bytes (longer text is cut); None stays
    None. A single process gets its own text back."""
    import jax

    if jax.process_count() == 1:
        return text
    import numpy as np
    from jax.experimental import multihost_utils

    buf = np.zeros(_TEXT_BYTES + 1, np.uint8)
    if text is not None:
        raw = text.encode()[:_TEXT_BYTES]
        buf[0] = 1
        buf[1 : 1 + len(raw)] = np.frombuffer(raw, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    if not out[0]:
        return None
    return bytes(out[1:]).rstrip(b"\0").decode(errors="replace")


def allgather_rows(a):
    """Every process's numpy array `a`, in process order (a collective: all call it).
    The arrays may differ in their first dimension only. They travel as bytes, so 64-bit
    keys keep their bits whether or not JAX has x64 on, in a buffer padded to a power of
    two: the gather compiles once per size class, not once per row count (a publish
    gathers a few dozen arrays whose lengths change every time)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return [a]
    from jax.experimental import multihost_utils

    a = np.ascontiguousarray(a)
    row = a.dtype.itemsize * math.prod(a.shape[1:])
    n = np.asarray(multihost_utils.process_allgather(np.array(a.shape[0], np.int32)))
    size = 1 << max(10, (int(np.max(n)) * row - 1).bit_length())
    buf = np.zeros(size, np.uint8)
    buf[: a.nbytes] = a.reshape(-1).view(np.uint8)
    got = np.asarray(multihost_utils.process_allgather(buf))
    return [
        np.ascontiguousarray(g[: k * row]).view(a.dtype).reshape(int(k), *a.shape[1:])
        for g, k in zip(got, n, strict=True)
    ]


def allgather_json(obj) -> list:
    """`obj` (JSON) of every process, in process order (a collective: all call it)."""
    import numpy as np

    text = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    return [json.loads(bytes(t).decode()) for t in allgather_rows(text)]
