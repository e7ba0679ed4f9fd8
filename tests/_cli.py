"""Run the `sparsejax` command in a child process, as a user would (for the tests of
several processes: each child gets one CPU device, not the suite's eight)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_sparsejax(*args: str, timeout: float = 300) -> str:
    """`python -m sparsejax ARGS` from the repository root; asserts it succeeded and
    returns its stdout and stderr."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    out = subprocess.run(
        [sys.executable, "-m", "sparsejax", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout + out.stderr
