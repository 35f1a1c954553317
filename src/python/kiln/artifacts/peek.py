"""`python -m kiln.artifacts.peek STORE NAME/VERSION...`: what `pants plan` reads from a store.

Prints one JSON object: for each artifact folder, the text of its STATUS, artifact.json and
failure.txt (null when absent or, for failure.txt, not read: `peek`). The Pants backend runs
it as a process when the prefix is a bucket, so the backend needs no bucket client of its own;
credentials come from the environment, as for every runtime process. Exit 4 (a StorageError,
one line naming the URL) when the store cannot be read.
"""

from __future__ import annotations

import json
import sys

from kiln.artifacts import FAILURE_FILE, RECORD_FILE, STATUS_FILE
from kiln.artifacts.locations import run_on_store
from kiln.artifacts.store import ObjectStore, read_texts


def peek(store: ObjectStore, folders: list[str]) -> dict[str, dict[str, str | None]]:
    """STATUS and artifact.json of every folder; then failure.txt only where it can say
    something: beside a STATUS other than SUCCESS, or beside a record without STATUS (a run
    that stopped). A built folder costs two reads."""
    first = read_texts(
        store, [f"{f}/{name}" for f in folders for name in (STATUS_FILE, RECORD_FILE)]
    )
    texts = {f: {n: first[f"{f}/{n}"] for n in (STATUS_FILE, RECORD_FILE)} for f in folders}
    unfinished = [f for f, t in texts.items() if _unfinished(t[STATUS_FILE], t[RECORD_FILE])]
    failures = read_texts(store, [f"{f}/{FAILURE_FILE}" for f in unfinished])
    for folder, files in texts.items():
        files[FAILURE_FILE] = failures.get(f"{folder}/{FAILURE_FILE}")
    return texts


def _unfinished(status: str | None, record: str | None) -> bool:
    return (status or "").strip() != "SUCCESS" and (status, record) != (None, None)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m kiln.artifacts.peek STORE NAME/VERSION...", file=sys.stderr)
        return 2
    return run_on_store(argv[0], lambda store: print(json.dumps(peek(store, argv[1:]))))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
