"""`python -m kiln.artifacts.dep_failed STORE [--clear NAME/VERSION]... [--mark NAME/VERSION
REASON]...`: Marin's "not built because an input failed", as an artifact's STATUS, in any store.

`pants build` marks each step whose input failed: its reason (FAILURE_FILE), then STATUS
DEP_FAILED in the step's folder, unless that folder holds a built artifact or a run (STATUS
SUCCESS, or RUNNING: in progress, or interrupted and resumable), which are left as they are.
Before it builds the step again it clears a folder holding nothing but that mark. Prints a
JSON line (kiln_contract.inventory.FolderOutcome) for each folder it marked. Exit 4 (a
StorageError, one line naming the URL) when the store cannot be written.
"""

from __future__ import annotations

import sys

from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.locations import run_on_store
from kiln.artifacts.store import ObjectStore
from kiln_contract.inventory import FolderOutcome
from kiln_contract.layout import DEP_FAILED, FAILURE_FILE, RUNNING, STATUS_FILE, SUCCESS

USAGE = "usage: python -m kiln.artifacts.dep_failed STORE [--clear KEY]... [--mark KEY REASON]..."


def mark(store: ObjectStore, key: str, reason: str) -> bool:
    """Marks the folder `key` DEP_FAILED, `reason` beside it, unless it holds a built artifact
    or a run; whether it did."""
    folder = ArtifactFolder(store, key)
    if folder.status() in (SUCCESS, RUNNING):
        return False
    folder.record_stop(reason)
    folder.write_status(DEP_FAILED)
    return True


def clear(store: ObjectStore, key: str) -> None:
    """Removes a mark that nothing else was written beside (an export refuses an existing
    folder; a run's files stay, and the runner resumes it)."""
    folder = ArtifactFolder(store, key)
    if set(store.keys(key)) <= {STATUS_FILE, FAILURE_FILE} and folder.status() == DEP_FAILED:
        store.remove_folder(key)


def main(argv: list[str]) -> int:
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    location, rest = argv[0], argv[1:]
    clears, marks = [], []
    while rest:
        if rest[0] == "--clear" and len(rest) >= 2:
            clears.append(rest[1])
            rest = rest[2:]
        elif rest[0] == "--mark" and len(rest) >= 3:
            marks.append((rest[1], rest[2]))
            rest = rest[3:]
        else:
            print(USAGE, file=sys.stderr)
            return 2
    return run_on_store(location, lambda store: _update(store, clears, marks))


def _update(store: ObjectStore, clears: list[str], marks: list[tuple[str, str]]) -> None:
    for key in clears:
        clear(store, key)
    for key, reason in marks:
        if mark(store, key, reason):
            print(FolderOutcome(key, done=True).to_json(), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
