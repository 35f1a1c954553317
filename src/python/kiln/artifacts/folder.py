"""An artifact's folder in the artifact store, read and written over the object-store
interface (kiln.artifacts.store): a directory and a bucket take the same code. The one way to
read and write an artifact's state (STATUS, the stop reason, the record).

    {name}/{version}/              the folder: record, STATUS (last), summary, the artifact's files
    {name}/.{version}.lease        its lease (kiln.artifacts.lease)
    {name}/.{version}.replaced/    the artifact a forced rebuild replaces (kiln.artifacts.replacement)
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifacts import one_line
from kiln.artifacts.atomic import json_bytes
from kiln.artifacts.content import copy_folder_into, files_under
from kiln.artifacts.lease import Lease, lease_key
from kiln.artifacts.locations import open_store
from kiln.artifacts.store import ObjectStore, read_text
from kiln_contract.layout import (
    FAILED,
    FAILURE_FILE,
    RECORD_FILE,
    STATUS_FILE,
    SUCCESS,
    SUMMARY_TEXT_FILE,
)
from kiln_contract.record import ArtifactRecord, fingerprint_drift


@dataclass(frozen=True)
class ArtifactFolder:
    store: ObjectStore
    key: str  # "{name}/{version}" under the store's root

    @classmethod
    def at(cls, location: str | os.PathLike[str]) -> ArtifactFolder:
        """The folder at a path or a URL, as a store of its own."""
        return cls(open_store(location), "")

    def as_store(self) -> ObjectStore:
        """The folder as a store of its own (its keys relative to it), on the same connection."""
        return self.store.under(self.key) if self.key else self.store

    def child(self, name: str) -> str:
        """The key of the object `name` in the folder (key "": a store rooted at the folder)."""
        return f"{self.key}/{name}" if self.key else name

    def location(self, name: str = "") -> str:
        """Where it is, for people and for readers (a path or a URL)."""
        return self.store.location(self.child(name) if name else self.key)

    def text(self, name: str) -> str | None:
        return read_text(self.store, self.child(name))

    def status(self) -> str | None:
        text = self.text(STATUS_FILE)
        return None if text is None else text.strip()

    def is_built(self) -> bool:
        return self.status() == SUCCESS

    def record(self) -> dict[str, Any] | None:
        """The stored record; None when there is none (or it is not a JSON object)."""
        text = self.text(RECORD_FILE)
        try:
            stored = None if text is None else json.loads(text)
        except ValueError:
            return None
        return stored if isinstance(stored, dict) else None

    def summary(self) -> str | None:
        return self.text(SUMMARY_TEXT_FILE)

    def drift(self, record: ArtifactRecord) -> str | None:
        """How the artifact stored here differs from `record` ("fingerprint X; differs in:
        ..."), or None when the folder holds this one or none."""
        stored = self.record()
        return None if stored is None else fingerprint_drift(stored, record)

    def write_json(self, name: str, obj: Any) -> None:
        self.store.write(self.child(name), json_bytes(obj))

    def write_status(self, status: str) -> None:
        self.store.write(self.child(STATUS_FILE), f"{status}\n".encode())

    def stop_reason(self) -> str | None:
        """Why the last run here failed or stopped (FAILURE_FILE), or None."""
        text = self.text(FAILURE_FILE)
        return None if text is None else text.strip()

    def record_stop(self, reason: str) -> None:
        """Writes why the run here failed or stopped, leaving STATUS as it is: FAILED is
        `mark_failed`'s, and an interrupted run stays RUNNING (resumable)."""
        self.store.write(self.child(FAILURE_FILE), (one_line(reason) + "\n").encode())

    def clear_stop_reason(self) -> None:
        """Removes an earlier run's reason: a run starting here has none yet."""
        self.store.remove(self.child(FAILURE_FILE))

    def mark_failed(self, reason: str) -> None:
        """Writes why the build failed, then STATUS FAILED, even on a full local disk: when the
        atomic write finds no space for its temp file, an existing STATUS is overwritten in place
        (its blocks are already allocated); the reason is then lost unless its own write found
        room. A write torn by a crash reads as neither SUCCESS nor anything else Kiln serves, so
        it is as safe as FAILED: the next run resumes or rebuilds either way."""
        with contextlib.suppress(OSError):
            self.record_stop(reason)
        try:
            self.write_status(FAILED)
        except OSError:
            root = self.store.root_location.folder
            if root is None:
                raise
            status = root / self.child(STATUS_FILE)
            with contextlib.suppress(OSError), open(status, "r+b") as f:
                f.write(f"{FAILED}\n".encode())
                f.truncate()
                f.flush()
                os.fsync(f.fileno())

    def lease(self, what: str, *, job: str | None = None) -> Lease:
        """The folder's lease, taken for `what` (by a host of cluster job `job`)."""
        return Lease(self.store, lease_key(self.key), what=what, job=job)

    def is_empty(self) -> bool:
        return not self.store.keys(self.key)

    @contextlib.contextmanager
    def local_files(self, fetch: Callable[[Path], None] | None = None) -> Iterator[Path]:
        """The artifact's files on this machine, to read: its own folder in a directory store;
        from a bucket, a temporary folder that `fetch` fills (by default with every object)."""
        if not self.store.root_location.in_bucket:
            yield Path(self.location())
            return
        with tempfile.TemporaryDirectory(prefix="kiln-artifact-") as local:
            (fetch or self._download_into)(Path(local))
            yield Path(local)

    @contextlib.contextmanager
    def local_output(self) -> Iterator[Path]:
        """A local folder the body writes the artifact's files in: its own folder in a directory
        store (writers there rename into place); for a bucket a temporary one, uploaded when the
        body ends without error and wrote it: STATUS removed first, the objects that no new file
        replaces deleted, STATUS uploaded last (a bucket has no rename, and a cut-off upload
        never reads as complete)."""
        if not self.store.root_location.in_bucket:
            yield Path(self.location())
            return
        with tempfile.TemporaryDirectory(prefix="kiln-upload-") as staging:
            local = Path(staging) / "out"
            yield local
            if local.is_dir():
                self._replace_with(local)

    def _download_into(self, local: Path) -> None:
        for name in self.store.keys(self.key):
            self.store.download(self.child(name), local / name)

    def _replace_with(self, local: Path) -> None:
        self.store.remove(self.child(STATUS_FILE))
        for stale in set(self.store.keys(self.key)) - set(files_under(local)):
            self.store.remove(self.child(stale))
        copy_folder_into(self.store, self.key, local)

