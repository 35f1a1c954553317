"""What the artifact store holds for an artifact: read from `{prefix}/{name}/{version}/`.

The runtime (`kiln.artifacts`) writes `artifact.json` (the record) and then `STATUS`; only a
record whose STATUS is SUCCESS counts as built. This module reads, from the Pants side, to
answer "is it built, and with the same identity?" (see docs/artifacts.md): a local store
directly; a bucket through the runtime's own store client (`python -m kiln.artifacts.peek`), as
one process for every folder a goal asks about, never cached beyond its session (PER_SESSION),
with the bucket's credentials from the caller's environment (kiln_pants.store_process).
DEP_FAILED marks are kiln_pants.dep_failed_marks'; listing and removal, kiln_pants.store_inventory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

from pants.engine.console import Console
from pants.engine.fs import CreateDigest, Digest, FileContent
from pants.engine.rules import Get, _uncacheable_rule, collect_rules, rule
from pants.util.frozendict import FrozenDict

from kiln_contract.layout import DEP_FAILED, FAILURE_FILE, RECORD_FILE, STATUS_FILE
from kiln_contract.location import in_bucket
from kiln_contract.record import ArtifactRecord, InputRef, differing_fields
from kiln_contract.step import Provenance
from kiln_pants.artifact_graph import Artifact, ArtifactGraph
from kiln_pants.runtime import PEEK, Runtime
from kiln_pants.store_process import process_failure, store_process

logger = logging.getLogger(__name__)

# The artifact's record (artifact_record's JSON) in the inputs of the process that builds it.
RECORD_INPUT = "artifact_record.json"


def artifact_record(artifact: Artifact, inputs: list[Artifact]) -> ArtifactRecord:
    """The identity part of `artifact.json`; the runtime adds provenance when it builds."""
    return ArtifactRecord(
        kind=artifact.kind,
        name=artifact.name,
        version=artifact.version,
        fingerprint=artifact.fingerprint,
        identity=artifact.identity,
        inputs=tuple(InputRef(i.ref, i.fingerprint) for i in inputs),
    )


def runtime_provenance(runtime: Runtime, lockfile: Digest) -> Provenance:
    """What a runtime process that builds an artifact is made of: its code and its lockfile."""
    return Provenance(
        code_digest=runtime.sources.digest.fingerprint, lockfile_digest=lockfile.fingerprint
    )


async def record_input(
    artifact: Artifact, inputs: list[Artifact], runtime: Runtime, lockfile: Digest
) -> Digest:
    """The artifact's record as RECORD_INPUT, with the provenance of the runtime process that
    builds it."""
    record = {
        **artifact_record(artifact, inputs).to_json(),
        "provenance": dataclasses.asdict(runtime_provenance(runtime, lockfile)),
    }
    return await Get(
        Digest, CreateDigest([FileContent(RECORD_INPUT, json.dumps(record, indent=2).encode())])
    )


def artifact_path(prefix: str, artifact: Artifact) -> str:
    return os.path.join(prefix, artifact.name, artifact.version)


@dataclass(frozen=True)
class StoredState:
    status: str  # built | would run | drift | failed | dep failed | incomplete | dev (rebuilt)
    detail: str = ""

    def describe(self) -> str:
        return f"{self.status} ({self.detail})" if self.detail else self.status


DEV = StoredState("dev", "mutable version: always rebuilt")


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class StoredFilesRequest:
    folder: str  # an artifact's folder in a local store
    names: tuple[str, ...]


@dataclass(frozen=True)
class StoredFiles:
    texts: tuple[Optional[str], ...]  # one per name: the file's text, None when absent


@_uncacheable_rule(desc="Reading an artifact's files in the store")
async def read_stored_files(request: StoredFilesRequest) -> StoredFiles:
    """The files as they are now: uncacheable, so pantsd rereads them every run while the store
    changes behind its back."""
    return StoredFiles(tuple(_read(os.path.join(request.folder, name)) for name in request.names))


def stored_state(prefix: str, artifact: Artifact) -> StoredState:
    path = artifact_path(prefix, artifact)
    if artifact.mutable:
        return DEV
    texts = [_read(os.path.join(path, name)) for name in (STATUS_FILE, RECORD_FILE, FAILURE_FILE)]
    return recorded_state(artifact, *texts)


def recorded_state(
    artifact: Artifact,
    status_text: Optional[str],
    record_text: Optional[str],
    failure_text: Optional[str] = None,
) -> StoredState:
    """The state of `artifact` given its folder's STATUS, artifact.json and failure.txt (the
    last run's reason for failing or stopping; None: absent)."""
    status = (status_text or "").strip()
    reason = (failure_text or "").strip()
    if status == DEP_FAILED:
        return StoredState(
            "dep failed", f"{reason or 'an input failed in the last build'}; will run"
        )
    if record_text is None:  # a run that ended before its record (on its inputs) still says why
        if status == "FAILED":
            return StoredState("failed", f"{reason or 'no reason recorded'}; will rerun")
        return StoredState("would run", f"the last run stopped: {reason}" if reason else "")
    record = json.loads(record_text)
    if record.get("fingerprint") != artifact.fingerprint:
        fields = differing_fields(record.get("identity", {}), artifact.identity)
        return StoredState(
            "drift",
            f"built with fingerprint {record.get('fingerprint')}; differs in: "
            f"{', '.join(fields) or 'identity format'}{_inputs_only(fields)}",
        )
    if status == "SUCCESS":
        return StoredState("built")
    if status == "FAILED":
        return StoredState("failed", f"{reason or 'no reason recorded'}; will rerun")
    if reason:
        return StoredState("incomplete", f"the last run stopped: {reason}; will resume")
    return StoredState("incomplete", "will resume")


