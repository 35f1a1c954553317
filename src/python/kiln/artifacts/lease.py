"""Leases: one builder per artifact, as an object in the store (no file lock).

The lease of a folder `.../X` is the object `.../.X.lease` beside it (so it can exist before the
folder does, and never travels with the folder's contents). It is a small JSON object:

    {"owner": "<random id>", "host": "...", "pid": 123, "pid_started": <clock ticks or null>,
     "what": "train checkpoints/x@v", "created": <unix s>, "expires": <unix s>,
     "job": <the cluster job's id, or null>, "detached": <bool>}

- Taking it is a conditional create (ObjectStore.create): of two processes, exactly one wins.
- The holder renews it from a heartbeat thread every HEARTBEAT_SECONDS, moving `expires` to
  now + LEASE_TTL_SECONDS, with a conditional replace on the generation it wrote last. When the
  build ends, successfully or not, it releases it: a conditional replace with a `released`
  record (which fails if the lease was taken over), then a delete of that record; where a
  directory's disk has no room for that record, a delete of the generation it wrote (which
  needs none; a directory honours generations on delete).
- Another process takes it over (a conditional replace of the generation it read) when it was
  released, when it has expired, or at once when its holder ran on this host and that process
  is gone (no such pid, a zombie, or a pid reused by a process started later): a crashed run is
  resumed without waiting. A holder on another host that died is taken over after expiry, or
  at once by the next attempt of the same cluster job (whose driver ended the one before).
- So no step depends on the store honouring a generation on delete (GCS emulators ignore it):
  every decision is a conditional create or replace. The delete only tidies a released
  record away; should a server ignore its generation while another process takes that
  released record over in the milliseconds between, that process's next renewal finds its
  lease gone, and it records nothing.
- A holder whose renewal finds another generation (it stalled past its expiry and was taken
  over) has lost the lease: `lost` says so, and its caller does not record a result.

Expiry compares wall clocks: hosts that share a store keep their clocks in sync (NTP); clock
skew shortens or lengthens a dead holder's grace period by the same amount.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kiln.artifacts.locations import open_store
from kiln.artifacts.storage_errors import StorageError
from kiln.artifacts.store import ObjectExists, ObjectMissing, ObjectStore, PreconditionFailed
from kiln_contract.layout import LEASE_SIBLING, sibling_key
from kiln_contract.processes import is_running

log = logging.getLogger(__name__)

LEASE_TTL_SECONDS = 120.0  # a holder that stops renewing is taken over this long after
HEARTBEAT_SECONDS = 30.0  # how often the holder renews: four times per TTL
_MAX_POLL_SECONDS = 2.0  # a waiter's longest pause between looks at the lease


def in_parent(folder: str | os.PathLike[str]) -> tuple[ObjectStore, str]:
    """A folder (a path, or a folder URL in a bucket) as (its parent opened as a store, its
    name there): where the objects beside it (its lease, its holds) are written."""
    parent, _, name = os.fspath(folder).rstrip("/").rpartition("/")
    return open_store(parent or "."), name


def lease_key(folder_key: str) -> str:
    """'tokenized/x/v1' -> 'tokenized/x/.v1.lease': the lease object beside a folder."""
    return sibling_key(folder_key, LEASE_SIBLING)


@dataclass(frozen=True)
class LeaseRecord:
    owner: str
    host: str
    pid: int
    pid_started: int | None
    what: str
    created: float
    expires: float
    job: str | None = None  # the cluster job whose process holds it (kiln.cluster), if any
    released: bool = False  # its holder let it go: free to take
    # Bound to no process: it holds until it expires or is released, after its writer ended
    # (a store-mode cache's build hold, kiln.artifacts.holds).
    detached: bool = False

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseRecord:
        """The record in a lease object; ValueError if it is not one."""
        try:
            fields = json.loads(data)
            return cls(
                owner=str(fields["owner"]),
                host=str(fields["host"]),
                pid=int(fields["pid"]),
                pid_started=None if fields["pid_started"] is None else int(fields["pid_started"]),
                what=str(fields["what"]),
                created=float(fields["created"]),
                expires=float(fields["expires"]),
                job=None if fields.get("job") is None else str(fields["job"]),
                released=bool(fields.get("released", False)),
                detached=bool(fields.get("detached", False)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a lease record ({e})") from None

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        return f"{self.what} (host {self.host}, pid {self.pid}, since {since})"

    def stale_reason(self, now: float, job: str | None = None) -> str | None:
        """Why this lease may be taken over now by a process of cluster job `job` (if any), or
        None while its holder may still be alive. The driver of a cluster job kills every host
        of an attempt before it starts the next, so a lease of the same job is stale at once."""
        if self.released:
            return "its holder released it"
        if now >= self.expires:
            return f"it expired {now - self.expires:.0f} s ago"
        if job is not None and self.job == job:
            return f"an earlier attempt of job {job} held it, and the job's driver ended it"
        if (
            not self.detached
            and self.host == socket.gethostname()
            and _process_is_gone(self.pid, self.pid_started)
        ):
            return f"its holder, pid {self.pid} on this host, has ended"
        return None


class LeaseHeld(RuntimeError):
    """Another live process holds the lease."""

    def __init__(self, location: str, holder: LeaseRecord):
        super().__init__(f"the lease {location} is held by {holder.describe()}")
        self.holder = holder


class Lease:
    """The lease at `key` in `store`, taken for `what` (a phrase naming the build)."""

    def __init__(
        self,
        store: ObjectStore,
        key: str,
        *,
        what: str,
        ttl: float = LEASE_TTL_SECONDS,
        heartbeat: float = HEARTBEAT_SECONDS,
        clock: Callable[[], float] = time.time,
        job: str | None = None,
        detached: bool = False,
    ) -> None:
        self.store = store
        self.key = key
        self.what = what
        self.job = job
        self.detached = detached
        self.ttl = ttl
        self.heartbeat = heartbeat
        self._clock = clock
        self._owner = secrets.token_hex(8)
        self._generation: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost: str | None = None  # why the lease was lost while held, if it was

    @classmethod
    def beside(
        cls,
        folder: str | os.PathLike[str],
        *,
        what: str,
        ttl: float = LEASE_TTL_SECONDS,
        heartbeat: float = HEARTBEAT_SECONDS,
    ) -> Lease:
        """The lease of a folder (a path, or a folder URL in a bucket): the object
        `.{name}.lease` in the folder's parent."""
        store, name = in_parent(folder)
        return cls(store, lease_key(name), what=what, ttl=ttl, heartbeat=heartbeat)

    @property
    def location(self) -> str:
        return self.store.location(self.key)

    def acquire(
        self, *, wait: bool, on_wait: Callable[[LeaseRecord], None] | None = None
    ) -> Lease:
        """Takes the lease. A live holder: LeaseHeld at once (`wait=False`), or wait until it
        releases the lease or goes stale; while waiting, `on_wait(holder)` is called at each
        look (every few seconds), or without it the holder is said once on the log."""
        delay, announced = 0.05, False
        while True:
            record = self._record()
            try:
                self._generation = self.store.create(self.key, record.to_bytes())
                break
            except ObjectExists:
                pass
            holder, self._generation = self._take_over_if_stale(record)
            if self._generation is not None:
                break
            if holder is None:
                continue  # deleted or taken by another just now: try again at once
            if not wait:
                raise LeaseHeld(self.location, holder)
            if on_wait is not None:
                on_wait(holder)
            elif not announced:
                log.warning(
                    "waiting for %s: %s holds %s", self.what, holder.describe(), self.location
                )
                announced = True
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_SECONDS)
        self._stop.clear()
        self._renewer = threading.Thread(
            target=self._renew_until_stopped, args=(record,), daemon=True
        )
        self._renewer.start()
        return self

    def release(self) -> None:
        """Stops renewing, marks the lease released and deletes it, unless another process has
        taken it over (the conditional replace then fails, and nothing is deleted)."""
        self._stop_renewing()
        if self._generation is None:
            return
        released = replace(self._record(), released=True).to_bytes()
        try:
            generation = self.store.replace(self.key, released, generation=self._generation)
            self.store.delete(self.key, generation=generation)
        except (PreconditionFailed, ObjectMissing):
            pass  # taken over after we stalled (or from the released record): not ours
        except (OSError, StorageError) as e:
            self._delete_own(e)
        self._generation = None

    def _delete_own(self, unreleased: Exception) -> None:
        """The released record could not be written: in a directory (its disk full, say) the
        lease is deleted while it is still the generation this process wrote, which needs no
        space (a directory honours generations on delete); a bucket's goes stale with this
        process."""
        assert self._generation is not None
        if self.store.root_location.in_bucket:
            log.warning("could not release the lease %s: %s", self.location, unreleased)
            return
        try:
            self.store.delete(self.key, generation=self._generation)
        except (PreconditionFailed, ObjectMissing):
            pass  # taken over after we stalled: not ours
        except OSError as e:
            log.warning("could not release the lease %s: %s", self.location, e)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _record(self) -> LeaseRecord:
        now = self._clock()
        return LeaseRecord(
            owner=self._owner,
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_started=_process_started(os.getpid()),
            what=self.what,
            created=now,
            expires=now + self.ttl,
            job=self.job,
            detached=self.detached,
        )

    def let_expire(self) -> None:
        """Stops renewing and leaves the record in place: a detached lease then holds until it
        expires (or another process releases it)."""
        self._stop_renewing()
        self._generation = None

    def _stop_renewing(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None

    def _take_over_if_stale(
        self, record: LeaseRecord
    ) -> tuple[LeaseRecord | None, str | None]:
        """(the live holder, None); or (None, the generation of `record`) when the lease was
        released or stale and this process replaced it; or (None, None) when it is gone or
        another process replaced it first."""
        try:
            current = self.store.read(self.key)
        except ObjectMissing:
            return None, None
        released = False
        try:
            holder = LeaseRecord.from_bytes(current.data)
            reason, released = holder.stale_reason(self._clock(), self.job), holder.released
        except ValueError as e:
            reason = f"it is unreadable: {e}"
        if reason is None:
            return holder, None
        try:
            generation = self.store.replace(
                self.key, record.to_bytes(), generation=current.generation
            )
        except (PreconditionFailed, ObjectMissing):
            return None, None  # another process took it, renewed it or released it first
        if not released:  # a released lease is free: taking it is no news
            log.warning("taking over the lease %s for %s: %s", self.location, self.what, reason)
        return None, generation

    def _renew_until_stopped(self, record: LeaseRecord) -> None:
        expires = record.expires
        while not self._stop.wait(self.heartbeat):
            record = replace(record, expires=self._clock() + self.ttl)
            assert self._generation is not None  # set before the thread starts
            try:
                self._generation = self.store.replace(
                    self.key, record.to_bytes(), generation=self._generation
                )
                expires = record.expires
            except ObjectMissing as e:
                if self.detached:  # ended by the work it held for (a cache's merge): not lost
                    self._generation = None
                    return
                self._lose(f"another process took it over ({e})")
                return
            except PreconditionFailed as e:
                self._lose(f"another process took it over ({e})")
                return
            except (OSError, StorageError) as e:  # a full disk, a bucket that stopped answering:
                # keep trying until the lease expires
                if self._clock() >= expires:
                    self._lose(f"it expired while renewals failed ({e})")
                    return
                log.warning("could not renew the lease %s (will retry): %s", self.location, e)

    def _lose(self, reason: str) -> None:
        self.lost = reason
        self._generation = None
        log.error("lost the lease %s for %s: %s", self.location, self.what, reason)


def _process_is_gone(pid: int, started: int | None) -> bool:
    """Whether process `pid` of this host, started at `started` (if known), has ended."""
    if not is_running(pid):
        return True
    stat = _proc_stat(pid)
    if stat is None:
        return False  # no /proc here: the pid answers, so assume it is the holder
    state, now_started = stat
    return state == "Z" or (started is not None and now_started != started)


def _process_started(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) from /proc/PID/stat; None without /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    return fields[0], int(fields[19])  # starttime is field 22
