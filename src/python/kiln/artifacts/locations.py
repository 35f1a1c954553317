"""Where a store location (a path, `s3://BUCKET/PATH`, `gs://BUCKET/PATH`) enters the runtime:
`open_store`, the one place that maps a location to its implementation, and `run_on_store`, the
body of the `python -m kiln.artifacts.X STORE ...` commands."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from kiln.artifacts.local import LocalStore
from kiln.artifacts.storage_errors import EXIT_STORAGE, StorageError
from kiln.artifacts.store import ObjectStore
from kiln_contract.location import StoreLocation


class UnsupportedStore(ValueError):
    """A store location this Kiln cannot open."""


def open_store(location: str | os.PathLike[str] | StoreLocation) -> ObjectStore:
    """The store at `location`: `s3://BUCKET/PATH`, `gs://BUCKET/PATH`, or a local directory
    (absolute or relative path)."""
    where = StoreLocation.parse(location)
    if not where.in_bucket:
        return LocalStore(where.text)
    # The bucket stores import their clients (requests, boto3) when first asked for: a run on a
    # local store starts without them.
    if where.scheme == "s3":
        from kiln.artifacts.s3 import S3Store

        return S3Store(where.text)
    if where.scheme == "gs":
        from kiln.artifacts.gcs import GCSStore

        return GCSStore(where.text)
    raise UnsupportedStore(
        f"{where}: Kiln stores artifacts in s3://, gs:// or local directories; for another "
        "store, mount it and give its mount point as the prefix."
    )


def run_on_store(location: str, action: Callable[[ObjectStore], None]) -> int:
    """The body of a `python -m kiln.artifacts.X STORE ...` command: `action` on the store at
    `location`, checked first; a StorageError is one line `error: ...` naming the store on stderr
    and exit EXIT_STORAGE, which the Pants backend shows as it is."""
    try:
        store = open_store(location)
        store.check()
        action(store)
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_STORAGE
    return 0
