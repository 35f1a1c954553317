"""`python -m kiln.artifacts.peek STORE NAME/VERSION...`: what `pants plan` reads from a store.

Prints one JSON object: for each artifact folder, the text of its STATUS, artifact.json and
failure.txt (null when absent). The Pants backend runs it as a process when the prefix is a
bucket, so the backend needs no bucket client of its own; credentials come from the
environment, as for every runtime process. Exit 4 (a StorageError, one line naming the URL) when the store
cannot be read.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

from kiln.artifacts import FAILURE_FILE, RECORD_FILE, STATUS_FILE
from kiln.artifacts.storage_errors import EXIT_STORAGE, StorageError
from kiln.artifacts.store import ObjectStore, open_store, read_text

READERS = 16  # requests in flight: a goal of a thousand artifacts reads three thousand objects
PEEKED_FILES = (STATUS_FILE, RECORD_FILE, FAILURE_FILE)


def peek(store: ObjectStore, folders: list[str]) -> dict[str, dict[str, str | None]]:
    keys = [f"{folder}/{name}" for folder in folders for name in PEEKED_FILES]
    with ThreadPoolExecutor(READERS) as pool:
        texts = dict(zip(keys, pool.map(lambda key: read_text(store, key), keys)))
    return {folder: {name: texts[f"{folder}/{name}"] for name in PEEKED_FILES}
            for folder in folders}  # fmt: skip



def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m kiln.artifacts.peek STORE NAME/VERSION...", file=sys.stderr)
        return 2
    try:
        store = open_store(argv[0])
        store.check()
        print(json.dumps(peek(store, argv[1:])))
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_STORAGE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
