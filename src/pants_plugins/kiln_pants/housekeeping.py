"""`pants store`: what the artifact store holds, and the removal of what is no longer wanted.

Lists every artifact in the store (`[kiln] prefix`: a directory or a bucket) with its STATUS,
size, age and the target of this repo that names it (`name` and `version`), from one runtime
process (kiln.artifacts.inventory). With `--remove` (no target names it; failed; all) and/or
`--older-than`, it prints what it would remove and, with `--yes`, removes it. It never removes
an artifact a live run holds the lease of, or one that an artifact it keeps was built from (the
records' inputs), and it never touches what belongs to no artifact (`.kiln/`).

It reads what it needs alone: every artifact target's name and version, and the artifact graph
of the targets naming what the store holds (for the fingerprints). A target wrong elsewhere does
not stop it: a line says which target it skipped and why.
"""

from __future__ import annotations

import datetime
import enum
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

from pants.base.build_root import BuildRoot
from pants.engine.addresses import Address
from pants.engine.console import Console
from pants.engine.fs import Workspace
from pants.engine.goal import Goal, GoalSubsystem
from pants.engine.rules import Get, collect_rules, goal_rule
from pants.option.option_types import BoolOption, EnumOption, StrOption

from kiln_contract.inventory import Inventory, StoredArtifact, ref_of
from kiln_contract.layout import DEP_FAILED, FAILED
from kiln_pants.shard_plan import count_text, size_text
from kiln_pants.store_inventory import (
    StoredTargets,
    StoredTargetsRequest,
    StoreInventory,
    StoreInventoryRequest,
    StoreRemoval,
    StoreRemovalRequest,
)
from kiln_pants.subsystem import KilnSubsystem


class Removal(enum.Enum):
    unnamed = "unnamed"  # no target of the repo names it
    failed = "failed"  # STATUS FAILED or DEP_FAILED
    all = "all"  # every artifact (narrow it with --older-than)


class StoreSubsystem(GoalSubsystem):
    name = "store"
    help = (
        "List what the artifact store holds (STATUS, size, age, the target naming each "
        "artifact) and remove what is no longer wanted."
    )

    remove = EnumOption(
        enum_type=Removal,
        default=None,
        help="Which artifacts to remove: `unnamed` (no target of this repo names its name and "
        "version), `failed` (STATUS FAILED or DEP_FAILED) or `all`; with --older-than, only "
        "those last written before that date. Prints them; removes them only with --yes.",
    )
    older_than = StrOption(
        default=None,
        help="A date, YYYY-MM-DD (UTC): remove only artifacts last written before it (all of "
        "them when --remove is not given).",
    )
    yes = BoolOption(
        default=False,
        help="Remove what --remove and --older-than select (without it: print it and stop).",
    )


class StoreGoal(Goal):
    subsystem_cls = StoreSubsystem
    environment_behavior = Goal.EnvironmentBehavior.LOCAL_ONLY


@dataclass(frozen=True)
class Selection:
    remove: tuple[StoredArtifact, ...]
    kept: Mapping[str, str]  # folder -> why an artifact the options select stays


def select(
    inventory: Inventory,
    named: Mapping[str, Address],
    removal: Optional[Removal],
    before: Optional[float],
) -> Selection:
    """The artifacts to remove: those `removal` and `before` select, less any a live run holds
    the lease of and any that an artifact staying in the store was built from."""
    chosen = {
        a.folder: a for a in inventory.artifacts if _chosen(a, named, removal, before)
    }
    kept = {f: f"a run holds its lease: {a.lease}" for f, a in chosen.items() if a.lease}
    by_ref = {a.ref: a.folder for a in inventory.artifacts}
    changed = True
    while changed:  # an input of anything that stays, stays (and so do its inputs)
        changed = False
        for artifact in inventory.artifacts:
            if artifact.folder in chosen and artifact.folder not in kept:
                continue
            for ref in artifact.inputs:
                folder = by_ref.get(ref)
                if folder in chosen and folder not in kept:
                    kept[folder] = f"{artifact.ref} was built from it"
                    changed = True
    remove = tuple(a for f, a in chosen.items() if f not in kept)
    return Selection(remove, kept)


def _chosen(
    artifact: StoredArtifact,
    named: Mapping[str, Address],
    removal: Optional[Removal],
    before: Optional[float],
) -> bool:
    if before is not None and artifact.modified >= before:
        return False
    if removal is Removal.unnamed:
        return artifact.folder not in named
    if removal is Removal.failed:
        return artifact.status in (FAILED, DEP_FAILED)
    return removal is Removal.all or before is not None


def parse_date(text: str) -> float:
    """Midnight UTC of `YYYY-MM-DD`, as unix seconds; ValueError naming the option."""
    try:
        day = datetime.date.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--store-older-than={text!r} is not a date: give YYYY-MM-DD, e.g. 2026-06-01"
        ) from None
    return datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.timezone.utc).timestamp()


