"""What the benchmarks print about the machine they ran on (shared by the scripts)."""

from __future__ import annotations

import os
import platform
import subprocess


def mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def cpu_steadiness(runs: int = 10, n: int = 1_000_000) -> dict:
    """How steady this machine's CPU is now: a fixed Python loop timed `runs` times in a
    row, {min, median, max} in ms. On a quiet machine max/min is ~1.1; a VM whose host
    is busy shows ~2 (the same code at half speed for a second), which no server can
    hide from a latency percentile."""
    import statistics
    import time

    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        s = 0
        for k in range(n):
            s += k * k
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "min_ms": round(min(times), 1),
        "median_ms": round(statistics.median(times), 1),
        "max_ms": round(max(times), 1),
    }
