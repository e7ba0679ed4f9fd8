"""Run the `sparsejax` command in a child process, as a user would (for the tests of
several processes: each child gets one CPU device, not the suite's eight)."""

import os
import subprocess
import sys

from sparsejax.sharding._launch import _drop_forced_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_device_env(env: dict | None = None) -> dict:
    """`env` (default: this process's) less conftest.py's 8 fake CPU devices, so a child
    process gets one; XLA's other flags (the suite's compile settings) are kept."""
    env = dict(os.environ if env is None else env)
    _drop_forced_devices(env)
    return env


def sparsejax_env() -> dict:
    """`one_device_env()` with this checkout of sparsejax first on the path."""
    env = one_device_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_sparsejax(*args: str, timeout: float = 300) -> str:
    """`python -m sparsejax ARGS` from the repository root; asserts it succeeded and
    returns its stdout and stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "sparsejax", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=sparsejax_env(),  # one CPU device per process
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout + out.stderr
