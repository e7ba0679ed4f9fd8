"""How much memory a table needs and how much the devices have: checked before a
table is allocated, so a table that cannot fit is refused by name instead of by
numpy's or XLA's allocator."""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _host_available() -> tuple[int, str] | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host MemAvailable"
    except OSError:
        pass
    try:
        return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host available pages")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory(devices: Sequence[jax.Device]) -> tuple[int, str] | None:
    """`(bytes, where)` that a replicated array of one copy per device may use: the
    least free memory of the devices (their memory stats), or for CPU devices the host's
    available memory divided among them (they share it); no devices: the host's. None
    if unknown."""
    cpu = [d for d in devices if d.platform == "cpu"]
    if cpu or not devices:
        host = _host_available()
        n = max(1, len(cpu))
        return (
            None if host is None else (host[0] // n, host[1] + (f" / {n} devices" if n > 1 else ""))
        )
    free = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append((stats["bytes_limit"] - stats.get("bytes_in_use", 0), str(d)))
    return min(free) if free else None
