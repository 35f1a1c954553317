"""`python lease_holder.py FOLDER`: takes the lease beside FOLDER, says so, and sleeps until
killed; the lease tests kill it (SIGKILL) to leave a lease whose holder is gone."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kiln.artifacts.lease import Lease

if __name__ == "__main__":
    Lease.beside(Path(sys.argv[1]), what="a holder that is killed").acquire(wait=False)
    print("holding", flush=True)
    time.sleep(600)
