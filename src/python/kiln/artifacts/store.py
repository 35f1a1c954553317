"""The artifact store's interface: whole objects under keys, and the conditional writes that
leases are made of.

The interface has object semantics, so that a bucket can implement it as well as a directory:
an object is written whole (a reader sees the old bytes or the new ones, never a mix), a
conditional create fails when the key exists (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`),
and a conditional replace or delete fails unless the object is still the generation the caller
read (S3 `If-Match: ETag`, GCS `ifGenerationMatch=N`). There is no rename of folders and no
lock: everything that must be exclusive is built from these operations (kiln.artifacts.lease).

A location (a path or URL) becomes a store in kiln.artifacts.locations.
"""

from __future__ import annotations

import abc
import copy
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from kiln.artifacts.bucket import ATTEMPTS, BucketURL
from kiln.artifacts.storage_errors import StorageError
from kiln_contract.location import StoreLocation


class ObjectMissing(Exception):
    """No object at the key."""


class ObjectExists(Exception):
    """A conditional create found an object at the key."""


class PreconditionFailed(Exception):
    """A conditional replace or delete found another generation of the object (or none)."""


@dataclass(frozen=True)
class StoredObject:
    data: bytes
    generation: str  # opaque: changes with every write of the key


@dataclass(frozen=True)
class ListedObject:
    name: str  # the key relative to the folder listed
    size: int  # bytes
    modified: float  # when it was last written, unix seconds


class ObjectStore(abc.ABC):
    """Objects under '/'-separated keys relative to the store's root."""

    @abc.abstractmethod
    def location(self, key: str) -> str:
        """Where the object is, for messages: a path or a URL."""

    @abc.abstractmethod
    def under(self, key: str) -> ObjectStore:
        """The store rooted at `key` of this one, on this one's connection: a folder of it
        handed to code that reads from a store's root (a cache's reader, its verifier)."""

    @abc.abstractmethod
    def check(self) -> None:
        """Fails fast (StorageError naming the store and what to check) when the store cannot
        be reached or its bucket does not exist."""

    @abc.abstractmethod
    def read(self, key: str) -> StoredObject:
        """The object and its generation; ObjectMissing if there is none."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes; ObjectMissing if there is none."""

    @abc.abstractmethod
    def generation(self, key: str) -> str:
        """The object's generation without reading it; ObjectMissing if there is none."""

    @abc.abstractmethod
    def kvstore(self, key: str) -> dict[str, Any]:
        """TensorStore's kvstore spec of the objects under `key/` (its `file`, `s3` or `gcs`
        driver; its path ends in "/"), for arrays stored there and `read_texts`. It names no
        credentials: TensorStore finds them in the same standard places as the store."""

    def sha256(self, key: str) -> str:
        """The hex sha256 digest of the object's bytes (read whole: a bucket's objects here are
        chunks of megabytes); ObjectMissing if there is none."""
        return hashlib.sha256(self.read(key).data).hexdigest()

    @abc.abstractmethod
    def write(self, key: str, data: bytes) -> str:
        """Writes the whole object, replacing any; returns its generation."""

    @abc.abstractmethod
    def upload(self, key: str, path: Path) -> None:
        """Writes the object from the local file `path`, replacing any, streamed in parts (a
        checkpoint's file of gigabytes never sits in memory); it appears whole or not at all."""

    @abc.abstractmethod
    def download(self, key: str, path: Path) -> None:
        """Writes the object into the local file `path`, streamed, renamed into place once
        complete; ObjectMissing if there is none."""

    @abc.abstractmethod
    def create(self, key: str, data: bytes) -> str:
        """Writes the object only if the key is free (ObjectExists otherwise); its generation."""

    @abc.abstractmethod
    def replace(self, key: str, data: bytes, *, generation: str) -> str:
        """Writes the object only if it is still `generation` (PreconditionFailed otherwise)."""

    @abc.abstractmethod
    def delete(self, key: str, *, generation: str) -> None:
        """Deletes the object only if it is still `generation` (PreconditionFailed otherwise)."""

    @abc.abstractmethod
    def listing(self, key: str) -> list[ListedObject]:
        """Every object under `key/` (names relative to `key`), sorted by name."""

    def keys(self, key: str) -> list[str]:
        """The keys of every object under `key/`, relative to `key`, sorted."""
        return [listed.name for listed in self.listing(key)]

    @abc.abstractmethod
    def remove(self, key: str) -> None:
        """Deletes the object whatever its generation; no error if there is none. For the
        objects of a folder only one writer touches (under its lease), never for leases."""

    def copy(self, source: str, destination: str) -> None:
        """Writes the object `source` again at `destination` (ObjectMissing if there is none),
        streamed through a local temp file; stores that copy on the server override it."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kiln-copy-") as folder:
            path = Path(folder) / "object"
            self.download(source, path)
            self.upload(destination, path)

    def move_folder(self, source: str, destination: str, *, first: tuple[str, ...] = ()) -> None:
        """Moves every object under `source/` to `destination/`: the names in `first` (a
        STATUS: the source never reads as built while part of it is gone), then copies of the
        others, then the deletion of the originals. Called again after an interruption, it
        finishes the move. A directory renames its folder instead, at once."""
        names = self.keys(source)
        moved_first = [name for name in first if name in names]
        for name in moved_first:
            self.copy(f"{source}/{name}", f"{destination}/{name}")
            self.remove(f"{source}/{name}")
        for name in names:
            if name not in moved_first:
                self.copy(f"{source}/{name}", f"{destination}/{name}")
        self.remove_folder(source)

    def remove_folder(self, key: str, *, first: tuple[str, ...] = ()) -> None:
        """Deletes every object under `key/`, the names in `first` before the others (a
        STATUS first: a folder being deleted never reads as built)."""
        names = self.keys(key)
        for name in sorted(names, key=lambda name: name not in first):
            self.remove(f"{key}/{name}")

    def folder_exists(self, key: str) -> bool:
        """Whether the folder `key` is there: in a bucket (which has no empty folders), whether
        any object is under it."""
        return bool(self.keys(key))

    def prune(self, key: str) -> None:  # noqa: B027 - a bucket has nothing to do
        """Forgets the empty folders that held `key` (a bucket has none: names alone)."""

    @property
    def root_location(self) -> StoreLocation:
        """Where the store's root is: a local folder (`.folder`) or a bucket's URL."""
        return StoreLocation.parse(self.location(""))


class BucketStore(ObjectStore):
    """A store in a bucket (S3, GCS): its keys live under `url`'s path."""

    url: BucketURL

    def location(self, key: str) -> str:
        return self.url.url(key)

    def under(self, key: str) -> Self:
        folder = copy.copy(self)  # the same client and credentials
        folder.url = self.url.under(key)
        return folder


