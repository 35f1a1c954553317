"""Served, refused or built: the one decision every run makes first, from the artifact's folder
in the store (its record and STATUS), before any input is placed or jax is loaded."""

from __future__ import annotations

import contextlib
from typing import Any

from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.lease import LeaseHeld
from kiln.runner import replacing
from kiln.runner.errors import StepError
from kiln_contract.record import ArtifactRecord, served_message
from kiln_contract.step import StepSpec
from kiln_contract.vocabulary import is_mutable_version


def serve_if_built(step: StepSpec, folder: ArtifactFolder) -> bool:
    """Serves the artifact when the folder holds it built (and deletes a finished replacement's
    leftover); refuses another artifact there (StepError); False when it is to be built. A dev
    version is always built again."""
    stored = None if is_mutable_version(step.version) else same_artifact(folder, step.record)
    if stored is None or not folder.is_built():
        return False
    serve(step, stored, folder)
    if replacing.is_replacing(folder):
        # A forced run stopped after the new artifact's STATUS SUCCESS: finish it, unless a run
        # holds the lease (that one finishes it).
        lease = folder.lease(f"finish replacing {step.ref}")
        with contextlib.suppress(LeaseHeld), lease.acquire(wait=False):
            replacing.finish(step, folder)
    return True


def same_artifact(folder: ArtifactFolder, record: ArtifactRecord) -> dict[str, Any] | None:
    """The stored record if the folder holds this artifact (None if it holds none);
    StepError, naming the fields that differ, if it holds another."""
    drift = folder.drift(record)
    if drift is not None:
        raise StepError(
            f"{record.ref} already exists at {folder.location()} with {drift}. Bump `version` "
            "in the BUILD file to build a new artifact (the old one is kept), or rebuild this "
            "version with `-- --force` (the old one is deleted once the new one is built)."
        )
    return folder.record()


def serve(step: StepSpec, stored: dict[str, Any], folder: ArtifactFolder) -> None:
    """Says that the artifact is built and prints its summary (written when it was built: losses
    against a unigram baseline, where things are, samples; no jax needed)."""
    code_digest = step.provenance.code_digest
    location = folder.location()
    print(served_message(step.ref, location, step.fingerprint, stored, code_digest, folder.summary()))
