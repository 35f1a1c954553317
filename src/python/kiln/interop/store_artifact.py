"""An artifact of the store that one local process writes whole: an `hf_model` export, an
`lm_eval_run` evaluation (docs/artifacts.md).

The Pants side gives the artifact's record (name, version, fingerprint, identity, inputs, the
code and lockfile digests). A folder holding this fingerprint with STATUS SUCCESS is served as
it is; one holding another fingerprint is refused, naming the fields that differ; a `dev`
version is always rebuilt. The artifact is written in a local folder: in a directory store the
folder itself (appearing whole, its artifact.json and STATUS written last inside the staging
folder before the rename), in a bucket a temporary folder uploaded with its STATUS last. A run
in a bucket that the artifact reads is read through a local copy of its files and one
checkpoint (kiln.train.run_mirror).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln import artifacts
from kiln.artifacts.folder import ArtifactFolder
from kiln.interop.errors import InteropError
from kiln_contract.parsing import SpecError
from kiln_contract.record import ArtifactRecord, fingerprint_drift
from kiln_contract.vocabulary import is_mutable_version


def read_record(path: Path) -> tuple[ArtifactRecord, dict[str, Any]]:
    """The record file the Pants side wrote: the artifact's record and its provenance."""
    try:
        obj = json.loads(Path(path).read_text())
        provenance = dict(obj.pop("provenance"))
        return ArtifactRecord.from_json(obj), provenance
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SpecError) as e:
        raise InteropError(f"{path}: not an artifact record: {e}") from None


def served_if_built(
    target: ArtifactFolder, record: ArtifactRecord, provenance: dict[str, Any]
) -> str | None:
    """What serving the artifact says, when `target` holds it built with this fingerprint;
    None when it must be built (a drifted folder is refused)."""
    stored = stored_record(target)
    if stored is None:
        return None
    check_same(target, stored, record)
    if target.is_built() and not is_mutable_version(record.version):
        return served(target, record, stored, provenance)
    return None


@contextlib.contextmanager
def writing(target: ArtifactFolder) -> Iterator[Path]:
    """Where the artifact is written (ArtifactFolder.local_output), what a dev build or an
    unfinished one left there cleared."""
    with target.local_output() as local:
        clear_previous(local)
        yield local


def stored_record(folder: ArtifactFolder) -> dict[str, Any] | None:
    text = folder.text(artifacts.RECORD_FILE)
    if text is None:
        return None
    try:
        stored = json.loads(text)
    except ValueError as e:
        raise InteropError(
            f"{folder.location(artifacts.RECORD_FILE)} is not JSON ({e}); move it away"
        ) from None
    return stored if isinstance(stored, dict) else None


def check_same(out: ArtifactFolder, stored: dict[str, Any], record: ArtifactRecord) -> None:
    drift = fingerprint_drift(stored, record)
    if drift is not None:
        raise InteropError(
            f"{out.location()} already holds {record.ref} with {drift}. Bump `version` in the "
            "BUILD file to export a new artifact (the old one is kept)."
        )


def served(
    out: ArtifactFolder, record: ArtifactRecord, stored: dict[str, Any], provenance: dict[str, Any]
) -> str:
    message = (
        f"kiln: {record.ref} is already built at {out.location()} (fingerprint "
        f"{record.fingerprint})."
    )
    built_by = stored.get("provenance", {}).get("code_digest")
    now = provenance.get("code_digest")
    if built_by and now and built_by != now:
        message += (
            f"\nkiln: note: it was exported by other code (runtime digest {built_by[:12]}, now "
            f"{now[:12]}); the code is not part of its identity, so it is kept. Bump `version` "
            "to export again with the current code."
        )
    return message


def clear_previous(out: Path) -> None:
    """Removes what a dev export (always rebuilt) or an unfinished folder left at `out`."""
    if out.exists():
        aside = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, aside)
        shutil.rmtree(aside)
