"""The artifact store: one artifact folder's layout, and the one-line reasons a build records.

Layout of one artifact (see docs/artifacts.md):

    {prefix}/{name}/{version}/
        artifact.json     the record: name, version, fingerprint, config, inputs, provenance
        summary.txt       what `pants run` prints for a built artifact
        failure.txt       why the last run failed or stopped, one line
                          (`ArtifactFolder.mark_failed`, `record_stop`); removed when a run starts
        STATUS            one of SUCCESS, FAILED, RUNNING; written last, so a record
                          without SUCCESS is never served
        ...               the artifact's own files (cache splits, checkpoints/, metrics.jsonl)
    {prefix}/{name}/.{version}.lease    the lease of the one process building it (beside the
                                        folder, so it exists before the folder does)
    {prefix}/{name}/.{version}.replaced/  the artifact a forced rebuild replaces, until the
                                          rebuild succeeds (`replacement`)
    {prefix}/{name}/.{version}.holds/     the holds of runs that need it kept: a training
                                          reading it, a cache's build between shards (`holds`)

The package's modules: `folder` (an artifact's folder: the one way to read and write its STATUS,
stop reason, record and lease), `store` (the object-store interface), `locations` (a path or URL
opened as a store: `open_store`), `local`, `s3` and `gcs` (the stores), `atomic` (temp file +
fsync + rename writes: a killed process leaves the old file or the new one, never half of one),
`lease` (leases as conditionally created objects), `holds` (runs' claims that an artifact stays
while they need it), `content` (file sizes and digests, and their
checks), `replacement` (a forced rebuild's old artifact, kept aside), `storage_errors` (storage
failures as one line).
"""

from __future__ import annotations

import getpass
import platform
import socket
import sys
import time
from typing import Any

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
