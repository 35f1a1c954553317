"""The artifact store: one artifact folder's layout, atomic writes and the status token.

Layout of one artifact (see docs/artifacts.md):

    {prefix}/{name}/{version}/
        artifact.json     the record: name, version, fingerprint, config, inputs, provenance
        summary.txt       what `pants run` prints for a built artifact
        failure.txt       why the last run failed or stopped, one line
                          (`folder.ArtifactFolder.mark_failed`, `record_stop`); removed when a run starts
        STATUS            one of SUCCESS, FAILED, RUNNING; written last, so a record
                          without SUCCESS is never served
        ...               the artifact's own files (cache splits, checkpoints/, metrics.jsonl)
    {prefix}/{name}/.{version}.lease    the lease of the one process building it (beside the
                                        folder, so it exists before the folder does)
    {prefix}/{name}/.{version}.replaced/  the artifact a forced rebuild replaces, until the
                                          rebuild succeeds (`replacement`)

Every write is temp-file + fsync + rename: a process killed at any moment leaves either the
old file or the new one, never half of one.

The package's modules: `folder` (an artifact's folder: the one way to read and write its
STATUS, stop reason and record), `store` (the object-store interface and `open_store`), `local` (a
directory as a store), `lease` (leases as conditionally created objects), `content` (file sizes
and digests, and their checks), `replacement` (a forced rebuild's old artifact, kept aside),
`storage_errors` (storage failures as one line).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from kiln_contract.layout import (  # noqa: F401 - the folder's names, re-exported for the runtime
    FAILED,
    FAILURE_FILE,
    RECORD_FILE,
    RUNNING,
    STATUS_FILE,
    SUCCESS,
    SUMMARY_TEXT_FILE,
    TRAIN_SPEC_FILE,
)

# A reason longer than this is cut: the file is one line for `plan` and messages, not a log.
MAX_REASON_CHARS = 2000


def built_here() -> dict[str, Any]:
    """Who builds where, for an artifact record's provenance: the user, host, Python, command
    line and start time of this process."""
    return {
        "user": getpass.getuser(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "argv": sys.argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    atomic_write_with(path, lambda f: f.write(data))


def atomic_write_with(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """The file at `path` as `write` writes it into an open temp file (streamed, in pieces),
    renamed into place once complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
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


def json_bytes(obj: Any) -> bytes:
    """A record file's bytes: sorted keys, indented, one trailing newline."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_bytes(path, json_bytes(obj))


def one_line(reason: str) -> str:
    """`reason` as the one line FAILURE_FILE holds: whitespace runs joined, cut if long."""
    line = " ".join(reason.split()) or "no reason was given"
    return line if len(line) <= MAX_REASON_CHARS else line[: MAX_REASON_CHARS - 3] + "..."


def failure_reason(error: BaseException) -> str:
    """The one line a build that failed with `error` records: Kiln's own errors (StepError,
    CacheDamaged, StorageError, ...) say what happened and what to do; others are named by
    their type."""
    if isinstance(error, BrokenPipeError):
        return (
            "the terminal or pipe the run printed to went away (its Pants client was killed?): "
            "rerun to go on"
        )
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (SIGINT or SIGTERM): rerun to go on"
    text = str(error) or repr(error)
    # `__main__`: a Kiln entry point run as `python -m kiln.runner` defines its errors there.
    own = type(error).__module__.split(".")[0] in ("kiln", "kiln_contract", "__main__")
    return text if own else f"{type(error).__name__}: {text}"
