"""Whether a process of this host is running: the one check that the runtime (stale endpoints,
lock files, leases, a killed build's temporaries) and the Pants backend (settings files of ended
Pants processes) make."""

from __future__ import annotations

import os
from pathlib import Path


def is_running(pid: int) -> bool:
    """Whether process `pid` exists on this host and has not ended (another user's counts). A
    zombie has ended: an orphan's exit is reaped by init, maybe late, and never in a container
    whose first process reaps nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether `pid` has ended but is not yet reaped (its state in /proc is Z)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # reaped meanwhile; or no /proc (macOS), where os.kill's answer stands
        return Path("/proc").is_dir()
    return stat.rsplit(")", 1)[1].split()[0] == "Z"
