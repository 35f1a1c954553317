"""An export as an artifact of the store (an `hf_model` target, docs/artifacts.md).

`python -m kiln.interop export RUN OUT --record RECORD.json`: the Pants side gives the
export's record, with its checkpoint as input; RUN must be that checkpoint, built. RUN and OUT
are folders or bucket URLs, served, refused or written whole as kiln.interop.store_artifact
says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln import artifacts
from kiln.artifacts.folder import ArtifactFolder
from kiln.interop.errors import InteropError
from kiln.interop.store_artifact import (
    check_same,
    read_record,
    served_if_built,
    stored_record,
    writing,
)
from kiln_contract.record import ArtifactRecord


def export_artifact(
    run_dir: str | Path, out: str | Path, record_file: Path, **export_options: Any
) -> str:
    """Builds (or serves) the export at `out`; returns what it did, for people."""
    from kiln.interop.export import export_run
    from kiln.train.run_mirror import local_run

    record, provenance = read_record(record_file)
    target, source = ArtifactFolder.at(str(out)), ArtifactFolder.at(str(run_dir))
    already = served_if_built(target, record, provenance)
    if already is not None:
        return already
    _check_checkpoint(source, record)
    full_record = {**record.to_json(), "provenance": {**provenance, **artifacts.built_here()}}
    with local_run(source, export_options.get("step", "last")) as run, \
            writing(target) as local:  # fmt: skip
        try:
            export_run(run, local, record=full_record, **export_options)
        except (InteropError, OSError):
            # Another export of the same artifact finished first: theirs is the same.
            stored = stored_record(target)
            if stored is None or not target.is_built():
                raise
            check_same(target, stored, record)
    return f"kiln: built {record.ref} at {target.location()}"


def _check_checkpoint(run: ArtifactFolder, record: ArtifactRecord) -> None:
    """The run must hold the checkpoint the record names, finished."""
    [checkpoint] = record.inputs
    stored = stored_record(run)
    if stored is None or not run.is_built():
        raise InteropError(
            f"{run.location()} holds no finished {checkpoint.ref} (no artifact.json with STATUS "
            "SUCCESS); build the checkpoint first (`pants run` its target)"
        )
    if stored.get("fingerprint") != checkpoint.fingerprint:
        raise InteropError(
            f"{run.location()} holds {checkpoint.ref} with fingerprint "
            f"{stored.get('fingerprint')}, but this export is of fingerprint "
            f"{checkpoint.fingerprint}"
        )
