"""`python -m kiln.artifacts.dep_failed STORE NAME/VERSION...` (`--clear` to undo): Marin's
"not built because an input failed", as an artifact's STATUS, in any store.

`pants build` marks each step whose input failed: STATUS DEP_FAILED in the step's folder, unless
that folder holds a built artifact or a run (STATUS SUCCESS, or RUNNING: in progress, or
interrupted and resumable), which are left as they are. Before it builds the step again it
clears a folder holding nothing but that mark. Prints one line per folder it marked. Exit 4 (a
StorageError, one line naming the URL) when the store cannot be written.
"""

from __future__ import annotations

import sys

from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.storage_errors import EXIT_STORAGE, StorageError
from kiln.artifacts.store import ObjectStore, open_store
from kiln_contract.layout import DEP_FAILED, RUNNING, STATUS_FILE, SUCCESS


def mark(store: ObjectStore, key: str) -> bool:
    """Marks the folder `key` DEP_FAILED unless it holds a built artifact or a run; whether it
    did."""
    folder = ArtifactFolder(store, key)
    if folder.status() in (SUCCESS, RUNNING):
        return False
    folder.write_status(DEP_FAILED)
    return True


def clear(store: ObjectStore, key: str) -> None:
    """Removes a mark that nothing else was written beside."""
    folder = ArtifactFolder(store, key)
    if store.keys(key) == [STATUS_FILE] and folder.status() == DEP_FAILED:
        store.remove(folder.child(STATUS_FILE))


def main(argv: list[str]) -> int:
    clearing = "--clear" in argv
    args = [arg for arg in argv if arg != "--clear"]
    if len(args) < 2:
        print("usage: python -m kiln.artifacts.dep_failed [--clear] STORE NAME/VERSION...",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        store = open_store(args[0])
        for key in args[1:]:
            if clearing:
                clear(store, key)
            elif mark(store, key):
                print(f"marked {store.location(key)} {DEP_FAILED}")
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_STORAGE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
