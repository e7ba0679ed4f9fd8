"""Arrays shared by the worker processes of one `sparsejax serve --workers N`: a model's
table arguments (and a delta's patched ones) are made once, in a file under a folder in
shared memory (/dev/shm), and every worker maps that file: one copy in memory, however
many workers, and a delta applied once is there for all.

An array is named by what it holds (the model dir or delta, the argument and its
checksum), so a worker that finds the file maps it, and the first one to need it makes
it: written under a temporary name and renamed, so a worker never maps half of one (two
workers making it at once both write it; the second rename wins, and both copies hold
the same bytes). The files are mapped shared and writable (so the arrays reach the
device without a copy); nothing writes them after the rename.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import numpy as np

ENV = "SPARSEJAX_SERVE_SHARED_DIR"
"""Set by the supervisor of `--workers`: the folder the workers share arrays in."""


class SharedArrays:
    """Get-or-make of named arrays in `directory` (see the module docstring)."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    @classmethod
    def from_env(cls) -> SharedArrays | None:
        """The workers' shared folder, if this process is one of them."""
        d = os.environ.get(ENV)
        return None if not d else cls(d)

    def path(self, name: str) -> str:
        return os.path.join(self.directory, hashlib.sha1(name.encode()).hexdigest() + ".bin")

    def get(self, name: str, shape: tuple, dtype, fill: Callable[[np.ndarray], None]) -> np.ndarray:
        """The array `name` of `shape` and `dtype`, mapped from its file; made with
        `fill(array)` first if no worker has made it yet."""
        path, dtype = self.path(name), np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes == 0:
            out = np.zeros(shape, dtype)
            fill(out)
            return out
        if not os.path.exists(path):
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as fh:
                fh.truncate(nbytes)
            made = np.memmap(tmp, dtype, "r+", shape=tuple(shape))
            try:
                fill(made)
                made.flush()
            except BaseException:
                del made
                os.unlink(tmp)
                raise
            del made
            os.replace(tmp, path)
        return np.memmap(path, dtype, "r+", shape=tuple(shape))

    def forget(self, name: str) -> None:
        """Remove array `name`'s file (workers that map it keep their mapping)."""
        try:
            os.unlink(self.path(name))
        except FileNotFoundError:
            pass
