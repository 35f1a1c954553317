"""Building an `hf_model`: `pants package experiments:X_hf` exports its checkpoint, read from the
artifact store, into the store at `{prefix}/{name}/{version}` with `python -m kiln.interop export`.

Like a `storage="store"` cache, the store is the cache: the export process runs every session
(a finished export with the same fingerprint is a no-op in it, another fingerprint is refused) and
`dist/` gets only a manifest pointing at the store. The checkpoint must be built in the store
first (`pants run` it): training is interactive and long, so packaging an export never trains.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from pants.backend.python.subsystems.setup import PythonSetup
from pants.base.build_root import BuildRoot
from pants.core.goals.package import BuiltPackage, PackageFieldSet
from pants.engine.addresses import Address
from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.fs import EMPTY_DIGEST, Digest, MergeDigests, PathGlobs
from pants.engine.process import Process, ProcessCacheScope, ProcessResult
from pants.engine.rules import Get, MultiGet, collect_rules, rule
from pants.engine.target import WrappedTarget, WrappedTargetRequest
from pants.engine.unions import UnionRule
from pants.util.frozendict import FrozenDict

from kiln_contract.layout import FAILURE_FILE, RECORD_FILE, STATUS_FILE
from kiln_contract.location import in_bucket
from kiln_pants.artifact_graph import (
    Artifact,
    TokenizerFiles,
    TokenizerFilesRequest,
    artifact_and_graph,
)
from kiln_pants.artifact_store import (
    RECORD_INPUT,
    BucketRecords,
    BucketRecordsRequest,
    StoredFiles,
    StoredFilesRequest,
    artifact_path,
    record_input,
    recorded_state,
)
from kiln_pants.dep_failed_marks import DepFailedMarked, DepFailedMarks
from kiln_pants.hf_model_targets import (
    CheckpointField,
    ExportDtypeField,
    ExportStepField,
)
from kiln_pants.package import store_pointer_package
from kiln_pants.runtime import EXPORT, KilnProcess, Runtime, RuntimeProcess, RuntimeRequest
from kiln_pants.store_process import STORE_ENVIRONMENT
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.target_types import LmCheckpointTarget, TokenizerField, tokenizer_address

logger = logging.getLogger(__name__)


class CheckpointNotBuilt(Exception):
    pass


@dataclass(frozen=True)
class StoredCheckpointRequest:
    export: Address  # what reads the checkpoint
    checkpoint: Artifact  # an lm_checkpoint, or an hf_model an evaluation scores
    prefix: str  # the artifact store: a directory or a bucket URL
    verb: str = "exports"  # what `export` does with it, for the message

    @property
    def path(self) -> str:
        """The checkpoint's folder in the store."""
        return artifact_path(self.prefix, self.checkpoint)


@dataclass(frozen=True)
class StoredCheckpoint:
    path: str


@dataclass(frozen=True)
class ExportRuntime:
    """What a process reading a stored checkpoint (an export, an evaluation) runs with: the
    runtime at its `export` entry point, the lockfile its record's provenance names, the
    artifact store it reads and writes, and the store's credentials (for a bucket)."""

    runtime: Runtime
    lockfile: Digest
    prefix: str  # the artifact store: a directory or a bucket URL
    environment: EnvironmentVars


@rule(desc="Preparing the runtime's export entry point")
async def export_runtime(
    python_setup: PythonSetup, kiln: KilnSubsystem, build_root: BuildRoot
) -> ExportRuntime:
    runtime, lockfile, environment = await MultiGet(
        Get(Runtime, RuntimeRequest(EXPORT)),
        Get(Digest, PathGlobs([python_setup.resolves[python_setup.default_resolve]])),
        Get(EnvironmentVars, EnvironmentVarsRequest(STORE_ENVIRONMENT)),
    )
    return ExportRuntime(runtime, lockfile, kiln.prefix_location(build_root.path), environment)


async def writing_into_store(
    export: ExportRuntime,
    artifact: Artifact,
    recorded: list[Artifact],
    argv: tuple[str, ...],
    inputs: list[Digest],
    description: str,
) -> Process:
    """The runtime process that writes `artifact` (an export, an evaluation) into the store, with
    its record (of the `recorded` inputs) at RECORD_INPUT beside the `inputs`. A DEP_FAILED mark
    that a `pants build` left on the artifact (its model failed) is cleared first."""
    prefix = export.prefix
    bucket = in_bucket(prefix)
    if bucket or os.path.exists(artifact_path(prefix, artifact)):
        await Get(DepFailedMarked, DepFailedMarks(prefix, clears=(artifact.folder,)))
    record = await record_input(artifact, recorded, export.runtime, export.lockfile)
    return (await Get(
        KilnProcess,
        RuntimeProcess(
            export.runtime,
            argv=argv,
            description=description,
            input_digest=await Get(Digest, MergeDigests([record, *inputs])),
            output_directories=(),
            # The store is the cache: the process skips itself when built, and can be deleted
            # behind Pants' back, so a cached "done" could point at nothing.
            cache_scope=ProcessCacheScope.PER_SESSION,
            # A bucket's clients find their credentials and endpoint in the caller's environment.
            env=FrozenDict(export.environment if bucket else {}),
        ),
    )).process  # fmt: skip


