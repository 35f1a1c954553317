"""A run folder in a bucket, worked on through a local staging folder on each host (docs/artifacts.md,
"Runs in a bucket").

The trainer, orbax and the report write files; a bucket has objects. So a run whose store is a
bucket trains into a local staging folder on every host, and the bucket stays the truth:

- `pull` fills the staging folder from the bucket before training: on process 0 the run's files
  (record, metrics, plots), on every host the newest *complete* checkpoint, one whose
  `metadata.json` object exists. That marker is uploaded last, so a save whose upload was cut
  off never reads as complete; process 0 (which holds the run's lease) deletes such leftovers.
- `uploading()` runs a background thread that uploads each checkpoint once it is complete in
  the staging folder, and on process 0 the run's other files, and deletes from the bucket the
  checkpoints the trainer pruned (their marker first). Training never waits for an upload.
- Checkpoints of several hosts: each host saves the shards it holds into its own staging folder
  (kiln.train.checkpoints, `per_host_folders`), uploads them, then writes
  `checkpoints/step-N/hosts/process-I.json` (its files and sizes). Process 0 uploads the marker,
  whose `files` are every host's, once every host's list is there.
- `push(status=True, final=True)` is the final, blocking upload: checkpoints (process 0 waits
  for the other hosts' lists), files, and `STATUS` last. `fetch` then gives each host what
  other hosts wrote of the run (their shards of the newest checkpoint, process 0's files), for
  the readers of the model after training.

The control endpoint's folder (its key is a secret) never leaves the machine.

Files move by the stores' streaming `upload` and `download` (in parts: a checkpoint's files of
gigabytes never sit in memory). Transient bucket errors are retried with backoff by the stores
themselves (kiln.artifacts.s3, kiln.artifacts.gcs); what still fails is a StorageError naming
the URL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kiln.artifacts import STATUS_FILE
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.storage_errors import StorageError
from kiln.artifacts.store import ObjectMissing, read_text
from kiln.control.tokens import CONTROL_DIR
from kiln.train.checkpoints import METADATA_FILE, STATE_DIR, STEP_DIR

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
HOSTS_DIR = "hosts"  # in a checkpoint's folder: each host's list of the files it uploaded
UPLOAD_INTERVAL_SECONDS = 1.0  # how often the background thread looks for new files
HOSTS_WAIT_SECONDS = 600.0  # the final push waits this long for the other hosts' uploads
_PARALLEL_OBJECTS = 8  # objects upload and download independently: overlap the requests
# Not uploaded as files: checkpoints (their own protocol, above) and the control endpoint's key
# and address (a secret, and meaningful only on this machine while the run lasts).
_NOT_FILES = (CHECKPOINTS, CONTROL_DIR)


class HostsMissing(StorageError):
    """The other hosts' uploads of a checkpoint did not arrive in time."""


