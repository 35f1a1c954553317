"""What an artifact's files are: their sizes and sha256 digests, recorded when they are written
and checked when they are read.

A record maps each file's path relative to a folder ('data/c/0') to `{"bytes": N, "sha256":
HEX}` (or `{"bytes": N}` alone, where hashing every save would cost too much: checkpoints).
Checking sizes costs one stat per file and runs whenever a reader opens the folder; checking
digests reads every byte (threads in parallel: hashlib releases the GIL) and runs when an
artifact is placed into the store or verified on request.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifacts.local import LocalStore
from kiln.artifacts.store import ObjectMissing, ObjectStore

FileRecords = dict[str, dict[str, Any]]  # relative path -> {"bytes": int, "sha256": str}


@dataclass(frozen=True)
class Damage:
    """One file that is not what its record says."""

    file: str  # relative to the checked folder
    reason: str


def _workers() -> int:
    return min(8, os.cpu_count() or 1)


def record_files(folder: Path, names: Iterable[str]) -> FileRecords:
    """Sizes and digests of the files `names` (relative to `folder`), in name order."""
    names = sorted(names)
    with ThreadPoolExecutor(_workers()) as pool:
        digests = list(pool.map(LocalStore(folder).sha256, names))
    return {
        name: {"bytes": (folder / name).stat().st_size, "sha256": digest}
        for name, digest in zip(names, digests)
    }


def record_bytes(data: bytes) -> dict[str, Any]:
    """The record of a file whose bytes are in memory."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def record_sizes(folder: Path, names: Iterable[str]) -> FileRecords:
    """Sizes of the files `names` (relative to `folder`), in name order."""
    return {name: {"bytes": (folder / name).stat().st_size} for name in sorted(names)}


def files_under(folder: Path, *, exclude: Iterable[str] = ()) -> list[str]:
    """Every regular file below `folder`, as sorted relative POSIX paths, minus `exclude`."""
    excluded = set(exclude)
    return sorted(
        relative
        for path in folder.rglob("*")
        if path.is_file() and (relative := path.relative_to(folder).as_posix()) not in excluded
    )


def copy_folder_into(store: ObjectStore, key: str, folder: str | os.PathLike[str]) -> int:
    """Uploads every file below the local `folder` to `key/...` in `store`, its STATUS (if any)
    last, so the copy is never read as complete before it is; returns the bytes copied."""
    root = Path(folder)
    files = files_under(root)
    last = [name for name in files if name == "STATUS"]
    first = [name for name in files if name != "STATUS"]

    def upload(name: str) -> int:
        store.upload(f"{key}/{name}" if key else name, root / name)
        return (root / name).stat().st_size

    with ThreadPoolExecutor(8) as pool:  # objects upload independently: overlap the requests
        copied = sum(pool.map(upload, first))
    return copied + sum(map(upload, last))


def check_sizes(folder: Path, records: Mapping[str, Mapping[str, Any]]) -> list[Damage]:
    """Files that are missing or of another size than recorded."""
    return check_object_sizes(LocalStore(folder), "", records)


def check_object_sizes(
    store: ObjectStore, folder: str, records: Mapping[str, Mapping[str, Any]]
) -> list[Damage]:
    """check_sizes for the objects under the key `folder` of `store` (a folder or a bucket)."""
    damage = []
    for name, record in records.items():
        try:
            size = store.size(f"{folder}/{name}" if folder else name)
        except ObjectMissing:
            damage.append(Damage(name, "is missing"))
            continue
        if size != record["bytes"]:
            damage.append(Damage(name, f"has {size} bytes, {record['bytes']} were written"))
    return damage


def check_digests(folder: Path, records: Mapping[str, Mapping[str, Any]]) -> list[Damage]:
    """Files that are missing, of another size, or whose bytes differ from their digest."""
    return check_object_digests(LocalStore(folder), "", records)


def check_object_digests(
    store: ObjectStore, folder: str, records: Mapping[str, Mapping[str, Any]]
) -> list[Damage]:
    """check_digests for the objects under the key `folder` of `store` (a folder or a bucket)."""
    damage = check_object_sizes(store, folder, records)
    damaged = {d.file for d in damage}
    names = [name for name in records if name not in damaged]
    with ThreadPoolExecutor(_workers()) as pool:
        digests = list(pool.map(store.sha256, [f"{folder}/{n}" if folder else n for n in names]))
    damage += [
        Damage(name, "does not match its sha256 digest (its bytes changed)")
        for name, digest in zip(names, digests)
        if digest != records[name]["sha256"]
    ]
    return damage
