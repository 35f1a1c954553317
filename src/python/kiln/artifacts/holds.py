"""Holds: a run's claim that an artifact stays in the store while the run needs it, whoever
runs housekeeping (kiln.artifacts.inventory) from whichever clone or machine.

    {name}/.{version}.holds/read-{id}.lease    a run reading the artifact (a training's input)
    {name}/.{version}.holds/build-{id}.lease   a shard process of a store-mode cache's build

A hold is a lease record (kiln.artifacts.lease) in an object of its own, so any number of runs
hold one artifact at once. A read hold is bound to its process as a lease is: renewed while the
process runs, released when it is done, stale at once when the process died on this host, else
after the lease's TTL. A build hold is detached: it outlives its shard process, so a cache is
held from its first shard's start, between shards, until its merge has written STATUS and
deletes the build holds; a build stopped part-way stays held for BUILD_HOLD_SECONDS after its
last shard process stopped renewing.

Taking a hold and removing an artifact exclude each other through the artifact's own lease: the
holder takes it (waiting) to check the artifact and write the hold; the remover takes it
(without waiting), then looks for live holds before it deletes anything. So a hold taken is a
hold seen, and an artifact removed is never held. (A shard does not wait for a merge or a
whole build that holds the cache's lease: no removal can hold it meanwhile.)
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.lease import LEASE_TTL_SECONDS, Lease, LeaseHeld, in_parent
from kiln.artifacts.store import ObjectStore
from kiln_contract.layout import HOLDS_SIBLING, sibling_key

BUILD_HOLD_SECONDS = 3600.0  # a stopped cache build's shards are kept this long after its last
REMOVAL = "remove"  # how a removal's lease names what it does (kiln.artifacts.inventory)

_READ = "read"
_BUILD = "build"


class NotBuilt(RuntimeError):
    """The artifact a run would read is not (or no longer) built in the store."""


def holds_key(folder_key: str) -> str:
    """'tokenized/x/v1' -> 'tokenized/x/.v1.holds': the folder of an artifact's holds."""
    return sibling_key(folder_key, HOLDS_SIBLING)


@contextlib.contextmanager
def reading(folder: ArtifactFolder, what: str) -> Iterator[Lease]:
    """Holds the built artifact in `folder` while the body reads it; NotBuilt when it is not
    built (or was removed before the hold was taken)."""
    hold = _hold(folder.store, folder.key, _READ, what)
    with folder.lease(f"hold {folder.key} to {what}").acquire(wait=True):
        if not folder.is_built():
            raise NotBuilt(f"{folder.location()} holds no finished artifact (no STATUS SUCCESS)")
        hold.acquire(wait=False)
    try:
        yield hold
    finally:
        hold.release()


@contextlib.contextmanager
def building(cache: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Holds the store-mode cache at `cache` (a path or a URL) for its build: from now until its
    merge ends, or BUILD_HOLD_SECONDS after this process stops (the body ends, is interrupted
    or the process dies); a body that fails lets it go at once."""
    store, key = in_parent(cache)
    folder = ArtifactFolder(store, key)
    hold = _hold(store, key, _BUILD, what, ttl=BUILD_HOLD_SECONDS, detached=True)
    built = not _held_for_build(folder, hold, what)
    try:
        yield
    except Exception:
        if not built:  # a failed build is no work in progress: its STATUS says FAILED
            hold.release()
        raise
    finally:
        if not built:
            hold.let_expire()  # released already if it failed


def _held_for_build(folder: ArtifactFolder, hold: Lease, what: str) -> bool:
    """Takes the build hold unless the cache is built (merged meanwhile); whether it did. Under
    the cache's lease, as a read hold, when that is free or a removal holds it (waited for: it
    is short). A builder holding it (a merge, a whole build) is not waited for: a merge ends the
    build holds once STATUS is written, so a hold taken beside it is let go when STATUS says the
    cache is built."""
    lease = folder.lease(f"hold {folder.key} to {what}")
    try:
        lease.acquire(wait=False)
    except LeaseHeld as e:
        if not e.holder.what.startswith(f"{REMOVAL} "):
            hold.acquire(wait=False)
            if folder.is_built():
                hold.release()
                return False
            return True
        lease.acquire(wait=True)
    with lease:
        if folder.is_built():
            return False
        hold.acquire(wait=False)
        return True


def end_build_holds(cache: str | os.PathLike[str]) -> None:
    """Deletes the build holds of the cache at `cache`: its merge has ended (its STATUS says how).
    Read holds stay: they are their runs'."""
    store, key = in_parent(cache)
    folder = holds_key(key)
    for name in store.keys(folder):
        if name.startswith(f"{_BUILD}-"):
            store.remove(f"{folder}/{name}")
            store.prune(f"{folder}/{name}")  # the holds' folder, once it is empty


def _hold(
    store: ObjectStore,
    folder_key: str,
    kind: str,
    what: str,
    *,
    ttl: float = LEASE_TTL_SECONDS,
    detached: bool = False,
) -> Lease:
    key = f"{holds_key(folder_key)}/{kind}-{secrets.token_hex(6)}.lease"
    return Lease(store, key, what=what, ttl=ttl, detached=detached)
