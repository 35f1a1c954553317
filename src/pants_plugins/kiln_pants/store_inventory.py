"""What the artifact store holds, and removing artifacts from it (`pants store`), through the
runtime's `python -m kiln.artifacts.inventory`, for a directory and a bucket alike: it answers
in JSON (kiln_contract.inventory); and the targets of the repository that name what it holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pants.engine.addresses import Address, Addresses
from pants.engine.rules import Get, MultiGet, collect_rules, rule
from pants.util.frozendict import FrozenDict

from kiln_contract.inventory import FolderOutcome, Inventory
from kiln_pants.artifact_folders import ArtifactFolders
from kiln_pants.artifact_graph import (
    ArtifactGraph,
    ArtifactGraphRequest,
    ArtifactOrProblem,
    ArtifactOrProblemRequest,
)
from kiln_pants.runtime import INVENTORY
from kiln_pants.store_process import process_failure, store_process


@dataclass(frozen=True)
class StoreInventoryRequest:
    prefix: str  # a local store's absolute path, or a bucket URL


@dataclass(frozen=True)
class StoreInventory:
    inventory: Optional[Inventory]
    error: Optional[str] = None  # why the store cannot be listed, naming it


@rule(desc="Listing what the artifact store holds")
async def list_store(request: StoreInventoryRequest) -> StoreInventory:
    description = f"Listing the artifacts in {request.prefix}"
    result = await store_process(INVENTORY, (request.prefix,), description)
    if result.exit_code != 0:
        return StoreInventory(None, process_failure(result))
    return StoreInventory(Inventory.from_json(result.stdout.decode()))


@dataclass(frozen=True)
class StoreRemovalRequest:
    prefix: str
    folders: tuple[str, ...]  # name/version


@dataclass(frozen=True)
class StoreRemoval:
    outcomes: tuple[FolderOutcome, ...]  # one per folder reached: removed, or kept and why
    error: Optional[str] = None  # why the store stopped answering, naming it


@rule(desc="Removing artifacts from the artifact store")
async def remove_from_store(request: StoreRemovalRequest) -> StoreRemoval:
    description = f"Removing {len(request.folders)} artifacts from {request.prefix}"
    argv = (request.prefix, "--remove", *request.folders)
    result = await store_process(INVENTORY, argv, description)
    outcomes = FolderOutcome.read_lines(result.stdout.decode())
    return StoreRemoval(outcomes, None if result.exit_code == 0 else process_failure(result))


@dataclass(frozen=True)
class StoredTargetsRequest:
    folders: tuple[str, ...]  # name/version: what the store holds


@dataclass(frozen=True)
class StoredTargets:
    """The targets naming what the store holds, read no further than `pants store` needs: every
    artifact target's name and version, and the graph of those naming a stored folder (for the
    fingerprints). A target wrong elsewhere stops nothing: it is skipped, with a line saying why.
    """

    named: FrozenDict[str, Address]  # folder -> the target naming it, for every named folder
    fingerprints: FrozenDict[str, str]  # folder -> its target's fingerprint, where one was made
    skipped: tuple[str, ...] = ()  # a line per target skipped: the target and why
    unread: Optional[str] = None  # why the repository's targets cannot be read at all


@rule(desc="Reading the targets that name what the artifact store holds")
async def stored_targets(request: StoredTargetsRequest) -> StoredTargets:
    folders = await Get(ArtifactFolders)
    if folders.unread is not None:
        return StoredTargets(FrozenDict(), FrozenDict(), unread=folders.unread)
    named = FrozenDict({folder: addresses[0] for folder, addresses in folders.by_folder.items()})
    skipped = [
        f"Skipped {target.address} (it names no artifact until fixed): {target.problem}"
        for target in folders.unnamed
    ]
    stored = [(f, a) for f in request.folders for a in folders.by_folder.get(f, ())]
    graph = await _graph_or_none(Addresses(a for _, a in stored))
    if graph is not None:
        fingerprints = {a.folder: a.fingerprint for a in graph}
        return StoredTargets(named, FrozenDict(fingerprints), tuple(skipped))
    # A bad target among them: each alone, so that the others still get their fingerprints.
    results = await MultiGet(Get(ArtifactOrProblem, ArtifactOrProblemRequest(a)) for _, a in stored)
    fingerprints = {}
    for (folder, address), result in zip(stored, results):
        if result.artifact is not None:
            fingerprints[folder] = result.artifact.fingerprint
        else:
            skipped.append(f"Skipped {address} (its artifact stays named; its fingerprint is "
                           f"not compared with the record's): {result.problem}")  # fmt: skip
    return StoredTargets(named, FrozenDict(fingerprints), tuple(skipped))


async def _graph_or_none(addresses: Addresses) -> Optional[ArtifactGraph]:
    try:
        return await Get(ArtifactGraph, ArtifactGraphRequest(addresses))
    except Exception:  # noqa: BLE001 - a bad target among them: the caller reads them one by one
        return None


def rules():
    return collect_rules()
