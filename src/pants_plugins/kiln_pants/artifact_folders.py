"""Which targets of the repository name each artifact folder `{name}/{version}`.

An artifact's name and version are its identity in the store and in `dist/logs/`: two targets
of one identity would build into one folder and one log, the second refused as drift after it
had trained in full. `refuse_shared_folders` refuses that before anything runs, for every goal
that reads the artifact graph, against the artifacts the command needs and every artifact target
of the repository. Only `artifact_name` and `version` are read here, so a target whose other
fields are wrong still names its folder (`pants store` keeps what it names).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from pants.engine.addresses import Address
from pants.engine.rules import Get, collect_rules, rule
from pants.engine.target import AllTargets, InvalidTargetException, Target
from pants.util.frozendict import FrozenDict

from kiln_pants.field_problems import FieldProblem
from kiln_pants.target_types import (
    DEFAULT_ARTIFACT_FOLDERS,
    ArtifactNameField,
    ArtifactVersionField,
    default_artifact_name,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnnamedTarget:
    """An artifact target whose `artifact_name` or `version` is wrong: it names no folder."""

    address: Address
    problem: str


@dataclass(frozen=True)
class ArtifactFolders:
    """Every artifact target of the repository by the folder it names, and those that name none.
    `unread`: why the repository's targets could not be read (a BUILD file Pants refuses)."""

    by_folder: FrozenDict[str, tuple[Address, ...]]
    unnamed: tuple[UnnamedTarget, ...] = ()
    unread: Optional[str] = None


def artifact_folder(target: Target) -> str | FieldProblem:
    """`{name}/{version}` of an artifact target, or the problem of the field that decides it."""
    name, version = target[ArtifactNameField].value, target[ArtifactVersionField].value
    for value in (name, version):
        if isinstance(value, FieldProblem):
            return value
    return f"{default_artifact_name(target)}/{version}"


def is_artifact_target(target: Target) -> bool:
    return target.alias in DEFAULT_ARTIFACT_FOLDERS and target.has_field(ArtifactVersionField)


def folders_of(targets: Iterable[Target]) -> ArtifactFolders:
    by_folder: dict[str, list[Address]] = {}
    unnamed = []
    for target in sorted(filter(is_artifact_target, targets), key=lambda t: t.address):
        folder = artifact_folder(target)
        if isinstance(folder, FieldProblem):
            unnamed.append(UnnamedTarget(target.address, folder.message))
        else:
            by_folder.setdefault(folder, []).append(target.address)
    return ArtifactFolders(FrozenDict({f: tuple(a) for f, a in by_folder.items()}), tuple(unnamed))


@rule(desc="Reading the artifact names and versions of the repository's targets")
async def artifact_folders() -> ArtifactFolders:
    try:
        targets = await Get(AllTargets)
    except Exception as e:  # noqa: BLE001 - a BUILD file Pants refuses stops only this check
        unread = str(e).strip().splitlines()[-1]
        logger.warning(
            "kiln: not comparing artifact names and versions with the repository's other "
            f"targets: {unread}"
        )
        return ArtifactFolders(FrozenDict(), unread=unread)
    return folders_of(targets)


def shared_folder_message(folder: str, addresses: Iterable[Address]) -> str:
    """One line: the targets of one identity, and what to change."""
    *first, last = sorted(map(str, addresses))
    name, _, version = folder.rpartition("/")
    return (
        f"Targets {', '.join(first)} and {last} are {'both' if len(first) == 1 else 'all'} the "
        f"artifact {name}@{version} (the same artifact name and version): they would build "
        "into one folder of the store and one log. Bump one's `version`, or give it another "
        "`artifact_name`."
    )


def refuse_shared_folders(needed: Iterable[Target], repo: ArtifactFolders) -> None:
    """Raises when an artifact target the command needs shares its folder with another target,
    among those needed or anywhere in the repository."""
    by_folder: dict[str, set[Address]] = {}
    for folder, needing in folders_of(needed).by_folder.items():
        by_folder[folder] = {*needing, *repo.by_folder.get(folder, ())}
    for folder, sharing in sorted(by_folder.items()):
        if len(sharing) > 1:
            raise InvalidTargetException(shared_folder_message(folder, sharing))


def rules():
    return collect_rules()
