"""A local directory as an object store (kiln.artifacts.store).

- write, upload: temp file + fsync + rename (kiln.artifacts.atomic.atomic_write_with); download too.
- create: the bytes go to a temp file first, then `link(temp, key)`, which fails if the key
  exists: the exclusive create of `O_CREAT|O_EXCL`, with the object's bytes complete the moment
  it appears (and atomic on NFS, where O_EXCL has not always been).
- replace and delete compare the generation and act while holding an `flock` on the object's
  current file: the file system has no compare-and-swap of its own. The lock lasts one
  comparison and write, never a lease's lifetime, and leaves no file behind.
- generation: the file's inode, modification time and size; every write makes a new inode.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.artifacts.atomic import atomic_write_bytes, atomic_write_with, temp_suffix
from kiln.artifacts.store import (
    ListedObject,
    ObjectExists,
    ObjectMissing,
    ObjectStore,
    PreconditionFailed,
    StoredObject,
)

_CHUNK = 8 << 20  # bytes copied at a time by upload and download


class LocalStore(ObjectStore):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / key

    def location(self, key: str) -> str:
        return str(self.path(key))

    def sha256(self, key: str) -> str:
        """Streamed from the file (a checkpoint's or a cache's files are large)."""
        try:
            with open(self.path(key), "rb") as f:
                return hashlib.file_digest(f, "sha256").hexdigest()
        except FileNotFoundError:
            raise ObjectMissing(self.location(key)) from None

    def under(self, key: str) -> LocalStore:
        return LocalStore(self.path(key))

    def check(self) -> None:
        """Nothing to reach: the directory is made on the first write."""

    def read(self, key: str) -> StoredObject:
        try:
            with open(self.path(key), "rb") as f:
                return StoredObject(f.read(), _generation(os.fstat(f.fileno())))
        except FileNotFoundError:
            raise ObjectMissing(self.location(key)) from None

    def size(self, key: str) -> int:
        try:
            return os.stat(self.path(key)).st_size
        except FileNotFoundError:
            raise ObjectMissing(self.location(key)) from None

    def generation(self, key: str) -> str:
        try:
            return _generation(os.stat(self.path(key)))
        except FileNotFoundError:
            raise ObjectMissing(self.location(key)) from None

    def kvstore(self, key: str) -> dict[str, Any]:
        return {"driver": "file", "path": os.path.join(self.path(key), "")}

    def write(self, key: str, data: bytes) -> str:
        atomic_write_bytes(self.path(key), data)
        return _generation(os.stat(self.path(key)))

    def upload(self, key: str, path: Path) -> None:
        with open(path, "rb") as source:
            atomic_write_with(self.path(key), lambda f: shutil.copyfileobj(source, f, _CHUNK))

    def download(self, key: str, path: Path) -> None:
        try:
            source = open(self.path(key), "rb")
        except FileNotFoundError:
            raise ObjectMissing(self.location(key)) from None
        with source:
            atomic_write_with(path, lambda f: shutil.copyfileobj(source, f, _CHUNK))

    def create(self, key: str, data: bytes) -> str:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=temp_suffix())
        with os.fdopen(fd, "wb") as f:
            try:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                os.link(tmp, path)
            except FileExistsError:
                raise ObjectExists(self.location(key)) from None
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            # The key's inode, once its links are final (a link count change moves its ctime).
            return _generation(os.fstat(f.fileno()))

    def replace(self, key: str, data: bytes, *, generation: str) -> str:
        with self._locked(key, generation):
            return self.write(key, data)

    def delete(self, key: str, *, generation: str) -> None:
        with self._locked(key, generation):
            os.unlink(self.path(key))

    def listing(self, key: str) -> list[ListedObject]:
        folder = self.path(key)
        found = []
        for path in folder.rglob("*"):
            try:
                status = path.stat()  # one stat a path: keys() lists through here
            except FileNotFoundError:
                continue  # deleted while listed
            if stat.S_ISREG(status.st_mode):
                name = path.relative_to(folder).as_posix()
                found.append(ListedObject(name, status.st_size, status.st_mtime))
        return sorted(found, key=lambda listed: listed.name)

    def remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def copy(self, source: str, destination: str) -> None:
        try:
            with open(self.path(source), "rb") as f:
                atomic_write_with(self.path(destination), lambda out: shutil.copyfileobj(f, out))
        except FileNotFoundError:
            raise ObjectMissing(self.location(source)) from None

    def move_folder(self, source: str, destination: str, *, first: tuple[str, ...] = ()) -> None:
        """One rename when `destination` does not exist yet (atomic); else object by object."""
        try:
            self.path(destination).parent.mkdir(parents=True, exist_ok=True)
            os.rename(self.path(source), self.path(destination))
        except FileNotFoundError:
            pass  # nothing (left) to move
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            super().move_folder(source, destination, first=first)

    def remove_folder(self, key: str, *, first: tuple[str, ...] = ()) -> None:
        for name in first:
            self.remove(f"{key}/{name}")
        shutil.rmtree(self.path(key), ignore_errors=True)

    def folder_exists(self, key: str) -> bool:
        return self.path(key).is_dir()

    def prune(self, key: str) -> None:
        """Removes the folders above `key` that are left empty, up to the store's root."""
        folder = self.path(key).parent
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): what is above it is not empty either
                return
            folder = folder.parent

    @contextlib.contextmanager
    def _locked(self, key: str, generation: str) -> Iterator[None]:
        """Holds an flock on the object's current file while it is still `generation`: a
        concurrent replace or delete locks the same file and then finds it unlinked or
        replaced. The lock lasts one compare-and-write, never longer."""
        path = self.path(key)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise PreconditionFailed(f"{self.location(key)} no longer exists") from None
        with f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                locked = os.fstat(f.fileno())
                try:
                    current = os.stat(path)
                except FileNotFoundError:
                    raise PreconditionFailed(f"{self.location(key)} no longer exists") from None
                if current.st_ino != locked.st_ino or _generation(current) != generation:
                    raise PreconditionFailed(
                        f"{self.location(key)} was rewritten by another process"
                    )
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _generation(stat: os.stat_result) -> str:
    """A file's version: its inode, size, and modification and change times. The change time
    (ctime) is the kernel's own: a writer that sets the modification time back (`touch -r`)
    still moves it."""
    return f"{stat.st_ino}-{stat.st_mtime_ns}-{stat.st_ctime_ns}-{stat.st_size}"
