"""`python lease_holder.py STORE FOLDER`: takes the lease of FOLDER (a key) in STORE (a path or
a bucket URL), says so, and sleeps until killed; the lease tests kill it (SIGKILL) to leave a
lease whose holder is gone."""

from __future__ import annotations

import sys
import time

from kiln.artifacts.lease import Lease, lease_key
from kiln.artifacts.locations import open_store

if __name__ == "__main__":
    store = open_store(sys.argv[1])
    Lease(store, lease_key(sys.argv[2]), what="a holder that is killed").acquire(wait=False)
    print("holding", flush=True)
    time.sleep(600)
