"""A run folder in a bucket, worked on through a local staging folder (docs/artifacts.md, "Runs
in a bucket").

The trainer, orbax and the report write files; a bucket has objects. So a run whose store is a
bucket trains into a local staging folder, and the bucket stays the truth:

- `pull` fills the staging folder from the bucket before training: the run's files (record,
  metrics, plots) and only the newest *complete* checkpoint, one whose `metadata.json` object
  exists. Its marker is uploaded last, so a save whose upload was cut off never reads as
  complete; such leftovers are deleted from the bucket (the puller holds the run's lease).
- `uploading()` runs a background thread that uploads each checkpoint once it is complete in
  the staging folder (every state file, the run's changed files such as metrics.jsonl, then
  `metadata.json`: a complete checkpoint never lacks the metrics up to it), then the run's
  other files, and deletes from the bucket the checkpoints the trainer pruned (their marker
  first). Training never waits for an upload.
- `push(status=True)` is the final, blocking upload: checkpoints, files, and `STATUS` last.

The control endpoint's folder (its key is a secret) never leaves the machine.

Files move by the stores' streaming `upload` and `download` (in parts: a checkpoint's files of
gigabytes never sit in memory). Transient bucket errors are retried with backoff by the stores
themselves (kiln.artifacts.s3, kiln.artifacts.gcs); what still fails is a StorageError naming
the URL.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kiln.artifacts import STATUS_FILE
from kiln.artifacts.storage_errors import StorageError
from kiln.artifacts.store import ObjectStore
from kiln.control.tokens import CONTROL_DIR
from kiln.train.checkpoints import METADATA_FILE, STEP_DIR

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
UPLOAD_INTERVAL_SECONDS = 1.0  # how often the background thread looks for new files
_PARALLEL_OBJECTS = 8  # objects upload and download independently: overlap the requests
# Not uploaded as files: checkpoints (their own protocol, above) and the control endpoint's key
# and address (a secret, and meaningful only on this machine while the run lasts).
_NOT_FILES = (CHECKPOINTS, CONTROL_DIR)


class RunMirror:
    """The run folder `key` of `store`, staged in the local folder `local`."""

    def __init__(self, store: ObjectStore, key: str, local: Path) -> None:
        self.store = store
        self.key = key
        self.local = local
        self._uploaded: dict[str, bytes] = {}  # checkpoint folder -> the marker uploaded
        self._files_uploaded: dict[str, tuple[int, int]] = {}  # file -> (mtime_ns, size)
        self._lock = threading.Lock()  # one upload pass at a time

    def location(self, name: str = "") -> str:
        return self.store.location(f"{self.key}/{name}" if name else self.key)

    def pull(self, *, checkpoints: bool) -> str | None:
        """Downloads the run's files and (`checkpoints`) its newest complete checkpoint into the
        staging folder; deletes incomplete checkpoints from the bucket (all of them when not
        `checkpoints`: a dev run starting over). Returns the checkpoint's folder name."""
        names = self.store.keys(self.key)
        folders = _checkpoint_folders(names)
        complete = sorted((f for f, files in folders.items() if METADATA_FILE in files),
                          key=_step)  # fmt: skip
        newest = complete[-1] if complete and checkpoints else None
        for folder, files in folders.items():
            if folder != newest and (folder not in complete or not checkpoints):
                self._remove_checkpoint(folder, files)
        wanted = [n for n in names if n.partition("/")[0] not in _NOT_FILES and n != STATUS_FILE]
        if newest is not None:
            wanted += [f"{CHECKPOINTS}/{newest}/{name}" for name in folders[newest]]
        _parallel(self._download, wanted)
        if newest is not None:
            marker = self.local / CHECKPOINTS / newest / METADATA_FILE
            self._uploaded[newest] = marker.read_bytes()
        return newest

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
                    log.warning("upload to %s failed, retrying: %s", self.location(), e)

        thread = threading.Thread(target=loop, name="kiln-upload", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def push(self, *, status: bool) -> None:
        """Uploads what is new in the staging folder: complete checkpoints, then the run's other
        files; `STATUS` last when `status`."""
        with self._lock:
            self._push_checkpoints()
            self._push_run_files()
            if status and (self.local / STATUS_FILE).is_file():
                self._upload(STATUS_FILE)

    def _push_run_files(self) -> None:
        """The run's files other than checkpoints and STATUS (metrics, record, plots), if changed."""
        files = [n for n in _files(self.local) if n.partition("/")[0] not in _NOT_FILES]
        _parallel(self._upload_if_changed, [n for n in files if n != STATUS_FILE])

    def _push_checkpoints(self) -> None:
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
            key = f"{self.key}/{CHECKPOINTS}/{folder}"
            try:
                if folder not in self._uploaded:
                    state = [n for n in _files(root / folder, hidden=True) if n != METADATA_FILE]
                    _parallel(self._upload, [f"{CHECKPOINTS}/{folder}/{n}" for n in state])
            except FileNotFoundError:  # pruned by the trainer meanwhile: a newer one supersedes it
                self._remove_checkpoint(folder, self.store.keys(key))
                continue
            # The metrics up to this step first: a complete checkpoint never lacks its history,
            # even when the upload of a later one is cut off.
            self._push_run_files()
            self.store.write(f"{key}/{METADATA_FILE}", marker)  # last: now it is complete
            self._uploaded[folder] = marker
        for folder in [f for f in self._uploaded if f not in present]:
            files = self.store.keys(f"{self.key}/{CHECKPOINTS}/{folder}")
            self._remove_checkpoint(folder, files)
            del self._uploaded[folder]

    def _remove_checkpoint(self, folder: str, files: list[str]) -> None:
        """Deletes a checkpoint's objects, its marker first: never a complete-looking part."""
        ordered = sorted(files, key=lambda name: name != METADATA_FILE)
        for name in ordered:
            self.store.remove(f"{self.key}/{CHECKPOINTS}/{folder}/{name}")

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
        self.store.upload(f"{self.key}/{name}", self.local / name)

    def _download(self, name: str) -> None:
        self.store.download(f"{self.key}/{name}", self.local / name)


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
