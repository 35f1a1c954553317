"""Storage failures (no space, no permission, I/O errors) as one line naming the path and cause.

Python raises them as OSError; TensorStore, and orbax above it, as ValueError whose message
carries the OS error code (`[os_error_code='28']`) and the file. Either becomes a StorageError,
which commands print as `error: PATH: CAUSE` and end with EXIT_STORAGE.
"""

from __future__ import annotations

import errno
import os
import re

EXIT_STORAGE = 4  # a storage error: fix the cause (space, permissions, device) and rerun

_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)'?")
_QUOTED_PATH = re.compile(r'"(/[^"]*)"')


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


def _cause(code: int) -> str:
    name = errno.errorcode.get(code, f"errno {code}")
    return f"{os.strerror(code)} ({name})"