def _inputs_only(fields: list[str]) -> str:
    """Advice when only inputs' fingerprints differ: the target itself did not change, one of
    its inputs (a parent run, a cache) did, and the stored artifact was made from the old one."""
    if not fields or not all(field.endswith(".fingerprint") for field in fields):
        return ""
    return (" (only its inputs changed: bump this target's `version` to build it from them, as "
            "every artifact made from a changed one needs)")  # fmt: skip


class BucketUnreadable(Exception):
    """The store's bucket cannot be read: one line naming it and what to check, which the goals
    reading the store (plan, build) print as their error (`stored_states_or_report`)."""


@dataclass(frozen=True)
class BucketRecordsRequest:
    prefix: str  # s3://... or gs://...
    folders: tuple[str, ...]  # name/version


@dataclass(frozen=True)
class BucketRecords:
    texts: FrozenDict[str, FrozenDict[str, Optional[str]]]  # folder -> file -> text or None


@rule(desc="Reading artifact records from a bucket")
async def read_bucket_records(request: BucketRecordsRequest) -> BucketRecords:
    description = f"Reading {len(request.folders)} artifact records from {request.prefix}"
    result = await store_process(PEEK, (request.prefix, *request.folders), description)
    if result.exit_code != 0:
        raise BucketUnreadable(f"cannot read the artifact store: {process_failure(result)}")
    texts = json.loads(result.stdout)
    return BucketRecords(FrozenDict({k: FrozenDict(v) for k, v in texts.items()}))


def bucket_folders(graph: ArtifactGraph) -> tuple[str, ...]:
    """The folders to read from a bucket: those of the graph's immutable artifacts."""
    return tuple(a.folder for a in graph if not a.mutable)


@dataclass(frozen=True)
class StoredStatesRequest:
    prefix: str
    graph: ArtifactGraph


@dataclass(frozen=True)
class StoredStates:
    states: FrozenDict[Artifact, StoredState]  # in the graph's order


@_uncacheable_rule(desc="Reading what the artifact store holds")
async def read_stored_states(request: StoredStatesRequest) -> StoredStates:
    """What the store holds for each artifact: a local store read directly; a bucket by one
    process for all of them (`kiln.artifacts.peek`). Uncacheable: pantsd looks at the store
    again in every session, as it changes behind Pants' back."""
    graph, prefix = request.graph, request.prefix
    if not in_bucket(prefix):
        return StoredStates(FrozenDict({a: stored_state(prefix, a) for a in graph}))
    records = await Get(BucketRecords, BucketRecordsRequest(prefix, bucket_folders(graph)))
    return StoredStates(FrozenDict({a: _bucket_state(a, records) for a in graph}))


async def stored_states_or_report(
    console: Console, prefix: str, graph: ArtifactGraph
) -> Optional[FrozenDict[Artifact, StoredState]]:
    """What the store holds for the graph's artifacts, for a goal; None when its bucket cannot be
    read, after printing the one line naming it (not the engine's traceback)."""
    try:
        return (await Get(StoredStates, StoredStatesRequest(prefix, graph))).states
    except BucketUnreadable as e:
        console.print_stderr(f"kiln: error: {e}")
        return None


def _bucket_state(artifact: Artifact, records: BucketRecords) -> StoredState:
    if artifact.mutable:
        return DEV
    texts = records.texts[artifact.folder]
    return recorded_state(artifact, texts[STATUS_FILE], texts[RECORD_FILE], texts.get(FAILURE_FILE))


def rules():
    return collect_rules()
