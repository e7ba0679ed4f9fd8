"""Process helpers shared by the layers (the run directory's lock, an export's temp
folder): whether a pid left behind by another process is still running."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True
