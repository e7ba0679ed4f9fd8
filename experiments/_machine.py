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
