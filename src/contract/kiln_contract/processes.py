"""Whether a process of this host is running: the one check that the runtime (stale endpoints,
lock files, leases) and the Pants backend (settings files of ended Pants processes) make."""

from __future__ import annotations

import os


def is_running(pid: int) -> bool:
    """Whether process `pid` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
