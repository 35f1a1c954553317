"""Storage failures (no space, no permission, I/O errors) as one line naming the path and cause.

Python raises them as OSError; TensorStore, and orbax above it, as ValueError whose message
carries the OS error code (`[os_error_code='28']`) and the file. Either becomes a StorageError,
which commands print as `error: PATH: CAUSE` and end with EXIT_STORAGE.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

EXIT_STORAGE = 4  # a storage error: fix the cause (space, permissions, device) and rerun

_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)'?")
_QUOTED_PATH = re.compile(r'"(/[^"]*)"')
# A file system that refuses a write whatever its size: read-only, or not this user's.
_REFUSED_WRITES = (errno.EROFS, errno.EACCES, errno.EPERM)


class StorageError(Exception):
    """Reading or writing the store failed for a reason outside Kiln: the message is
    `PATH: CAUSE`."""

    def __init__(self, path: str | os.PathLike[str], cause: str):
        super().__init__(f"{os.fspath(path)}: {cause}")
        self.path = os.fspath(path)
        self.cause = cause


def as_storage_error(error: BaseException, where: str | os.PathLike[str]) -> StorageError | None:
    """`error` as a StorageError if it is a storage failure (else None); `where` names the path
    when the error itself does not."""
    if isinstance(error, StorageError):
        return error
    if isinstance(error, OSError) and error.errno is not None:
        return StorageError(error.filename or where, _cause(error.errno))
    match = _OS_ERROR_CODE.search(str(error))
    if match is None:
        return None
    path = _QUOTED_PATH.search(str(error))
    return StorageError(path[1] if path else where, _cause(int(match[1])))


def refused_store_write(
    error: BaseException, store: str | os.PathLike[str]
) -> StorageError | None:
    """A write under the local artifact store `store` that its file system refuses (mounted
    read-only, not this user's to write) as one line naming the store and what to do; None for
    any other error."""
    if not isinstance(error, OSError) or error.errno not in _REFUSED_WRITES:
        return None
    path = Path(error.filename or store).absolute()
    root = Path(store).absolute()
    if path != root and root not in path.parents:
        return None
    return StorageError(
        root,
        f"the artifact store cannot be written here ({path}: {_cause(error.errno)}): point "
        "`[kiln] prefix` (--kiln-prefix) at a folder this user may write, or make this one "
        "writable",
    )


def _cause(code: int) -> str:
    name = errno.errorcode.get(code, f"errno {code}")
    return f"{os.strerror(code)} ({name})"