def read_text(store: ObjectStore, key: str) -> str | None:
    """The object at `key` as text; None if there is none."""
    try:
        return store.read(key).data.decode()
    except ObjectMissing:
        return None


def read_texts(store: ObjectStore, keys: Sequence[str]) -> dict[str, str | None]:
    """Many small objects as text (None where there is none), read all at once through
    TensorStore's kvstore: its C++ client keeps the requests in flight (READS_IN_FLIGHT) at a
    tenth of the CPU per request of boto3 or requests, which on two thousand records is the
    difference between a second and several (benchmarks/RESULTS.md)."""
    import tensorstore as ts

    try:
        kvstore = ts.KvStore.open(store.kvstore(""), context=ts.Context(_READS)).result()
        reads = [(key, kvstore.read(key)) for key in keys]
        return {key: _text(read.result()) for key, read in reads}
    except ValueError as e:  # TensorStore's message names the object and the server's answer
        raise StorageError(store.location(""), f"cannot read: {e}") from None


# Requests retried as the Python clients retry theirs, not TensorStore's default of 32 times
# over minutes (an unreachable server fails in seconds); READS_IN_FLIGHT at a time.
READS_IN_FLIGHT = 32
_RETRIES = {"max_retries": ATTEMPTS - 1, "initial_delay": "0.2s", "max_delay": "2s"}
_READS = {
    "s3_request_retries": _RETRIES,
    "gcs_request_retries": _RETRIES,
    "s3_request_concurrency": {"limit": READS_IN_FLIGHT},
    "gcs_request_concurrency": {"limit": READS_IN_FLIGHT},
}


def _text(result: Any) -> str | None:
    return bytes(result.value).decode() if result.state == "value" else None
