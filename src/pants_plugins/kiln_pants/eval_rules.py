"""Building an `lm_eval_run`: `pants package experiments:X_eval` (and `pants build`) scores its
model with `python -m kiln.interop eval-artifact` into the artifact store at
`{prefix}/{name}/{version}` (kiln.interop.eval_artifact).

As for an `hf_model`, the store is the cache: the process runs every session (a finished
evaluation with the same fingerprint is a no-op in it, another fingerprint is refused) and
`dist/` gets a manifest pointing at the store. A run or export it scores must be built in the
store first; its validation caches are built as any run's are (inline ones travel with the
process, store ones are read where they are).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pants.core.goals.package import BuiltPackage, PackageFieldSet
from pants.engine.addresses import Addresses
from pants.engine.process import Process, ProcessResult
from pants.engine.rules import Get, MultiGet, collect_rules, rule
from pants.engine.target import WrappedTarget, WrappedTargetRequest
from pants.engine.unions import UnionRule

from kiln_pants.artifact_graph import ReferencedFiles, ReferencedFilesRequest, artifact_and_graph
from kiln_pants.artifact_store import RECORD_INPUT, artifact_path
from kiln_pants.eval_targets import EvalModelField, EvalSuiteField
from kiln_pants.hf_model_rules import (
    ExportRuntime,
    StoredCheckpoint,
    StoredCheckpointRequest,
    writing_into_store,
)
from kiln_pants.package import store_pointer_package
from kiln_pants.target_types import CacheStorageField, EvalNameField
from kiln_pants.tokenize_rules import CachesAsInputs, CachesAsInputsRequest, cache_location


@dataclass(frozen=True)
class LmEvalRunPackageFieldSet(PackageFieldSet):
    required_fields = (EvalModelField,)

    model: EvalModelField
    evals: EvalSuiteField


@rule(desc="Packaging an lm_eval_run")
async def package_lm_eval_run(
    field_set: LmEvalRunPackageFieldSet, export: ExportRuntime
) -> BuiltPackage:
    artifact, graph = await artifact_and_graph(field_set.address)
    prefix = export.prefix
    if artifact.parent is not None:  # fails in seconds, saying how to build it, when it is not
        await Get(
            StoredCheckpoint,
            StoredCheckpointRequest(
                field_set.address, graph.get(artifact.parent), prefix, verb="scores"
            ),
        )
    caches = [graph.get(a) for a in artifact.cache_inputs]
    wrapped_caches = await MultiGet(
        Get(WrappedTarget, WrappedTargetRequest(c.address, description_of_origin="<kiln eval>"))
        for c in caches
    )
    placed = await Get(CachesAsInputs, CachesAsInputsRequest(Addresses(artifact.cache_inputs)))
    suite = field_set.evals.value
    task_files = None
    if suite and suite.task_files:
        files_request = ReferencedFilesRequest(field_set.address, suite.task_files, "evals")
        task_files = (await Get(ReferencedFiles, ReferencedFilesRequest, files_request)).sources
    validation = []
    for cache, wrapped in zip(caches, wrapped_caches):
        in_store = wrapped.target[CacheStorageField].value == "store"
        where = artifact_path(prefix, cache) if in_store else cache_location(cache)
        validation += ["--validation", f"{wrapped.target[EvalNameField].value}={where}"]
    task_dirs = sorted({os.path.dirname(f) for f in task_files.files if f.endswith(".yaml")}) \
        if task_files else []  # fmt: skip
    out = artifact_path(prefix, artifact)
    argv = (
        "eval-artifact", out, "--record", RECORD_INPUT, "--prefix", prefix, *validation,
        *(arg for folder in task_dirs for arg in ("--task-files", folder)),
    )  # fmt: skip
    recorded = caches + ([graph.get(artifact.parent)] if artifact.parent is not None else [])
    digests = [placed.digest, *([task_files.snapshot.digest] if task_files else [])]
    process = await writing_into_store(
        export, artifact, recorded, argv, digests, f"Evaluating {artifact.ref}"
    )
    await Get(ProcessResult, Process, process)
    return await store_pointer_package(artifact, out)


def rules():
    return [*collect_rules(), UnionRule(PackageFieldSet, LmEvalRunPackageFieldSet)]
