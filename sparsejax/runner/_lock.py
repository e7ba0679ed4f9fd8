"""One process per run directory: an exclusive `fcntl.flock` on `RUN/.lock`, which holds
the owner's pid.

The lock belongs to the open file, so the kernel releases it when the process ends,
however it ends: a lock file left by a dead process is simply taken over (and said so).
The file itself stays (emptied on release): deleting it would let a second process lock
a fresh file while a third still holds the old one.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Callable

from .._process import pid_alive
from ._config import ConfigError

LOCK_NAME = ".lock"


class RunLockedError(ConfigError):
    """Another process holds the run directory."""


class RunLock:
    """Exclusive lock of a run directory for the life of a `with` block.

    Raises:
      RunLockedError: another process holds it (the message names its pid).
    """

    def __init__(self, run_dir: str, *, log: Callable[[str], None] = print):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.log = log
        self._file = None

    def acquire(self) -> RunLock:
        os.makedirs(self.run_dir, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "unknown pid"
            f.close()
            raise RunLockedError(
                f"run directory {self.run_dir} is in use by another sparsejax process "
                f"({owner}); wait for it to end, or use another name="
            ) from None
        f.seek(0)
        previous = f.read().split()
        if previous and previous[0] == "pid" and previous[1].isdigit():
            pid = int(previous[1])
            if pid != os.getpid():
                state = "ended" if not pid_alive(pid) else "no longer holds it"
                self.log(f"took over the lock of {self.run_dir} from pid {pid} ({state})")
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%c')}\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()
        self._file.flush()
        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        self._file.close()
        self._file = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
