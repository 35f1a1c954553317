"""An export as an artifact of the store (an `hf_model` target, docs/artifacts.md).

`python -m kiln.interop export RUN OUT --record RECORD.json`: the Pants side gives the
export's record (name, version, fingerprint, identity, its checkpoint as input, the code and
lockfile digests). An OUT holding this fingerprint with STATUS SUCCESS is served as it is; one
holding another fingerprint is refused, naming the fields that differ; a `dev` version is always
rebuilt. RUN must be the checkpoint the record names, built. RUN and OUT are folders or bucket
URLs: a run in a bucket is read through a local copy of its files and the exported checkpoint
(kiln.train.run_mirror), and an export into a bucket is written here, then uploaded with its
STATUS last. In a folder, OUT appears whole, its artifact.json and STATUS written last inside
the staging folder before the rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln import artifacts
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.store import copy_folder_into
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


def export_artifact(
    run_dir: str | Path, out: str | Path, record_file: Path, **export_options: Any
) -> str:
    """Builds (or serves) the export at `out`; returns what it did, for people."""
    from kiln.interop.export import export_run

    record, provenance = read_record(record_file)
    target, source = ArtifactFolder.at(str(out)), ArtifactFolder.at(str(run_dir))
    stored = _stored_record(target)
    if stored is not None:
        _check_same(target, stored, record)
        if target.is_built() and not is_mutable_version(record.version):
            return _served(target, record, stored, provenance)
    _check_checkpoint(source, record)
    full_record = {**record.to_json(), "provenance": {**provenance, **artifacts.built_here()}}
    with local_run(source.location(), export_options.get("step", "last")) as run, \
            _writing(target) as local:  # fmt: skip
        try:
            export_run(run, local, record=full_record, **export_options)
        except (InteropError, OSError):
            # Another export of the same artifact finished first: theirs is the same.
            stored = _stored_record(target)
            if stored is None or not target.is_built():
                raise
            _check_same(target, stored, record)
    return f"kiln: built {record.ref} at {target.location()}"


@contextlib.contextmanager
def local_run(location: str | Path, step: int | str) -> Iterator[Path]:
    """The run's folder on this machine: itself, or (in a bucket) a copy of what an export of
    checkpoint `step` reads."""
    run = ArtifactFolder.at(str(location))
    if run.store.local_root is not None:
        yield Path(location)
        return
    from kiln.train.run_mirror import RunMirror

    with tempfile.TemporaryDirectory(prefix="kiln-export-run-") as folder:
        RunMirror(run, Path(folder)).fetch(step=step)
        yield Path(folder)


@contextlib.contextmanager
def _writing(target: ArtifactFolder) -> Iterator[Path]:
    """Where the export writes: the folder itself (what a dev export or an unfinished one
    left there cleared), or a local folder uploaded into the bucket once written, STATUS
    last."""
    if target.store.local_root is not None:
        _clear_previous(Path(target.location()))
        yield Path(target.location())
        return
    with tempfile.TemporaryDirectory(prefix="kiln-export-") as folder:
        local = Path(folder) / "out"
        yield local
        if local.is_dir():
            target.store.remove_folder(target.key, first=(artifacts.STATUS_FILE,))
            copy_folder_into(target.store, target.key, local)


def _stored_record(folder: ArtifactFolder) -> dict[str, Any] | None:
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


def _check_same(out: ArtifactFolder, stored: dict[str, Any], record: ArtifactRecord) -> None:
    drift = fingerprint_drift(stored, record)
    if drift is not None:
        raise InteropError(
            f"{out.location()} already holds {record.ref} with {drift}. Bump `version` in the "
            "BUILD file to export a new artifact (the old one is kept)."
        )


def _served(
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


def _check_checkpoint(run: ArtifactFolder, record: ArtifactRecord) -> None:
    """The run must hold the checkpoint the record names, finished."""
    [checkpoint] = record.inputs
    stored = _stored_record(run)
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


def _clear_previous(out: Path) -> None:
    """Removes what a dev export (always rebuilt) or an unfinished folder left at `out`."""
    if out.exists():
        aside = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, aside)
        shutil.rmtree(aside)
