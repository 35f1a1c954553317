"""Replacing a built artifact in a local store (`--force`): the old folder is kept aside until
the new one has STATUS SUCCESS, and is then deleted.

    {prefix}/{name}/{version}/            the rebuild (RUNNING until it succeeds)
    {prefix}/{name}/.{version}.replaced/  the artifact it replaces, whole, as it was

Every step is one rename or one deletion, each done under the artifact's lease, so a process
killed at any moment leaves one of these states, and the next run (forced or not) goes on:

- no `.replaced`: an ordinary run; a forced one renames the folder aside first.
- `.replaced`, the folder missing or not SUCCESS: the rebuild goes on (it resumes from its
  newest checkpoint) and `.replaced` is kept.
- `.replaced` (perhaps partly deleted), the folder SUCCESS: the rebuild is done, so
  `.replaced` is deleted.

The old artifact is recovered by hand, with no run going: delete the folder and rename
`.{version}.replaced` back to `{version}`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifacts import RECORD_FILE, SUCCESS, is_built, read_status

REPLACED_SUFFIX = ".replaced"


def replaced_folder(folder: Path) -> Path:
    """'store/checkpoints/x/v1' -> 'store/checkpoints/x/.v1.replaced'."""
    return folder.parent / f".{folder.name}{REPLACED_SUFFIX}"


def is_replacing(folder: Path) -> bool:
    """Whether a replacement of `folder` has begun and not finished."""
    return replaced_folder(folder).exists()


class NotThisArtifact(RuntimeError):
    """The folder's record names another artifact: nothing in it is moved or deleted."""


def set_aside(folder: Path, name: str, version: str, fingerprint: str) -> str:
    """Begins (or goes on with) the replacement of `folder`, the artifact `name@version`, by a
    rebuild with `fingerprint`; returns what it did, for people. The caller holds the lease.

    A finished replacement's leftover is deleted first. Then, when none is under way, the
    folder is renamed aside whole. When one is (a forced run was stopped), its rebuild is kept
    to be resumed, unless it was started with another fingerprint: then it is deleted (it never
    succeeded) and the rebuild starts over; the artifact set aside stays as it is."""
    finish(folder)
    aside = replaced_folder(folder)
    stored = _record(folder)
    if stored is not None and (stored.get("name"), stored.get("version")) != (name, version):
        raise NotThisArtifact(
            f"{folder} holds a record that does not name {name}@{version}; it is not this "
            "artifact's folder, so it is neither moved nor deleted. Move it away and rerun."
        )
    if not aside.exists():
        if not folder.exists():
            return f"nothing is built at {folder} yet: building it"
        os.rename(folder, aside)
        return f"moved {folder} aside to {aside}; it is deleted once the rebuild succeeds"
    if stored is not None and stored.get("fingerprint") != fingerprint:
        shutil.rmtree(folder)
        return (
            f"deleted an unfinished rebuild with another configuration from {folder}; the "
            f"replaced artifact stays at {aside} until the rebuild succeeds"
        )
    return f"resuming the rebuild; the replaced artifact stays at {aside} until it succeeds"


@dataclass(frozen=True)
class Finished:
    """A replacement just completed: the artifact it replaced, and where that was."""

    replaced: Path
    fingerprint: str | None  # the replaced artifact's, when its record was still there


def finish(folder: Path) -> Finished | None:
    """When `folder` has STATUS SUCCESS and an artifact set aside: deletes that one (the caller
    holds the lease). None when there is nothing to finish."""
    aside = replaced_folder(folder)
    if not (aside.exists() and is_built(folder)):
        return None
    old = _record(aside) or {}
    shutil.rmtree(aside)
    fingerprint = old.get("fingerprint")
    return Finished(aside, fingerprint if isinstance(fingerprint, str) else None)


@dataclass(frozen=True)
class Dependent:
    """A built artifact whose record names an input."""

    ref: str
    kind: str
    folder: Path
    input_fingerprint: str  # the input's fingerprint it was built from


def built_dependents(prefix: Path, ref: str) -> list[Dependent]:
    """The built artifacts in the store at `prefix` whose records name `ref` as an input.

    Artifact folders are the folders holding a record; the walk does not descend into them
    (their checkpoints and shards hold many files) nor into hidden folders (leases, staging
    folders, replaced artifacts)."""
    found = []
    for here, folders, files in os.walk(prefix):
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        if RECORD_FILE not in files:
            continue
        folders.clear()
        folder = Path(here)
        stored = _record(folder)
        if stored is None or read_status(folder) != SUCCESS:
            continue
        for entry in stored.get("inputs") or ():
            if isinstance(entry, dict) and entry.get("ref") == ref:
                own = f"{stored.get('name')}@{stored.get('version')}"
                found.append(
                    Dependent(own, str(stored.get("kind")), folder, str(entry.get("fingerprint")))
                )
    return found


def _record(folder: Path) -> dict[str, Any] | None:
    """The record in `folder`; None when there is none or it cannot be read as JSON."""
    try:
        stored = json.loads((folder / RECORD_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return stored if isinstance(stored, dict) else None
