"""The artifact store on disk: atomic writes, the status token and the artifact record.

Layout of one artifact (see docs/artifacts.md):

    {prefix}/{name}/{version}/
        artifact.json     the record: name, version, fingerprint, config, inputs, provenance
        summary.txt       what `pants run` prints for a built artifact
        STATUS            one of SUCCESS, FAILED, RUNNING; written last, so a record
                          without SUCCESS is never served
        .lease            held by the one process building the artifact
        ...               the artifact's own files (cache splits, checkpoints/, metrics.jsonl)

Every write is temp-file + fsync + rename: a process killed at any moment leaves either the
old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RECORD_FILE = "artifact.json"
SUMMARY_TEXT_FILE = "summary.txt"  # a built artifact's human summary, printed when it is served
STATUS_FILE = "STATUS"
TRAIN_SPEC_FILE = "train_spec.json"  # a checkpoint's trainer spec (docs/step-spec.md)
LEASE_FILE = ".lease"

SUCCESS = "SUCCESS"
FAILED = "FAILED"
RUNNING = "RUNNING"


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; artifacts are shared, so give the usual umask-respecting mode.
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_status(artifact_dir: str | os.PathLike[str]) -> str | None:
    try:
        return (Path(artifact_dir) / STATUS_FILE).read_text().strip()
    except FileNotFoundError:
        return None


def write_status(artifact_dir: str | os.PathLike[str], status: str) -> None:
    atomic_write_text(Path(artifact_dir) / STATUS_FILE, status + "\n")


def is_built(artifact_dir: str | os.PathLike[str]) -> bool:
    return read_status(artifact_dir) == SUCCESS


class LeaseHeld(RuntimeError):
    """Another process is building the same artifact."""


@contextlib.contextmanager
def lease(artifact_dir: str | os.PathLike[str], *, wait: bool) -> Iterator[None]:
    """Holds an exclusive lock on the artifact for the duration of a build.

    An OS file lock (flock) rather than a timestamped lease file: the kernel releases it when
    the holder dies, even by SIGKILL, so there is no staleness to guess. `wait=False` raises
    LeaseHeld at once if another process holds it.
    """
    path = Path(artifact_dir) / LEASE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        flags = fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(f.fileno(), flags)
        except BlockingIOError:
            raise LeaseHeld(
                f"{artifact_dir} is being built by another process (lock {path}); "
                "wait for it to finish or stop it."
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