def inventory_lines(
    inventory: Inventory,
    named: Mapping[str, Address],
    fingerprints: Mapping[str, str],
    now: float,
) -> Iterable[str]:
    """The table of what the store holds, and its totals."""
    yield f"  {'STATUS':<11} {'SIZE':>9}  {'AGE':>7}  {'ARTIFACT':<48} TARGET"
    for a in inventory.artifacts:
        target = str(named[a.folder]) if a.folder in named else "(no target)"
        if a.fingerprint not in (None, fingerprints.get(a.folder, a.fingerprint)):
            target += " (built with another fingerprint)"
        yield (
            f"  {a.status or '-':<11} {size_text(a.size):>9}  {human_age(now - a.modified):>7}  "
            f"{a.ref:<48} {target}"
        )
        if a.lease:
            yield f"  {'':<11} {'':>9}  {'':>7}  leased: {a.lease}"
    unnamed = [a for a in inventory.artifacts if a.folder not in named]
    artifacts = count_text(len(inventory.artifacts), "artifact")
    total = size_text(sum(a.size for a in inventory.artifacts))
    others = count_text(inventory.other_objects, "other object")
    yield (
        f"{artifacts}, {total}; no target names {len(unnamed)} of them "
        f"({size_text(sum(a.size for a in unnamed))}); {others} "
        f"({size_text(inventory.other_size)}: .kiln/ and files of no artifact, never removed)"
    )


def human_age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds // length:.0f} {unit}"
    return "now"


async def _remove(console: Console, prefix: str, selection: Selection, yes: bool) -> int:
    size = size_text(sum(a.size for a in selection.remove))
    doing = "Removing" if yes else "Would remove"
    console.print_stdout(f"{doing} {count_text(len(selection.remove), 'artifact')} ({size}):")
    for artifact in selection.remove:
        console.print_stdout(f"  {artifact.ref} ({artifact.status or 'no STATUS'}, "
                             f"{size_text(artifact.size)})")  # fmt: skip
    for folder, why in sorted(selection.kept.items()):
        console.print_stdout(f"Keeping {ref_of(folder)}: {why}")
    if not yes or not selection.remove:
        if selection.remove:
            console.print_stdout("Nothing removed: add --store-yes to remove them.")
        return 0
    folders = tuple(a.folder for a in selection.remove)
    removal = await Get(StoreRemoval, StoreRemovalRequest(prefix, folders))
    for outcome in removal.outcomes:
        if not outcome.done:
            console.print_stdout(f"Keeping {ref_of(outcome.folder)}: {outcome.kept}")
    removed = sum(outcome.done for outcome in removal.outcomes)
    console.print_stdout(
        f"Removed {removed} of {count_text(len(folders), 'artifact')} from {prefix}."
    )
    if removal.error is not None:
        console.print_stderr(f"kiln: error: {removal.error}")
        return 1
    return 0


@goal_rule
async def store(
    console: Console,
    kiln: KilnSubsystem,
    subsystem: StoreSubsystem,
    build_root: BuildRoot,
    workspace: Workspace,  # marks the goal as side-effecting: it reads and deletes in the store
) -> StoreGoal:
    try:  # a bad option fails before the graph is computed or the store listed
        before = None if subsystem.older_than is None else parse_date(subsystem.older_than)
    except ValueError as e:
        console.print_stderr(f"kiln: error: {e}")
        return StoreGoal(exit_code=1)
    prefix = kiln.prefix_or_report(console, build_root.path)
    if prefix is None:
        return StoreGoal(exit_code=1)
    listed = await Get(StoreInventory, StoreInventoryRequest(prefix))
    if listed.inventory is None:
        console.print_stderr(f"kiln: error: cannot list the artifact store: {listed.error}")
        return StoreGoal(exit_code=1)
    stored = tuple(a.folder for a in listed.inventory.artifacts)
    targets = await Get(StoredTargets, StoredTargetsRequest(stored))
    if targets.unread is not None:
        console.print_stderr(
            f"kiln: error: cannot read the targets naming what the store keeps: {targets.unread}"
        )
        return StoreGoal(exit_code=1)
    console.print_stdout(f"Artifact store: {prefix}")
    now = time.time()
    for line in inventory_lines(listed.inventory, targets.named, targets.fingerprints, now):
        console.print_stdout(line)
    for line in targets.skipped:
        console.print_stdout(line)
    if subsystem.remove is None and before is None:
        return StoreGoal(exit_code=0)
    selection = select(listed.inventory, targets.named, subsystem.remove, before)
    return StoreGoal(exit_code=await _remove(console, prefix, selection, subsystem.yes))


def rules():
    return collect_rules()