@rule(desc="Looking for a checkpoint in the artifact store")
async def stored_checkpoint(request: StoredCheckpointRequest) -> StoredCheckpoint:
    """Fails in seconds, with the command that builds it, when the checkpoint is not built (or
    the store holds another configuration under its name and version)."""
    checkpoint = request.checkpoint
    names = (STATUS_FILE, RECORD_FILE, FAILURE_FILE)
    if in_bucket(request.prefix):  # read through the runtime's store client
        folder = checkpoint.folder
        records = await Get(BucketRecords, BucketRecordsRequest(request.prefix, (folder,)))
        texts = tuple(records.texts[folder].get(name) for name in names)
    else:
        stored = await Get(StoredFiles, StoredFilesRequest(request.path, names))
        texts = tuple(stored.texts)
    state = recorded_state(checkpoint, *texts)
    goal = "run" if checkpoint.kind == LmCheckpointTarget.alias else "package"
    build = f"./pants {goal} {checkpoint.address}"
    if state.status == "drift":
        raise CheckpointNotBuilt(
            f"{request.export} {request.verb} {checkpoint.address}, but {request.path} holds another "
            f"configuration of {checkpoint.ref} ({state.detail}): bump the checkpoint's "
            f"`version` and build it with `{build}`."
        )
    if state.status != "built":
        raise CheckpointNotBuilt(
            f"{request.export} {request.verb} {checkpoint.address} ({checkpoint.ref}), which is not "
            f"built in the artifact store ({request.path}: {state.describe()}): build it with "
            f"`{build}`, then package again."
        )
    return StoredCheckpoint(request.path)


@dataclass(frozen=True)
class HfModelPackageFieldSet(PackageFieldSet):
    required_fields = (CheckpointField, ExportDtypeField)

    checkpoint: CheckpointField
    step: ExportStepField
    dtype: ExportDtypeField


@dataclass(frozen=True)
class RunTokenizer:
    """The checkpoint's tokenizer files from the repo, for the export to save beside the weights
    (empty when its caches name a tokenizer outside the repo: the export finds that one itself)."""

    digest: Digest
    argv: tuple[str, ...]


async def _run_tokenizer(checkpoint: Artifact) -> RunTokenizer:
    first_cache = checkpoint.inputs[0]  # every cache of a run shares one tokenizer
    wrapped = await Get(
        WrappedTarget, WrappedTargetRequest(first_cache, description_of_origin="<kiln export>")
    )
    tokenizer = wrapped.target[TokenizerField].value
    if tokenizer_address(tokenizer) is None:
        return RunTokenizer(EMPTY_DIGEST, ())
    files = await Get(TokenizerFiles, TokenizerFilesRequest(first_cache, tokenizer))
    return RunTokenizer(files.digest, ("--tokenizer", files.directory))


@rule(desc="Packaging an hf_model")
async def package_hf_model(
    field_set: HfModelPackageFieldSet, export: ExportRuntime
) -> BuiltPackage:
    artifact, graph = await artifact_and_graph(field_set.address)
    checkpoint = graph.get(artifact.inputs[0])
    stored = await Get(
        StoredCheckpoint, StoredCheckpointRequest(field_set.address, checkpoint, export.prefix)
    )
    tokenizer = await _run_tokenizer(checkpoint)
    out = artifact_path(export.prefix, artifact)
    argv = (
        "export", stored.path, out, "--step", str(field_set.step.value),
        "--dtype", field_set.dtype.value, "--record", RECORD_INPUT, *tokenizer.argv,
    )  # fmt: skip
    process = await writing_into_store(
        export, artifact, [checkpoint], argv, [tokenizer.digest],
        f"Exporting {checkpoint.ref} as {artifact.ref}",
    )  # fmt: skip
    exported = await Get(ProcessResult, Process, process)
    # Pants shows no output of its processes: pass on the note that other code built it.
    for line in exported.stdout.decode().splitlines():
        if line.startswith("kiln: note:"):
            logger.warning(line)
    return await store_pointer_package(artifact, out)


def rules():
    return [
        *collect_rules(),
        UnionRule(PackageFieldSet, HfModelPackageFieldSet),
    ]
