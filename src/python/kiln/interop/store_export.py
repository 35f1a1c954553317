"""An export as an artifact of the store (an `hf_model` target, docs/artifacts.md).

`python -m kiln.interop export RUN_DIR OUT --record RECORD.json`: the Pants side gives the
export's record (name, version, fingerprint, identity, its checkpoint as input, the code and
lockfile digests). An OUT holding this fingerprint with STATUS SUCCESS is served as it is; one
holding another fingerprint is refused, naming the fields that differ; a `dev` version is always
rebuilt. RUN_DIR must be the checkpoint the record names, built. The folder appears whole, its
artifact.json and STATUS written last inside the staging folder before the rename.
"""

from __future__ import annotations

import getpass
import json
import os
import platform
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from kiln import artifacts
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
        raise InteropError(f"{path}: not an export's artifact record: {e}") from None


def export_artifact(run_dir: Path, out: Path, record_file: Path, **export_options: Any) -> str:
    """Builds (or serves) the export at `out`; returns what it did, for people."""
    from kiln.interop.export import export_run

    record, provenance = read_record(record_file)
    stored = _stored_record(out)
    if stored is not None:
        _check_same(out, stored, record)
        if artifacts.is_built(out) and not is_mutable_version(record.version):
            return _served(out, record, stored, provenance)
    _check_checkpoint(run_dir, record)
    _clear_previous(out)
    full_record = {**record.to_json(), "provenance": {**provenance, **_where_built()}}
    try:
        export_run(run_dir, out, record=full_record, **export_options)
    except (InteropError, OSError):
        # Another export of the same artifact finished first: theirs is the same.
        stored = _stored_record(out)
        if stored is None or not artifacts.is_built(out):
            raise
        _check_same(out, stored, record)
    return f"kiln: built {record.ref} at {out}"


def _stored_record(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / artifacts.RECORD_FILE).read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise InteropError(
            f"{folder / artifacts.RECORD_FILE} is not JSON ({e}); move it away"
        ) from None


def _check_same(out: Path, stored: dict[str, Any], record: ArtifactRecord) -> None:
    drift = fingerprint_drift(stored, record)
    if drift is not None:
        raise InteropError(
            f"{out} already holds {record.ref} with {drift}. Bump `version` in the BUILD file "
            "to export a new artifact (the old one is kept)."
        )


def _served(
    out: Path, record: ArtifactRecord, stored: dict[str, Any], provenance: dict[str, Any]
) -> str:
    message = f"kiln: {record.ref} is already built at {out} (fingerprint {record.fingerprint})."
    built_by = stored.get("provenance", {}).get("code_digest")
    now = provenance.get("code_digest")
    if built_by and now and built_by != now:
        message += (
            f"\nkiln: note: it was exported by other code (runtime digest {built_by[:12]}, now "
            f"{now[:12]}); the code is not part of its identity, so it is kept. Bump `version` "
            "to export again with the current code."
        )
    return message


def _check_checkpoint(run_dir: Path, record: ArtifactRecord) -> None:
    """RUN_DIR must hold the checkpoint the record names, finished."""
    [checkpoint] = record.inputs
    stored = _stored_record(run_dir)
    if stored is None or not artifacts.is_built(run_dir):
        raise InteropError(
            f"{run_dir} holds no finished {checkpoint.ref} (no artifact.json with STATUS "
            "SUCCESS); build the checkpoint first (`pants run` its target)"
        )
    if stored.get("fingerprint") != checkpoint.fingerprint:
        raise InteropError(
            f"{run_dir} holds {checkpoint.ref} with fingerprint {stored.get('fingerprint')}, "
            f"but this export is of fingerprint {checkpoint.fingerprint}"
        )


def _clear_previous(out: Path) -> None:
    """Removes what a dev export (always rebuilt) or an unfinished folder left at `out`."""
    if out.exists():
        aside = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, aside)
        shutil.rmtree(aside)


def _where_built() -> dict[str, Any]:
    return {
        "user": getpass.getuser(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "argv": sys.argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