class RunMirror:
    """The run folder `folder` of a store, staged in the local folder `local` of process
    `process_index` of `process_count`."""

    def __init__(
        self,
        folder: ArtifactFolder,
        local: Path,
        *,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        self.folder = folder
        self.store = folder.store
        self.local = local
        self.process_index = process_index
        self.process_count = process_count
        self._uploaded: dict[str, bytes] = {}  # checkpoint folder -> the marker uploaded
        self._state_uploaded: set[str] = set()  # checkpoint folders whose own files are up
        self._files_uploaded: dict[str, tuple[int, int]] = {}  # file -> (mtime_ns, size)
        self._lock = threading.Lock()  # one upload pass at a time

    @property
    def _leader(self) -> bool:
        return self.process_index == 0


    def pull(self, *, checkpoints: bool) -> str | None:
        """Downloads the newest complete checkpoint (unless not `checkpoints`) and, on process
        0, the run's files into the staging folder; process 0 deletes incomplete checkpoints
        from the bucket (all of them when not `checkpoints`: a dev run starting over). Returns
        the checkpoint's folder name."""
        names = self.store.keys(self.folder.key)
        folders = _checkpoint_folders(names)
        complete = sorted((f for f, files in folders.items() if METADATA_FILE in files),
                          key=_step)  # fmt: skip
        newest = complete[-1] if complete and checkpoints else None
        wanted = []
        if self._leader:
            for folder, files in folders.items():
                if folder != newest and (folder not in complete or not checkpoints):
                    self._remove_checkpoint(folder, files)
            wanted += [n for n in names
                       if n.partition("/")[0] not in _NOT_FILES and n != STATUS_FILE]  # fmt: skip
        if newest is not None:
            wanted += [f"{CHECKPOINTS}/{newest}/{name}" for name in folders[newest]
                       if not name.startswith(f"{HOSTS_DIR}/")]  # fmt: skip
        _parallel(self._download, wanted)
        if newest is not None:
            marker = self.local / CHECKPOINTS / newest / METADATA_FILE
            self._uploaded[newest] = marker.read_bytes()
            self._state_uploaded.add(newest)
        return newest

    def fetch(self, *, step: int | str = "last") -> None:
        """A copy here of the run's files and one complete checkpoint ("last": the newest), for
        a reader: an export, or a host after training (the report reads the whole model and
        the run's summary, which other hosts wrote). Files this folder holds already are kept.
        Nothing in the bucket changes."""
        names = self.store.keys(self.folder.key)
        folders = _checkpoint_folders(names)
        complete = sorted((f for f, files in folders.items() if METADATA_FILE in files), key=_step)
        chosen = [f for f in complete if step == "last" or _step(f) == step][-1:]
        wanted = [n for n in names if n.partition("/")[0] not in _NOT_FILES]
        wanted += [f"{CHECKPOINTS}/{folder}/{name}" for folder in chosen
                   for name in folders[folder] if not name.startswith(f"{HOSTS_DIR}/")]  # fmt: skip
        _parallel(self._download, [n for n in wanted if not (self.local / n).is_file()])

    def holds_checkpoint(self, path: Path) -> bool:
        """Whether the checkpoint the trainer committed at `path` is complete in the bucket: its
        marker object is there (asked of the bucket, not of what this process uploaded). One
        outside the run's checkpoints (a temporary base path) is not mirrored: it is as durable
        as its commit."""
        if path.parent.resolve() != (self.local / CHECKPOINTS).resolve():
            return True
        try:
            self.store.size(f"{self._checkpoint_key(path.name)}/{METADATA_FILE}")
        except ObjectMissing:
            return False
        return True

    @contextlib.contextmanager
    def uploading(self) -> Iterator[None]:
        """Uploads in the background while the block runs (failures are logged and retried on
        the next pass; the final `push` raises them)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(UPLOAD_INTERVAL_SECONDS):
                try:
                    self.push(status=False)
                except (OSError, StorageError) as e:
                    log.warning("upload to %s failed, retrying: %s", self.folder.location(), e)

        thread = threading.Thread(target=loop, name="kiln-upload", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def push(self, *, status: bool, final: bool = False) -> None:
        """Uploads what is new in the staging folder: complete checkpoints, then (process 0) the
        run's other files, and `STATUS` last when `status`. A `final` push on process 0 waits
        until the other hosts have uploaded the newest checkpoint."""
        with self._lock:
            self._push_checkpoints(wait=final)
            if not self._leader:
                return
            self._push_run_files()
            if status and (self.local / STATUS_FILE).is_file():
                self._upload(STATUS_FILE)

    def _push_run_files(self) -> None:
        """The run's files other than checkpoints and STATUS (metrics, record, plots), if changed."""
        files = [n for n in _files(self.local) if n.partition("/")[0] not in _NOT_FILES]
        _parallel(self._upload_if_changed, [n for n in files if n != STATUS_FILE])

    def _push_checkpoints(self, *, wait: bool) -> None:
        root = self.local / CHECKPOINTS
        present = sorted((p.name for p in root.iterdir() if STEP_DIR.match(p.name)), key=_step) \
            if root.is_dir() else []  # fmt: skip
        for folder in present:
            try:
                marker = (root / folder / METADATA_FILE).read_bytes()
            except FileNotFoundError:
                continue  # still being saved
            if self._uploaded.get(folder) == marker:
                continue
            try:
                self._push_state(folder)
            except FileNotFoundError:  # pruned by the trainer meanwhile: a newer one supersedes it
                if self._leader:
                    self._remove_checkpoint(folder, self.store.keys(self._checkpoint_key(folder)))
                continue
            if self._leader:
                self._complete(folder, marker, wait=wait and folder == present[-1])
            else:
                self._uploaded[folder] = marker
        if self._leader:
            for folder in [f for f in self._uploaded if f not in present]:
                files = self.store.keys(self._checkpoint_key(folder))
                self._remove_checkpoint(folder, files)
                del self._uploaded[folder]

    def _push_state(self, folder: str) -> None:
        """Uploads this host's files of the checkpoint (once); other hosts than process 0 then
        list them under hosts/. Process 0 uploads its whole state folder; the others the array
        files inside it (its top-level metadata is process 0's to write)."""
        if folder in self._state_uploaded:
            return
        state = self.local / CHECKPOINTS / folder / STATE_DIR
        names = [n for n in _files(state, hidden=True) if self._leader or "/" in n]
        _parallel(self._upload, [f"{CHECKPOINTS}/{folder}/{STATE_DIR}/{n}" for n in names])
        if not self._leader:
            sizes = {f"{n}": {"bytes": (state / n).stat().st_size} for n in names}
            listing = json.dumps({"files": sizes}, sort_keys=True).encode()
            self.store.write(self._host_list_key(folder, self.process_index), listing)
        self._state_uploaded.add(folder)

    def _complete(self, folder: str, marker: bytes, *, wait: bool) -> None:
        """On process 0: the metrics up to this step first (a complete checkpoint never lacks
        its history), then the marker, with every host's files, once every host's are up."""
        deadline = time.monotonic() + (HOSTS_WAIT_SECONDS if wait else 0.0)
        while (listings := self._host_listings(folder)) is None:
            if time.monotonic() >= deadline:
                if wait:
                    raise HostsMissing(
                        self.folder.location(f"{CHECKPOINTS}/{folder}"),
                        f"the other hosts' uploads of it did not arrive within "
                        f"{HOSTS_WAIT_SECONDS:.0f} s",
                    )
                return  # the next pass looks again
            time.sleep(UPLOAD_INTERVAL_SECONDS)
        self._push_run_files()
        self.store.write(f"{self._checkpoint_key(folder)}/{METADATA_FILE}",
                         _with_files(marker, listings))  # fmt: skip
        self._uploaded[folder] = marker

    def _host_listings(self, folder: str) -> list[dict[str, Any]] | None:
        """The other hosts' lists of their files of the checkpoint; None while one is missing."""
        listings = []
        for index in range(1, self.process_count):
            text = read_text(self.store, self._host_list_key(folder, index))
            if text is None:
                return None
            listings.append(json.loads(text))
        return listings

    def _checkpoint_key(self, folder: str) -> str:
        return self.folder.child(f"{CHECKPOINTS}/{folder}")

    def _host_list_key(self, folder: str, index: int) -> str:
        return f"{self._checkpoint_key(folder)}/{HOSTS_DIR}/process-{index}.json"

    def _remove_checkpoint(self, folder: str, files: list[str]) -> None:
        """Deletes a checkpoint's objects, its marker first: never a complete-looking part."""
        ordered = sorted(files, key=lambda name: name != METADATA_FILE)
        for name in ordered:
            self.store.remove(f"{self._checkpoint_key(folder)}/{name}")

    def _upload_if_changed(self, name: str) -> None:
        try:
            stat = (self.local / name).stat()
            version = (stat.st_mtime_ns, stat.st_size)
            if self._files_uploaded.get(name) != version:
                self._upload(name)
                self._files_uploaded[name] = version
        except FileNotFoundError:
            pass  # replaced or removed meanwhile: the next pass sees what is there

    def _upload(self, name: str) -> None:
        self.store.upload(self.folder.child(name), self.local / name)

    def _download(self, name: str) -> None:
        self.store.download(self.folder.child(name), self.local / name)


def _with_files(marker: bytes, listings: list[dict[str, Any]]) -> bytes:
    """Process 0's metadata.json with the other hosts' files added to its `files`."""
    if not listings:
        return marker
    metadata = json.loads(marker)
    if metadata.get("files") is not None:
        for listing in listings:
            metadata["files"].update(listing["files"])
    return json.dumps(metadata).encode()


def _files(folder: Path, *, hidden: bool = False) -> list[str]:
    """The files below `folder`; hidden ones (temporaries of atomic writes) only if `hidden`."""
    names = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return sorted(n for n in names if hidden or not any(p.startswith(".") for p in n.split("/")))


def _checkpoint_folders(names: list[str]) -> dict[str, list[str]]:
    """'checkpoints/step-3/state/x' -> {'step-3': ['state/x', ...]}."""
    folders: dict[str, list[str]] = {}
    for name in names:
        top, _, rest = name.partition("/")
        folder, _, inside = rest.partition("/")
        if top == CHECKPOINTS and STEP_DIR.match(folder) and inside:
            folders.setdefault(folder, []).append(inside)
    return folders


def _step(folder: str) -> int:
    return int(folder.removeprefix("step-"))


def _parallel(action: Callable[[str], None], names: list[str]) -> None:
    with ThreadPoolExecutor(_PARALLEL_OBJECTS) as pool:
        list(pool.map(action, names))


def local_run(folder: ArtifactFolder, step: int | str) -> contextlib.AbstractContextManager[Path]:
    """The run's folder on this machine, to read: itself in a directory store, or a copy of what
    an export of checkpoint `step` reads from a bucket (its files and that checkpoint)."""
    return folder.local_files(lambda local: RunMirror(folder, local).fetch(step=step))
