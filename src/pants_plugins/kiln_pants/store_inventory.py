"""What the artifact store holds, and removing artifacts from it (`pants store`), through the
runtime's `python -m kiln.artifacts.inventory`, for a directory and a bucket alike: it answers
in JSON (kiln_contract.inventory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pants.engine.rules import collect_rules, rule

from kiln_contract.inventory import FolderOutcome, Inventory
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


def rules():
    return collect_rules()
