"""What one lm_checkpoint step's run carries through kiln.runner, as frozen objects: where it is
built (`Destination`) and, once its workspace is open and its train spec made, the run itself
(`StepRun`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.store import ObjectStore
from kiln.runner.workspace import Workspace
from kiln.train import multihost
from kiln_contract.step import StepSpec
from kiln_contract.train import TrainSpec


@dataclasses.dataclass(frozen=True)
class Destination:
    """Where a step is built: its folder in a store, and whether that store is the artifact
    store (its inputs are placed there, `--force` replaces, a compilation cache is kept) or a
    scratch folder of a hermetic run (`--output`: the inputs are read where they are)."""

    folder: ArtifactFolder
    artifact_store: bool = True
    staging: Path | None = None  # where a run in a bucket stages (default: a temporary folder)

    @property
    def store(self) -> ObjectStore:
        return self.folder.store


@dataclasses.dataclass(frozen=True)
class StepRun:
    """One step's run on this process, from its open workspace to its STATUS."""

    step: StepSpec
    spec: TrainSpec  # the trainer's: inputs where it reads them, output in the workspace
    inputs_root: Path  # where the step's relative input paths are
    destination: Destination
    workspace: Workspace
    process_group: multihost.ProcessGroup
    process_index: int
    cluster_job: dict[str, Any] | None = None  # the Ray job's id and retries, when it is one
    force: bool = False  # replacing a built artifact

    @property
    def shown_at(self) -> str:
        """Where people find the artifact: its folder's location (a bucket URL, for a run
        staged locally)."""
        return self.destination.folder.location()
